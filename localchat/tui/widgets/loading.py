"""The model's loading, in the conversation while it runs: a bar and the stage it is in (bytes fetched, or
the seconds spent). The loader's plain lines become notes above it; what it prints (a library's progress bar,
a step of its own) stands as the stage until the next one."""

from __future__ import annotations

import time

from textual import events
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Label, ProgressBar

from localchat.engine.default_model import Step
from localchat.tui.widgets.messages import Note


class LoadProgress(Horizontal):
    DEFAULT_CSS = """
    LoadProgress {
        height: 1;
        margin: 1 0 0 0;
    }
    LoadProgress #load-text {
        margin-left: 2;
        color: $text-muted;
    }
    """

    class Said(Message):
        def __init__(self, line: str) -> None:
            super().__init__()
            self.line = line

    def __init__(self) -> None:
        super().__init__(id="load-progress")
        self.stage: str = "starting"
        self.counted = False
        self.since = time.monotonic()
        self.printed = ""  # the printed line being written, until its newline

    def compose(self):
        yield ProgressBar(total=None, show_eta=False, show_percentage=False)
        yield Label(self.stage, id="load-text", markup=False)

    def on_mount(self) -> None:
        self.app.begin_capture_print(self)
        self.set_interval(1.0, self.draw)

    def on_unmount(self) -> None:
        self.app.end_capture_print(self)

    def say(self, line: str) -> None:
        """A line from the loader; any thread."""
        self.post_message(self.Said(line))

    def on_load_progress_said(self, msg: Said) -> None:
        self.show(msg.line)

    def show(self, line: str) -> None:
        if not isinstance(line, Step):
            self.note(line)
            return
        bar = self.query_one(ProgressBar)
        if line.total:
            bar.update(total=line.total, progress=line.done)
        elif self.counted or line != self.stage:
            bar.update(total=None, progress=0)
            self.since = time.monotonic()
        self.stage, self.counted = str(line), bool(line.total)
        self.draw()

    def draw(self) -> None:
        seconds = "" if self.counted else f"  {time.monotonic() - self.since:.0f} s"
        self.query_one("#load-text", Label).update(self.stage + seconds)

    def note(self, text: str) -> None:
        if text.strip() and self.parent is not None:
            self.parent.mount(Note(text.strip()), before=self)

    def on_print(self, event: events.Print) -> None:
        """The newest printed line as a terminal shows it (after its last carriage return); an indented one
        continues a message (a warning's source line) and is skipped."""
        *lines, self.printed = (self.printed + event.text).split("\n")
        self.printed = self.printed.rsplit("\r", 1)[-1]
        shown = [line.rsplit("\r", 1)[-1] for line in (*lines, self.printed)]
        shown = [line.strip() for line in shown if line.strip() and not line[:1].isspace()]
        if shown:
            self.stage = shown[-1]
            self.draw()
