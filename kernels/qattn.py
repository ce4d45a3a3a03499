"""Decode attention over the quantized retained cache, dequantizing on the fly.

Inputs (the layout of engine/qcache.py; H = KV heads, Hq = query heads, d = head_dim, g = group size):
  query   `[1, Hq, 1, d]` (post-RoPE)            quant   {"qk", "qv": uint8 `[1, H, nq, d*bits/8]`,
  tail_k, tail_v `[1, H, nt, d]` full precision            "ks", "kz", "vs", "vz": fp16 `[1, H, nq, d/g]`}
  inv_freq `[d/2]` or None: when given, quantized key i is stored un-rotated and sits at RoPE position i (its slot).
Output `[1, 1, Hq, d]` in the query's dtype (transformers' attention-function layout).

Triton: a flash-decoding kernel (two launches per layer), in three ways (`Split.way`, below): per query head as
described here, per KV head for all its query heads, or the same with the products on tensor cores. Program
(query head, split) walks its split of the nq units in blocks: unpack codes, scale + zero per group, score
against the query rotated by the unit's slot (q·R(i)k = (R(-i)q)·k, cos/sin computed in the kernel), online
softmax, accumulate values; one more program per head does the full-precision tail. Each writes a partial
output and its log-sum-exp; a second kernel merges them. The query is read in place (no copy).
The twin dequantizes the whole quantized part and runs plain softmax attention in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localchat.kernels import use_triton
from localchat.kernels.quant import dequantize
from localchat.kernels.rope import rope_table, rotate


def decode_attention(query, quant, tail_k, tail_v, bits: int, group: int, scaling: float, inv_freq=None,
                     split: Split | None = None):
    """`split`: the Triton kernel's settings (default `Split()`); the twin ignores them."""
    if use_triton(query) and (inv_freq is None or 2 * inv_freq.shape[-1] == query.shape[-1]):  # partial RoPE: twin
        return decode_attention_triton(query, quant, tail_k, tail_v, bits, group, scaling, inv_freq, split)
    return decode_attention_torch(query, quant, tail_k, tail_v, bits, group, scaling, inv_freq)


# --- the twin ----------------------------------------------------------------------------------------------


BLOCK_UNITS = 1024  # units dequantized at a time: the temporaries stay this small whatever the cache holds


def dequantize_into(quant, bits: int, group: int, out_k, out_v, inv_freq=None, block: int = BLOCK_UNITS) -> None:
    """Write the quantized part into `out_k`, `out_v` `[1, H, >= nq, d]` (any float dtype), `block` units at a
    time: keys rotated to their slots when `inv_freq` is given. The math is fp32, stored at the outputs' dtype."""
    nq = quant["qk"].shape[2]
    for a in range(0, nq, block):
        b = min(nq, a + block)
        part = {name: t[:, :, a:b] for name, t in quant.items()}
        keys = dequantize(part["qk"], part["ks"], part["kz"], bits, group)
        if inv_freq is not None:
            cos, sin = rope_table(torch.arange(a, b, device=keys.device), inv_freq)
            keys = rotate(keys, cos, sin)
        out_k[:, :, a:b] = keys
        out_v[:, :, a:b] = dequantize(part["qv"], part["vs"], part["vz"], bits, group)


