"""An exclusive lock on a file, held across processes for a `with` block (`flock`; a no-op without `fcntl`).

The kernel drops the lock when its process ends, so a killed holder leaves nothing to clean up. Used by the
bench lanes (one results file, several processes) and by the one-time model conversion (several processes
starting on a fresh cache at once).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: run one process per cache or results file there
    fcntl = None


class Locked:
    """Hold an exclusive flock on `path` (made if missing) inside `with`; `waiting(text)` is called once when
    another process holds it and this one starts to wait."""

    def __init__(self, path: Path, waiting: Callable[[str], None] | None = None):
        self.path, self.waiting = Path(path), waiting

    def __enter__(self):
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        if fcntl:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if self.waiting:
                    self.waiting(f"waiting for another localchat process that holds {self.path} ...")
                fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)  # closing drops the lock
