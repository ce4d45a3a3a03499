"""Decode attention for a captured decode step (engine/graph_step.py): every shape at the cache's capacity and
the lengths in device memory, so one CUDA graph serves a step at any length.

Inputs (H = KV heads, Hq = query heads, C = the cache's capacity in units, T = the tail's):
  query   `[1, Hq, 1, d]` post-RoPE
  main    the plain cache's keys and values `{"k", "v": [1, H, C, d]}` (bits 0), or the quantized part's buffers
          (engine/qcache.py's QUANT_KEYS -> `[1, H, C, ...]`)
  tail_k, tail_v  `[1, H, T, d]` full precision (the quantized cache's tail; None for the plain cache)
  lens    int32 `[2]` on the device: units held in `main` and in the tail (slots past them are never read)
  inv_freq  `[d/2]` or None: quantized key i is stored un-rotated and sits at RoPE position i (compact positions)
Output `[1, 1, Hq, d]` in the query's dtype.

Triton: kernels/_qattn_triton.py's split kernel with `LENS` (its grid planned for C, a split past the units held
reads nothing) and its merge. The twin masks the slots past each length (any content there, NaN included, is
ignored) and is the reference of the tests.
"""

from __future__ import annotations

import torch

from localchat.kernels import use_triton
from localchat.kernels.qattn import _kernels, dequantized_keys_values, plan_splits


def attention(query, main, tail_k, tail_v, lens, bits: int, group: int, scaling: float, inv_freq=None):
    if use_triton(query):
        return attention_triton(query, main, tail_k, tail_v, lens, bits, group, scaling, inv_freq)
    return attention_torch(query, main, tail_k, tail_v, lens, bits, group, scaling, inv_freq)


def _masked(x: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `[1, H, C, d]` fp32 with slots from `count` on zeroed, and the mask of the slots before it `[C]`."""
    live = torch.arange(x.shape[2], device=x.device) < count
    return torch.where(live[:, None], x.float(), 0.0), live


def attention_torch(query, main, tail_k, tail_v, lens, bits, group, scaling, inv_freq=None):
    if bits:
        keys, values = dequantized_keys_values(main, bits, group, inv_freq)
    else:
        keys, values = main["k"], main["v"]
    keys, live = _masked(keys, lens[0])
    values, _ = _masked(values, lens[0])
    if tail_k is not None:
        tk, tail_live = _masked(tail_k, lens[1])
        tv, _ = _masked(tail_v, lens[1])
        keys, values = torch.cat((keys, tk), dim=2), torch.cat((values, tv), dim=2)
        live = torch.cat((live, tail_live))
    h, h_q = keys.shape[1], query.shape[1]
    q = query[0, :, -1].float().reshape(h, h_q // h, -1)  # [H, G, d]
    scores = torch.einsum("hgd,hnd->hgn", q, keys[0]) * scaling
    probs = torch.softmax(scores.masked_fill(~live, float("-inf")), dim=-1)
    out = torch.einsum("hgn,hnd->hgd", probs, values[0]).reshape(1, 1, h_q, -1)
    return out.to(query.dtype)


def attention_triton(query, main, tail_k, tail_v, lens, bits, group, scaling, inv_freq=None):
    import triton

    k = _kernels()
    h_q, d = query.shape[1], query.shape[-1]
    if bits:
        kc, vc, ks, kz, vs, vz = (main[name] for name in ("qk", "qv", "ks", "kz", "vs", "vz"))
    else:
        kc, vc = main["k"], main["v"]
        ks = kz = vs = vz = kc  # not read
    if tail_k is None:  # the plain cache: the tail program finds 0 units (lens[1])
        tail_k, tail_v = kc, vc
    h, capacity = kc.shape[1], kc.shape[2]
    for t in (kc, vc, ks, kz, vs, vz, tail_k, tail_v, query):
        if t.stride(-1) != 1:
            raise ValueError("decode attention needs tensors contiguous along their last axis")
    d_pad = triton.next_power_of_2(d)
    block = 64 if d_pad <= 64 else 32
    splits, per_split = plan_splits(capacity, h_q, block)
    programs = splits + 1
    parts = torch.empty((h_q, programs, d), device=query.device, dtype=torch.float32)
    lse = torch.empty((h_q, programs), device=query.device, dtype=torch.float32)
    rotate = inv_freq is not None and bits > 0
    inv = inv_freq.to(query.device, torch.float32) if rotate else lse
    k.qattn_split_kernel[(h_q, programs)](
        query, kc, ks, kz, vc, vs, vz, tail_k, tail_v, inv, parts, lse, lens,
        0, 0, per_split, float(scaling), query.stride(1),
        kc.stride(1), kc.stride(2), vc.stride(1), vc.stride(2), ks.stride(1), ks.stride(2), kz.stride(1),
        kz.stride(2), vs.stride(1), vs.stride(2), vz.stride(1), vz.stride(2),
        tail_k.stride(1), tail_k.stride(2), tail_v.stride(1), tail_v.stride(2),
        Q_PER_KV=h_q // h, D=d, D_PAD=d_pad, BITS=bits, G=group, ROTATE=rotate, BLOCK=block, LENS=True,
    )
    out = torch.empty((1, 1, h_q, d), device=query.device, dtype=query.dtype)
    k.merge_kernel[(h_q,)](parts, lse, out, programs, D=d, D_PAD=d_pad, P_PAD=triton.next_power_of_2(programs))
    return out
