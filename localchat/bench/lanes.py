"""Several `localchat bench` processes ("lanes") on one results file.

Start the same command once per core: each example is claimed before it runs, so no two lanes run it,
and a lane skips what another has written or is running. A claim is an exclusive `flock` on
OUT/.claims/<hash of the example's key>; the kernel drops it when its process ends, so a killed lane
leaves nothing to clean up. Rows are appended in one `write` under OUT/results.jsonl.lock, the lock
that cutting a torn last line (from a killed run) also takes. Without `fcntl` (Windows) claims always
succeed and the locks are no-ops: run one process per results file there.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from localchat.filelock import Locked

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

CLAIMS = ".claims"


def _lock_path(results: Path) -> Path:
    return results.with_name(results.name + ".lock")


def append_row(results: Path, line: str) -> None:
    """Append one JSONL line with a single write, under the results file's lock."""
    data = (line.rstrip("\n") + "\n").encode("utf-8")
    with Locked(_lock_path(results)):
        fd = os.open(results, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


def cut_torn_line(results: Path) -> None:
    """Cut a last line with no newline (a run killed mid-write), under the lock writers take."""
    if not results.exists():
        return
    with Locked(_lock_path(results)):
        data = results.read_bytes()
        if data and not data.endswith(b"\n"):
            with results.open("r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)


def _claim_path(results: Path, key: str) -> Path:
    return results.parent / CLAIMS / hashlib.sha1(key.encode("utf-8")).hexdigest()


class Claim:
    """This process's hold on one example; `release()` once its row is written (or on failure)."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            self.path.unlink(missing_ok=True)  # unlink while held: a waiting lane then sees the row
        finally:
            os.close(self.fd)
            self.fd = -1


def claim(results: Path, key: str) -> Claim | None:
    """Take the example `key`, or None when another live process holds it."""
    path = _claim_path(results, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    if fcntl:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
    return Claim(path, fd)


def busy(results: Path, key: str) -> bool:
    """Whether another live process holds the example `key` now (nothing is taken)."""
    taken = claim(results, key)
    if taken is None:
        return True
    os.close(taken.fd)  # drop the probe without unlinking: a lane may have opened the file meanwhile
    return False


def running(results: Path, keys: list[str]) -> int:
    """How many of `keys` other live processes hold now; keys never claimed are not probed (no file is made)."""
    return sum(1 for key in keys if _claim_path(results, key).exists() and busy(results, key))


def read_rows(path: Path) -> list[dict]:
    """The rows of a results file (none when it does not exist); a torn line is skipped."""
    rows = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows
