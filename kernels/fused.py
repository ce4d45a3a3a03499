"""Fused element-wise ops of a captured decode step (engine/graph_step.py): in a CUDA graph each op is a kernel
of a few microseconds, so a layer's ~45 small kernels cost more than a small model's weights. The fusions:

| op | replaces |
|---|---|
| `add_rms_norm(x, residual, norm)` | the residual add and RMSNorm's 6 ops (Llama, Qwen2, Qwen3 norms) |
| `heads_score(head, x)` | LOCRET's retaining head on the new unit: fc1, its act and fc2 (3 launches) |
| `rope_write(q, k, v, cos, sin, ...)` | the query's and key's rotation (`rope_qk`: 5 ops each) and the new unit's K, V, score, true position and key remainder (`write_unit`: 4-5 index writes) |
| `silu_mul(gate, up)` | the MLP's act and product |
| `join_linears(...)` | q/k/v (and gate/up) as one product where they are plain linear layers: 3 launches -> 1 |
| `norm_linear(x, residual, norm, w)` | add_rms_norm and the product that reads its output (a Triton GEMV) |
| `silu_linear(gate, up, w)` | silu_mul and the down projection that reads it (a Triton GEMV) |

Triton where `use_triton`, else the eager ops themselves (the twin). `serves(model)` says whether the model's
layers are the ones these replace.
"""

from __future__ import annotations

import torch

from localchat.kernels import use_triton

_K = None


def _kernels():
    global _K
    if _K is None:
        from localchat.kernels import _fused_triton

        _K = _fused_triton
    return _K


