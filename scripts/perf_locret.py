"""LOCRET vs full attention on this machine, side by side in one run: a thin call into `localchat bench perf`.

Run:  python scripts/perf_locret.py --out bench/results/perf-locret-smollm2-cpu
Writes OUT.json (every figure and setting) and OUT.md (the tables); `localchat bench perf --out DIR`
does the same into DIR/perf.json and DIR/perf.md.

1. A 7.6K-token document, chunk 512: `full` (original positions) vs `locret` (b=1024, n_s=256,
   n_loc=96, compact positions), plus `full` through transformers' DynamicCache (labelled): prefill
   tokens/s, decode tokens/s over 64 tokens, KV bytes held.
2. LOCRET time per token at 4K, 8K, 16K and 32K tokens (compact positions).
Speed does not depend on the heads' weights, only on their size: random heads (d_R=1024) are used
until trained heads ship.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from localchat.bench.perf import PerfConfig, markdown, measure, write


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="4096,8192,16384,32768")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    config = PerfConfig(chunk=512, length=7600, lengths=[int(n) for n in args.lengths.split(",")], budget=1024,
                        heads="random", decode_tokens=64, seed=args.seed,
                        command=shlex.join(["python", "scripts/perf_locret.py", *sys.argv[1:]]))
    result = measure(config, say=lambda line: print(line, file=sys.stderr, flush=True))
    out = Path(args.out)
    write(result, out.with_suffix(".json"), out.with_suffix(".md"))
    print(markdown(result))


if __name__ == "__main__":
    main()
