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


def layer_inv_freqs(model, kinds) -> list[torch.Tensor | None]:
    """Each layer's RoPE `inv_freq` (None for a layer without RoPE): Gemma 3 keeps one per layer type
    (`sliding_attention_inv_freq`, `full_attention_inv_freq`), the others one for every layer."""
    types = getattr(model.config, "layer_types", None) or []
    per_type: dict[str, torch.Tensor] = {}
    for module in model.modules():
        for t in set(types):
            buf = getattr(module, f"{t}_inv_freq", None)
            if isinstance(buf, torch.Tensor):
                per_type.setdefault(t, buf)
    plain = rope_inv_freq(model)
    return [per_type.get(types[i] if i < len(types) else "", plain) if kind.rope else None
            for i, kind in enumerate(kinds)]
