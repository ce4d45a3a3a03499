"""RoPE on cached keys (rotate-half layout, fp32 math), shared by the engine's caches and the kernels' twins.

RoPE is a rotation per frequency pair, so a key rotated at position p becomes the key at position
p + delta by one more rotation of angle delta * inv_freq. The model's own `inv_freq` (with any
llama3 / linear scaling already folded in) is used; the attention scaling of YaRN-style RoPE is not
applied again. Partial RoPE (Qwen3-Next: only the first 2 * len(inv_freq) dims of a head rotate) leaves the
other dims as they are.
"""

from __future__ import annotations

import torch


def rotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half layout) of `keys` `[1, H, n, d]` with `cos`/`sin` `[n, r]` or `[H, n, r]`, in fp32; with
    r < d only the first r dims rotate (partial RoPE)."""
    k = keys.float()
    r = cos.shape[-1]
    if r < k.shape[-1]:
        return torch.cat([rotate(k[..., :r], cos, sin), k[..., r:]], dim=-1)
    half = k.shape[-1] // 2
    return k * cos + torch.cat([-k[..., half:], k[..., :half]], dim=-1) * sin


def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[*positions.shape, d]` fp32 for integer `positions`."""
    angles = positions.float()[..., None] * inv_freq.to(positions.device, torch.float32)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def shift_keys(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate `keys` `[1, H, n, d]` by `delta` `[H, n]` positions (Llama's rotate-half layout), in fp32.
    Each half is written in place from half-width cos/sin (no full-width tables, no concatenations)."""
    r = 2 * inv_freq.shape[-1]
    if r < keys.shape[-1]:  # partial RoPE: the other dims stay
        out = keys.clone()
        out[..., :r] = shift_keys(keys[..., :r], delta, inv_freq)
        return out
    angles = delta.to(torch.float32)[None, :, :, None] * inv_freq.to(keys.device, torch.float32)  # [1,H,n,d/2]
    cos, sin = angles.cos(), angles.sin()
    k = keys.to(torch.float32)
    half = k.shape[-1] // 2
    x1, x2 = k[..., :half], k[..., half:]
    out = torch.empty_like(k)
    torch.mul(x1, cos, out=out[..., :half]).addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
    torch.mul(x2, cos, out=out[..., half:]).addcmul_(x1, sin)  # x2 cos + x1 sin
    return out.to(keys.dtype)
