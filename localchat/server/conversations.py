"""The server's conversations: found by their messages, kept in memory up to a bound, saved in the store.

Clients send the whole conversation with every request, and the answers back as text. A request whose earlier
messages (roles and text, spaces around them aside) are those of a conversation the server holds continues that
conversation's Session: its compressed cache is kept, and only what the conversation does not hold yet is read
(the new question, and any turns the client added). A request that asks a conversation's last question again (a
client's "regenerate") answers it again from the cache as it was before that answer. A request whose history
matches nothing starts a Session restored with that history, read once. Every answered turn is saved in the store (chats named `serve-...`), so a
restarted server continues from the saved cache; at most `keep` Sessions stay in memory, the least recently used
go first (they are saved already), and at most `saved` stay in the store (one-off requests, such as a client's
title suggestions, would otherwise pile up there). A `conversation` name pins one: `serve-NAME`.

A document that moves. Some clients put a document in front of the *last* question on every turn and keep only the
bare questions in the history (Open WebUI's whole-document mode: its RAG template, the document inside, then the
question). Turn 2 then shares no beginning with turn 1, yet the conversation that read the document holds it. So a
question that begins with a long block (`DOCUMENT_CHARS` or more) which a conversation's first message began with is
matched to that conversation: the block is cut off at a line end, and if the conversation's messages without it are
the request's history, the conversation goes on with the rest of the question alone (the block is not read again);
if they are the history with this question already answered, it answers again. A block found under another history
is read again, and the log says why.
"""

from __future__ import annotations

import hashlib
import json
import sys
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from localchat.engine.events import Done, Error, Token
from localchat.server.turns import BadRequest, Turn, refusal
from localchat.session import Session

PREFIX = "serve-"
DOCUMENT_CHARS = 2000  # a moved block at least this long is a document (not a shared greeting)
CUTS = 16  # line ends tried, from the end of the shared block back, to find where the question starts


def key(system: str | None, messages: list[dict]) -> str:
    """What identifies a conversation: its system prompt and the role and text of each message."""
    rows = ([["system", system.strip()]] if system else []) + [[m["role"], m["content"].strip()] for m in messages]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def split_system(messages: list[dict]) -> tuple[str | None, list[dict]]:
    """The leading system messages, joined, and the rest."""
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        n += 1
    system = "\n\n".join(m["content"] for m in messages[:n]).strip()
    return system or None, messages[n:]


def opening(messages: list[dict]) -> str | None:
    """What finds the conversations a moved document came from: a hash of its first message's first
    DOCUMENT_CHARS characters (None when that message is shorter)."""
    first = next((m["content"] for m in messages if m["role"] == "user"), "")
    return hashlib.sha256(first[:DOCUMENT_CHARS].encode()).hexdigest() if len(first) >= DOCUMENT_CHARS else None


def cuts(first: str, question: str) -> list[int]:
    """Where the block `first` and `question` begin with may end: just after a line end inside their common
    beginning, newest first, none closer to the start than DOCUMENT_CHARS."""
    n, stop = 0, min(len(first), len(question))
    while n < stop and first[n] == question[n]:
        n += 1
    out, at = [], first.rfind("\n", 0, n)
    while at >= DOCUMENT_CHARS - 1 and len(out) < CUTS:
        out.append(at + 1)
        at = first.rfind("\n", 0, at)
    return out


@dataclass
class Moved:
    """A request whose question carries a document a conversation has read: that conversation, the question
    without the document, the messages the request has past the conversation's (if any), and whether it asks the
    conversation's last question again."""

    name: str
    question: str
    extra: list[dict]
    again: bool


