"""Turns a failed save kept: <data dir>/journal/, one JSON file per turn, replayed into the chats by a later run.

When the chats database cannot take an answered turn (a full disk, a file-size limit, a read-only medium), the
store writes what the database lacks here instead (the messages past the ones it holds, with the chat's settings)
and says where; every later start of the store puts kept turns back into their chats and removes the files. A
file is replayed only once the process that wrote it is gone (the chat window keeps its own turns and saves them
with its next save), and under the chat's lock.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import sqlite3
import time
from pathlib import Path

from localchat.store import rows
from localchat.store.private import open_private, room

FORMAT = "localchat-turn-1"
NAME = re.compile(r"[0-9a-f]{12}-([0-9]+)-[0-9]+\.json")  # <chat hash>-<pid>-<time>.json


def keep(directory: Path, entry: dict) -> Path:
    """Write `entry` as a new file in `directory` (0700, made if missing), synced; its path."""
    room(directory)
    stem = hashlib.sha256(entry["chat"].encode("utf-8", "surrogatepass")).hexdigest()[:12]
    path = directory / f"{stem}-{os.getpid()}-{time.time_ns()}.json"
    tmp = path.with_suffix(".tmp")
    fd = open_private(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogatepass") as f:
            fd = None
            json.dump({"format": FORMAT, **entry}, f, ensure_ascii=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if fd is not None:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return path


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def waiting(directory: Path) -> list[Path]:
    """Kept turns whose writer is gone, oldest first."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        match = NAME.fullmatch(name)
        if match and not _alive(int(match.group(1))):
            found.append(directory / name)
    return sorted(found, key=lambda p: int(p.stem.rsplit("-", 1)[1]))


def read(path: Path) -> dict | None:
    """The entry in `path`, or None when it is not one (damaged, or another program's file)."""
    try:
        fd = open_private(path, os.O_RDONLY)
        with os.fdopen(fd, encoding="utf-8", errors="surrogatepass") as f:
            entry = json.load(f)
    except (OSError, ValueError):
        return None
    ok = (isinstance(entry, dict) and entry.get("format") == FORMAT and isinstance(entry.get("chat"), str)
          and isinstance(entry.get("messages"), list)
          and all(isinstance(m, dict) and m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str)
                  for m in entry["messages"]))
    return entry if ok else None


def entry_for(session, name: str, row: dict, messages: list[dict], held: list[dict] | None) -> dict:
    """What the database lacks of `session` (saved as chat `name`, whose row and messages would be `row` and
    `messages`): the messages past the `held` ones when the database holds them unchanged, else all of them
    (`held` None: it could not be read)."""
    roles = [{"role": m["role"], "content": m["content"]} for m in messages]
    start = len(held) if held and session.saved_at is not None and roles[:len(held)] == held else 0
    return {"chat": name, "base": session.saved_at if start else None, "from": start, "messages": messages[start:],
            "attachments": [dataclasses.asdict(a) for a in session.attachments], "time": time.time(),
            **{k: row[k] for k in ("system", "title", "model", "policy", "settings", "fed")}}


def put_back(db: sqlite3.Connection, entry: dict) -> tuple[str, str | None]:
    """Write a kept turn into its chat, or as a chat of its own when the chat changed since; the name it is saved
    under, and the cache file the chat's old row named (now unused)."""
    from localchat.session import Attachment

    name = entry["chat"]
    attachments = [Attachment(**a) for a in entry.get("attachments") or []]
    start, messages = int(entry.get("from") or 0), entry["messages"]
    db.execute("BEGIN IMMEDIATE")
    try:
        old = db.execute("SELECT id, cache_file, created, updated FROM chats WHERE name = ?", (name,)).fetchone()
        held = db.execute("SELECT role, content, question FROM messages WHERE chat_id = ? ORDER BY idx",
                          (old[0],)).fetchall() if old else []
        fits = (old is None and start == 0) or (old is not None and old[3] == entry.get("base") and len(held) == start)
        if fits and old:
            messages = [{"role": r, "content": c, "question": q} for r, c, q in held] + messages
            db.execute("DELETE FROM chats WHERE id = ?", (old[0],))
        elif not fits:  # the chat changed since: the kept messages become a chat of their own
            kept_as, n = f"{name} (kept)", 2
            while rows.exists(db, kept_as):
                kept_as, n = f"{name} (kept {n})", n + 1
            name = kept_as
            attachments = [dataclasses.replace(a, turn=a.turn - start) for a in attachments if a.turn >= start]
        when = float(entry.get("time") or time.time())
        rows.insert(db, name, {"title": str(entry.get("title") or name), "model": str(entry.get("model") or ""),
                               "policy": str(entry.get("policy") or ""), "system": entry.get("system"),
                               "created": old[2] if fits and old else when, "updated": when,
                               "fed": int(entry.get("fed") or 0), "kept_units": 0, "kept_bytes": 0,
                               "cache_file": None, "settings": str(entry.get("settings") or "{}")},
                    messages, attachments)
        db.execute("COMMIT")
    except BaseException:
        rows.rollback(db)
        raise
    return name, old[1] if fits and old else None
