"""Turns a failed save kept: <data dir>/journal/, one JSON file per turn, replayed into the chats by a later run.

When the chats database cannot take an answered turn (a full disk, a file-size limit, a read-only medium), the
store writes what the database lacks here instead (the messages past the ones it holds, with the chat's settings)
and says where; every later start of the store puts kept turns back into their chats and removes the files. A
file is replayed only once the process that wrote it is gone (the chat window keeps its own turns and saves them
with its next save), and under the chat's lock.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from localchat.private_files import open_private, room

FORMAT = "localchat-turn-1"
NAME = re.compile(r"[0-9a-f]{12}-([0-9]+)-[0-9]+\.json")  # <chat hash>-<pid>-<time>.json


def keep(directory: Path, entry: dict) -> Path:
    """Write `entry` as a new file in `directory` (0700, made if missing), synced; its path."""
    import hashlib

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
