"""An exclusive lock on a file, held across processes for a `with` block (`flock`; a no-op without `fcntl`).

The kernel drops the lock when its process ends, so a killed holder leaves nothing to clean up. Used by the
bench lanes (one results file, several processes), by the one-time model conversion (several processes
starting on a fresh cache at once) and by the per-chat locks (localchat/store/chat_lock.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: run one process per cache or results file there
    fcntl = None


def try_lock(fd: int) -> bool:
    """Take the exclusive lock on open file `fd` if nobody holds it; True when taken."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def poll_lock(fd: int, deadline: float, check: Callable[[], None] | None = None) -> bool:
    """Try to take the lock on `fd` until `deadline` (time.monotonic()); `check()` runs between tries and may
    raise to stop waiting. True when taken."""
    pause = 0.01
    while not try_lock(fd):
        if time.monotonic() >= deadline:
            return False
        if check is not None:
            check()
        time.sleep(pause)
        pause = min(pause * 2, 0.2)
    return True


class Locked:
    """Hold an exclusive flock on `path` (made if missing) inside `with`; `waiting(text)` is called once when
    another process holds it and this one starts to wait. With `timeout` (seconds), TimeoutError after it."""

    def __init__(self, path: Path, waiting: Callable[[str], None] | None = None, timeout: float | None = None):
        self.path, self.waiting, self.timeout = Path(path), waiting, timeout

    def __enter__(self):
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        if not try_lock(self.fd):
            if self.waiting:
                self.waiting(f"waiting for another localchat process that holds {self.path} ...")
            if self.timeout is None:
                fcntl.flock(self.fd, fcntl.LOCK_EX)
            elif not poll_lock(self.fd, time.monotonic() + self.timeout):
                os.close(self.fd)
                raise TimeoutError(f"{self.path} is still held by another process after {self.timeout:g} s")
        return self

    def __exit__(self, *exc):
        os.close(self.fd)  # closing drops the lock