def dequantized_keys_values(quant, bits: int, group: int, inv_freq=None, value_dtype=torch.float32):
    """fp32 keys (rotated to their slots when `inv_freq` is given) and `value_dtype` values `[1, H, nq, d]`."""
    _, h, nq, packed = quant["qk"].shape
    keys = torch.empty((1, h, nq, packed * 8 // bits), dtype=torch.float32, device=quant["qk"].device)
    values = torch.empty_like(keys, dtype=value_dtype)
    dequantize_into(quant, bits, group, keys, values, inv_freq, block=max(nq, 1))
    return keys, values


def decode_attention_torch(query, quant, tail_k, tail_v, bits, group, scaling, inv_freq=None):
    nq, (_, h, nt, d) = quant["qk"].shape[2], tail_k.shape
    keys = torch.empty((1, h, nq + nt, d), dtype=torch.float32, device=query.device)
    values = torch.empty_like(keys)
    dequantize_into(quant, bits, group, keys, values, inv_freq)
    keys[:, :, nq:], values[:, :, nq:] = tail_k, tail_v
    keys, values = keys[0], values[0]  # [H, n, d]
    h_q, h = query.shape[1], keys.shape[0]
    q = query[0, :, -1].float().reshape(h, h_q // h, -1)  # [H, G, d]
    probs = torch.softmax(torch.einsum("hgd,hnd->hgn", q, keys) * scaling, dim=-1)
    out = torch.einsum("hgn,hnd->hgd", probs, values).reshape(1, 1, h_q, -1)
    return out.to(query.dtype)


# --- Triton ------------------------------------------------------------------------------------------------

_KERNELS = None
MAX_SPLITS = 127
# The split kernel's ways: "group" one program per KV head and split for its query heads (qattn_group_kernel), "dot"
# the same with its products on tensor cores (qattn_dot_kernel), "head" one program per query head
# (qattn_split_kernel)
WAYS = {"group": "qattn_group_kernel", "dot": "qattn_dot_kernel", "head": "qattn_split_kernel"}


@dataclass(frozen=True)
class Split:
    """How the split kernel runs. The defaults are the engine's; bench/experiments/gpu_attn.py times the others.

    way       "group" (plain fp32 sums), "dot" (tensor cores: fp16 operands, fp32 sums) or "head" (`WAYS`)
    block     units a block in the dot way (64)
    programs  the split planner's target (264: about two per SM of an H100, enough splits to fill the GPU at
              short lengths)
    warps     warps a program (4, Triton's default: the int8 cache's kernels then hold 168-252 registers a thread
              for the 8B's heads, by way and block, tools/gpu/compile_check.py; 8 spreads the same tiles thinner)
    kernels   a module with the Triton kernels (None: kernels/_qattn_triton.py; another version of that file for
              an A/B in one process)
    """

    way: str = "group"
    block: int = 64
    programs: int = 264
    warps: int = 4
    kernels: object = None

    def __post_init__(self) -> None:
        if self.way not in WAYS:
            raise ValueError(f"split kernel way {self.way!r}: use one of {', '.join(WAYS)}")


DEFAULT = Split()


def _kernels():
    """The Triton kernels, imported at first use (so TRITON_INTERPRET set by a test before that is honoured)."""
    global _KERNELS
    if _KERNELS is None:
        from localchat.kernels import _qattn_triton

        _KERNELS = _qattn_triton
    return _KERNELS


def plan_splits(nq: int, heads: int, block: int, programs: int = DEFAULT.programs) -> tuple[int, int]:
    """(splits, units per split): about `programs` programs over `heads` (the grid's first axis) to fill the GPU,
    each split a whole number of blocks."""
    blocks = -(-nq // block)
    splits = max(1, min(MAX_SPLITS, -(-programs // heads), blocks))
    per_split = -(-blocks // splits) * block
    return -(-nq // per_split) if nq else 0, per_split


def decode_attention_triton(query, quant, tail_k, tail_v, bits, group, scaling, inv_freq=None, split=None):
    kc = quant["qk"]
    nq, nt = kc.shape[2], tail_k.shape[2]
    if nq + nt == 0:
        raise ValueError("decode attention over an empty cache")
    return split_attention(query, [quant[name] for name in ("qk", "ks", "kz", "qv", "vs", "vz")], tail_k, tail_v,
                           bits, group, scaling, inv_freq, nq, (nq, nt), split)


def split_attention(query, packed, tail_k, tail_v, bits, group, scaling, inv_freq, units, lengths,
                    split: Split | None = None):
    """The split kernel and its merge. `packed`: keys' codes, scales, zeros and values' (or plain keys and values
    with `bits` 0: the same tensor in the scale and zero places, not read); the grid is planned for `units`;
    `lengths`: (quantized units, tail units) as numbers, or an int tensor `[2]` on the device (a captured step);
    `split`: the kernel's way, block, split target and warps (default `Split()`)."""
    import triton

    split = split or DEFAULT
    way = split.way
    k = split.kernels or _kernels()
    kc, ks, kz, vc, vs, vz = packed
    h_q, d, h = query.shape[1], query.shape[-1], kc.shape[1]
    for t in (kc, vc, ks, kz, vs, vz, tail_k, tail_v, query):
        if t.stride(-1) != 1:
            raise ValueError("decode attention needs tensors contiguous along their last axis")
    d_pad = triton.next_power_of_2(d)
    qp = triton.next_power_of_2(h_q // h)
    if way == "group":  # a [query heads, BLOCK, d] product per block: about 8K values
        block, sizes = max(16, min(64, 8192 // (qp * d_pad))), {"D": d, "D_PAD": d_pad, "QP": qp}
    elif way == "dot":  # tl.dot wants 16 rows at least, and the head's halves a power of two each
        block, sizes = split.block, {"D": d, "QM": max(16, qp), "HALF_PAD": max(16, triton.next_power_of_2(d // 2))}
    else:
        block, sizes = 64 if d_pad <= 64 else 32, {"D": d, "D_PAD": d_pad}
    splits, per_split = plan_splits(units, h_q if way == "head" else h, block, split.programs)
    programs = splits + 1  # the last one per head reads the tail
    parts = torch.empty((h_q, programs, d), device=query.device, dtype=torch.float32)
    lse = torch.empty((h_q, programs), device=query.device, dtype=torch.float32)
    rotate = inv_freq is not None and bits > 0
    inv = inv_freq.to(query.device, torch.float32) if rotate else lse  # unused when not rotating
    in_memory = isinstance(lengths, torch.Tensor)
    n, nt = (0, 0) if in_memory else lengths
    kernel, grid = getattr(k, WAYS[way]), (h_q if way == "head" else h, programs)
    kernel[grid](
        query, kc, ks, kz, vc, vs, vz, tail_k, tail_v, inv, parts, lse, lengths if in_memory else lse,
        n, nt, per_split, float(scaling), query.stride(1),
        kc.stride(1), kc.stride(2), vc.stride(1), vc.stride(2), ks.stride(1), ks.stride(2), kz.stride(1),
        kz.stride(2), vs.stride(1), vs.stride(2), vz.stride(1), vz.stride(2),
        tail_k.stride(1), tail_k.stride(2), tail_v.stride(1), tail_v.stride(2),
        Q_PER_KV=h_q // h, BITS=bits, G=group, ROTATE=rotate, BLOCK=block, LENS=in_memory, **sizes,
        num_warps=split.warps,
    )
    out = torch.empty((1, 1, h_q, d), device=query.device, dtype=query.dtype)
    k.merge_kernel[(h_q,)](parts, lse, out, programs, D=d, D_PAD=d_pad, P_PAD=triton.next_power_of_2(programs),
                           PB=16)
    return out


def merge(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Softmax-weighted merge of partial attentions `[Hq, S, d]`, `[Hq, S]` -> `[Hq, d]` (merge_kernel's rule)."""
    w = torch.softmax(lses, dim=-1)
    return (outs * w[..., None]).sum(dim=1)
