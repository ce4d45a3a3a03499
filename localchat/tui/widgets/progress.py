"""Prefill progress: a bar with tokens done/total, tokens/s and ETA."""

from __future__ import annotations

from textual.containers import Horizontal
from textual.widgets import Label, ProgressBar

from localchat.engine.events import Progress


def _seconds(s: float | None) -> str:
    if s is None:
        return "?"
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def progress_text(p: Progress) -> str:
    return f"reading {p.done:,}/{p.total:,} tokens  {p.tokens_per_s:,.0f} tok/s  ETA {_seconds(p.eta_s)}  (Esc stops)"


class PrefillProgress(Horizontal):
    def compose(self):
        yield ProgressBar(total=None, show_eta=False, show_percentage=True)
        yield Label("", id="progress-text")

    def show(self, p: Progress) -> None:
        self.display = True
        self.query_one(ProgressBar).update(total=max(p.total, 1), progress=p.done)
        self.query_one("#progress-text", Label).update(progress_text(p))
        self.last = p

    def start(self, text: str = "reading…  (Esc stops)") -> None:
        self.display = True
        self.last = None
        self.query_one(ProgressBar).update(total=None, progress=0)
        self.query_one("#progress-text", Label).update(text)

    def hide(self) -> None:
        self.display = False
