"""`localchat bench by-length --out DIR SRC [SRC ...]`: accuracy against document length, 4K to 128K, per policy.

The grid's results live in several directories (the 4K-32K grid, the 64K/128K lanes, a GPU's lanes); this reads
the rows of each SRC (labelled as `bench report` labels them: named heads, weights and cache precisions are series
of their own, but a GPU lane's fp32 rows join the CPU's: `_joined`), keeps one budget (full attention has none),
and writes per task a table (mean score and N per policy and length; each policy's plain series unless
`--policies` names others) and a plot (`accuracy-by-length-TASK.png`, log2 length axis) into DIR, with
`by-length.md` listing both."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from statistics import mean

from localchat.bench.report import _legend_right, _ordered, _save, load_rows, series_style
from localchat.errors import UserError


def collect(sources: list[Path], budget: int, policies: list[str] | None = None) -> list[dict]:
    """The rows at `budget` (and full attention's); by default each policy's plain series only (no named heads,
    other positions or precisions), else the series named in `policies` (labels as `bench report` prints them)."""
    rows = _joined([[r for r in load_rows(src) if r.get("error") is None] for src in sources])
    rows = [r for r in rows if r.get("budget") in (None, budget)
            and (r["policy"] in policies if policies else not re.search(r"[\[ ]", r["policy"]))]
    if not rows:
        raise UserError(f"no rows at budget {budget} (or full attention) in {', '.join(map(str, sources))}")
    return rows


def _joined(per_source: list[list[dict]]) -> list[dict]:
    """The sources' rows as one series per setting: fp32 rows from any machine (a GPU lane's `--weights fp32`)
    join the CPU's default-dtype rows, a GPU's default-dtype rows are a series of their own, and an example an
    earlier source already has is not counted twice."""
    seen: set[tuple] = set()
    out = []
    for rows in per_source:
        keys = set()
        for r in rows:
            if r.get("weights") == "fp32":
                r["policy"] = r["policy"].replace(" weights=fp32", "")
            elif r.get("weights") is None and (r.get("hardware") or {}).get("gpu"):
                r["policy"] += " weights=gpu-default"
            key = (r["task"], r["length"], r["policy"], r.get("budget"), r.get("seed"), r.get("n"), r["example"])
            if key not in seen:
                out.append(r)
                keys.add(key)
        seen |= keys
    return out


def cells(rows: list[dict], task: str) -> dict[str, dict[int, list[float]]]:
    """policy -> length -> scores."""
    out: dict[str, dict[int, list[float]]] = {}
    for r in rows:
        if r["task"] == task:
            out.setdefault(r["policy"], {}).setdefault(r["length"], []).append(float(r["score"]))
    return out


def table(rows: list[dict], task: str) -> list[str]:
    by_policy = cells(rows, task)
    lengths = sorted({n for per in by_policy.values() for n in per})
    lines = ["| policy | " + " | ".join(f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}" for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for policy in _ordered(r["policy"] for r in rows if r["task"] == task):
        per = by_policy[policy]
        lines.append(f"| {policy} | " + " | ".join(f"{mean(per[n]):.2f} ({len(per[n])})" if n in per else ""
                                                 for n in lengths) + " |")
    return lines


def plot(plt, rows: list[dict], task: str, budget: int, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    policies = _ordered(r["policy"] for r in rows)
    by_policy = cells(rows, task)
    for policy, per in sorted(by_policy.items(), key=lambda kv: policies.index(kv[0])):
        xs = sorted(per)
        label = policy if policy.startswith("full") else f"{policy} b={budget}"
        ax.plot(xs, [mean(per[n]) for n in xs], marker="o", label=label, **series_style(policies.index(policy)))
    ax.set_xscale("log", base=2)
    lengths = sorted({n for per in by_policy.values() for n in per})
    ax.set_xticks(lengths, [f"{n / 1024:g}K" for n in lengths])
    ax.minorticks_off()
    ax.set(title=f"{task}: accuracy vs document length", xlabel="document tokens", ylabel="accuracy",
           ylim=(-0.05, 1.05))
    _legend_right(fig, ax)
    safe = re.sub(r"[^\w.-]+", "-", task).strip("-")
    return _save(plt, fig, out / f"accuracy-by-length-{safe}.png")


def _command(args, out: Path, sources: list[Path]) -> str:
    """The command that makes this report, quoted so that it can be pasted (policy labels hold spaces)."""
    words = ["localchat", "bench", "by-length", "--out", str(out), *map(str, sources), "--budget", str(args.budget)]
    return shlex.join(words + (["--policies", args.policies] if args.policies else []))


def main(args) -> int:
    out, sources = Path(args.out), [Path(s) for s in args.sources]
    chosen = [p.strip() for p in args.policies.split(",") if p.strip()] if args.policies else None
    rows = collect(sources, args.budget, chosen)
    tasks = _ordered(r["task"] for r in rows)
    out.mkdir(parents=True, exist_ok=True)
    md = [f"# Accuracy by document length (budget {args.budget}; full attention where it can read)", "",
          "Sources: " + ", ".join(f"`{s}`" for s in sources), "",
          f"Each cell: mean score (examples). Command: `{_command(args, out, sources)}`", ""]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
        md += ["(no plots: pip install 'localchat[plot]')", ""]
    for task in tasks:
        md += [f"## {task}", "", *table(rows, task), ""]
        if plt is not None:
            md += [f"![{task}]({plot(plt, rows, task, args.budget, out).name})", ""]
    path = out / "by-length.md"
    path.write_text("\n".join(md), encoding="utf-8")
    print(path.read_text(encoding="utf-8"))
    return 0
