"""Conversations on disk: SQLite in the user data dir, the compressed cache next to it (safetensors).

Every save is atomic. The cache file is written under a new name (temporary file, fsync, rename), then
one SQLite transaction points the chat at it, then the old file is removed: a process killed at any
moment leaves the previous state (or the new one) readable, never a mix. A file such a kill leaves behind
(half written, written but never referenced, or no longer referenced but not yet removed) is collected by a
later save or `localchat sessions` once it is ORPHAN_GRACE old. Files are written in caches/partial/, since
safetensors writes through a temporary file of its own beside the target, under a name of its own.

A saved cache is reused only when its fingerprint (model, heads, policy settings, chunk, positions,
library versions) and the hash of the text it holds match the conversation; otherwise the next turn
re-reads the conversation, with a notice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import sqlite3
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from localchat import __version__, turn_journal
from localchat.chat_lock import ChatLock
from localchat.engine.focus import ANSWER_ONLY
from localchat.errors import UserError
from localchat.paths import PARTIAL, SAFETENSORS_TMP, collect_partial, data_dir
from localchat.private_files import check_rooms, link_error, open_private, open_warning, room
from localchat.session import Attachment, Session

SCHEMA = 2
MIGRATIONS = {  # version -> SQL that brings version - 1 to it
    1: """
    CREATE TABLE chats (
        id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL, title TEXT NOT NULL, model TEXT NOT NULL,
        policy TEXT NOT NULL, system TEXT, created REAL NOT NULL, updated REAL NOT NULL,
        fed INTEGER NOT NULL DEFAULT 0, kept_units INTEGER NOT NULL DEFAULT 0,
        kept_bytes INTEGER NOT NULL DEFAULT 0, cache_file TEXT);
    CREATE TABLE messages (
        chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE, idx INTEGER NOT NULL,
        role TEXT NOT NULL, content TEXT NOT NULL, question TEXT, PRIMARY KEY (chat_id, idx));
    CREATE TABLE attachments (
        chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE, turn INTEGER NOT NULL,
        name TEXT NOT NULL, path TEXT NOT NULL, sha256 TEXT NOT NULL, tokens INTEGER NOT NULL,
        tok_start INTEGER NOT NULL, tok_end INTEGER NOT NULL, char_offset INTEGER NOT NULL);
    """,
    # the settings a chat was last answered with (policy and its parameters, positions, chunk, --kv)
    2: "ALTER TABLE chats ADD COLUMN settings TEXT NOT NULL DEFAULT '{}';",
}
SCHEMA_COLUMNS = {
    "chats": {"id", "name", "title", "model", "policy", "system", "created", "updated", "fed", "kept_units",
              "kept_bytes", "cache_file", "settings"},
    "messages": {"chat_id", "idx", "role", "content", "question"},
    "attachments": {"chat_id", "turn", "name", "path", "sha256", "tokens", "tok_start", "tok_end", "char_offset"},
}
LOCK_WAIT = 10.0  # seconds a save waits for another process's save before it gives up
MAX_CACHE_BYTES = 2 << 30  # a larger cache (full attention over a long document) is not saved
# An unreferenced cache file this old was left by a process killed mid-save; a younger one may be another
# process's save in progress (written, waiting up to LOCK_WAIT for the database, not yet committed).
ORPHAN_GRACE = 300.0
CACHE_NAME = re.compile(r"[0-9a-f]{12}-[0-9a-f]{12}-[0-9]+\.(safetensors|tmp)")  # what _write_cache names


class SaveIncomplete(UserError):
    """A save that kept the turn, but not all of the chat where it belongs; `name` is set when the chat is saved."""

    def __init__(self, name: str | None, message: str):
        super().__init__(message)
        self.name = name


def _reason(exc: BaseException) -> str:
    """An OS or SQLite failure in a few words ("No space left on device", "database or disk is full")."""
    text = getattr(exc, "strerror", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
    errno = re.search(r"\(os error ([0-9]+)\)", text)  # safetensors' wording of an OS error
    return os.strerror(int(errno.group(1))) if errno else text[:200]


NAME_MAX = 100  # characters in a chat's name


def check_name(name: str) -> None:
    """UserError unless `name` can name a chat: not empty, printable, at most NAME_MAX characters."""
    if not name.strip():
        raise UserError("the session name is empty; give one, e.g. --session notes")
    if not name.isprintable():
        raise UserError("the session name holds control characters; use letters, digits and punctuation")
    if len(name) > NAME_MAX:
        raise UserError(f"the session name is {len(name):,} characters long; use at most {NAME_MAX}")


def shown(name: str, width: int = 60) -> str:
    """`name` quoted for a message, cut to `width` characters."""
    return repr(name if len(name) <= width else name[:width - 1] + "…")


def damaged(path: Path, exc: Exception) -> UserError:
    """One line for a chats database SQLite cannot use (damaged, truncated, or another program's file)."""
    return UserError(f"{path} is damaged or not a localchat chats database ({exc}); move it aside (it may hold "
                     f"chats worth keeping) and localchat starts a new one, or point LOCALCHAT_DATA_DIR elsewhere")


@dataclass(frozen=True)
class ChatInfo:
    name: str
    title: str
    model: str
    policy: str
    turns: int
    tokens: int  # tokens the conversation has put through the model
    kept_units: int  # cache units per KV head per layer
    kept_bytes: int
    updated: float


def _number(value, kind):
    """A number column as `kind`; 0 where a damaged row holds something else (the chat stays listed)."""
    try:
        number = kind(value)
    except (TypeError, ValueError, OverflowError):
        return kind(0)
    return number if number == number and abs(number) < 2**62 else kind(0)  # not NaN, not absurd


def _quantized_weights(engine) -> str | None:
    """The weights' quantization (int8/int4/nf4) and the layer type that holds it (CPU int4 was quanto's groups of
    128 before it was torch's packed groups of 32: other weights, so another cache), or None: a float dtype is
    already in the fingerprint's `dtype`, so a chat saved before the plan named fp32 explicitly keeps its cache."""
    from localchat.engine.heads import attention_modules

    weights = getattr(engine, "weights", None)
    if weights in (None, "fp32", "bf16", "fp16"):
        return None
    attn = attention_modules(engine.model)[0]
    return f"{weights} {type(getattr(attn, 'q_proj', None) or attn.qkv_proj).__name__}"


def fingerprint(engine) -> str:
    """What a saved cache depends on besides the text: model, policy (incl. heads), versions."""
    import transformers

    facts = {
        "model": engine.name, "config": engine.model.config.to_json_string(use_diff=False),
        "dtype": str(next(engine.model.parameters()).dtype),
        "settings": {k: v for k, v in settings_of(engine).items() if k not in ANSWER_ONLY},
        "heads": _heads_hash(getattr(engine.policy, "heads", None)), "weights": _quantized_weights(engine),
        "torch": torch.__version__, "transformers": transformers.__version__, "localchat": __version__,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()


def _heads_hash(heads) -> str | None:
    """sha256 of the retaining heads' weights (computed once per heads object)."""
    if heads is None:
        return None
    if getattr(heads, "weights_sha256", None) is None:
        h = hashlib.sha256()
        for name, t in sorted(heads.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().float().cpu().numpy().tobytes())
        heads.weights_sha256 = h.hexdigest()
    return heads.weights_sha256


def settings_of(engine) -> dict:
    """The cache settings a chat is answered with (policy and its parameters, positions, chunk, --kv):
    saved next to it, and part of its cache's fingerprint."""
    p = engine.policy
    fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name != "heads"}
    return {"policy": p.name, **fields, "positions": engine.positions, "chunk": engine.chunk,
            "kv": getattr(engine, "kv", "none")}


def tensors_hash(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors' names, shapes, dtypes and bytes, in name order (a saved cache's checksum)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{list(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class Store:
    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path else data_dir() / "chats.sqlite3"
        data = self.path.parent
        check_rooms(data)  # no link in it leads outside (localchat/private_files.py)
        warning = open_warning(data)
        self.notices = [warning] if warning else []  # lines for the user, printed by whoever opened the store
        self.cache_dir = room(data / "caches")
        # chats hold whole documents: readable by their owner only
        os.close(open_private(self.path, os.O_CREAT | os.O_RDWR))
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=LOCK_WAIT)
            self.db.execute("PRAGMA foreign_keys = ON")
            self._migrate()
            self._check_schema()
            self._replay()
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise UserError(f"{self.path} is locked by another localchat ({exc}); close it and try again") \
                    from None
            raise damaged(self.path, exc) from None
        except sqlite3.DatabaseError as exc:
            raise damaged(self.path, exc) from None

    def _check_schema(self) -> None:
        """The tables and columns this version reads (a file with other tables is not our database)."""
        for table, columns in SCHEMA_COLUMNS.items():
            have = {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}
            if not columns <= have:
                raise sqlite3.DatabaseError(f"table {table} lacks {', '.join(sorted(columns - have))}")

    def _migrate(self) -> None:
        if self._version() == SCHEMA:
            return
        # Under the write lock, reading the version again: two processes creating one new database must not
        # both run the steps (the second would find "table chats already exists").
        self.db.execute("BEGIN IMMEDIATE")
        try:
            for v in range(self._version() + 1, SCHEMA + 1):
                for statement in MIGRATIONS[v].split(";"):
                    if statement.strip():
                        self.db.execute(statement)
                self.db.execute(f"PRAGMA user_version = {v}")
            self.db.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise

    def _version(self) -> int:
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA:
            raise UserError(f"{self.path} was written by a newer localchat (schema {version}, this one reads "
                            f"{SCHEMA}); upgrade localchat or point LOCALCHAT_DATA_DIR elsewhere")
        return version

    def close(self) -> None:
        self.db.close()

    def check_writable(self) -> None:
        """One line now, before an answer is computed, when a save would fail: a locked or read-only database, or a
        cache folder that cannot be written."""
        try:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute("ROLLBACK")
        except sqlite3.OperationalError as exc:
            raise UserError(f"cannot save chats in {self.path} ({exc}); close the other localchat that holds it, "
                            f"or point LOCALCHAT_DATA_DIR at a writable folder") from None
        if not os.access(self.cache_dir, os.W_OK):
            raise UserError(f"cannot write to {self.cache_dir}; point LOCALCHAT_DATA_DIR at a writable folder")

    def chat_lock(self, name: str, who: str = "ask") -> ChatLock:
        """The lock that keeps one writer at a time on chat `name` (localchat/chat_lock.py)."""
        return ChatLock(name, self.path.parent / "locks", who)

    # --- listing -------------------------------------------------------------------------------

    def list(self) -> list[ChatInfo]:
        rows = self.db.execute(
            "SELECT name, title, model, policy, (SELECT COUNT(*) FROM messages m WHERE m.chat_id = c.id "
            "AND m.role = 'user'), fed, kept_units, kept_bytes, updated FROM chats c ORDER BY updated DESC"
        ).fetchall()
        return [ChatInfo(*(str(v) for v in row[:4]), *(_number(v, int) for v in row[4:8]), _number(row[8], float))
                for row in rows]

    def settings(self, name: str) -> dict:
        """The settings `name` was last answered with ({} for chats saved before schema 2)."""
        row = self.db.execute("SELECT settings FROM chats WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise UserError(f"no chat named {shown(name)}; `localchat sessions` lists them")
        try:
            settings = json.loads(row[0])
        except (TypeError, ValueError):  # a damaged row: the chat stays listed, without its settings
            return {}
        return settings if isinstance(settings, dict) else {}

    def exists(self, name: str) -> bool:
        return self.db.execute("SELECT 1 FROM chats WHERE name = ?", (name,)).fetchone() is not None

    def delete(self, name: str) -> None:
        row = self.db.execute("SELECT id, cache_file FROM chats WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise UserError(f"no chat named {shown(name)}; `localchat sessions` lists them")
        self.db.execute("DELETE FROM chats WHERE id = ?", (row[0],))
        self._remove(row[1])

    # --- save / load ---------------------------------------------------------------------------

    def save(self, session: Session, name: str | None = None) -> str:
        """Save messages, settings and (when small enough) the compressed cache; returns the name.

        An answered turn is never lost: when the cache file cannot be written the chat is saved without it (the
        next question reads the conversation again), and when the database cannot take the turn it is kept in
        the journal (localchat/turn_journal.py) for the next run; both raise SaveIncomplete, one line that says
        where the turn is."""
        name = name or session.name or self._new_name()
        session.name = name
        try:
            cache_file, cache_problem = self._write_cache(session), None
        except Exception as exc:  # noqa: BLE001 - disk full, a size limit, a read-only medium: the turn goes on
            cache_file, cache_problem = None, _reason(exc)
        try:
            old = self._write_row(session, name, cache_file)
        except UserError:
            self._remove(cache_file)
            raise
        except (sqlite3.Error, OSError) as exc:
            self._remove(cache_file)
            raise SaveIncomplete(None, self._keep_turn(session, name, _reason(exc))) from None
        if old and old != cache_file:
            self._remove(old)
        for path in session.kept_turns:  # turns the journal kept for this session are in the chat now
            path.unlink(missing_ok=True)
        session.kept_turns = []
        self.collect_orphans()
        if cache_problem:
            raise SaveIncomplete(name, f"chat {name!r} is saved, but not its compressed cache ({cache_problem}); "
                                       f"the next question reads the conversation again once. Make room in "
                                       f"{self.cache_dir} (disk space, or the file-size limit) to keep it next time")
        return name

    def _write_row(self, session: Session, name: str, cache_file: str | None) -> str | None:
        """One transaction: the chat's row, messages and attachments; the cache file it replaced (or None)."""
        now = time.time()
        e = session.engine
        settings = {**settings_of(e), "spec": e.spec.to_dict() if e.spec is not None else None}  # the run's RunSpec
        self.db.execute("BEGIN IMMEDIATE")  # one writer at a time, from the read of the old row to the commit
        try:
            old = self.db.execute("SELECT id, cache_file, created, updated FROM chats WHERE name = ?",
                                  (name,)).fetchone()
            if old and old[3] != session.saved_at:  # another process saved this chat since this one read it
                raise UserError(f"chat {name!r} changed in another process since this one opened it; this answer was "
                                f"not saved, so nothing of either is lost: ask again to continue from the saved chat")
            if old:
                self.db.execute("DELETE FROM chats WHERE id = ?", (old[0],))
            questions = iter(session.questions)
            self._insert(name, {"title": session.title(), "model": e.name, "policy": e.policy.name,
                                "system": session.system, "created": old[2] if old else now, "updated": now,
                                "fed": session.fed, "kept_units": session.kv_units, "kept_bytes": session.kv_bytes,
                                "cache_file": cache_file, "settings": json.dumps(settings)},
                         [{**m, "question": next(questions, None) if m["role"] == "user" else None}
                          for m in session.messages], session.attachments)
            self.db.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise
        session.saved_at = now
        return old[1] if old else None

    def _rollback(self) -> None:
        """Undo the open transaction (SQLite has undone it itself after some failures, a full disk among them)."""
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")

    def _insert(self, name: str, row: dict, messages: list[dict], attachments: list[Attachment]) -> None:
        """Insert chat `name` (inside the caller's transaction): its row, messages and attachments."""
        cur = self.db.execute(
            "INSERT INTO chats (name, title, model, policy, system, created, updated, fed, kept_units, kept_bytes, "
            "cache_file, settings) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (name, row["title"], row["model"], row["policy"], row["system"], row["created"], row["updated"],
             row["fed"], row["kept_units"], row["kept_bytes"], row["cache_file"], row["settings"]))
        chat_id = cur.lastrowid
        self.db.executemany("INSERT INTO messages VALUES (?, ?, ?, ?, ?)",
                            [(chat_id, i, m["role"], m["content"], m.get("question")) for i, m in enumerate(messages)])
        self.db.executemany("INSERT INTO attachments VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            [(chat_id, a.turn, a.name, a.path, a.sha256, a.tokens, a.start, a.end, a.offset)
                             for a in attachments])

    # --- the journal: turns a failed save kept --------------------------------------------------

    def _keep_turn(self, session: Session, name: str, reason: str) -> str:
        """Write what the database lacks of `session` to the journal; the one line that says where it is."""
        questions = iter(session.questions)
        messages = [{**m, "question": next(questions, None) if m["role"] == "user" else None}
                    for m in session.messages]
        base, held = session.saved_at, []
        try:  # the messages the database holds already (reading works where writing does not)
            row = self.db.execute("SELECT id FROM chats WHERE name = ?", (name,)).fetchone()
            if row:
                held = [{"role": r, "content": c} for r, c in self.db.execute(
                    "SELECT role, content FROM messages WHERE chat_id = ? ORDER BY idx", (row[0],))]
        except sqlite3.Error:
            base = None
        start = len(held) if [{"role": m["role"], "content": m["content"]} for m in messages[:len(held)]] == held \
            and base is not None else 0
        e = session.engine
        entry = {"chat": name, "base": base if start else None, "from": start, "messages": messages[start:],
                 "system": session.system, "title": session.title(), "model": e.name, "policy": e.policy.name,
                 "settings": json.dumps({**settings_of(e), "spec": e.spec.to_dict() if e.spec is not None else None}),
                 "attachments": [dataclasses.asdict(a) for a in session.attachments], "fed": session.fed,
                 "time": time.time()}
        try:
            path = turn_journal.keep(self.path.parent / "journal", entry)
        except (OSError, UserError) as exc:
            return (f"chat {name!r} could not be saved ({reason}), nor its turn kept aside ({_reason(exc)}): the "
                    f"answer above is all there is of it. Make room in {self.path.parent} (disk space, or the file-size "
                    f"limit) and ask again")
        session.kept_turns.append(path)
        return (f"chat {name!r} could not be saved ({reason}); this turn is kept in {path}, and the next localchat "
                f"run puts it back into the chat. Make room in {self.path.parent} (disk space, or the file-size limit)")

    def _replay(self) -> None:
        """Put the turns kept in the journal back into their chats (see localchat/turn_journal.py)."""
        for path in turn_journal.waiting(self.path.parent / "journal"):
            entry = turn_journal.read(path)
            if entry is None:
                self.notices.append(f"{path} is not a turn localchat kept; it is left as it is (move it aside)")
                continue
            name = entry["chat"]
            lock = self.chat_lock(name, "replay")
            if not lock.try_acquire():  # in use: the next start puts it back
                continue
            try:
                if not path.exists():  # another process put it back
                    continue
                try:
                    kept_as = self._put_back(entry)
                except (sqlite3.Error, OSError, KeyError, TypeError, ValueError) as exc:
                    self.notices.append(f"a turn of chat {name!r} is still kept in {path} ({_reason(exc)})")
                    continue
                path.unlink(missing_ok=True)
                self.notices.append(f"a turn of chat {name!r} that a failed save kept aside is saved now"
                                    + (f", as chat {kept_as!r} (the chat changed since)" if kept_as != name else ""))
            finally:
                lock.release()

    def _put_back(self, entry: dict) -> str:
        """Write a kept turn into its chat, or as a chat of its own when the chat changed since; the name used."""
        name = entry["chat"]
        attachments = [Attachment(**a) for a in entry.get("attachments") or []]
        self.db.execute("BEGIN IMMEDIATE")
        try:
            old = self.db.execute("SELECT id, cache_file, created, updated FROM chats WHERE name = ?",
                                  (name,)).fetchone()
            start, messages = int(entry.get("from") or 0), entry["messages"]
            count = self.db.execute("SELECT COUNT(*) FROM messages WHERE chat_id = ?", (old[0],)).fetchone()[0] \
                if old else 0
            fits = (old is None and start == 0) or (old is not None and old[3] == entry.get("base") and count == start)
            if fits and old:
                held = self.db.execute("SELECT role, content, question FROM messages WHERE chat_id = ? ORDER BY idx",
                                       (old[0],)).fetchall()
                messages = [{"role": r, "content": c, "question": q} for r, c, q in held] + messages
                self.db.execute("DELETE FROM chats WHERE id = ?", (old[0],))
            elif not fits:
                kept_as = f"{name} (kept)"
                n = 2
                while self.exists(kept_as):
                    kept_as, n = f"{name} (kept {n})", n + 1
                name, attachments = kept_as, [a for a in attachments if a.turn >= start]
                attachments = [dataclasses.replace(a, turn=a.turn - start) for a in attachments]
            when = float(entry.get("time") or time.time())
            self._insert(name, {"title": str(entry.get("title") or name), "model": str(entry.get("model") or ""),
                                "policy": str(entry.get("policy") or ""), "system": entry.get("system"),
                                "created": old[2] if fits and old else when, "updated": when,
                                "fed": int(entry.get("fed") or 0),
                                "kept_units": 0, "kept_bytes": 0, "cache_file": None,
                                "settings": str(entry.get("settings") or "{}")}, messages, attachments)
            self.db.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise
        if fits and old:
            self._remove(old[1])
        return name

    def load(self, name: str, engine) -> tuple[Session, list[str]]:
        """The saved chat over `engine`, and notices (e.g. why its cache will be re-read)."""
        row = self.db.execute("SELECT id, system, cache_file, fed, updated FROM chats WHERE name = ?",
                              (name,)).fetchone()
        if row is None:
            raise UserError(f"no chat named {shown(name)}; `localchat sessions` lists them")
        chat_id, system, cache_file, fed, updated = row
        session = Session(engine, system=system, name=name)
        session.saved_at = updated
        messages = self.db.execute("SELECT role, content, question FROM messages WHERE chat_id = ? ORDER BY idx",
                                   (chat_id,)).fetchall()
        attachments = self.db.execute(
            "SELECT name, path, sha256, tokens, turn, tok_start, tok_end, char_offset FROM attachments WHERE chat_id = ? "
            "ORDER BY rowid", (chat_id,)).fetchall()
        bad = next((i for i, (r, c, q) in enumerate(messages) if r not in ("user", "assistant")
                    or not isinstance(c, str) or not isinstance(q, (str, type(None)))), None)
        if bad is not None or not isinstance(system, (str, type(None))):
            where = f"message {bad + 1}" if bad is not None else "its system prompt"
            raise UserError(f"chat {name!r} in {self.path} is damaged ({where} is not a saved message); it is left "
                            f"as it is: start another chat, or remove this one with `localchat sessions --delete`")
        state = session._state
        state.messages = [{"role": r, "content": c} for r, c, _ in messages]
        state.attachments = [Attachment(*a) for a in attachments]
        session.questions = [q if q is not None else c for r, c, q in messages if r == "user"]
        if not state.messages:
            return session, []
        notices = []
        problem = self._read_cache(session, cache_file, fed)
        if problem:
            session.mark_stale(problem)
            notices.append(f"the saved cache of {name!r} is not reused ({problem}); the next question re-reads "
                           f"the conversation once")
        return session, notices

    # --- the cache file ------------------------------------------------------------------------

    def _write_cache(self, session: Session) -> str | None:
        cache = session.cache
        if cache is None or not session.messages or session._stale or session.kv_bytes > MAX_CACHE_BYTES:
            return None
        tensors = {k: v.contiguous() for k, v in cache.tensors().items()}
        meta = {"fingerprint": fingerprint(session.engine), "text": text_hash(session.cached_text),
                "fed": str(session.fed), "positions": cache.positions, "layers": str(len(cache.layers)),
                "format": "localchat-cache-1", "sha256": tensors_hash(tensors)}
        stem = hashlib.sha256(session.name.encode()).hexdigest()[:12]
        final = self.cache_dir / f"{stem}-{meta['text'][:12]}-{time.time_ns()}.safetensors"
        tmp = room(self.cache_dir / PARTIAL) / final.with_suffix(".tmp").name
        try:
            save_file(tensors, str(tmp), metadata=meta)  # through a temporary file of its own, in scratch too
            fd = open_private(tmp, os.O_RDONLY)
            try:
                os.fchmod(fd, 0o600)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk: give back what it took
            raise
        return final.name

    def _read_cache(self, session: Session, cache_file: str | None, fed: int) -> str | None:
        """Load the saved cache into `session`; None when it was reused, else why not."""
        engine = session.engine
        if not cache_file:
            return "no cache was saved with it"
        text = engine.render(session._with_system(session.messages[:-1])) + session.messages[-1]["content"]
        try:
            path = self._cache_path(cache_file)
            if path is None:
                return "its file name is not one localchat writes"
            kind = path.lstat().st_mode
            if stat.S_ISLNK(kind):
                raise link_error(path)
            if not stat.S_ISREG(kind):
                return f"{path.name} in {self.cache_dir} is not a file (a folder or a device is in its place)"
            with safe_open(str(path), framework="pt", device=str(engine.device)) as f:
                meta = f.metadata() or {}
                if meta.get("format") != "localchat-cache-1":
                    return "the file is not a localchat cache"
                if meta.get("fingerprint") != fingerprint(engine):
                    return "it was made with another model, policy, heads or library version"
                if meta.get("text") != text_hash(text) or int(meta.get("fed", -1)) != fed:
                    return "it does not match the saved messages"
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            if meta.get("sha256") != tensors_hash(tensors):  # flipped bytes would read as a wrong cache, silently
                return "the file is damaged: its tensors do not match their checksum"
        except FileNotFoundError:
            return "its file is missing"
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - a damaged file: say so, re-read
            return f"the file is damaged: {(str(exc).splitlines() or [type(exc).__name__])[0]}"
        cache = engine.new_cache()
        if int(meta.get("layers", -1)) != len(cache.layers) or meta.get("positions") != cache.positions:
            return "its shape does not fit this model"
        try:
            cache.load_tensors(tensors)
        except (KeyError, RuntimeError) as exc:
            return f"the file is damaged: {exc}"
        state = session._state
        state.cache, state.text, state.fed = cache, text, fed
        return None

    def _cache_path(self, cache_file: str | None) -> Path | None:
        """The cache file a row names, only when it is a plain name of a file inside caches/ (a damaged or hostile
        row naming `../x` or an absolute path is never read or deleted)."""
        if not cache_file or Path(cache_file).name != cache_file or not cache_file.endswith(".safetensors"):
            return None
        return self.cache_dir / cache_file

    def _remove(self, cache_file: str | None) -> None:
        """Remove a cache file a row named, when it is one (never a directory, a symlink's target, or a failure)."""
        path = self._cache_path(cache_file)
        if path is None:
            return
        try:
            if stat.S_ISREG(path.lstat().st_mode):
                path.unlink()
        except OSError:  # gone already; or not removable: collect_orphans tries again later
            pass

    def collect_orphans(self, grace: float | None = None) -> int:
        """Remove cache files that no chat references and that are older than `grace` seconds (ORPHAN_GRACE):
        what a process killed while writing its cache file (caches/partial/), between writing and committing, or
        between committing and removing the old file left behind. Only regular files in caches/partial/ or with
        names localchat (or safetensors, for it) writes, never through a symlink. Returns how many went."""
        referenced = {row[0] for row in self.db.execute("SELECT cache_file FROM chats WHERE cache_file IS NOT NULL")}

        def ours(name: str) -> bool:  # in caches/: our names, and safetensors' temporary files of earlier versions
            return name not in referenced and bool(CACHE_NAME.fullmatch(name) or SAFETENSORS_TMP.fullmatch(name))

        grace = ORPHAN_GRACE if grace is None else grace
        return collect_partial(self.cache_dir, ours, grace) + \
            collect_partial(self.path.parent / "journal", lambda n: n.endswith(".tmp"), grace)

    def _new_name(self) -> str:
        n = 1 + self.db.execute("SELECT COUNT(*) FROM chats").fetchone()[0]
        while self.exists(f"chat-{n}"):
            n += 1
        return f"chat-{n}"
