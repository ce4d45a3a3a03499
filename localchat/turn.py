"""One turn of a conversation, answered the same way by `ask`, `chat`, the chat window and the server.

`answer()` checks the question, fits a document to the memory found (the default full attention gives way to a
bounded policy when it cannot hold it), streams the session's events, saves the answered turn, and ends with
`Done` or with an `Error`. `failure()` turns whatever went wrong into one `Failure`: a line for the user and how
each front end reports it (an exit code, an HTTP status and error code, a note in the chat).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from localchat.documents import Document
from localchat.engine.events import Done, Error, Event, Notice
from localchat.errors import EXIT_FAIL, EXIT_USAGE, TooLong, UserError, check_text, first_line

if TYPE_CHECKING:
    from localchat.engine.sampling import GenerationSettings
    from localchat.session import Session
OUT_OF_MEMORY = ("out of memory while answering; the chat is kept. Lower the budget (--budget, /budget) or the "
                 "chunk (--chunk), or use a shorter document")


@dataclass(frozen=True)
class Failure:
    """What went wrong, in one line, and its kind: `input` (the user can fix what was asked), `too_long` (the
    conversation does not fit the model's window or the memory), `memory` (the device ran out while answering),
    `engine` (anything else)."""

    kind: str
    message: str

    @property
    def exit_code(self) -> int:
        return EXIT_FAIL if self.kind in ("memory", "engine") else EXIT_USAGE

    @property
    def http_status(self) -> int:
        return {"input": 400, "too_long": 400, "memory": 503}.get(self.kind, 500)

    @property
    def code(self) -> str:
        """The API's error code."""
        return {"input": "invalid_value", "too_long": "context_length_exceeded", "memory": "out_of_memory"}.get(
            self.kind, "server_error")


def _out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    import sys

    torch = sys.modules.get("torch")  # never imported here for this check's sake
    return torch is not None and isinstance(exc, torch.OutOfMemoryError)


def failure(problem: BaseException | Error) -> Failure:
    """The one mapping from an exception, or the engine's Error event, to a Failure."""
    exc = problem.exc if isinstance(problem, Error) else problem
    if isinstance(problem, Error) and exc is None:
        return Failure("input", problem.message)
    message = problem.message if isinstance(problem, Error) else first_line(exc)
    if isinstance(exc, TooLong):
        return Failure("too_long", message)
    if isinstance(exc, UserError):
        return Failure("input", message)
    if _out_of_memory(exc):
        return Failure("memory", OUT_OF_MEMORY)
    return Failure("engine", message if isinstance(problem, Error) else f"the engine failed: {message}")


class Unsaved(Notice):
    """The answer stands, but the turn was not saved as it should be (where it is kept instead, and why)."""


def check_question(question: str) -> str:
    """The question, stripped; a UserError when it is empty or not text (found before the model loads)."""
    check_text(question, "the question")
    if not question.strip():
        raise UserError("the question is empty; type a question")
    return question.strip()


def answer(session: Session, question: str, documents: Sequence[Document] = (),
           settings: GenerationSettings | None = None, cancel: threading.Event | None = None, *,
           save: Callable[[Session], None] | None = None, again: bool = False) -> Iterator[Event]:
    """Answer `question` about `documents` in `session` (with `again`, answer the last question once more from the
    cache as it was before it). Streams Notice / Progress / Token events and ends with Done or Error; an answered
    turn is passed to `save` before Done (a save that fails is an `Unsaved` notice). A failed or cancelled turn
    leaves the session as it was."""
    try:
        if not again:
            question = check_question(question)
        for doc in documents:
            check_text(doc.text, f"document {doc.name}")
        if documents:
            switched = fit(session, documents)
            if switched:
                yield Notice(switched)
        events = session.retry(settings, cancel) if again else session.send(question, documents, settings, cancel)
        for event in events:
            if isinstance(event, Error):
                yield Error(failure(event).message, event.exc or UserError(event.message))
                return
            if isinstance(event, Done) and event.stop_reason != "cancelled" and save is not None:
                try:
                    save(session)
                except Exception as exc:  # noqa: BLE001 - the answer stands; where the turn went is said
                    yield Unsaved(failure(exc).message)
            yield event
    except Exception as exc:  # noqa: BLE001 - one line for the user, the session as before the turn
        yield Error(failure(exc).message, exc)


def fit(session: Session, documents: Sequence[Document]) -> str | None:
    """Where full attention was only the default and cannot hold `documents` in the memory found, turn the chat to
    the best bounded policy without heads; the line that says so, else None."""
    from localchat.engine.policies import NO_HEADS_POLICY
    from localchat.planning.load import fit_document, use_spec
    from localchat.planning.resolve import is_default

    engine = session.engine
    if engine.spec is None or engine.policy.bounded() or not is_default(engine.spec, "policy"):
        return None  # what follows counts the documents' tokens
    tokens = engine.count_tokens("".join(d.text for d in documents))
    spec = fit_document(engine, engine.spec, tokens, session.kv_units)
    if spec is None:
        return None
    use_spec(engine, spec, session=session)
    return (f"full attention cannot hold this document in the memory found: reading it with {NO_HEADS_POLICY}, "
            f"the best policy without trained heads in this project's benchmarks (a bounded cache). Trained heads "
            f"keep more: `localchat train-heads`, then --policy locret (/policy locret in the chat window)")
