"""pip pointed at one index, for tests of the default model's fetch that run a real pip child."""

from __future__ import annotations

import os
import socket


def closed_port() -> int:
    """A loopback port nothing listens on: a connection to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pip_env(index: str, environ=os.environ) -> dict[str, str]:
    """`environ` where pip sees only `index`: no config files, find-links, extra indexes or cache of this machine
    (and no LOCALCHAT_DEFAULT_WHEEL, which skips pip)."""
    env = {k: v for k, v in environ.items() if not k.startswith("PIP_") and k != "LOCALCHAT_DEFAULT_WHEEL"}
    return env | {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": index, "PIP_NO_CACHE_DIR": "1"}


def pip_at(monkeypatch, index: str) -> None:
    """pip_env in this process's environment, for the test's duration."""
    for name in list(os.environ):
        if name.startswith("PIP_") or name == "LOCALCHAT_DEFAULT_WHEEL":
            monkeypatch.delenv(name)
    for name, value in pip_env(index, {}).items():
        monkeypatch.setenv(name, value)
