"""LOCRET's settings one at a time: what n_loc, n_s, the chunk, a sink and an oracle change (original positions
at 7,680 tokens unless told otherwise).

    python scripts/positions_sweep.py [--task T] [--length N] [--positions P] [--heads DIR] \
        BUDGET EXAMPLES VARIANT [VARIANT ...] > OUT.jsonl
    # e.g. 512 5,6,7 '{"local": 512}' '{"stabilizers": 32}' '{"chunk": 1024}'
    # defaults: --task passkey --length 7680 --positions original, the shipped heads

A VARIANT is a JSON object over `local` (n_loc, default 96), `stabilizers` (n_s, default the bench's), `chunk`
(default 512), `protect` (an oracle, off by default: the answer's prompt tokens and `protect` tokens either
side are never evicted, in every layer and KV head) and `sink` (the prompt's first `sink` tokens are never
evicted; off by default). The examples are those of `localchat bench --tasks T --lengths N --policies locret
--budgets BUDGET -n 20 --positions P [--heads DIR]` (seed 0), which has no n_loc or n_s flag. One JSON line per
example and variant: the settings, correct, answer_kept, the output and wall_s.
"""

import argparse
import json
import time

import torch

from localchat.bench.cell import Cell, answer_tokens, load_engine, run_example, sample_for, use_policy
from localchat.bench.tasks import ANSWER_TOKENS, prompt_messages
from localchat.engine.policies.base import PROTECT, protect_first


def protect(engine, sample, span: int | None, sink: int) -> int | None:
    """The policy's priority never evicts the prompt's first `sink` tokens nor, when `span` is not None (an
    oracle), the answer's prompt tokens and `span` tokens either side. Returns how many answer-side tokens
    that protects (None: no oracle; 0: the answer could not be located). Protecting nothing changes nothing."""
    if span is None and sink <= 0:
        return None
    near: set[int] = set()
    if span is not None:
        text = engine.render(prompt_messages(sample))
        ids = engine.encode(text)
        where = answer_tokens(engine.tokenizer, text, ids, sample.answers)
        near = {j for i in where for j in range(i - span, i + span + 1) if 0 <= j < len(ids)}
    wanted = torch.tensor(sorted(near), dtype=torch.long)
    policy = engine.policy
    base = type(policy).priority

    def priority(layer, layer_idx, last_chunk):
        prio = protect_first(base(policy, layer, layer_idx, last_chunk), layer.positions, sink)
        if len(wanted):
            prio[torch.isin(layer.positions, wanted.to(layer.positions.device))] = PROTECT
        return prio

    policy.priority = priority
    return None if span is None else len(near)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="passkey")
    ap.add_argument("--length", type=int, default=7680, help="document tokens")
    ap.add_argument("--positions", choices=("original", "compact"), default="original")
    ap.add_argument("--heads", default=None, help="a heads directory, or random (default: the shipped heads)")
    ap.add_argument("budget", type=int)
    ap.add_argument("examples", help="comma-separated example indices (0-19)")
    ap.add_argument("variants", nargs="+", help='JSON objects, e.g. \'{"local": 512}\'')
    args = ap.parse_args()
    examples = [int(x) for x in args.examples.split(",")]
    variants = [json.loads(v) for v in args.variants]
    cell = Cell(task=args.task, length=args.length, policy="locret", budget=args.budget, n=20, seed=0,
                model_spec=None, heads=args.heads, chunk=512, positions=args.positions,
                max_new_tokens=ANSWER_TOKENS[args.task])
    engine = load_engine(cell)
    for variant in variants:
        use_policy(engine, cell)  # the bench's policy for this cell, then the variant's changes
        policy = engine.policy
        policy.local = variant.get("local", policy.local)
        policy.stabilizers = variant.get("stabilizers", policy.stabilizers)
        engine.chunk = variant.get("chunk", cell.chunk)
        for ex in examples:
            sample = sample_for(cell, engine.tokenizer, ex)
            protected = protect(engine, sample, variant.get("protect"), variant.get("sink", 0))
            t = time.time()
            r = run_example(engine, sample, cell.max_new_tokens)
            row = {"task": cell.task, "length": cell.length, "heads": cell.heads, "budget": cell.budget,
                   "local": policy.local, "stabilizers": policy.stabilizers,
                   "chunk": engine.chunk, "positions": engine.positions, "protected": protected,
                   "sink": variant.get("sink", 0), "example": ex, "depth": sample.depth,
                   "expected": sample.answers, "correct": r["correct"], "answer_kept": r["answer_kept"],
                   "output": r["output"], "max_new_tokens": cell.max_new_tokens, "wall_s": round(time.time() - t, 1)}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
