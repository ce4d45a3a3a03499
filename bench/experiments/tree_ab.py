"""LOCRET's prefill and decode speed on SmolLM2-135M-Instruct, one code tree against another
(bench/results/compact-positions-drift/, section 3).

    python bench/experiments/tree_ab.py run --before OLD_TREE --after NEW_TREE --reps 3 --lengths 4096 \
        --decode 32 > ab.jsonl          # alternates the trees, fp32 then bf16 weights, one process per run
    python bench/experiments/tree_ab.py table ab.jsonl    # medians per (weights, length), after / before
    python bench/experiments/tree_ab.py measure fp32 4096,8192 64 after   # one process, the tree on PYTHONPATH

`measure` loads the model at `weights` (fp32 or bf16), answers once to warm up, then for each length reads a
niah_single prompt (seed 0, the `bench perf` layout) in chunks of 512 with b=1024 and random retaining heads and
decodes `decode` greedy tokens (EOS ignored). One JSON line per length, with wall-clock rates and the rates by
this process's CPU time (`*_cpu_*`: what a core shared with other work still measures fairly).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict


def prompt(engine, n_tokens: int, seed: int) -> list[int]:
    """`bench perf`'s prompt, built from the bench's tasks (public in every tree this compares)."""
    from localchat.bench.tasks import niah_single, prompt_messages

    return engine.encode_chat(prompt_messages(niah_single(engine.tokenizer, n_tokens, seed, depth=0.5)))


def timed(engine, ids: list[int], new: int):
    """Done, CPU seconds to the first token (prefill), CPU seconds from there to the end (decode)."""
    from localchat.engine.events import Done, Token
    from localchat.engine.sampling import GenerationSettings

    t0 = time.process_time()
    first = None
    for event in engine.generate(ids, GenerationSettings(max_new_tokens=new, ignore_eos=True)):
        if isinstance(event, Token) and first is None:
            first = time.process_time()
        if isinstance(event, Done):
            return event, first - t0, time.process_time() - first
    raise RuntimeError("the engine ended without a Done event")


def measure(weights: str, lengths: list[int], decode: int, label: str) -> None:
    # Imported here: `run` starts this in a process whose PYTHONPATH names the tree to measure.
    import torch

    from localchat.engine.engine import Engine
    from localchat.planning.load import policy_for

    torch.manual_seed(0)
    engine = Engine.load(None, chunk=512, weights=weights, say=lambda *_: None)
    engine.set_policy(policy_for(engine, "locret", budget=1024, heads="random"), "compact")
    timed(engine, prompt(engine, 1500, 0), 4)  # warm-up
    for n in lengths:
        done, cpu_prefill, cpu_decode = timed(engine, prompt(engine, n, 0), decode)
        print(json.dumps({"tree": label, "weights": weights, "dtype": str(next(engine.model.parameters()).dtype),
                          "length": n, "prompt_tokens": done.prompt_tokens, "prefill_s": round(done.prefill_s, 3),
                          "prefill_tok_s": round(done.prompt_tokens / done.prefill_s, 1),
                          "new_tokens": done.new_tokens,
                          "decode_tok_s": round((done.new_tokens - 1) / done.decode_s, 2),
                          "kv_mib": round(done.kv_bytes / 2**20, 2),
                          "prefill_cpu_tok_s": round(done.prompt_tokens / cpu_prefill, 1),
                          "decode_cpu_tok_s": round((done.new_tokens - 1) / cpu_decode, 2)}),
              flush=True)


def alternate(before: str, after: str, reps: int, lengths: str, decode: int) -> None:
    """`measure` in a fresh process per tree, weights and repeat, trees back to back; rows gain `rep`."""
    for rep in range(1, reps + 1):
        for weights in ("fp32", "bf16"):
            for label, tree in (("before", before), ("after", after)):
                env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": tree}
                out = subprocess.run([sys.executable, __file__, "measure", weights, lengths, str(decode), label],
                                     env=env, check=True, capture_output=True, text=True).stdout
                for line in out.splitlines():
                    print(json.dumps({"rep": rep, **json.loads(line)}), flush=True)


def table(path: str) -> None:
    """Median prefill and decode tokens/s per (weights, length, tree), and after / before: by CPU time
    (`*_cpu_tok_s`) when the rows have it, else by wall clock."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    cpu = all("prefill_cpu_tok_s" in r for r in rows)
    P, D = ("prefill_cpu_tok_s", "decode_cpu_tok_s") if cpu else ("prefill_tok_s", "decode_tok_s")
    groups = defaultdict(list)
    for r in rows:
        groups[(r["weights"], r["length"], r["tree"])].append(r)
    print(f"Medians by {'CPU time' if cpu else 'wall clock'}.\n")
    print("| weights | length | runs | prefill tok/s before | after | after/before | decode tok/s before | after | "
          "after/before | KV MiB before | after |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for weights, length in sorted({(w, n) for w, n, _ in groups}):
        b, a = groups[(weights, length, "before")], groups[(weights, length, "after")]

        def med(rs, key):
            return statistics.median(r[key] for r in rs)

        pb, pa, db, da = med(b, P), med(a, P), med(b, D), med(a, D)
        print(f"| {weights} | {length} | {len(b)}+{len(a)} | {pb:.1f} | {pa:.1f} | {pa / pb:.3f} | {db:.2f} | "
              f"{da:.2f} | {da / db:.3f} | {b[0]['kv_mib']} | {a[0]['kv_mib']} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="LOCRET's speed, one code tree against another.")
    sub = ap.add_subparsers(dest="command", required=True)
    one = sub.add_parser("measure", help="one process: the tree on PYTHONPATH")
    one.add_argument("weights", choices=["fp32", "bf16"])
    one.add_argument("lengths", help="comma-separated document lengths")
    one.add_argument("decode", type=int, help="tokens to decode")
    one.add_argument("label", help="the tree's name in the rows (before, after)")
    both = sub.add_parser("run", help="alternate two trees, one process per run")
    both.add_argument("--before", required=True, help="the tree before the change (a directory holding localchat/)")
    both.add_argument("--after", required=True, help="the tree after it")
    both.add_argument("--reps", type=int, default=3)
    both.add_argument("--lengths", default="4096,8192")
    both.add_argument("--decode", type=int, default=64)
    summary = sub.add_parser("table", help="medians of a run's rows, after / before")
    summary.add_argument("rows", help="the JSONL that `run` printed")
    args = ap.parse_args(argv)
    if args.command == "measure":
        measure(args.weights, [int(n) for n in args.lengths.split(",")], args.decode, args.label)
    elif args.command == "run":
        alternate(args.before, args.after, args.reps, args.lengths, args.decode)
    else:
        table(args.rows)


if __name__ == "__main__":
    main()
