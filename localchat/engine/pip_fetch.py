"""pip as a quiet child process: what it prints is kept (for an error message), never shown, and the bytes it
has downloaded so far are counted in its temporary directory, for a progress display."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SIZE = re.compile(r"Downloading \S+ \(([\d.]+) (kB|MB|GB)\)")
UNITS = {"kB": 10**3, "MB": 10**6, "GB": 10**9}
REFUSED = re.compile(r"after connection broken by '\w+\('?(?:<[^>]*>: )?(.+?)'?\)'")


@dataclass
class PipRun:
    code: int
    output: str  # stdout and stderr together


class PipOutput(Exception):
    """What a failed pip run printed, chained under the one-line error (shown with --debug)."""


def run_pip(args: list[str], scratch: Path, progress: Callable[[int, int], None] = lambda done, total: None,
            every_s: float = 0.5) -> PipRun:
    """`python -m pip ARGS` with its output captured. `progress(done, total)`: bytes downloaded so far (pip
    writes a download into its temporary directory, here under `scratch`) and the size pip announced (0 until
    then), every `every_s` while they change."""
    tmp = scratch / "pip-tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmp), TEMP=str(tmp), TMP=str(tmp), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        last = (0, 0)
        while True:
            try:
                proc.wait(timeout=every_s)
                break
            except subprocess.TimeoutExpired:
                now = (bytes_under(tmp), announced(lines))
                if now != last and now[0]:
                    progress(*now)
                    last = now
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=5)
        shutil.rmtree(tmp, ignore_errors=True)
    return PipRun(proc.returncode, "".join(lines))


def bytes_under(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:  # moved away meanwhile
                pass
    return total


def announced(lines: list[str]) -> int:
    """The size in pip's "Downloading NAME (93.0 MB)" line, in bytes; 0 before it."""
    for line in list(lines):
        found = SIZE.search(line)
        if found:
            return int(float(found.group(1)) * UNITS[found.group(2)])
    return 0


def what_failed(output: str) -> str:
    """The line of pip's output that says what went wrong: a connection it could not make, else its first
    error, else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        found = REFUSED.search(line)
        if found:
            return found.group(1)[:200]
    for line in lines:
        if line.startswith("ERROR:"):
            return line.removeprefix("ERROR:").strip()[:200]
    return lines[-1][:200] if lines else "it printed nothing"
