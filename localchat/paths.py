"""Where localchat keeps things on disk (platformdirs), with LOCALCHAT_* overrides for tests and CI."""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Callable
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


PARTIAL = "partial"  # DIR/partial/: files being written; an old one in it was left by a killed write
SAFETENSORS_TMP = re.compile(r"\.tmp[0-9A-Za-z]{6}")  # safetensors' own temporary file, beside its target


def _entries(directory: Path) -> list[os.DirEntry]:
    try:
        return list(os.scandir(directory))
    except OSError:
        return []


def collect_partial(directory: Path, ours: Callable[[str], bool], older_than: float) -> int:
    """Remove what killed writes left: the regular files in `directory`/partial/ and the files in `directory` whose
    names `ours` accepts, when last written over `older_than` seconds ago (a younger one may be a write in
    progress). Never through a symlink, and only a real partial/ directory is looked into. Returns how many went."""
    found = [e for e in _entries(directory) if ours(e.name)]
    try:
        if stat.S_ISDIR((directory / PARTIAL).lstat().st_mode):
            found += _entries(directory / PARTIAL)
    except OSError:
        pass
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