def log(line: str) -> None:
    """One line in the server's log (stderr)."""
    print(f"localchat: {line}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Named:
    """A job's first item: the conversation that answers it, and the tokens it holds that the request's prompt
    begins with (None: not known before the answer, e.g. a question asked again)."""

    name: str
    cached: int | None = None


@dataclass
class Answered:
    """A turn's result: the final event, the conversation's name and the prompt tokens served from the cache."""

    done: Done
    name: str
    cached: int


class Conversations:
    def __init__(self, store, engine, keep: int = 4, saved: int = 256):
        self.store, self.engine, self.keep, self.saved = store, engine, keep, saved
        self.live: OrderedDict[str, Session] = OrderedDict()
        self.index: dict[str, list[str]] = {}  # key -> the conversations holding exactly those messages, newest last
        self.keys: dict[str, str] = {}
        self.asked: dict[str, str] = {}  # key of a live conversation without its last answer -> its name
        self.openings: dict[str, list[str]] = {}  # opening() of a first message -> the conversations, newest last
        self.opened: dict[str, str] = {}
        for info in store.list()[::-1]:  # oldest first: the newest ends last in each list
            if info.name.startswith(PREFIX):
                system, messages = store.messages(info.name)
                self._index(info.name, key(system, messages), opening(messages))

    def _index(self, name: str, k: str, first: str | None = None) -> None:
        self._forget(name)
        self.keys[name] = k
        self.index.setdefault(k, []).append(name)
        if first is not None:
            self.opened[name] = first
            self.openings.setdefault(first, []).append(name)

    def _forget(self, name: str) -> None:
        old = self.keys.pop(name, None)
        if old is not None and name in self.index.get(old, []):
            self.index[old].remove(name)
        first = self.opened.pop(name, None)
        if first is not None and name in self.openings.get(first, []):
            self.openings[first].remove(name)

    def _session(self, name: str) -> Session | None:
        """Conversation `name` from memory or the store (None when there is none)."""
        session = self.live.pop(name, None)
        if session is None and self.store.exists(name):
            session, _ = self.store.load(name, self.engine)  # a cache that cannot be reused is re-read once
        return session

    def _hold(self, name: str, session: Session) -> None:
        self.live[name] = session
        self.live.move_to_end(name)
        while len(self.live) > self.keep:
            gone, _ = self.live.popitem(last=False)
            self.asked = {k: n for k, n in self.asked.items() if n != gone}

    def _prune(self) -> None:
        """Delete the least recently used saved conversations past `saved`."""
        for info in [c for c in self.store.list() if c.name.startswith(PREFIX)][self.saved:]:  # newest first
            lock = self.store.chat_lock(info.name, "serve")
            if lock.try_acquire():
                try:
                    self.store.delete(info.name)
                finally:
                    lock.release()
                self.live.pop(info.name, None)
                self._forget(info.name)

    def _asked_again(self, turn: Turn) -> Session | None:
        """The live conversation whose last question `turn` asks again, when it can answer it again."""
        k = key(*split_system(turn.messages))
        name = self.asked.get(k)
        session = self.live.get(name) if name is not None else None
        if session is None or not session.can_retry or key(session.system, session.messages[:-1]) != k:
            return None
        return self.live.pop(name)

    def moved(self, turn: Turn) -> Moved | None:
        """The conversation that read the document `turn`'s question begins with, when its messages without that
        document are the request's history (or that history and this question, answered: asked again)."""
        if turn.conversation is not None or len(turn.question) < DOCUMENT_CHARS:
            return None
        system, history = split_system(turn.messages[:-1])
        first = opening([{"role": "user", "content": turn.question}])
        for name in reversed(self.openings.get(first, [])):
            live = self.live.get(name)
            held_system, held = (live.system, live.messages) if live is not None else self.store.messages(name)
            if (held_system or None) != (system or None) or not held or held[0]["role"] != "user":
                continue
            for cut in cuts(held[0]["content"], turn.question):
                bare = [{"role": "user", "content": held[0]["content"][cut:]}, *held[1:]]
                question = turn.question[cut:]
                if len(bare) <= len(history) and key(None, bare) == key(None, history[:len(bare)]):
                    return Moved(name, question, history[len(bare):], again=False)
                asked = [*history, {"role": "user", "content": question}]
                if len(bare) == len(asked) + 1 and key(None, bare[:-1]) == key(None, asked) and \
                        live is not None and live.can_retry:
                    return Moved(name, question, [], again=True)
            log(f"a document that {name} read came again under other messages: it is read again")
        return None

    def open(self, turn: Turn) -> Session:
        """The Session that answers `turn` (its question not sent yet): continued, or new and restored."""
        system, history = split_system(turn.messages[:-1])
        if turn.conversation is not None:
            name = PREFIX + turn.conversation
            session = self._session(name)
        else:
            name, session = None, None
            for n in range(len(history), 0, -1):  # the longest known beginning of the history
                for candidate in reversed(self.index.get(key(system, history[:n]), [])):
                    session = self._session(candidate)
                    if session is not None:
                        name = candidate
                        break
                if session is not None:
                    break
        if session is not None and _continues(session, system, history):
            session.extend(history[len(session.messages):])
            return session
        if session is None or turn.conversation is None:
            session = Session(self.engine, system=system, name=name if turn.conversation else None)
            session.name = session.name or PREFIX + uuid.uuid4().hex[:12]
        session.system = system  # a pinned conversation with another history: that history, read once
        session.restore(history, [], [m["content"] for m in history if m["role"] == "user"])
        return session

    def answer(self, turn: Turn, cancel, put: Callable) -> Answered | None:
        """Answer `turn`, passing each Token to `put`; save the turn. None when cancelled (nothing is kept)."""
        from localchat import turn as turns

        moved, question = self.moved(turn), turn.question
        session = self._session(moved.name) if moved is not None else None  # None: deleted meanwhile
        if session is not None:  # the document is not read again: the question alone goes on
            question = moved.question
            again = session if moved.again else None
            if moved.extra:
                session.extend(moved.extra)
            log(f"the document {moved.name} read came again in front of the question: {moved.name} goes on "
                f"without reading it again")
        else:
            again = self._asked_again(turn) if turn.conversation is None else None
            session = again or self.open(turn)
        held = session.fed if session.cache is not None and session.stale is None else 0
        put(Named(session.name, None if again is not None else held))  # the request's first item
        lock = self.store.chat_lock(session.name, "serve")
        if not lock.try_acquire():
            raise BadRequest(f"{lock.in_use()}; try again when it is done", "conversation", "conversation_in_use", 409)
        try:
            final = None
            for event in turns.answer(session, question, (), turn.settings, cancel, save=self.store.save,
                                      again=again is not None):
                if isinstance(event, Token):
                    put(event)
                elif isinstance(event, turns.Unsaved):
                    log(event.message)
                elif isinstance(event, (Done, Error)):
                    final = event
            if isinstance(final, Error):
                self.live.pop(session.name, None)
                raise refusal(final)
            if final is None or final.stop_reason == "cancelled":
                self.live.pop(session.name, None)  # the store holds what it held before this turn
                return None
        finally:
            lock.release()
        self._index(session.name, key(session.system, session.messages), opening(session.messages))
        self.asked[key(session.system, session.messages[:-1])] = session.name
        self._hold(session.name, session)
        self._prune()
        return Answered(final, session.name, max(0, session.fed - final.prompt_tokens - final.new_tokens))


def _continues(session: Session, system: str | None, history: list[dict]) -> bool:
    """Whether `history` is the session's messages and, maybe, more after them."""
    held = session.messages
    return (session.system or None) == (system or None) and len(held) <= len(history) and \
        key(None, held) == key(None, history[:len(held)])
