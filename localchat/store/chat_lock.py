"""One writer per saved chat: a lock per chat name, held from loading the chat to saving it.

`localchat ask --session S` takes the lock of S after its model loads; a second `ask` on S waits (it says so
once), then loads what the first one saved (turns and cache) and continues from it, so concurrent writers keep
every turn, in the order they got the lock. The wait is bounded (LOCALCHAT_SESSION_WAIT seconds, default 600);
past it the second one stops in one line, before answering. The chat window holds the lock of the chat it has
open for as long as it shows it: an `ask` on that chat is refused at once (it would wait for hours), and the
window does not open a chat an `ask` is answering in.

Lock files live in <data dir>/locks/ (0700), one per chat name (named by its hash), and hold "<who> <pid>" while
held; one that is a link is refused, never written through.
They are never deleted (deleting a lock file that another process has open breaks the lock); the kernel drops
a lock when its process ends, so a killed holder blocks nobody.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from localchat.errors import UserError
from localchat.filelock import poll_lock, try_lock
from localchat.store.private import NOFOLLOW, open_private, room

WAIT_ENV = "LOCALCHAT_SESSION_WAIT"
DEFAULT_WAIT = 600.0  # seconds: a turn over a long document on a CPU takes minutes
WINDOW = "window"  # who holds a chat open in the chat window


def wait_limit(env: dict | None = None) -> float:
    """Seconds an `ask` waits for another localchat using its chat (LOCALCHAT_SESSION_WAIT, default 600)."""
    raw = (os.environ if env is None else env).get(WAIT_ENV, "").strip()
    if not raw:
        return DEFAULT_WAIT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value <= 7 * 24 * 3600):
        raise UserError(f"{WAIT_ENV} must be a number of seconds from 0 to 604800 (got {raw[:40]!r}); "
                        f"unset it for the default of {DEFAULT_WAIT:g}")
    return value


class ChatLock:
    """The lock of chat `name` under `directory` (<data dir>/locks); `who` is "ask", "window" or "delete"."""

    def __init__(self, name: str, directory: Path, who: str = "ask"):
        self.name, self.who = name, who
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        self.path = Path(directory) / f"{digest}.lock"
        self.fd: int | None = None

    @property
    def held(self) -> bool:
        return self.fd is not None

    def holder(self) -> tuple[str, str]:
        """(who, pid) of the process holding it, as its file says (("", "") when unknown)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | NOFOLLOW)
        except OSError:
            return "", ""
        try:
            words = os.read(fd, 200).decode("utf-8", "replace").split()
        finally:
            os.close(fd)
        return (words[0], words[1]) if len(words) == 2 else ("", "")

    def _open(self) -> int:
        try:
            room(self.path.parent)
            return open_private(self.path, os.O_CREAT | os.O_RDWR)  # a link is refused, never truncated
        except OSError as exc:
            raise UserError(f"cannot lock chat {self.name!r} in {self.path.parent} ({exc.strerror or exc}); "
                            f"point LOCALCHAT_DATA_DIR at a writable folder") from None

    def _took(self, fd: int) -> None:
        self.fd = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{self.who} {os.getpid()}\n".encode(), 0)

    def try_acquire(self) -> bool:
        """Take it if free; False when another process holds it."""
        if self.held:
            return True
        fd = self._open()
        if try_lock(fd):
            self._took(fd)
            return True
        os.close(fd)
        return False

    def in_use(self) -> str:
        """One line saying who holds the chat, for messages."""
        who, pid = self.holder()
        if who == WINDOW:
            return f"chat {self.name!r} is open in the chat window of another localchat (pid {pid})"
        return f"chat {self.name!r} is in use by another localchat" + (f" (pid {pid})" if pid else "")

    def acquire(self, timeout: float, say: Callable[[str], None]) -> None:
        """Take it, waiting up to `timeout` seconds for another `ask`; UserError at once when the chat window holds
        it, or when the wait runs out. `say(line)` is called once when this starts to wait."""
        if self.try_acquire():
            return

        def window_holds():
            if self.holder()[0] == WINDOW:
                raise UserError(f"{self.in_use()}; ask there, or start another chat there (/new) and try again")

        window_holds()
        fd = self._open()
        say(f"waiting for another localchat using chat {self.name!r} to finish its answer "
            f"(up to {timeout:g} s, {WAIT_ENV} sets it) ...")
        try:
            taken = poll_lock(fd, time.monotonic() + timeout, window_holds)
        except BaseException:
            os.close(fd)
            raise
        if not taken:
            os.close(fd)
            raise UserError(f"{self.in_use()} after waiting {timeout:g} s, so this question was not asked; try "
                            f"again when it is done, or raise {WAIT_ENV}")
        self._took(fd)

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                os.ftruncate(fd, 0)  # nobody holds it now
            finally:
                os.close(fd)  # closing drops the lock
