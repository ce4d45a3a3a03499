"""The retained map: which parts of the attached document are still in the KV cache."""

from __future__ import annotations

import math

from textual.widgets import Static

BLOCKS = " ▁▂▃▄▅▆▇█"  # index 0 unused: any kept token shows at least ▁


def blocks(shares: list[float]) -> str:
    """One block per bin, as tall as its share still cached relative to the largest; blank = none."""
    top = max(shares, default=0.0)
    if top <= 0:
        return " " * len(shares)
    return "".join(BLOCKS[max(1, math.ceil(s / top * 8))] if s > 0 else " " for s in shares)


def map_text(shares: list[float] | None, name: str | None, tokens: int | None) -> str:
    if shares is None:
        return "Retained map: no document attached in this chat yet."
    kept = sum(shares) / len(shares) if shares else 0.0
    head = f"Retained map: {name} ({tokens:,} tokens), {kept:.0%} still cached (all layers and KV heads)"
    end = f"{tokens:,}"
    axis = "0" + " " * max(1, len(shares) - 1 - len(end)) + end
    legend = f"(height: share of each stretch still cached, █ = {max(shares, default=0):.0%}, blank = none; start on the left)"
    return f"{head}\n{blocks(shares)}\n{axis}\n{legend}"


class RetainedMap(Static):
    def __init__(self, **kw) -> None:
        super().__init__("", markup=False, **kw)
