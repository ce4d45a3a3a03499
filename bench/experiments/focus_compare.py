"""Per example: LOCRET with --focus against the same cell without it (bench/results/focus-smollm2-cpu/).

Same documents means the same task, length, budget, cap, seed and N. Prints, per cell, right-with-focus /
right-without over the examples both ran, and which examples differ.

    python bench/experiments/focus_compare.py bench/results/focus-smollm2-cpu/results.jsonl \
        bench/results/max-copies-smollm2-cpu/results.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def rows(paths: list[str]):
    for path in paths:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if r.get("policy") == "locret" and not r.get("error") and r.get("weights") in (None, "fp32"):
                    yield r


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="LOCRET with --focus against the same cells without it.")
    ap.add_argument("results", nargs="+", help="results.jsonl files holding both kinds of rows")
    focus, plain = defaultdict(dict), defaultdict(dict)
    for r in rows(ap.parse_args(argv).results):
        cell = (r["task"], r["length"], r["budget"], r.get("max_copies"), r["seed"], r["n"], r.get("turns"))
        (focus if r.get("focus") else plain)[cell].setdefault(r["example"], r["score"])
    for cell in sorted(focus):
        both = sorted(set(focus[cell]) & set(plain.get(cell, {})))
        if not both:
            print(cell[:4], f"focus {sum(focus[cell].values()):g} of {len(focus[cell])}, no rows without focus")
            continue
        f, p = (sum(d[e] for e in both) for d in (focus[cell], plain[cell]))
        gained = [e for e in both if focus[cell][e] > plain[cell][e]]
        lost = [e for e in both if focus[cell][e] < plain[cell][e]]
        turns = f" turns={cell[6]}" if cell[6] is not None else ""
        print(f"{cell[0]}{turns} {cell[1]} b={cell[2]} cap={cell[3]}: focus {f:g} of {len(both)}, without {p:g}; "
              f"gained {gained}, lost {lost}")


if __name__ == "__main__":
    main()
