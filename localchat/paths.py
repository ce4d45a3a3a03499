"""Where localchat keeps things on disk (platformdirs), with LOCALCHAT_* overrides for tests and CI."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import platformdirs

APP = "localchat"


def _dir(env: str, default: str, private: bool = False) -> Path:
    """The directory (made if missing); `private`: made 0700 (chats hold whole documents)."""
    path = Path(os.environ.get(env) or default).expanduser()
    try:
        if private and not path.exists():
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(0o700)
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file in the way, no permission, a read-only disk
        from localchat.errors import UserError

        where = f"{env}={path}" if os.environ.get(env) else str(path)
        raise UserError(f"cannot use {where} as a directory ({exc.strerror or exc}); point {env} at a directory") from None
    return path


def cache_dir() -> Path:
    """Model downloads and converted weights."""
    return _dir("LOCALCHAT_CACHE_DIR", platformdirs.user_cache_dir(APP))


def data_dir() -> Path:
    """Chats and saved compressed sessions."""
    return _dir("LOCALCHAT_DATA_DIR", platformdirs.user_data_dir(APP), private=True)


def config_dir() -> Path:
    """config.toml and tuned profiles."""
    return _dir("LOCALCHAT_CONFIG_DIR", platformdirs.user_config_dir(APP))


def entries(directory: Path) -> list[os.DirEntry]:
    """What is in `directory`; [] when it is missing or unreadable."""
    try:
        return list(os.scandir(directory))
    except OSError:
        return []


def is_real_dir(path: Path) -> bool:
    """A directory, not a symlink to one."""
    try:
        return stat.S_ISDIR(path.lstat().st_mode)
    except OSError:
        return False


def remove_old_files(found: list[os.DirEntry], older_than: float) -> int:
    """Unlink the regular files (never through a symlink) last written over `older_than` seconds ago; how many."""
    cutoff = time.time() - older_than
    removed = 0
    for entry in found:
        try:
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff:
                os.unlink(entry.path)
                removed += 1
        except OSError:  # gone already (another process collected it), or not ours to remove
            continue
    return removed
