"""Conversations on disk, in the user data directory, in three rooms:

- rows.py: the chats database (SQLite): a chat's row, messages and attachments, written in one transaction;
  upgrades/: its schema, one module per version;
- cache_files.py: each chat's compressed cache, one safetensors file in caches/, written atomically and reused
  only when its fingerprint and checksum match;
- journal.py: turns a failed save kept aside, put back by the next run.

Every save is atomic: the cache file is written under a new name, then one transaction points the chat at it,
then the old file is removed, so a process killed at any moment leaves the previous state (or the new one)
readable, never a mix; what such a kill leaves behind is collected later. Nothing in the data directory is
reached through a link (private.py), and one writer at a time holds a chat (localchat/store/chat_lock.py).
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING

from localchat.errors import UserError, first_line
from localchat.paths import collect_partial, data_dir
from localchat.store import journal, rows, upgrades
from localchat.store.cache_files import ORPHAN_GRACE, CacheFiles, fingerprint, settings_of
from localchat.store.chat_lock import ChatLock
from localchat.store.private import check_rooms, open_private, open_warning
from localchat.store.rows import NAME_MAX, ChatInfo, check_name, shown
from localchat.store.upgrades import MIGRATIONS, SCHEMA

if TYPE_CHECKING:  # imported where a chat is loaded: listing the saved chats imports no session (nor torch)
    from localchat.session import Session

__all__ = ["Store", "SaveIncomplete", "ChatInfo", "NAME_MAX", "check_name", "shown", "damaged", "fingerprint",
           "settings_of", "MIGRATIONS", "SCHEMA", "ORPHAN_GRACE"]

LOCK_WAIT = 10.0  # seconds a save waits for another process's save before it gives up


class SaveIncomplete(UserError):
    """A save that kept the turn, but not all of the chat where it belongs; `name` is set when the chat is saved."""

    def __init__(self, name: str | None, message: str):
        super().__init__(message)
        self.name = name


def _reason(exc: BaseException) -> str:
    """An OS or SQLite failure in a few words ("No space left on device", "database or disk is full")."""
    text = getattr(exc, "strerror", None) or first_line(exc)
    errno = re.search(r"\(os error ([0-9]+)\)", text)  # safetensors' wording of an OS error
    return os.strerror(int(errno.group(1))) if errno else text[:200]


def damaged(path: Path, exc: Exception) -> UserError:
    """One line for a chats database SQLite cannot use (damaged, truncated, or another program's file)."""
    return UserError(f"{path} is damaged or not a localchat chats database ({exc}); move it aside (it may hold "
                     f"chats worth keeping) and localchat starts a new one, or point LOCALCHAT_DATA_DIR elsewhere")


class Store:
    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path else data_dir() / "chats.sqlite3"
        data = self.path.parent
        check_rooms(data)  # no link in it leads outside (private.py)
        warning = open_warning(data)
        self.notices = [warning] if warning else []  # lines for the user, printed by whoever opened the store
        self.caches = CacheFiles(data / "caches")
        self.cache_dir = self.caches.directory
        # chats hold whole documents: readable by their owner only
        os.close(open_private(self.path, os.O_CREAT | os.O_RDWR))
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=LOCK_WAIT)
            self.db.execute("PRAGMA foreign_keys = ON")
            upgrades.upgrade(self.db, self.path, lambda db, path: self._version())
            upgrades.check(self.db)
            self._replay()
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise UserError(f"{self.path} is locked by another localchat ({exc}); close it and try again") \
                    from None
            raise damaged(self.path, exc) from None
        except sqlite3.DatabaseError as exc:
            raise damaged(self.path, exc) from None

    def _version(self) -> int:
        return upgrades.version(self.db, self.path)

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
        """The lock that keeps one writer at a time on chat `name` (localchat/store/chat_lock.py)."""
        return ChatLock(name, self.path.parent / "locks", who)

    # --- chats -----------------------------------------------------------------------------------

    def list(self) -> list[ChatInfo]:
        return rows.listing(self.db)

    def settings(self, name: str) -> dict:
        """The settings `name` was last answered with ({} for chats saved before schema 2)."""
        return rows.settings(self.db, name)

    def exists(self, name: str) -> bool:
        return rows.exists(self.db, name)

    def messages(self, name: str) -> tuple[str | None, list[dict]]:
        """Chat `name`'s system prompt and the role and text of its messages, without loading its cache."""
        row = self.db.execute("SELECT system FROM chats WHERE name = ?", (name,)).fetchone()
        return (row[0] if row else None), rows.held_messages(self.db, name)

    def delete(self, name: str) -> None:
        self.caches.remove(rows.delete(self.db, name))

    def load(self, name: str, engine) -> tuple[Session, list[str]]:
        """The saved chat over `engine`, and notices (e.g. why its cache will be re-read)."""
        from localchat.session import Session

        saved = rows.read(self.db, name, self.path)
        session = Session(engine, system=saved.system, name=name)
        session.saved_at = saved.updated
        session.restore([{"role": m["role"], "content": m["content"]} for m in saved.messages], saved.attachments,
                        [m["question"] if m["question"] is not None else m["content"]
                         for m in saved.messages if m["role"] == "user"])
        if not session.messages:
            return session, []
        problem = self.caches.read(session, saved.cache_file, saved.fed)
        if problem is None:
            return session, []
        session.mark_stale(problem, said=True)  # the caller shows the notice below
        return session, [f"the saved cache of {shown(name)} is not reused ({problem}); the next question re-reads "
                         f"the conversation once"]

    def save(self, session: Session, name: str | None = None) -> str:
        """Save messages, settings and (when small enough) the compressed cache; returns the name.

        An answered turn is never lost: when the cache file cannot be written the chat is saved without it (the
        next question reads the conversation again), and when the database cannot take the turn it is kept in
        the journal for the next run; both raise SaveIncomplete, one line that says where the turn is."""
        name = name or session.name or rows.new_name(self.db)
        session.name = name
        try:
            cache_file, cache_problem = self.caches.write(session), None
        except Exception as exc:  # noqa: BLE001 - disk full, a size limit, a read-only medium: the turn goes on
            cache_file, cache_problem = None, _reason(exc)
        row, messages = self._row(session, cache_file), self._messages(session)
        try:
            old = rows.write(self.db, name, row, messages, session.attachments, session.saved_at)
        except UserError:
            self.caches.remove(cache_file)
            raise
        except (sqlite3.Error, OSError) as exc:
            self.caches.remove(cache_file)
            raise SaveIncomplete(None, self._keep_turn(session, name, row, messages, _reason(exc))) from None
        session.saved_at = row["updated"]
        if old and old != cache_file:
            self.caches.remove(old)
        for path in session.kept_turns:  # turns the journal kept for this session are in the chat now
            path.unlink(missing_ok=True)
        session.kept_turns = []
        self.collect_orphans()
        if cache_problem:
            raise SaveIncomplete(name, f"chat {shown(name)} is saved, but not its compressed cache ({cache_problem}); "
                                       f"the next question reads the conversation again once. Make room in "
                                       f"{self.cache_dir} (disk space, or the file-size limit) to keep it next time")
        return name

    @staticmethod
    def _row(session: Session, cache_file: str | None) -> dict:
        e, now = session.engine, time.time()
        settings = {**settings_of(e), "spec": e.spec.to_dict() if e.spec is not None else None}  # the run's RunSpec
        return {"title": session.title(), "model": e.name, "policy": e.policy.name, "system": session.system,
                "created": now, "updated": now, "fed": session.fed, "kept_units": session.kv_units,
                "kept_bytes": session.kv_bytes, "cache_file": cache_file, "settings": json.dumps(settings)}

    @staticmethod
    def _messages(session: Session) -> list[dict]:
        questions = iter(session.questions)
        return [{**m, "question": next(questions, None) if m["role"] == "user" else None} for m in session.messages]

    # --- the journal: turns a failed save kept --------------------------------------------------

    def _keep_turn(self, session: Session, name: str, row: dict, messages: list[dict], reason: str) -> str:
        """Write what the database lacks of `session` to the journal; the one line that says where it is."""
        try:  # the messages the database holds already (reading works where writing does not)
            held = rows.held_messages(self.db, name)
        except sqlite3.Error:
            held = None
        try:
            path = journal.keep(self.path.parent / "journal", journal.entry_for(session, name, row, messages, held))
        except (OSError, UserError) as exc:
            return (f"chat {shown(name)} could not be saved ({reason}), nor its turn kept aside ({_reason(exc)}): the "
                    f"answer above is all there is of it. Make room in {self.path.parent} (disk space, or the "
                    f"file-size limit) and ask again")
        session.kept_turns.append(path)
        return (f"chat {shown(name)} could not be saved ({reason}); this turn is kept in {path}, and the next "
                f"localchat run puts it back into the chat. Make room in {self.path.parent} (disk space, or the "
                f"file-size limit)")

    def _replay(self) -> None:
        """Put the turns kept in the journal back into their chats (see journal.py)."""
        for path in journal.waiting(self.path.parent / "journal"):
            entry = journal.read(path)
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
                    kept_as, unused = journal.put_back(self.db, entry)
                except (sqlite3.Error, OSError, KeyError, TypeError, ValueError) as exc:
                    self.notices.append(f"a turn of chat {shown(name)} is still kept in {path} ({_reason(exc)})")
                    continue
                self.caches.remove(unused)
                path.unlink(missing_ok=True)
                self.notices.append(f"a turn of chat {shown(name)} that a failed save kept aside is saved now"
                                    + (f", as chat {shown(kept_as)} (the chat changed since)" if kept_as != name else ""))
            finally:
                lock.release()

    def collect_orphans(self, grace: float | None = None) -> int:
        """Remove what killed saves left behind, once `grace` seconds old (ORPHAN_GRACE): cache files no chat
        references (cache_files.py), and half-written journal files. Returns how many went."""
        referenced = {row[0] for row in self.db.execute("SELECT cache_file FROM chats WHERE cache_file IS NOT NULL")}
        grace = ORPHAN_GRACE if grace is None else grace
        return self.caches.collect(referenced, grace) + \
            collect_partial(self.path.parent / "journal", lambda n: n.endswith(".tmp"), grace)
