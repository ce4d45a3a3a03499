"""The eviction step: which units each KV head keeps, and the gather of those units.

`select(priorities, keep)`: priorities `[H, n]` per layer (stabilizers and recent units already raised by the
policy) -> kept indices `[H, keep]` per layer, ascending (temporal order). Layers of the same shape are
stacked into one top-k and one sort instead of one pair per layer. Torch on every device: a top-k is
already one fused library call, so the batching over layers is the saving.

`gather_rotate(keys, values, idx, inv_freq)`: keys `[1, H, n, d]`, values `[1, H, n, dv]`, idx `[H, k]`
-> kept keys, values `[1, H, k, d]`, `[1, H, k, dv]` (new tensors). With `inv_freq` (compact positions), kept
key j moves from slot idx[j] to slot j: it is rotated by j - idx[j] positions (rotate-half RoPE, in fp32).
Triton: one program per (head, block of kept units) loads the rows, rotates and stores them (one pass
instead of gather, float copy, cos, sin, cat and multiply). The twin is an index_select per head + rope.shift_keys.

`gather_rotate_rest(keys, values, rest, idx, inv_freq)`: the same for half-precision keys that carry an int8
remainder `rest` `[1, H, n, d]` (kernels/keyrest.py): each kept key is rotated from its exact value `w + r *
step(w)` and split again into the nearest key and its remainder -> kept keys, values, remainders. The same
Triton kernel with the remainder loaded and stored beside the key; the twin is `rows` + keyrest.join +
shift_keys + keyrest.split.
"""

from __future__ import annotations

import torch

from localchat.kernels import keyrest, use_triton
from localchat.kernels.rope import shift_keys

BLOCK = 32


def select(priorities: list[torch.Tensor], keep: int) -> list[torch.Tensor]:
    if priorities and all(p.shape == priorities[0].shape for p in priorities):
        idx = torch.stack(priorities).topk(keep, dim=-1).indices.sort(dim=-1).values
        return list(idx.unbind(0))
    return [p.topk(keep, dim=-1).indices.sort(dim=-1).values for p in priorities]


def _whole(keys, inv_freq) -> bool:
    """True unless RoPE is partial (the Triton kernels rotate every dim of a head)."""
    return inv_freq is None or 2 * inv_freq.shape[-1] == keys.shape[-1]


def gather_rotate(keys, values, idx, inv_freq=None):
    if use_triton(keys) and _whole(keys, inv_freq):
        return gather_rotate_triton(keys, values, idx, inv_freq)
    return gather_rotate_torch(keys, values, idx, inv_freq)


def rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows `idx` `[H, k]` of each head of `t` `[1, H, n, w]` -> `[1, H, k, w]` (an index_select per head: on
    the CPU several times faster than torch.gather, which reads an index per element)."""
    return torch.stack([t[0, h].index_select(0, idx[h]) for h in range(idx.shape[0])])[None]


def gather_rotate_torch(keys, values, idx, inv_freq=None):
    kept_k, kept_v = rows(keys, idx), rows(values, idx)
    if inv_freq is not None:
        delta = torch.arange(idx.shape[-1], device=idx.device)[None, :] - idx
        kept_k = shift_keys(kept_k, delta, inv_freq)
    return kept_k, kept_v


def gather_rotate_rest(keys, values, rest, idx, inv_freq):
    if use_triton(keys) and _whole(keys, inv_freq):
        return gather_rotate_triton(keys, values, idx, inv_freq, rest)
    return gather_rotate_rest_torch(keys, values, rest, idx, inv_freq)


def gather_rotate_rest_torch(keys, values, rest, idx, inv_freq):
    exact = keyrest.join(rows(keys, idx), rows(rest, idx))
    delta = torch.arange(idx.shape[-1], device=idx.device)[None, :] - idx
    kept_k, kept_r = keyrest.split(shift_keys(exact, delta, inv_freq), keys.dtype)
    return kept_k, rows(values, idx), kept_r


_KERNEL = None


def gather_rotate_triton(keys, values, idx, inv_freq=None, rest=None):
    """(keys, values), or (keys, values, remainders) when `rest` is given (then `inv_freq` must be too)."""
    global _KERNEL
    import triton

    if _KERNEL is None:
        from localchat.kernels import _evict_triton

        _KERNEL = _evict_triton.gather_rotate_kernel
    h, k = idx.shape
    d, dv = keys.shape[-1], values.shape[-1]
    out_k = keys.new_empty((1, h, k, d))
    out_v = values.new_empty((1, h, k, dv))
    with_rest = rest is not None
    out_r = rest.new_empty((1, h, k, d)) if with_rest else out_k
    if k == 0:
        return (out_k, out_v, out_r) if with_rest else (out_k, out_v)
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or (with_rest and rest.stride(-1) != 1):
        raise ValueError("keys, values and remainders must be contiguous along head_dim")
    idx = idx.contiguous()
    rotate = inv_freq is not None
    if with_rest and not rotate:
        raise ValueError("a remainder is only carried through a rotation")
    inv = inv_freq.to(keys.device, torch.float32).contiguous() if rotate else idx
    info = torch.finfo(keys.dtype)
    r_in = rest if with_rest else keys
    _KERNEL[(h, triton.cdiv(k, BLOCK))](
        keys, values, r_in, idx, inv, out_k, out_v, out_r, k,
        keys.stride(1), keys.stride(2), values.stride(1), values.stride(2), r_in.stride(1), r_in.stride(2),
        idx.stride(0), out_k.stride(1), out_k.stride(2), out_v.stride(1), out_v.stride(2),
        out_r.stride(1), out_r.stride(2), info.smallest_normal, info.eps / keyrest.STEPS,
        D=d, D_PAD=triton.next_power_of_2(d), DV=dv, DV_PAD=triton.next_power_of_2(dv), ROTATE=rotate,
        REST=with_rest, BF16=keys.dtype == torch.bfloat16, LIMIT=keyrest.LIMIT, BLOCK=BLOCK,
    )
    return (out_k, out_v, out_r) if with_rest else (out_k, out_v)
