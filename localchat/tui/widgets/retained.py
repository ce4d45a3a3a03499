"""The retained map: which parts of the attached document are still in the KV cache."""

from __future__ import annotations

from textual.widgets import Static

BLOCKS = " ▁▂▃▄▅▆▇█"


def blocks(shares: list[float]) -> str:
    """One block character per bin, by the share of its tokens still cached (0..1)."""
    top = len(BLOCKS) - 1
    return "".join(BLOCKS[max(0, min(top, round(s * top)))] if s > 0 else "·" for s in shares)


def map_text(shares: list[float] | None, name: str | None, tokens: int | None) -> str:
    if shares is None:
        return "Retained map: no document attached in this chat yet."
    kept = sum(shares) / len(shares) if shares else 0.0
    head = f"Retained map: {name} ({tokens:,} tokens), {kept:.0%} still cached (all layers and KV heads)"
    width = len(shares)
    end = f"{tokens:,}"
    axis = "0" + " " * max(1, width - 1 - len(end)) + end
    return f"{head}\n{blocks(shares)}\n{axis}\n(█ all kept · ▄ half · · none; start of the document on the left)"


class RetainedMap(Static):
    def __init__(self, **kw) -> None:
        super().__init__("", markup=False, **kw)
