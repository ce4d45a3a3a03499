"""niah_multikey: how many wrong answers give the number of another needle of the same document
(bench/results/grid-smollm2-cpu-long/, LOCRET with the paper's rule, the fp32 rows of the CPU and GPU grids).

    python bench/experiments/other_needle.py 65536 2048      # and 1024; 131072 for 128K
"""

from __future__ import annotations

import argparse
import json
import re

from localchat.bench.cell import Cell, load_engine, sample_for

RESULTS = ("bench/results/grid-smollm2-cpu-long/results.jsonl", "bench/results/grid-smollm2-gpu-long/results.jsonl")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="niah_multikey: wrong answers that give another needle's number.")
    ap.add_argument("length", type=int)
    ap.add_argument("budget", type=int)
    ap.add_argument("--results", nargs="+", default=list(RESULTS), help="results.jsonl files to read")
    a = ap.parse_args(argv)
    rows = []
    for path in a.results:
        with open(path) as f:
            rows += [json.loads(line) for line in f]
    cell = Cell(task="niah_multikey", length=a.length, policy="locret", budget=a.budget, n=20, seed=0,
                model_spec=None, heads=None, chunk=512, positions="compact", max_new_tokens=24)
    engine = load_engine(cell)
    picked = [r for r in rows if r["task"] == "niah_multikey" and r["length"] == a.length and r["budget"] == a.budget
              and r["policy"] == "locret" and r.get("max_copies") is None and r.get("weights") in (None, "fp32")]
    other = []
    for r in picked:
        if r["correct"]:
            continue
        sample = sample_for(cell, engine.tokenizer, r["example"])
        numbers = re.findall(r"special magic numbers? for [\w-]+ is:? (\d+)", sample.document)
        if any(g in numbers for g in re.findall(r"\d{5,}", r["output"])):
            other.append(r["example"])
    print(a.length, a.budget, "rows", len(picked), "right", sum(r["correct"] for r in picked),
          "another needle's number", len(other), sorted(other))


if __name__ == "__main__":
    main()
