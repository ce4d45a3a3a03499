"""`localchat bench cross-check A B [--weights-a W] [--weights-b W] [--out FILE]`: two results files on the same
examples, side by side.

Do the answers depend on the machine, or on the weights' precision? Rows pair up when task, length, policy,
budget, heads, positions and example match, each side at its weights (default fp32: a CPU row's default dtype,
`weights` null, pairs with `--weights fp32`). Per cell: paired examples, identical answer texts, the same verdict
(correct or not), and the correct count on each side.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from localchat.bench.runner import RESULTS, publish, read_rows, require_results

FIELDS = ("task", "length", "policy", "budget", "heads", "positions", "example")


def fp32_rows(directory: Path, weights: str = "fp32") -> dict[tuple, dict]:
    """The rows of `directory` at `weights` (fp32: also a CPU row's default) without error, KV quantization or
    turns, by FIELDS."""
    out = {}
    for r in read_rows(directory / RESULTS):
        cpu = not (r.get("hardware") or {}).get("gpu")
        ours = r.get("weights") == weights or (weights == "fp32" and r.get("weights") is None and cpu)
        if ours and not r.get("error") and not r.get("kv") and r.get("turns") is None:
            out[tuple(r.get(f) for f in FIELDS)] = r
    return out


def compare(a: dict[tuple, dict], b: dict[tuple, dict]) -> list[str]:
    """The table: one row per cell both sides have, then the totals."""
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


def render(a: Path, b: Path, weights_a: str = "fp32", weights_b: str = "fp32") -> str:
    """cross-check.md's text for results directories `a` and `b`."""
    flags = "".join(f" --weights-{side} {w}" for side, w in (("a", weights_a), ("b", weights_b)) if w != "fp32")
    return "\n".join([f"# `{a}` (A, {weights_a}) against `{b}` (B, {weights_b}) on the same examples", "",
                      f"`localchat bench cross-check {a} {b}{flags}`", "",
                      *compare(fp32_rows(a, weights_a), fp32_rows(b, weights_b))]) + "\n"


def main(args) -> int:
    """`localchat bench cross-check`: print the table (and write it to --out)."""
    a, b = Path(args.a), Path(args.b)
    require_results(a, b)
    return publish(render(a, b, args.weights_a, args.weights_b), args.out)
