"""The data directory's files stay inside it: no link is followed, and its rooms are the owner's only.

Chats hold whole documents, and every file localchat writes, truncates or deletes in the data directory is named
by it. A symbolic link there (or a hard link to a file written in place) would send those writes outside, so
`check_rooms` refuses any it finds, in one line, before anything is opened; the files are also opened with
O_NOFOLLOW, so a link made after the check is refused too. The rooms localchat makes are 0700; a data
directory that already exists and is open to others is named in a warning, never chmod-ed behind the user's back.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from localchat.errors import UserError

DB_FILES = ("chats.sqlite3", "chats.sqlite3-journal", "chats.sqlite3-wal", "chats.sqlite3-shm")
ROOMS = ("caches", "caches/partial", "locks", "journal")  # folders localchat owns inside the data directory
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def link_error(path: Path, hard: bool = False) -> UserError:
    what = "is a hard link to a file elsewhere" if hard else "is a symbolic link"
    return UserError(f"{path} {what}; localchat follows no links inside its data directory, so nothing was done: "
                     f"remove {path.name} (what it links to is not touched) and try again")


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return path.lstat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UserError(f"cannot read {path} ({exc.strerror or exc}); point LOCALCHAT_DATA_DIR at a folder of "
                        f"yours") from None


def _check_file(path: Path, st: os.stat_result | None) -> None:
    if st is not None and (stat.S_ISLNK(st.st_mode) or (stat.S_ISREG(st.st_mode) and st.st_nlink > 1)):
        raise link_error(path, hard=not stat.S_ISLNK(st.st_mode))


def _folder(path: Path) -> os.stat_result | None:
    """lstat of the room `path` (None when missing); UserError when a link or something other than a folder."""
    st = _lstat(path)
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise link_error(path)
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise UserError(f"{path} is not a folder; move it aside and localchat makes its own")
    return st


def check_rooms(data: Path) -> None:
    """UserError when the database files, a room, or anything in a room is a symbolic link, or a file there is
    hard-linked elsewhere."""
    for name in DB_FILES:
        _check_file(data / name, _lstat(data / name))
    for room in ROOMS:
        if _folder(data / room) is None:
            continue
        try:
            entries = list(os.scandir(data / room))
        except OSError:
            continue
        for entry in entries:
            _check_file(Path(entry.path), entry.stat(follow_symlinks=False))


def room(path: Path) -> Path:
    """The folder `path` inside the data directory, made 0700 if missing; a link or a file there is refused."""
    st = _folder(path)
    try:
        if st is None:
            path.mkdir(mode=0o700)
        elif stat.S_IMODE(st.st_mode) & 0o077:
            path.chmod(0o700)  # a room of localchat's own, made wider by an earlier version
    except FileExistsError:  # made by another process just now
        return room(path)
    except OSError as exc:
        raise UserError(f"cannot use {path} as a folder ({exc.strerror or exc}); point LOCALCHAT_DATA_DIR at a "
                        f"writable folder") from None
    return path


def open_private(path: Path, flags: int) -> int:
    """os.open(path, flags | O_NOFOLLOW, 0o600), refusing a link (symbolic, or a hard link to a file elsewhere)."""
    try:
        fd = os.open(path, flags | NOFOLLOW, 0o600)
    except OSError:
        st = _lstat(path)
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise link_error(path) from None
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise UserError(f"{path} is not a file; move it aside and try again") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{path} is not a file; move it aside and try again")
        raise link_error(path, hard=True)
    return fd


def open_warning(data: Path) -> str | None:
    """One line when the data directory can be read or entered by other users (it holds whole documents)."""
    try:
        mode = stat.S_IMODE(data.stat().st_mode)
    except OSError:
        return None
    if not mode & 0o077 or os.name != "posix":
        return None
    return (f"the data directory {data} is open to other users (mode {mode:o}) and chats hold whole documents; "
            f"`chmod 700 {data}` keeps them yours")
