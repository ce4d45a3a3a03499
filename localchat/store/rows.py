"""A chat's rows in the chats database: the chat, its messages (with the user's own words), its attachments.

Functions over an open sqlite3 connection; a chat is written in one transaction, under SQLite's write lock from
the read of its old row to the commit, and refused when another process saved it since this one read it.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from localchat.errors import UserError

if TYPE_CHECKING:  # imported where a chat is read: listing the saved chats imports no session (nor torch)
    from localchat.session import Attachment

NAME_MAX = 100  # characters in a chat's name


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


@dataclass
class Saved:
    """A chat as its rows hold it."""

    system: str | None
    cache_file: str | None
    fed: int
    updated: float
    messages: list[dict]  # role, content, question (the user's own words; None for answers)
    attachments: list[Attachment]


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


def no_chat(name: str) -> UserError:
    return UserError(f"no chat named {shown(name)}; `localchat sessions` lists them")


def _number(value, kind):
    """A number column as `kind`; 0 where a damaged row holds something else (the chat stays listed)."""
    try:
        number = kind(value)
    except (TypeError, ValueError, OverflowError):
        return kind(0)
    return number if number == number and abs(number) < 2**62 else kind(0)  # not NaN, not absurd


def listing(db: sqlite3.Connection) -> list[ChatInfo]:
    rows = db.execute(
        "SELECT name, title, model, policy, (SELECT COUNT(*) FROM messages m WHERE m.chat_id = c.id "
        "AND m.role = 'user'), fed, kept_units, kept_bytes, updated FROM chats c ORDER BY updated DESC"
    ).fetchall()
    return [ChatInfo(*(str(v) for v in row[:4]), *(_number(v, int) for v in row[4:8]), _number(row[8], float))
            for row in rows]


def settings(db: sqlite3.Connection, name: str) -> dict:
    """The settings `name` was last answered with ({} for chats saved before schema 2)."""
    row = db.execute("SELECT settings FROM chats WHERE name = ?", (name,)).fetchone()
    if row is None:
        raise no_chat(name)
    try:
        found = json.loads(row[0])
    except (TypeError, ValueError):  # a damaged row: the chat stays listed, without its settings
        return {}
    return found if isinstance(found, dict) else {}


def exists(db: sqlite3.Connection, name: str) -> bool:
    return db.execute("SELECT 1 FROM chats WHERE name = ?", (name,)).fetchone() is not None


def delete(db: sqlite3.Connection, name: str) -> str | None:
    """Delete chat `name`; the cache file it named."""
    row = db.execute("SELECT id, cache_file FROM chats WHERE name = ?", (name,)).fetchone()
    if row is None:
        raise no_chat(name)
    db.execute("DELETE FROM chats WHERE id = ?", (row[0],))
    return row[1]


def read(db: sqlite3.Connection, name: str, path: Path) -> Saved:
    """Chat `name` as saved; UserError when it is missing, or damaged where a message should be."""
    row = db.execute("SELECT id, system, cache_file, fed, updated FROM chats WHERE name = ?", (name,)).fetchone()
    if row is None:
        raise no_chat(name)
    chat_id, system, cache_file, fed, updated = row
    messages = db.execute("SELECT role, content, question FROM messages WHERE chat_id = ? ORDER BY idx",
                          (chat_id,)).fetchall()
    attachments = db.execute(
        "SELECT name, path, sha256, tokens, turn, tok_start, tok_end, char_offset FROM attachments WHERE chat_id = ? "
        "ORDER BY rowid", (chat_id,)).fetchall()
    bad = next((i for i, (r, c, q) in enumerate(messages) if r not in ("user", "assistant")
                or not isinstance(c, str) or not isinstance(q, (str, type(None)))), None)
    if bad is not None or not isinstance(system, (str, type(None))):
        where = f"message {bad + 1}" if bad is not None else "its system prompt"
        raise UserError(f"chat {shown(name)} in {path} is damaged ({where} is not a saved message); it is left as it "
                        f"is: start another chat, or remove this one with `localchat sessions --delete`")
    from localchat.session import Attachment

    return Saved(system, cache_file, fed, updated, [{"role": r, "content": c, "question": q} for r, c, q in messages],
                 [Attachment(*a) for a in attachments])


def held_messages(db: sqlite3.Connection, name: str) -> list[dict]:
    """The role and text of each message chat `name` holds ([] when there is no such chat)."""
    return [{"role": r, "content": c} for r, c in db.execute(
        "SELECT m.role, m.content FROM messages m JOIN chats c ON c.id = m.chat_id WHERE c.name = ? ORDER BY m.idx",
        (name,))]


def insert(db: sqlite3.Connection, name: str, row: dict, messages: list[dict], attachments: list[Attachment]) -> None:
    """Insert chat `name` (inside the caller's transaction): its row, messages and attachments."""
    cur = db.execute(
        "INSERT INTO chats (name, title, model, policy, system, created, updated, fed, kept_units, kept_bytes, "
        "cache_file, settings) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (name, row["title"], row["model"], row["policy"], row["system"], row["created"], row["updated"],
         row["fed"], row["kept_units"], row["kept_bytes"], row["cache_file"], row["settings"]))
    chat_id = cur.lastrowid
    db.executemany("INSERT INTO messages VALUES (?, ?, ?, ?, ?)",
                   [(chat_id, i, m["role"], m["content"], m.get("question")) for i, m in enumerate(messages)])
    db.executemany("INSERT INTO attachments VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   [(chat_id, a.turn, a.name, a.path, a.sha256, a.tokens, a.start, a.end, a.offset)
                    for a in attachments])


def write(db: sqlite3.Connection, name: str, row: dict, messages: list[dict], attachments: list[Attachment],
          saved_at: float | None) -> str | None:
    """Replace chat `name` in one transaction; the cache file its old row named. `saved_at`: when this process
    last read or wrote it (a newer save elsewhere is refused: its turn would be lost)."""
    db.execute("BEGIN IMMEDIATE")  # one writer at a time, from the read of the old row to the commit
    try:
        old = db.execute("SELECT id, cache_file, created, updated FROM chats WHERE name = ?", (name,)).fetchone()
        if old and old[3] != saved_at:  # another process saved this chat since this one read it
            raise UserError(f"chat {shown(name)} changed in another process since this one opened it; this answer "
                            f"was not saved, so nothing of either is lost: ask again to continue from the saved chat")
        if old:
            db.execute("DELETE FROM chats WHERE id = ?", (old[0],))
        insert(db, name, {**row, "created": old[2] if old else row["created"]}, messages, attachments)
        db.execute("COMMIT")
    except BaseException:
        rollback(db)
        raise
    return old[1] if old else None


def rollback(db: sqlite3.Connection) -> None:
    """Undo the open transaction (SQLite has undone it itself after some failures, a full disk among them)."""
    if db.in_transaction:
        db.execute("ROLLBACK")


def new_name(db: sqlite3.Connection) -> str:
    n = 1 + db.execute("SELECT COUNT(*) FROM chats").fetchone()[0]
    while exists(db, f"chat-{n}"):
        n += 1
    return f"chat-{n}"
