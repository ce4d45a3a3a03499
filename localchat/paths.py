"""Where localchat keeps things on disk (platformdirs), with LOCALCHAT_* overrides for tests and CI."""

from __future__ import annotations

import os
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
