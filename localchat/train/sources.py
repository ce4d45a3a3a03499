"""Python source code for training prompts: standard-library `.py` files of one corpus split.

The same module split as localchat.bench.corpus (`split_of`), so code from "eval" modules (and the
docstrings inside it) never reaches training. Files are found with importlib's spec lookup, without
importing them.
"""

from __future__ import annotations

import functools
import importlib.util
import random
import sys

from localchat.bench.corpus import SKIP, split_of


@functools.lru_cache(maxsize=2)
def _files(split: str) -> tuple[str, ...]:
    found = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIP or split_of(name) != split:
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec and spec.origin and spec.origin.endswith(".py"):
            found.append(spec.origin)
    return tuple(found)


def source_text(split: str, n_chars: int, seed: int) -> str:
    """About `n_chars` characters of whole-line source from `split`'s modules, in a seeded order."""
    files = list(_files(split))
    random.Random(f"src:{split}:{seed}").shuffle(files)
    parts, size = [], 0
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        parts.append(f"# file: {path.rsplit('/', 1)[-1]}\n{text}")
        size += len(parts[-1])
        if size >= n_chars:
            break
    joined = "\n".join(parts)[:n_chars]
    return joined[: joined.rfind("\n") + 1] if "\n" in joined else joined
