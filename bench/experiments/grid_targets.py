"""`python bench/experiments/grid_targets.py DIR [--fill DIR] [--out FILE]`: LOCRET's accuracy targets on a
results file of the grid (bench/results/grid-smollm2-cpu/).

Each target is met, not met, or waiting for cells. Rows are counted only for the default heads (LOCRET rows
without `heads`), `--heads random` (shown as `random heads`) and the other policies at their own settings. A
cell with fewer than N=20 rows is "waiting". Targets: at 7.5K (7,680 tokens), LOCRET >= 95 %
of full attention's accuracy at b=1024 and >= 90 % at b=512 on each task; at every budget and task, LOCRET above
random heads and above StreamingLLM; on average over tasks, above every other policy; at 32K compact b=1024,
passkey >= 90 % and niah_single within 10 points of full attention at 4K.

`--fill DIR`: a cell with fewer than N rows here takes DIR's `--weights fp32` rows for it (the same examples in
the CPU rows' dtype on another machine; `localchat bench cross-check` compares the two where both have a cell).
Such values are marked with a dagger.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from localchat.bench.runner import RESULTS, publish, read_rows, require_results

TASKS = ("passkey", "niah_single", "niah_multikey")
BASELINES = ("random heads", "streaming", "h2o", "snapkv", "sirllm", "random")
N = 20


def load(directory: Path, weights: str | None = None) -> dict[tuple, list[bool]]:
    """(task, length, name, budget, positions) -> correctness of each example, for rows of `weights`."""
    cells: dict[tuple, list[bool]] = defaultdict(list)
    for r in read_rows(directory / RESULTS):
        if r.get("turns") is not None or r.get("weights") != weights or r.get("kv") or r.get("error"):
            continue
        name = r["policy"]
        if name == "locret" and r.get("heads"):
            if r["heads"] != "random":
                continue  # a heads variant, not the shipped heads
            name = "random heads"
        positions = None if name == "full" else r["positions"]
        cells[(r["task"], r["length"], name, r["budget"], positions)].append(bool(r["correct"]))
    return cells


class Filled(list):
    """A cell's correctness list taken from --fill rows."""


def fill(cells, other) -> dict[tuple, list[bool]]:
    """`cells` with each cell short of N rows taken (as `Filled`) from `other` where that has N."""
    merged = dict(cells)
    for key, got in other.items():
        if len(cells.get(key, [])) < N <= len(got):
            merged[key] = Filled(got)
    return merged


class Acc(float):
    """An accuracy that knows whether it rests on --fill rows (printed with a dagger)."""

    def __new__(cls, value: float, filled: bool = False):
        self = super().__new__(cls, value)
        self.filled = filled
        return self


def acc(cells, task, length, name, budget=None, positions="compact") -> Acc | None:
    got = cells.get((task, length, name, budget, None if name == "full" else positions), [])
    return Acc(sum(got) / len(got), isinstance(got, Filled)) if len(got) >= N else None


def fmt(x: Acc | None) -> str:
    return "waiting" if x is None else f"{x:.2f}" + ("†" if x.filled else "")


def verdict(ok: bool | None) -> str:
    return "waiting" if ok is None else ("met" if ok else "**not met**")


