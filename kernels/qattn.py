"""Decode attention over the quantized retained cache, dequantizing on the fly.

Inputs (the layout of engine/qcache.py; H = KV heads, Hq = query heads, d = head_dim, g = group size):
  query   `[1, Hq, 1, d]` (post-RoPE)            quant   {"qk", "qv": uint8 `[1, H, nq, d*bits/8]`,
  tail_k, tail_v `[1, H, nt, d]` full precision            "ks", "kz", "vs", "vz": fp16 `[1, H, nq, d/g]`}
  inv_freq `[d/2]` or None: when given, quantized key i is stored un-rotated and sits at RoPE position i (its slot).
Output `[1, 1, Hq, d]` in the query's dtype (transformers' attention-function layout).

Triton: a flash-decoding kernel. Program (query head, split) walks its split of the nq units in blocks:
unpack codes, scale + zero per group, rotate keys by their slot (cos/sin computed in the kernel), online
softmax, accumulate values; it writes a partial output and its log-sum-exp. The tail (a few hundred units
at most, full precision) is attended in torch and merged with the partials by their log-sum-exps.
The twin dequantizes the whole quantized part and runs plain softmax attention in fp32.
"""

from __future__ import annotations

import torch

from localchat.kernels import use_triton

BLOCK = 64  # units per inner step
MIN_SPLIT = 128  # units per program, at least


def decode_attention(query, quant, tail_k, tail_v, bits: int, group: int, scaling: float, inv_freq=None):
    if use_triton(query):
        return decode_attention_triton(query, quant, tail_k, tail_v, bits, group, scaling, inv_freq)
    return decode_attention_torch(query, quant, tail_k, tail_v, bits, group, scaling, inv_freq)


# --- the twin ----------------------------------------------------------------------------------------------


def dequantized_keys_values(quant, bits: int, group: int, inv_freq=None):
    """fp32 keys (rotated to their slots when `inv_freq` is given) and values `[1, H, nq, d]`."""
    from localchat.engine.qcache import _rotate, dequantize, rope_table

    keys = dequantize(quant["qk"], quant["ks"], quant["kz"], bits, group)
    if inv_freq is not None:
        cos, sin = rope_table(torch.arange(keys.shape[-2], device=keys.device), inv_freq)
        keys = _rotate(keys, cos, sin)
    return keys, dequantize(quant["qv"], quant["vs"], quant["vz"], bits, group)


def decode_attention_torch(query, quant, tail_k, tail_v, bits, group, scaling, inv_freq=None):
    keys, values = dequantized_keys_values(quant, bits, group, inv_freq)
    keys = torch.cat([keys, tail_k.float()], dim=-2)[0]  # [H, n, d]
    values = torch.cat([values, tail_v.float()], dim=-2)[0]
    h_q, h = query.shape[1], keys.shape[0]
    q = query[0, :, -1].float().reshape(h, h_q // h, -1)  # [H, G, d]
    probs = torch.softmax(torch.einsum("hgd,hnd->hgn", q, keys) * scaling, dim=-1)
    out = torch.einsum("hgn,hnd->hgd", probs, values).reshape(1, 1, h_q, -1)
    return out.to(query.dtype)


# --- Triton ------------------------------------------------------------------------------------------------

_KERNEL = None


def _kernel():
    """The Triton kernel, defined at first use (so TRITON_INTERPRET set by a test before that is honoured)."""
    global _KERNEL
    if _KERNEL is None:
        from localchat.kernels import _qattn_triton

        _KERNEL = _qattn_triton.qattn_split_kernel
    return _KERNEL


def _partials(query, quant, bits, group, scaling, inv_freq):
    """Partial outputs `[Hq, S, d]` fp32 and log-sum-exps `[Hq, S]` over the quantized part, S splits."""
    import triton

    h_q, d = query.shape[1], query.shape[-1]
    kc, vc = quant["qk"], quant["qv"]
    h, nq = kc.shape[1], kc.shape[2]
    splits = max(1, min(triton.cdiv(nq, MIN_SPLIT), 64))
    per_split = triton.cdiv(triton.cdiv(nq, splits), BLOCK) * BLOCK
    splits = triton.cdiv(nq, per_split)
    q = query[0, :, -1].float().contiguous()  # [Hq, d]
    out = torch.empty((h_q, splits, d), device=query.device, dtype=torch.float32)
    lse = torch.empty((h_q, splits), device=query.device, dtype=torch.float32)
    rotate = inv_freq is not None
    inv = inv_freq.to(query.device, torch.float32).contiguous() if rotate else q  # unused when not rotating
    ks, kz, vs, vz = quant["ks"], quant["kz"], quant["vs"], quant["vz"]
    for t in (kc, vc, ks, kz, vs, vz):
        if t.stride(-1) != 1:
            raise ValueError("quantized cache tensors must be contiguous along their last axis")
    _kernel()[(h_q, splits)](
        q, kc, ks, kz, vc, vs, vz, inv, out, lse,
        nq, per_split, float(scaling),
        kc.stride(1), kc.stride(2), vc.stride(1), vc.stride(2),
        ks.stride(1), ks.stride(2), kz.stride(1), kz.stride(2),
        vs.stride(1), vs.stride(2), vz.stride(1), vz.stride(2),
        Q_PER_KV=h_q // h, D=d, D_PAD=triton.next_power_of_2(d), BITS=bits, G=group, ROTATE=rotate, BLOCK=BLOCK,
    )
    return out, lse


def _tail(query, tail_k, tail_v, scaling):
    """Output `[Hq, 1, d]` and log-sum-exp `[Hq, 1]` over the full-precision tail."""
    h_q, h = query.shape[1], tail_k.shape[1]
    q = query[0, :, -1].float().reshape(h, h_q // h, -1)
    logits = torch.einsum("hgd,hnd->hgn", q, tail_k[0].float()) * scaling
    lse = torch.logsumexp(logits, dim=-1)  # [H, G]
    out = torch.einsum("hgn,hnd->hgd", torch.exp(logits - lse[..., None]), tail_v[0].float())
    return out.reshape(h_q, 1, -1), lse.reshape(h_q, 1)


def merge(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Softmax-weighted merge of partial attentions: `[Hq, S, d]`, `[Hq, S]` -> `[Hq, d]`."""
    w = torch.softmax(lses, dim=-1)
    return (outs * w[..., None]).sum(dim=1)


def decode_attention_triton(query, quant, tail_k, tail_v, bits, group, scaling, inv_freq=None):
    h_q = query.shape[1]
    parts, lses = [], []
    if quant["qk"].shape[2] > 0:
        out, lse = _partials(query, quant, bits, group, scaling, inv_freq)
        parts.append(out)
        lses.append(lse)
    if tail_k.shape[2] > 0:
        out, lse = _tail(query, tail_k, tail_v, scaling)
        parts.append(out)
        lses.append(lse)
    if not parts:
        raise ValueError("decode attention over an empty cache")
    return merge(torch.cat(parts, dim=1), torch.cat(lses, dim=1)).reshape(1, 1, h_q, -1).to(query.dtype)
