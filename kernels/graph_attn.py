"""Decode attention for a captured decode step (engine/graph_step.py): every shape at the cache's capacity and
the lengths in device memory, so one CUDA graph serves a step at any length.

Inputs (H = KV heads, Hq = query heads, C = the cache's capacity in units, T = the tail's):
  query   `[1, Hq, 1, d]` post-RoPE
  main    the plain cache's keys and values `{"k", "v": [1, H, C, d]}` (bits 0), or the quantized part's buffers
          (engine/qcache.py's QUANT_KEYS -> `[1, H, C, ...]`)
  tail_k, tail_v  `[1, H, T, d]` full precision (the quantized cache's tail; None for the plain cache)
  lens    int32 `[2]` on the device: units held in `main` and in the tail (slots past them are never read)
  inv_freq  `[d/2]` or None: quantized key i is stored un-rotated and sits at RoPE position i (compact positions)
  split   the Triton kernel's settings (kernels/qattn.py `Split`; default the engine's); the twin ignores them
Output `[1, 1, Hq, d]` in the query's dtype.

Triton: kernels/_qattn_triton.py's split kernel with `LENS` (its grid planned for C, a split past the units held
reads nothing) and its merge. The twin masks the slots past each length (any content there, NaN included, is
ignored) and is the reference of the tests.
"""

from __future__ import annotations

import torch

from localchat.kernels import use_triton
from localchat.kernels.qattn import dequantized_keys_values, split_attention


def attention(query, main, tail_k, tail_v, lens, bits: int, group: int, scaling: float, inv_freq=None, split=None):
    if use_triton(query):
        return attention_triton(query, main, tail_k, tail_v, lens, bits, group, scaling, inv_freq, split)
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


def attention_triton(query, main, tail_k, tail_v, lens, bits, group, scaling, inv_freq=None, split=None):
    if bits:
        packed = [main[name] for name in ("qk", "ks", "kz", "qv", "vs", "vz")]
    else:
        packed = [main["k"], main["k"], main["k"], main["v"], main["v"], main["v"]]  # scales, zeros: not read
    if tail_k is None:  # the plain cache: the tail program finds 0 units (lens[1])
        tail_k, tail_v = main["k"], main["v"]
    return split_attention(query, packed, tail_k, tail_v, bits, group, scaling, inv_freq, packed[0].shape[2], lens,
                           split)
