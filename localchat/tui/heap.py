"""Keep the garbage collector out of the chat: the objects alive once the model has loaded (torch, transformers,
the model: about 400K) are frozen out of later collections. A full collection over them holds the GIL about
0.3 s on a laptop core, a visible stall of the window; the chat's own objects are collected as usual."""

from __future__ import annotations

import gc


def freeze() -> None:
    """Collect once, then leave every object alive now out of later collections."""
    gc.collect()
    gc.freeze()


def unfreeze() -> None:
    gc.unfreeze()