def _pad(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def serves(model) -> bool:
    """True when every layer has RMSNorms of (weight, variance_epsilon) and a SiLU-gated MLP (gate and up apart,
    or in one projection as Phi-3's)."""
    cfg = model.config
    if getattr(cfg, "hidden_act", None) != "silu":
        return False
    norms = [model.model.norm]
    for layer in model.model.layers:
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        mlp = layer.mlp
        if not hasattr(mlp, "down_proj") or not (hasattr(mlp, "gate_up_proj") or
                                                 (hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj"))):
            return False
    return all(type(n).__name__.endswith("RMSNorm") and hasattr(n, "variance_epsilon") and n.weight.dim() == 1
               and not getattr(n, "with_scale", False) for n in norms)


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x) for one row `[1, 1, n]`; `x` None: (norm(residual), residual)."""
    if not use_triton(residual):
        h = residual if x is None else residual + x
        return norm(h), h
    out = torch.empty(residual.shape, dtype=torch.promote_types(norm.weight.dtype, residual.dtype),
                      device=residual.device)
    total = residual if x is None else torch.empty_like(residual)
    n = residual.shape[-1]
    _kernels().add_rms_norm_kernel[(1,)](
        residual if x is None else x.contiguous(), residual, norm.weight, out, total, n,
        float(norm.variance_epsilon), HAS_R=x is not None, N_PAD=_pad(n), num_warps=8)
    return out, total


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q `[1, Hq, 1, d]`, k `[1, H, 1, d]` rotated by cos/sin `[1, 1, 1, d]` (one position), as transformers
    rotates them (rope_write's twin)."""
    return rotate(q, cos, sin), rotate(k, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if not use_triton(gate):
        return torch.nn.functional.silu(gate) * up
    out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    n, block = gate.numel(), 1024
    _kernels().silu_mul_kernel[(-(-n // block),)](gate.contiguous(), up.contiguous(), out, n, BLOCK=block)
    return out


def _gemv_grid(n_out: int, n_in: int) -> tuple[int, int]:
    """(rows a program, columns a step): a power of two from 4 to 32 rows, for about 264 programs (two an SM of a
    large GPU) where the output has rows enough; a tile of at most 4,096 weights (32 a thread)."""
    per = max(1, n_out // 264)
    rows = min(32, max(4, 1 << (per.bit_length() - 1)))
    return rows, min(_pad(n_in), 4096 // rows)


def norm_linear(x: torch.Tensor | None, residual: torch.Tensor, norm, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(residual + x)), residual + x) for one row `[1, 1, n]`: add_rms_norm and the product in one
    launch, the normed row never written out. `weight` `[out, n]` plain (a float linear layer's)."""
    if not use_triton(residual):
        normed, total = add_rms_norm(x, residual, norm)
        return torch.nn.functional.linear(normed, weight, bias), total
    n_out, n_in = weight.shape
    out = torch.empty((1, 1, n_out), dtype=weight.dtype, device=residual.device)
    total = residual if x is None else torch.empty_like(residual)
    block_n, block_k = _gemv_grid(n_out, n_in)
    _kernels().norm_gemv_kernel[(-(-n_out // block_n),)](
        residual if x is None else x.contiguous(), residual, norm.weight, weight, bias if bias is not None else weight,
        out, total, n_in, n_out, float(norm.variance_epsilon), HAS_R=x is not None, HAS_B=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k)
    return out, total


def silu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear(silu(gate) * up) for one row, in one launch (the product silu_mul would write is never written)."""
    if not use_triton(gate):
        return torch.nn.functional.linear(silu_mul(gate, up), weight, bias)
    n_out, n_in = weight.shape
    out = torch.empty((*gate.shape[:-1], n_out), dtype=weight.dtype, device=gate.device)
    block_n, block_k = _gemv_grid(n_out, n_in)
    _kernels().silu_gemv_kernel[(-(-n_out // block_n),)](
        gate.contiguous(), up.contiguous(), weight, bias if bias is not None else weight, out, n_in, n_out,
        HAS_B=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


HEADS_BLOCK = 4  # hidden units of a retaining head per program of heads_score_kernel (256 programs at d_R 1,024)
_ROUND = {torch.bfloat16: 1, torch.float16: 2}


def heads_score(head, x: torch.Tensor, kernel: bool = True) -> torch.Tensor:
    """LOCRET's retaining head (engine/heads.py: fc2(silu(fc1 x)), no biases) on one row `x` `[1, in]`: its output
    `[1, H]`, or with the kernel the partial sums `[programs, H]` fp32 whose sum (rope_write's) is that output, in
    one launch instead of three. `kernel` False, another act or biases: the head itself."""
    if not (kernel and use_triton(x)) or not _plain_silu(head):
        return head(x.to(head.fc1.weight.dtype))
    w1, w2 = head.fc1.weight, head.fc2.weight
    d_r, n_in, h = w1.shape[0], w1.shape[1], w2.shape[0]
    programs = -(-d_r // HEADS_BLOCK)
    parts = torch.empty((programs, h), dtype=torch.float32, device=x.device)
    _kernels().heads_score_kernel[(programs,)](x.contiguous(), w1, w2, parts, n_in, d_r, H=h, H_PAD=_pad(h),
                                              BLOCK_R=HEADS_BLOCK, BLOCK_K=min(1024, _pad(n_in)))
    return parts


def _plain_silu(head) -> bool:
    return (head.fc1.bias is None and head.fc2.bias is None and head.fc1.weight.is_contiguous()
            and head.fc2.weight.is_contiguous() and type(head.act).__name__ in ("SiLU", "SiLUActivation"))


def write_unit(dst_k, dst_v, dst_s, dst_p, dst_r, kv_slot, slot, true, k, v, score,
               score_dtype: torch.dtype | None = None) -> None:
    """Write one token's unit into a cache layer's buffers: `k`, `v` `[1, H, 1, d]` at `kv_slot` of `dst_k`, `dst_v`
    `[1, H, C, d]`; `score` (the sum of its rows `[P, H]`: a head's output `[1, H]` or heads_score's partial sums,
    rounded to `score_dtype`; None: 0) and `true` `[1]` (its position) at `slot` of `dst_s`, `dst_p` `[H, C]`;
    `dst_r` (key remainders `[1, H, C, d]` int8, or None) zeroed at `slot`. Slots are `[1]` device tensors (a
    captured step's inputs). Index writes: rope_write's twin."""
    h = k.shape[1]
    dst_k.index_copy_(2, kv_slot, k)
    dst_v.index_copy_(2, kv_slot, v)
    if score is None:
        dst_s.index_fill_(1, slot, 0.0)
    else:
        total = score.float().sum(dim=0, keepdim=True)
        dst_s.index_copy_(1, slot, total.to(score_dtype or score.dtype).float().T)
    dst_p.index_copy_(1, slot, true.expand(h, 1))
    if dst_r is not None:
        dst_r.index_fill_(2, slot, 0)


def rope_write(q, k, v, cos, sin, dst_k, dst_v, dst_s, dst_p, dst_r, kv_slot, slot, true, score,
               kernel: bool = True, score_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The new unit's RoPE and writes in one launch: `q`, `k` rotated (rope_qk), then write_unit with the rotated
    key; returns the rotated query `[1, Hq, 1, d]`. `kernel` False: the twins (an A/B)."""
    if not (kernel and use_triton(k)) or cos.dtype != q.dtype:
        q, k = rope_qk(q, k, cos, sin)
        write_unit(dst_k, dst_v, dst_s, dst_p, dst_r, kv_slot, slot, true, k, v, score, score_dtype)
        return q
    hq, h, d = q.shape[1], k.shape[1], k.shape[-1]
    for t in (dst_k, dst_v, q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("rope_write needs rows contiguous along the head dimension")
    qo = torch.empty((1, hq, 1, d), dtype=q.dtype, device=q.device)
    rest = dst_r if dst_r is not None else dst_k
    parts = score.shape[0] if score is not None else 1
    _kernels().rope_write_kernel[(h,)](
        q, k, v, cos.contiguous(), sin.contiguous(), qo, kv_slot, slot, true,
        score.contiguous() if score is not None else dst_s, dst_k, dst_v, dst_s, dst_p, rest,
        q.stride(1), k.stride(1), v.stride(1), dst_k.stride(1), dst_k.stride(2), dst_v.stride(1), dst_v.stride(2),
        dst_s.stride(0), dst_p.stride(0), rest.stride(1), rest.stride(2), parts,
        Q_PER_KV=hq // h, QP_PAD=_pad(hq // h), D=d, D_PAD=_pad(d), HAS_SCORE=score is not None,
        HAS_REST=dst_r is not None, H=h, P_PAD=_pad(parts),
        ROUND=_ROUND.get(score_dtype or (score.dtype if score is not None else torch.float32), 0))
    return qo


def join_linears(owner, name: str, linears) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) of one linear layer doing the work of `linears` (which read the same input), kept on `owner`
    as `name`: the layers' own parameters are re-pointed into it, so there is no second copy and every other path
    reads the same numbers. None when they are not plain `nn.Linear` of one dtype and device, with all or no
    biases (quantized layers keep their own products)."""
    joined = getattr(owner, name, None)
    if joined is not None and all(m.weight.untyped_storage().data_ptr() == joined[0].untyped_storage().data_ptr()
                                  for m in linears):
        return joined
    if not all(type(m) is torch.nn.Linear for m in linears):
        return None
    weights, biases = [m.weight for m in linears], [m.bias for m in linears]
    if len({(w.dtype, w.device) for w in weights}) != 1 or len({b is None for b in biases}) != 1:
        return None
    with torch.no_grad():
        weight = torch.cat([w.detach() for w in weights])
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        at = 0
        for m in linears:
            rows = m.weight.shape[0]
            m.weight = torch.nn.Parameter(weight[at:at + rows], requires_grad=False)
            if bias is not None:
                m.bias = torch.nn.Parameter(bias[at:at + rows], requires_grad=False)
            at += rows
    setattr(owner, name, (weight, bias))
    return weight, bias


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin in x's dtype, as transformers' apply_rotary_pos_emb (a decoded token's q and k;
    kernels/rope.py's `rotate` is the fp32 one for cached keys)."""
    half = x.shape[-1] // 2
    return (x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin).to(x.dtype)
