"""Ctrl+O: pick a file from a directory tree, or type its path."""

from __future__ import annotations

from pathlib import Path

from textual import on
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DirectoryTree, Input, Static


class _Tree(DirectoryTree):
    def filter_paths(self, paths):
        return [p for p in paths if not p.name.startswith(".")]


class FilePicker(ModalScreen[Path | None]):
    CSS_PATH = "file_picker.tcss"
    BINDINGS = [Binding("escape", "dismiss_none", "Close")]

    def __init__(self, start: Path | None = None) -> None:
        super().__init__()
        self.start = start or Path.cwd()

    def compose(self):
        with Vertical(id="picker"):
            yield Static("Attach a document: pick a file, or type a path and press Enter (Esc closes)",
                         id="picker-title", markup=False)
            yield Input(placeholder="path", id="picker-path")
            yield _Tree(self.start, id="picker-tree")

    def on_mount(self) -> None:
        self.query_one(_Tree).focus()

    @on(DirectoryTree.FileSelected)
    def picked(self, event: DirectoryTree.FileSelected) -> None:
        self.dismiss(Path(event.path))

    @on(Input.Submitted, "#picker-path")
    def typed(self, event: Input.Submitted) -> None:
        if event.value.strip():
            self.dismiss(Path(event.value.strip()).expanduser())

    def action_dismiss_none(self) -> None:
        self.dismiss(None)
