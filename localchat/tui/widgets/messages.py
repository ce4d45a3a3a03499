"""Conversation items: the user's turn, the assistant's streamed markdown answer, and notes."""

from __future__ import annotations

from textual.containers import Vertical
from textual.widgets import Markdown, Static


class UserMessage(Static):
    def __init__(self, question: str, chips: list[str] = ()) -> None:
        text = question + "".join(f"\n[{c}]" for c in chips)
        super().__init__(text, markup=False)


class AssistantMessage(Vertical):
    """Streams through Textual's MarkdownStream; fully re-rendered when the answer is done."""

    def __init__(self, text: str = "") -> None:
        super().__init__()
        self.text = text
        self.markdown = Markdown(text)
        self._stream = None

    def compose(self):
        yield self.markdown

    async def write(self, piece: str) -> None:
        if self._stream is None:
            self._stream = Markdown.get_stream(self.markdown)
        self.text += piece
        await self._stream.write(piece)

    async def stop(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None

    async def finish(self, text: str) -> None:
        await self.stop()
        self.text = text
        await self.markdown.update(text)


class Note(Static):
    """A line from localchat itself: info, or an error (class "error")."""

    def __init__(self, text: str, error: bool = False, classes: str = "") -> None:
        super().__init__(text, markup=False, classes=" ".join(filter(None, [classes, "error" if error else ""])))
