"""Retaining heads for carded models from an official LOCRET release, kept converted in the user cache.

The official releases are whole models with the heads inside; `fetch_heads` reads only the heads' bytes.
"""

from __future__ import annotations

from pathlib import Path

from localchat import paths
from localchat.engine.cards import ModelCard
from localchat.engine.heads import CONFIG, WEIGHTS


def heads_cache_dir(card: ModelCard) -> Path:
    """Where the converted heads of `card`'s model live: <user cache>/heads/<card id>/."""
    return paths.cache_dir() / "heads" / card.id


def cached_heads(card: ModelCard) -> Path | None:
    """The cache directory when it holds complete converted heads (weights and config), else None."""
    directory = heads_cache_dir(card)
    return directory if (directory / WEIGHTS).is_file() and (directory / CONFIG).is_file() else None
