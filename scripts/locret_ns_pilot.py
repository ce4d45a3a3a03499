"""LOCRET n_s pilot: 32K niah_single, b=1024, compact positions, the shipped heads (the logit heads when it ran).

    python scripts/locret_ns_pilot.py NS EXAMPLES > OUT.jsonl     # e.g. 64 1,3,4,5,7,8

One JSON line per example (n_s, example, depth, expected, correct, answer_kept, output, wall_s). The examples
are those of `localchat bench --tasks niah_single --lengths 32k --policies locret --budgets 1024 -n 20`
(the bench has no n_s flag: it uses the card's, 256).
"""

import json
import sys
import time

from localchat.bench.cell import Cell, load_engine, run_example, sample_for
from localchat.engine.policy_setup import policy_for


def main() -> None:
    ns = int(sys.argv[1])
    examples = [int(x) for x in sys.argv[2].split(",")]
    cell = Cell(task="niah_single", length=32768, policy="locret", budget=1024, n=20, seed=0, model_spec=None,
                heads=None, chunk=512, positions="compact", max_new_tokens=24, turns=None, weights=None, kv=None)
    engine = load_engine(cell)
    engine.set_policy(policy_for(engine, "locret", budget=1024, stabilizers=ns, heads=None), "compact")
    for ex in examples:
        sample = sample_for(cell, engine.tokenizer, ex)
        t = time.time()
        r = run_example(engine, sample, cell.max_new_tokens)
        row = {"n_s": ns, "example": ex, "depth": sample.depth, "expected": sample.answers, "correct": r["correct"],
               "answer_kept": r["answer_kept"], "output": r["output"], "wall_s": round(time.time() - t, 1)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
