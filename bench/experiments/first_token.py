"""Time to the first answer token of a fresh `localchat ask` (process start, imports, load, read, first token),
by weight precision (or by code tree), runs interleaved so the machine's drift falls on every row alike.

    python bench/experiments/first_token.py --weights default,fp32,int8,int4 --repeat 5 --out DIR
    python bench/experiments/first_token.py --weights default --tree before=/tmp/old --tree after=. --out DIR

`default` runs with no --weights flag (what a newcomer gets). `--tree NAME=PATH` runs the package found under PATH
(as PYTHONPATH), for a before/after of two checkouts. Writes DIR/first_token.json and DIR/first_token.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

QUESTION = "Name a fruit."


def one_run(weights: str, max_new: int, tree: tuple[str, str] | None = None) -> dict:
    """One fresh process: seconds to its first byte of answer and to its exit, and its peak RSS."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(Path(tree[1]).resolve())
    flags = [] if weights == "default" else ["--weights", weights]
    cmd = [sys.executable, "-m", "localchat", *flags, "--max-new-tokens", str(max_new), "ask", QUESTION]
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = child.stdout.read(1)
    first_s = time.perf_counter() - start
    rest = child.stdout.read()
    err = child.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(child.pid, 0)
    total_s = time.perf_counter() - start
    if status != 0 or not first:
        raise SystemExit(f"`{' '.join(cmd)}` failed: {err.strip()[-400:]}")
    return {"weights": weights, "tree": tree[0] if tree else None, "first_token_s": round(first_s, 3), "total_s": round(total_s, 3),
            "peak_rss_mib": round(usage.ru_maxrss / 1024, 1), "answer": (first + rest).decode(errors="replace").strip()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", default="default,fp32,int8,int4", help="comma-separated; `default` = no flag")
    p.add_argument("--repeat", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                   help="a code tree to run (as PYTHONPATH); repeat to compare trees")
    p.add_argument("--out", required=True, type=Path)
    a = p.parse_args(argv)
    kinds = a.weights.split(",")
    trees = [tuple(t.split("=", 1)) for t in a.tree] or [None]
    for tree in trees:  # warm the page cache and the kernels' build once per tree, not counted
        one_run(kinds[0], a.max_new_tokens, tree)
    runs = [one_run(w, a.max_new_tokens, t) for _ in range(a.repeat) for t in trees for w in kinds]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "first_token.json").write_text(json.dumps(runs, indent=1))
    lines = ["| tree | weights | first token s (median) | min-max | exit s (median) | peak RSS MiB | answer |",
             "|---|---|---|---|---|---|---|"]
    for tree, w in [(t, w) for t in trees for w in kinds]:
        name = tree[0] if tree else None
        rows = [r for r in runs if r["weights"] == w and r["tree"] == name]
        ft = [r["first_token_s"] for r in rows]
        lines.append(f"| {name or 'installed'} | {w} | {statistics.median(ft):.2f} | {min(ft):.2f}-{max(ft):.2f} | "
                     f"{statistics.median(r['total_s'] for r in rows):.2f} | "
                     f"{max(r['peak_rss_mib'] for r in rows):.0f} | {rows[0]['answer'][:40]!r} |")
    (a.out / "first_token.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
