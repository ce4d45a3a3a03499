"""Two results files on the same examples, side by side: do the answers depend on the machine?

    python scripts/grid_cross_check.py bench/results/grid-smollm2-cpu bench/results/grid-smollm2-h100-fp32 [--out F.md]

Rows pair up when task, length, policy, budget, heads, positions and example match and both ran in fp32 (a CPU
row's default dtype, `weights` null, pairs with `--weights fp32`). Per cell: paired examples, identical answer
texts, the same verdict (correct or not), and the correct count on each side.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from localchat.bench.runner import RESULTS, read_rows

FIELDS = ("task", "length", "policy", "budget", "heads", "positions", "example")


def fp32_rows(directory: Path) -> dict[tuple, dict]:
    out = {}
    for r in read_rows(directory / RESULTS):
        cpu = not (r.get("hardware") or {}).get("gpu")
        fp32 = r.get("weights") == "fp32" or (r.get("weights") is None and cpu)
        if fp32 and not r.get("error") and not r.get("kv") and r.get("turns") is None:
            out[tuple(r.get(f) for f in FIELDS)] = r
    return out


def compare(a: dict[tuple, dict], b: dict[tuple, dict]) -> list[str]:
    cells: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    for key in a.keys() & b.keys():
        x, y, c = a[key], b[key], cells[key[:-1]]
        c[0] += 1
        c[1] += x["output"].strip() == y["output"].strip()
        c[2] += bool(x["correct"]) == bool(y["correct"])
        c[3] += bool(x["correct"])
        c[4] += bool(y["correct"])
    lines = ["| task | length | policy | budget | heads | positions | paired | same answer | same verdict | "
             "correct A | correct B |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    total = [0] * 5
    for key in sorted(cells, key=lambda k: tuple(str(v) for v in k)):
        c = cells[key]
        total = [t + v for t, v in zip(total, c)]
        lines.append("| " + " | ".join("" if v is None else str(v) for v in key) + " | " + " | ".join(map(str, c)) + " |")
    lines.append(f"| all | | | | | | {' | '.join(map(str, total))} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    text = "\n".join([f"# `{args.a}` (A) against `{args.b}` (B), fp32 rows on the same examples", "",
                      f"`python scripts/grid_cross_check.py {args.a} {args.b}`", "", *compare(
                          fp32_rows(args.a), fp32_rows(args.b))]) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
