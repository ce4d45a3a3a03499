"""What a result was measured on: hardware, library versions, peak memory."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

from localchat.planning.memory import cpu_model, max_rss_bytes  # noqa: F401 - device probes live in planning


def hardware() -> dict:
    cuda = torch.cuda.is_available()
    return {
        "cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if cuda else None, "platform": platform.platform(),
    }


def versions() -> dict:
    import transformers

    from localchat import __version__

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "localchat": __version__, "commit": source_commit()}


SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout holding localchat/ (site-packages for a wheel)


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source_commit(root: Path = SOURCE_ROOT) -> str | None:
    """The git commit the code runs from: "<sha>", or "<sha>+dirty" when files under localchat/ differ from it;
    None outside a git checkout (an installed wheel) or without git."""
    if not (root / ".git").exists():
        return None
    sha = _git(root, "rev-parse", "--short=12", "HEAD")
    if not sha:
        return None
    changed = _git(root, "status", "--porcelain", "--", "localchat")
    return sha + ("+dirty" if changed else "")


