"""Retaining heads on disk: the weights and config file names, and the config reader (no torch: the command line
and the planner read them before any model loads)."""

from __future__ import annotations

import json
from pathlib import Path

from localchat.errors import UserError, first_line

WEIGHTS, CONFIG = "heads.safetensors", "heads.json"


def read_config(directory: Path) -> dict:
    """The heads' config (heads.json) as a dict; a missing, unreadable or non-object file is one UserError line."""

    try:
        config = json.loads((Path(directory) / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read retaining heads in {directory}: {first_line(exc, 160)}") \
            from None
    if not isinstance(config, dict):
        raise UserError(f"{Path(directory) / CONFIG} is not a heads config (a JSON object with shape and d_r); "
                        f"train or import the heads again")
    return config
