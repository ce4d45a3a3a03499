"""A conversation: its messages and the compressed KV cache carried across turns (docs/methods/locret.md §6.4).

Each turn prefills only what the cache does not hold yet: the chat template's text for the whole
conversation, minus the text already cached (the rendered history plus the answers' own tokens). At
the start of a turn the history is compressed to the budget; the new tokens go through the same
chunked loop with eviction; the answer's tokens are scored and kept like any others. Between turns the
cache holds at most budget + local tail + the last answer, however long the chat runs.

A snapshot of the (bounded) cache is taken before each turn: a cancelled or failed turn, `retry()` and
`edit_last()` restore it. Changing the policy, the system prompt or the model re-reads the history once,
with a Notice.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from localchat.documents import Document
from localchat.engine.cache import KVCache
from localchat.engine.events import Done, Error, Event, Notice
from localchat.engine.sampling import GenerationSettings
from localchat.render import user_turn


@dataclass
class Attachment:
    """A document attached to a user turn; `start`/`end` are its token positions in the conversation."""

    name: str
    path: str
    sha256: str
    tokens: int
    turn: int  # index in `Session.messages` of the user message that carries it
    start: int = -1
    end: int = -1
    offset: int = -1  # character offset of the document's text inside that message


@dataclass
class _State:
    """What the cache holds: the cache, the text it corresponds to, and the tokens fed so far."""

    cache: KVCache | None = None
    text: str = ""
    fed: int = 0  # true positions used so far (the next token's true position)
    messages: list[dict] = field(default_factory=list)
    attachments: list[Attachment] = field(default_factory=list)

    def copy(self) -> _State:
        """Messages and attachments copied, the same cache object (`_snapshot` keeps what restores it)."""
        return _State(self.cache, self.text, self.fed, list(self.messages), list(self.attachments))


class Session:
    """A conversation over one engine. `send()` streams Notice/Progress/Token/Done/Error events."""

    def __init__(self, engine, *, system: str | None = None, name: str | None = None):
        self.engine = engine
        self.system = system or None
        self.name = name
        self.saved_at: float | None = None  # when the store last saved (or loaded) it: a newer save elsewhere conflicts
        self.questions: list[str] = []  # the user's own words per user turn (for display and export)
        self.kept_turns: list = []  # journal files a failed save of this session wrote (localchat/store/journal.py)
        self.last: Done | None = None
        self._state = _State()
        self._before_last: tuple[_State, KVCache | int | None] | None = None  # for retry / edit
        self._stale: str | None = None  # why the cache no longer matches (re-read at the next turn)
        self._stale_said = False  # the user was told why already: the turn's notice is not repeated

    # --- what the UI shows ---------------------------------------------------------------------

    @property
    def messages(self) -> list[dict]:
        return self._state.messages

    @property
    def attachments(self) -> list[Attachment]:
        return self._state.attachments

    @property
    def turns(self) -> int:
        return sum(m["role"] == "user" for m in self.messages)

    @property
    def cache(self) -> KVCache | None:
        return self._state.cache

    @property
    def fed(self) -> int:
        """True positions used so far: the tokens this conversation has put through the model."""
        return self._state.fed

    @property
    def cached_text(self) -> str:
        return self._state.text

    @property
    def kv_units(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    @property
    def kv_bytes(self) -> int:
        return self.cache.nbytes() if self.cache is not None else 0

    @property
    def budget(self) -> int | None:
        return self.engine.policy.budget if self.engine.policy.evicts else None

    def retained_map(self, bins: int = 64) -> list[float] | None:
        """For the latest attachment: the share of its tokens still cached in each of `bins` equal
        stretches of the document, averaged over layers and KV heads (0..1). None without one."""
        spans = [a for a in self.attachments if a.end > a.start >= 0]
        if not spans or self.cache is None or self.kv_units == 0:
            return None
        a = spans[-1]
        length = a.end - a.start
        bins = max(1, min(bins, length))
        per_bin = torch.bincount(torch.arange(length) * bins // length, minlength=bins).float()
        held = torch.zeros(bins)
        layers = [layer for _, layer in self.cache.governed_layers()]  # what the policy keeps of the document
        for layer in layers:
            pos = layer.positions.flatten().cpu()
            pos = pos[(pos >= a.start) & (pos < a.end)] - a.start
            held += torch.bincount(pos * bins // length, minlength=bins).float()
        heads = layers[0].positions.shape[0]
        return (held / (per_bin * heads * len(layers))).clamp(max=1.0).tolist()

    def kept_share(self, start: int, end: int) -> float:
        """The share of the units at true positions [start, end) still cached, over layers and KV heads."""
        if self.cache is None or end <= start:
            return 0.0
        layers = [layer for _, layer in self.cache.governed_layers()]
        held = sum(int(((layer.positions >= start) & (layer.positions < end)).sum()) for layer in layers)
        heads = layers[0].positions.shape[0]
        return held / ((end - start) * heads * len(layers))

    def export_markdown(self) -> str:
        lines = [f"# {self.title()}", "", f"*{self.engine.name}, {self.engine.policy.name} policy*", ""]
        if self.system:
            lines += [f"**System:** {self.system}", ""]
        questions = iter(self.questions)
        for i, m in enumerate(self.messages):
            if m["role"] == "user":
                lines += ["## You", "", next(questions, m["content"]), ""]
                for a in (a for a in self.attachments if a.turn == i):
                    lines += [f"> attached `{a.name}` ({a.tokens:,} tokens, sha256 {a.sha256[:12]})", ""]
            else:
                lines += ["## localchat", "", m["content"], ""]
        return "\n".join(lines)

    def title(self) -> str:
        first = self.questions[0] if self.questions else "New chat"
        return first if len(first) <= 60 else first[:57] + "..."

    # --- changes that invalidate the cache -----------------------------------------------------

    def set_system(self, text: str | None) -> None:
        if (text or None) != self.system:
            self.system = text or None
            self.mark_stale("the system prompt changed")

    def set_policy(self, policy, positions: str | None = None) -> None:
        self.engine.set_policy(policy, positions)
        self.policy_changed()

    def policy_changed(self) -> None:
        """The engine runs another policy now: the next turn reads the conversation again."""
        policy = self.engine.policy
        self.mark_stale(f"the policy is now {policy.name}" + (f" (budget {policy.budget})" if policy.evicts else ""))

    def set_engine(self, engine) -> None:
        self.engine = engine
        self.mark_stale(f"the model is now {engine.name}")

    @property
    def stale(self) -> str | None:
        """Why the cache no longer fits the conversation's settings (None when it does)."""
        return self._stale

    def restore(self, messages: list[dict], attachments: list[Attachment], questions: list[str]) -> None:
        """Put a saved conversation back (the store's load), without a cache: the next turn reads it once."""
        self._state = _State(messages=[dict(m) for m in messages], attachments=list(attachments))
        self.questions = list(questions)
        self._before_last = None

    def extend(self, messages: list[dict]) -> None:
        """Messages this session has not read yet (a client's history past what it holds): the next turn reads them
        with its question, after what the cache already holds."""
        self._state.messages = [*self.messages, *({"role": m["role"], "content": m["content"]} for m in messages)]
        self.questions += [m["content"] for m in messages if m["role"] == "user"]
        self._before_last = None

    def saved_text(self) -> str:
        """The conversation as the model has read it once the last answer is written: what a saved cache holds."""
        return self.engine.render(self._with_system(self.messages[:-1])) + self.messages[-1]["content"]

    def restore_cache(self, cache: KVCache, fed: int) -> None:
        """Continue from `cache`, which holds `saved_text()` read over `fed` true positions."""
        self._state.cache, self._state.text, self._state.fed = cache, self.saved_text(), fed

    def mark_stale(self, why: str, said: bool = False) -> None:
        """The cache no longer fits the settings: the next turn re-reads the history once (and says why, unless
        the caller has `said` it)."""
        if self.messages:
            self._stale, self._stale_said = why, said
        else:
            self._state.cache = None
        self._before_last = None

    def clear(self) -> None:
        self._state = _State()
        self.questions = []
        self.last = None
        self._before_last = None
        self._stale = None

    # --- turns ---------------------------------------------------------------------------------

    def send(self, question: str, documents: Sequence[Document] = (), settings: GenerationSettings | None = None,
             cancel: threading.Event | None = None) -> Iterator[Event]:
        """Ask `question` about `documents` (attached to this turn); only the new tokens are read."""
        question = question.strip()
        yield from self._turn(question, user_turn(question, list(documents)), list(documents), settings, cancel)

    @property
    def can_retry(self) -> bool:
        """Whether `retry()` has the cache from before the last turn to answer from."""
        return self._before_last is not None and bool(self.messages)

    def retry(self, settings: GenerationSettings | None = None, cancel: threading.Event | None = None) -> Iterator[Event]:
        """Answer the last question again, from the cache as it was before that turn."""
        if not self._rewind():
            yield Error("nothing to retry: ask a question first")
            return
        question, content, spans = self._undone
        yield from self._turn(question, content, spans, settings, cancel, undo_on_fail=self._undo_rewind)

    def edit_last(self, question: str, documents: Sequence[Document] = (), settings: GenerationSettings | None = None,
                  cancel: threading.Event | None = None) -> Iterator[Event]:
        """Replace the last question (and its documents) and answer it."""
        if not self._rewind():
            yield Error("nothing to edit: ask a question first")
            return
        question = question.strip()
        yield from self._turn(question, user_turn(question, list(documents)), list(documents), settings, cancel,
                              undo_on_fail=self._undo_rewind)

    def _rewind(self) -> bool:
        """Go back to the state before the last turn (kept since that turn); False if there is none."""
        if self._before_last is None or not self.messages:
            return False
        self._redo = (self._state, list(self.questions), self.last, self._before_last)
        before, cache_then = self._before_last
        last_user = len(self.messages) - 2
        spans = [a for a in self.attachments if a.turn == last_user]
        self._undone = (self.questions[-1], self.messages[last_user]["content"], spans)
        self._state = _restore(before, cache_then)
        self.questions = self.questions[:-1]
        self._before_last = None
        return True

    def _undo_rewind(self) -> None:
        self._state, self.questions, self.last, self._before_last = self._redo

    def _turn(self, question: str, content: str, documents: list, settings, cancel,
              undo_on_fail=None) -> Iterator[Event]:
        """One turn; `documents` are Documents (new) or the Attachments of a turn being retried."""
        engine = self.engine
        if not question:
            if undo_on_fail is not None:
                undo_on_fail()
            yield Error("the message is empty: type a question")
            return
        before = self._state.copy()
        # a stale cache is re-read below: nothing to snapshot (and cloning it could copy a whole offloaded cache)
        cache_then = None if self._stale else _snapshot(before.cache, engine.policy.evicts)
        messages = [*self.messages, {"role": "user", "content": content}]
        try:
            full = engine.render(self._with_system(messages))
        except Exception as exc:  # a template that rejects the messages
            if undo_on_fail is not None:
                undo_on_fail()
            yield Error(f"cannot build the prompt: {exc}", exc)
            return
        state = self._state
        if self._stale or state.cache is None or not full.startswith(state.text):
            if self._stale or state.cache is not None:
                why = self._stale or "the chat template rendered the history differently"
                if not (self._stale and self._stale_said):
                    yield Notice(f"re-reading the conversation once: {why}")
            state.cache, state.text, state.fed = None, "", 0
        start_text = len(state.text)
        ids = engine.encode(full[start_text:])
        if start_text == 0 and state.attachments:  # a re-read moves earlier documents
            state.attachments = self._locate(state.attachments, full, messages)
        if state.cache is None:
            state.cache = engine.new_cache(len(ids), (settings or GenerationSettings()).max_new_tokens)
        turn = len(messages) - 1
        spans = self._locate([self._attachment(d, content, turn) if isinstance(d, Document) else d
                              for d in documents], full, messages, start_text, state.fed)
        settled = False
        try:
            for event in engine.continue_on(state.cache, ids, state.fed, settings, cancel, keep_last=True):
                if not isinstance(event, (Done, Error)):
                    yield event
                    continue
                # settle the session before the last event: a consumer may stop reading at Done
                if isinstance(event, Done) and event.stop_reason != "cancelled":
                    state.messages = [*messages, {"role": "assistant", "content": event.text}]
                    state.attachments = [*state.attachments, *spans]
                    state.text = full + event.text
                    state.fed += len(ids) + event.new_tokens
                    self.questions.append(question)
                    self.last = event
                    self._before_last = (before, cache_then)
                    self._stale = None
                else:  # cancelled or failed: as if never asked
                    self._state = _restore(before, cache_then)
                    if undo_on_fail is not None:
                        undo_on_fail()
                settled = True
                yield event
                return
        finally:
            if not settled:  # the consumer stopped reading mid-turn: as if never asked
                self._state = _restore(before, cache_then)
                if undo_on_fail is not None:
                    undo_on_fail()

    def _with_system(self, messages: list[dict]) -> list[dict]:
        return [{"role": "system", "content": self.system}, *messages] if self.system else messages

    def _attachment(self, doc: Document, content: str, turn: int) -> Attachment:
        body = doc.text.strip()
        return Attachment(doc.name, str(doc.path), doc.sha256, self.engine.count_tokens(body), turn,
                          offset=content.find(body))

    def _locate(self, attachments: list[Attachment], full: str, messages: list[dict], start_text: int = 0,
                fed: int = 0) -> list[Attachment]:
        """Set each attachment's token span from where its message sits in the rendered text `full`
        (`full[:start_text]` is already cached and holds `fed` positions)."""
        located = []
        for a in attachments:
            at = full.find(messages[a.turn]["content"], start_text) if a.offset >= 0 else -1
            if at < 0:
                located.append(replace(a, start=-1, end=-1))
                continue
            start = fed + self.engine.count_tokens(full[start_text:at + a.offset])
            located.append(replace(a, start=start, end=start + a.tokens))
        return located

def _snapshot(cache: KVCache | None, evicts: bool) -> KVCache | int | None:
    """What restoring needs: a clone of an evicting cache, or the length of an append-only one."""
    if cache is None:
        return None
    return cache.clone() if evicts else cache.get_seq_length()


def _restore(before: _State, cache_then: KVCache | int | None) -> _State:
    if isinstance(cache_then, int):  # append-only cache: drop what the failed turn added
        extra = before.cache.get_seq_length() - cache_then
        if extra > 0:
            before.cache.crop(-extra)
    else:
        before.cache = cache_then
    return before
