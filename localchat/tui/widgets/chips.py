"""Attachment chips above the input: a document's name and exact token count; click one to remove it."""

from __future__ import annotations

from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Static


def chip_label(name: str, tokens: int) -> str:
    return f"{name} · {tokens:,} tokens"


class Chip(Static):
    class Removed(Message):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index

    def __init__(self, index: int, label: str) -> None:
        super().__init__(f"{label} ✕", markup=False, classes="chip")
        self.index = index
        self.tooltip = "click to remove"

    def on_click(self) -> None:
        self.post_message(self.Removed(self.index))


class ChipBar(Horizontal):
    async def show(self, labels: list[str]) -> None:
        await self.remove_children()
        await self.mount_all([Chip(i, label) for i, label in enumerate(labels)])
        self.display = bool(labels)