def checks(cells) -> list[str]:
    """The targets table, one row per target and cell."""
    lines = ["| target | cell | LOCRET | reference | verdict |", "|---|---|---|---|---|"]
    for budget, share in ((1024, 0.95), (512, 0.90)):
        for task in TASKS:
            for positions in ("compact", "original"):
                loc, full = acc(cells, task, 7680, "locret", budget, positions), acc(cells, task, 7680, "full")
                ok = None if loc is None or full is None else loc >= share * full
                lines.append(f"| >= {share:.0%} of full | {task} 7,680 b={budget} {positions} | {fmt(loc)} | "
                             f"full {fmt(full)} | {verdict(ok)} |")
    for length in (4096, 7680, 32768):
        for positions in ("compact",) if length == 32768 else ("compact", "original"):
            for budget in (256, 512, 1024):
                for task in TASKS:
                    loc = acc(cells, task, length, "locret", budget, positions)
                    for other in ("random heads", "streaming"):
                        ref = acc(cells, task, length, other, budget, positions)
                        ok = None if loc is None or ref is None else loc > ref
                        lines.append(f"| above {other} | {task} {length:,} b={budget} {positions} | {fmt(loc)} | "
                                     f"{other} {fmt(ref)} | {verdict(ok)} |")
                means = {}
                for name in ("locret", *BASELINES):
                    got = [acc(cells, t, length, name, budget, positions) for t in TASKS]
                    means[name] = None if None in got else Acc(sum(got) / len(got), any(g.filled for g in got))
                rest = {k: v for k, v in means.items() if k != "locret"}
                ok = None if None in means.values() else all(means["locret"] > v for v in rest.values())
                known = [(v, k) for k, v in rest.items() if v is not None]
                best = "best other " + (f"{max(known)[1]} {fmt(max(known)[0])}" if known else "waiting")
                lines.append(f"| mean over tasks above every other policy | {length:,} b={budget} {positions} | "
                             f"{fmt(means['locret'])} | {best} | {verdict(ok)} |")
    pk = acc(cells, "passkey", 32768, "locret", 1024)
    lines.append(f"| passkey >= 0.90 | passkey 32,768 b=1024 compact | {fmt(pk)} | 0.90 | "
                 f"{verdict(None if pk is None else pk >= 0.90)} |")
    ns, full4 = acc(cells, "niah_single", 32768, "locret", 1024), acc(cells, "niah_single", 4096, "full")
    ok = None if ns is None or full4 is None else ns >= full4 - 0.10
    lines.append(f"| within 10 points of full at 4K | niah_single 32,768 b=1024 compact | {fmt(ns)} | "
                 f"full at 4K {fmt(full4)} | {verdict(ok)} |")
    return lines


def render(directory: Path, fill_from: Path | None = None) -> str:
    """targets.md's text for the results in `directory`, cells short of N filled from `fill_from`'s fp32 rows."""
    cells = load(directory)
    if fill_from:
        cells = fill(cells, load(fill_from, weights="fp32"))
    lines = checks(cells)
    count = {v: sum(line.endswith(f"| {v} |") for line in lines) for v in ("met", "**not met**", "waiting")}
    command = f"python bench/experiments/grid_targets.py {directory}" + (f" --fill {fill_from}" if fill_from else "")
    head = [f"# LOCRET's accuracy targets on `{directory}` (N = {N} per cell)", "",
            f"`{command}`: met {count['met']}, not met {count['**not met**']}, "
            f"waiting for cells {count['waiting']}.", ""]
    if fill_from:
        filled = sum(isinstance(got, Filled) for got in cells.values())
        head += [f"† the cell's rows come from `{fill_from}` (`--weights fp32`, {filled} cells), because "
                 f"`{directory}` has fewer than {N} there.", ""]
    return "\n".join(head + lines) + "\n"


def main(argv=None) -> int:
    """Print the table (and write it to --out)."""
    import argparse

    parser = argparse.ArgumentParser(description="LOCRET's accuracy targets on DIR/results.jsonl: met, not met, "
                                                 "waiting")
    parser.add_argument("dir", help="a bench --out directory")
    parser.add_argument("--fill", help="results dir whose --weights fp32 rows fill cells short of N=20 in DIR")
    parser.add_argument("--out", help="also write the table to this file (e.g. DIR/targets.md)")
    args = argv if isinstance(argv, argparse.Namespace) else parser.parse_args(argv)
    directory, fill_from = Path(args.dir), Path(args.fill) if args.fill else None
    require_results(directory, fill_from)
    return publish(render(directory, fill_from), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
