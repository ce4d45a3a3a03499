"""Tables of focus_sweep.jsonl (bench/results/grid-smollm2-cpu-long/): per setting, the answers right at 128K
(niah_single, each example a column) and at 4K (per task).

    python bench/experiments/focus_sweep_table.py bench/results/grid-smollm2-cpu-long/focus_sweep.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Tables of focus_sweep.py's rows.")
    ap.add_argument("rows", nargs="?", default="bench/results/grid-smollm2-cpu-long/focus_sweep.jsonl")
    path = Path(ap.parse_args(argv).rows)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    long = collections.defaultdict(dict)
    short = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in rows:
        key = (r["window"], r["spread"], r["k"])
        if r["length"] == 131072:
            long[key][r["example"]] = r["correct"]
        else:
            short[key][r["task"]].append(r["correct"])
    examples = sorted({e for v in long.values() for e in v})
    full = {k: v for k, v in long.items() if set(v) == set(examples)}
    print(f"128K niah_single, the {len(examples)} examples every setting below ran ({', '.join(map(str, examples))}):\n")
    print("| window | spread | K | right | " + " | ".join(map(str, examples)) + " |")
    print("|---|---|---|---|" + "---|" * len(examples))
    for key, v in sorted(full.items(), key=lambda kv: (-sum(kv[1].values()), kv[0])):
        print(f"| {key[0]} | {key[1]} | {key[2]} | {sum(v.values())} | "
              + " | ".join("x" if v[e] else "." for e in examples) + " |")
    tasks = sorted({t for v in short.values() for t in v})
    print("\n4K (answers right / examples run):\n")
    print("| window | spread | K | " + " | ".join(tasks) + " |")
    print("|---|---|---|" + "---|" * len(tasks))
    for key in sorted(short):
        print(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(
            f"{sum(short[key][t])} / {len(short[key][t])}" if short[key][t] else "-" for t in tasks) + " |")


if __name__ == "__main__":
    main()
