"""Re-rotating cached (post-RoPE) keys when their RoPE position changes.

RoPE is a rotation per frequency pair, so a key rotated at position p becomes the key at position
p + delta by one more rotation of angle delta * inv_freq. The model's own `inv_freq` (with any
llama3 / linear scaling already folded in) is used; the attention scaling of YaRN-style RoPE is not
applied again.
"""

from __future__ import annotations

import torch


def rope_inv_freq(model) -> torch.Tensor | None:
    """The `inv_freq` buffer of the model's rotary embedding, or None if it has none."""
    for module in model.modules():
        inv = getattr(module, "inv_freq", None)
        if isinstance(inv, torch.Tensor):
            return inv
    return None


def shift_keys(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate `keys` `[1, H, n, d]` by `delta` `[H, n]` positions (Llama's rotate-half layout), in fp32."""
    angles = delta.to(torch.float32)[None, :, :, None] * inv_freq.to(keys.device, torch.float32)  # [1,H,n,d/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)
    k = keys.to(torch.float32)
    half = k.shape[-1] // 2
    rotated = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
    return (k * cos + rotated * sin).to(keys.dtype)
