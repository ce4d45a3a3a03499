"""The measured-against-planned table of a folder's verify-*.json files (`localchat plan --verify --json`
outputs; bench/results/planner-precision-cpu/).

    python bench/experiments/planner_table.py bench/results/planner-precision-cpu
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GIB = 2**30


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Measured peak against the plan, from plan --verify --json files.")
    ap.add_argument("folder", nargs="?", default="bench/results/planner-precision-cpu")
    folder = Path(ap.parse_args(argv).folder)
    print("| run | weights | KV cache | budget | chunk | KV cache + copy (planned) | predicted peak | measured peak | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for f in sorted(folder.glob("verify-*.json")):
        try:
            d = json.loads(f.read_text())
        except ValueError:
            continue
        b = d["bytes"]
        kv = b.get("KV cache", 0) + b.get("KV copy (1 layer)", 0)
        err = (d["predicted_used"] - d["measured_peak"]) / d["measured_peak"]
        print(f"| {f.stem[len('verify-'):]} | {d['weights_dtype']} | {d['kv']} | {d['budget']:,} | {d['chunk']:,} | "
              f"{kv / GIB:.3f} GiB | {d['predicted_used'] / GIB:.3f} GiB | {d['measured_peak'] / GIB:.3f} GiB | {err:+.1%} |")


if __name__ == "__main__":
    main()
