"""While the window runs on a terminal, file descriptors 1 and 2 lead to a log file and the window draws on
a copy of the terminal: what child processes (pip) and C libraries write never lands on the screen."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

LOG_LIMIT = 1 << 20  # a longer log starts afresh


@contextmanager
def window_only(log: Path):
    """Fds 1 and 2 to `log` (appended) inside the block, sys.stdout/stderr (and their __dunder__ twins, which
    Textual draws on) to copies of the terminal; all as before afterwards. Nothing changes off a terminal."""
    try:
        on_terminal = sys.__stdout__ is not None and os.isatty(sys.__stderr__.fileno())
    except (AttributeError, OSError, ValueError):  # no real stderr (embedded, tests)
        on_terminal = False
    if not on_terminal:
        yield
        return
    streams = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    for stream in streams:
        stream.flush()
    saved = (os.dup(1), os.dup(2))
    out, err = (os.fdopen(os.dup(fd), "w", buffering=1, encoding=stream.encoding, errors="backslashreplace")
                for fd, stream in ((1, sys.__stdout__), (2, sys.__stderr__)))
    log.parent.mkdir(parents=True, exist_ok=True)
    fresh = not log.exists() or log.stat().st_size > LOG_LIMIT
    with open(log, "wb" if fresh else "ab") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    sys.stdout = sys.__stdout__ = out
    sys.stderr = sys.__stderr__ = err
    try:
        yield
    finally:
        out.flush()
        err.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__ = streams
        out.close()
        err.close()
