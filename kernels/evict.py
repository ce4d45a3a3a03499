"""The eviction step: which units each KV head keeps, and the gather of those units.

`select(priorities, keep)`: priorities `[H, n]` per layer (stabilizers and recent units already raised by the
policy) -> kept indices `[H, keep]` per layer, ascending (temporal order). Layers of the same shape are
stacked into one top-k and one sort instead of one pair per layer. Torch on every device: a top-k is
already one fused library call, so the batching over layers is the saving.

`gather_rotate(keys, values, idx, inv_freq)`: keys `[1, H, n, d]`, values `[1, H, n, dv]`, idx `[H, k]`
-> kept keys, values `[1, H, k, d]`, `[1, H, k, dv]` (new tensors). With `inv_freq` (compact positions), kept
key j moves from slot idx[j] to slot j: it is rotated by j - idx[j] positions (rotate-half RoPE, in fp32).
Triton: one program per (head, block of kept units) loads the rows, rotates and stores them (one pass
instead of gather, float copy, cos, sin, cat and multiply). The twin is torch.gather + rope.shift_keys.
"""

from __future__ import annotations

import torch

from localchat.kernels import use_triton
from localchat.kernels.rope import shift_keys

BLOCK = 32


def select(priorities: list[torch.Tensor], keep: int) -> list[torch.Tensor]:
    if priorities and all(p.shape == priorities[0].shape for p in priorities):
        idx = torch.stack(priorities).topk(keep, dim=-1).indices.sort(dim=-1).values
        return list(idx.unbind(0))
    return [p.topk(keep, dim=-1).indices.sort(dim=-1).values for p in priorities]


def gather_rotate(keys, values, idx, inv_freq=None):
    if use_triton(keys):
        return gather_rotate_triton(keys, values, idx, inv_freq)
    return gather_rotate_torch(keys, values, idx, inv_freq)


def gather_rotate_torch(keys, values, idx, inv_freq=None):
    rows = idx[None, :, :, None]
    kept_k = torch.gather(keys, 2, rows.expand(-1, -1, -1, keys.shape[-1]))
    kept_v = torch.gather(values, 2, rows.expand(-1, -1, -1, values.shape[-1]))
    if inv_freq is not None:
        delta = torch.arange(idx.shape[-1], device=idx.device)[None, :] - idx
        kept_k = shift_keys(kept_k, delta, inv_freq)
    return kept_k, kept_v


_KERNEL = None


def gather_rotate_triton(keys, values, idx, inv_freq=None):
    global _KERNEL
    import triton

    if _KERNEL is None:
        from localchat.kernels import _evict_triton

        _KERNEL = _evict_triton.gather_rotate_kernel
    h, k = idx.shape
    d, dv = keys.shape[-1], values.shape[-1]
    out_k = keys.new_empty((1, h, k, d))
    out_v = values.new_empty((1, h, k, dv))
    if k == 0:
        return out_k, out_v
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("keys and values must be contiguous along head_dim")
    idx = idx.contiguous()
    rotate = inv_freq is not None
    inv = inv_freq.to(keys.device, torch.float32).contiguous() if rotate else idx
    _KERNEL[(h, triton.cdiv(k, BLOCK))](
        keys, values, idx, inv, out_k, out_v, k,
        keys.stride(1), keys.stride(2), values.stride(1), values.stride(2), idx.stride(0),
        out_k.stride(1), out_k.stride(2), out_v.stride(1), out_v.stride(2),
        D=d, D_PAD=triton.next_power_of_2(d), DV=dv, DV_PAD=triton.next_power_of_2(dv), ROTATE=rotate, BLOCK=BLOCK,
    )
    return out_k, out_v
