"""Messages that worker threads post to the chat screen (post_message is thread-safe)."""

from __future__ import annotations

from textual.message import Message


class EngineEvent(Message):
    """One engine event (Notice, Progress, Token, Done, Error) from the running turn."""

    def __init__(self, event) -> None:
        super().__init__()
        self.event = event


class TurnEnded(Message):
    pass


class EngineLoaded(Message):
    def __init__(self, engine=None, error: str | None = None) -> None:
        super().__init__()
        self.engine, self.error = engine, error


class DocumentReady(Message):
    def __init__(self, document=None, tokens: int = 0, error: str | None = None) -> None:
        super().__init__()
        self.document, self.tokens, self.error = document, tokens, error


class ChatSaved(Message):
    def __init__(self, name: str | None, error: str | None = None) -> None:
        super().__init__()
        self.name, self.error = name, error


class ChatOpened(Message):
    def __init__(self, session=None, name: str | None = None, notices=(), error: str | None = None,
                 lock=None, spec=None) -> None:
        super().__init__()
        self.session, self.name, self.notices, self.error = session, name, list(notices), error
        self.lock = lock  # the chat's lock (localchat/store/chat_lock.py), held while the window shows it
        self.spec = spec  # the chat's own settings, now the window's (None: the window's stay)
