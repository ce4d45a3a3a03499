"""The grid README's "Every policy side by side" table, from the rows.

    python scripts/grid_side_by_side.py bench/results/grid-smollm2-cpu

Mean score over passkey, niah_single, niah_multikey and multiturn (each policy's default rows: no named
heads, LOCRET at compact positions) at 4K and 7,680 for b=256/512/1024, then the median KV kept and the
median peak memory over the 7,680 b=1024 passkey and niah rows.
"""

import sys
from pathlib import Path
from statistics import median

from localchat.bench.runner import RESULTS, read_rows

POLICIES = "locret,full,omnikv,sirllm,streaming,roco,h2o,sagekv,snapkv,corm,random".split(",")
TASKS = ("passkey", "niah_single", "niah_multikey", "multiturn")
MIB = 2**20


def main() -> None:
    rows = [r for r in read_rows(Path(sys.argv[1]) / RESULTS)
            if r.get("heads") is None and not (r["policy"] == "locret" and r["positions"] == "original")]

    def cell(policy, length, budget, tasks):
        b = None if policy == "full" else budget
        return [r for r in rows if (r["policy"], r["length"], r["budget"]) == (policy, length, b) and r["task"] in tasks]

    def mean_score(policy, length, budget):
        means = [sum(r["score"] for r in cell(policy, length, budget, (t,))) / 20 for t in TASKS]
        return sum(means) / len(means)

    print("| policy | 4K b=256 | 4K b=512 | 4K b=1024 | 7,680 b=256 | 7,680 b=512 | 7,680 b=1024 "
          "| KV kept at 7,680 b=1024 (MiB) | peak RSS at 7,680 b=1024 (MiB, median) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in POLICIES:
        scores = [f"{mean_score(p, n, b):.2f}" for n in (4096, 7680) for b in (256, 512, 1024)]
        mem = cell(p, 7680, 1024, TASKS[:3])
        kv = median(r["kv_bytes"] for r in mem) / MIB
        peak = median(r["peak_memory_bytes"] for r in mem) / MIB
        print(f"| {p} | {' | '.join(scores)} | {kv:.1f} | {peak:.0f} |")


if __name__ == "__main__":
    main()
