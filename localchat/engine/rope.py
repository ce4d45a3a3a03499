"""The model's RoPE frequencies; the rotations themselves are in kernels/rope.py (re-exported here)."""

from __future__ import annotations

import torch

from localchat.kernels.rope import rope_table, rotate, shift_keys  # noqa: F401 - the engine's RoPE helpers


def rope_inv_freq(model) -> torch.Tensor | None:
    """The `inv_freq` buffer of the model's rotary embedding, or None if it has none."""
    for module in model.modules():
        inv = getattr(module, "inv_freq", None)
        if isinstance(inv, torch.Tensor):
            return inv
    return None
