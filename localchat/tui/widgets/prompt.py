"""The input box: slash-command completion (Tab accepts), pasted paths and large pastes become chips."""

from __future__ import annotations

import os

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import Input

from localchat.documents import parse_path_input, single_token

BIG_PASTE_CHARS = 2000
BIG_PASTE_LINES = 8


def looks_like_path(text: str) -> bool:
    """A single quoted/escaped token, a file:// URL or an absolute path: meant as a file, even if missing."""
    text = text.strip()
    token = single_token(text)
    if token is None:
        return False
    if token.lower().startswith("file://"):
        return True
    return (token.startswith(("/", "~")) and token.count("/") >= 2) or (
        text[0] in "'\"" and os.path.isabs(os.path.expanduser(token)))


class Prompt(Input):
    BINDINGS = [Binding("tab", "complete", "Complete", show=False)]

    class PathPasted(Message):
        def __init__(self, path: str) -> None:
            super().__init__()
            self.path = path

    class BigPaste(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def _on_paste(self, event: events.Paste) -> None:
        text = event.text
        event.stop()
        event.prevent_default()  # Input's own handler would insert the first line
        path = parse_path_input(text)
        if path is not None or looks_like_path(text):
            self.post_message(self.PathPasted(path or text.strip()))
        elif len(text) > BIG_PASTE_CHARS or text.count("\n") >= BIG_PASTE_LINES:
            self.post_message(self.BigPaste(text))
        elif text:  # a few lines: keep them all, on one line
            self.insert_text_at_cursor(" ".join(line.strip() for line in text.splitlines() if line.strip()))

    def action_complete(self) -> None:
        if self._suggestion and self._suggestion != self.value:
            self.value = self._suggestion
            self.cursor_position = len(self.value)
        else:
            self.screen.focus_next()
