"""`localchat bench side-by-side DIR`: the grid README's "Every policy side by side" table, from the rows.

Mean score over passkey, niah_single, niah_multikey and multiturn (each policy's default rows: no named heads,
LOCRET at compact positions) at 4K and 7,680 for b=256/512/1024, then the median KV kept and the median peak
memory over the 7,680 b=1024 passkey and niah rows. A task's mean divides by N=20, the grid's examples per cell.
"""

from __future__ import annotations

from pathlib import Path
from statistics import median

from localchat.bench.runner import RESULTS, publish, read_rows, require_results
from localchat.engine.policies import POLICIES as REGISTRY
from localchat.errors import UserError

POLICIES = "locret,full,omnikv,sirllm,streaming,roco,h2o,sagekv,snapkv,corm,random".split(",")
TASKS = ("passkey", "niah_single", "niah_multikey", "multiturn")
MIB = 2**20


def table(directory: Path) -> list[str]:
    """The markdown table's lines for the rows in `directory`."""
    rows = [r for r in read_rows(directory / RESULTS)
            if r.get("heads") is None and not (r["policy"] == "locret" and r["positions"] == "original")]

    def cell(policy, length, budget, tasks):
        b = budget if REGISTRY[policy].uses_budget() else None
        return [r for r in rows if (r["policy"], r["length"], r["budget"]) == (policy, length, b) and r["task"] in tasks]

    def mean_score(policy, length, budget):
        means = [sum(r["score"] for r in cell(policy, length, budget, (t,))) / 20 for t in TASKS]
        return sum(means) / len(means)

    lines = ["| policy | 4K b=256 | 4K b=512 | 4K b=1024 | 7,680 b=256 | 7,680 b=512 | 7,680 b=1024 "
             "| KV kept at 7,680 b=1024 (MiB) | peak RSS at 7,680 b=1024 (MiB, median) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in POLICIES:
        scores = [f"{mean_score(p, n, b):.2f}" for n in (4096, 7680) for b in (256, 512, 1024)]
        mem = cell(p, 7680, 1024, TASKS[:3])
        if not mem:
            raise UserError(f"{directory} has no {p} rows at 7,680 tokens and b=1024 (passkey, niah_*)")
        kv = median(r["kv_bytes"] for r in mem) / MIB
        peak = median(r["peak_memory_bytes"] for r in mem) / MIB
        lines.append(f"| {p} | {' | '.join(scores)} | {kv:.1f} | {peak:.0f} |")
    return lines


def main(args) -> int:
    """`localchat bench side-by-side`: print the table."""
    directory = Path(args.dir)
    require_results(directory)
    return publish("\n".join(table(directory)), None)
