"""Per-unit affine quantization of cache rows: codes packed along head_dim, an fp16 scale and zero per group.

code = round((x - zero) / scale), scale = (max - min) / (2^bits - 1), zero = min, per (row, group of head_dim).
Every row of codes, scales and zeros belongs to one unit, so a gather along the token axis moves packed rows
with their scales. The codes come from optimum-quanto's `quantize_affine` op when it is installed (the same
formula in plain torch otherwise). Used by the engine's quantized cache and the decode-attention kernels.
"""

from __future__ import annotations

import torch

GROUP = 64  # elements of head_dim per scale (fewer when head_dim is smaller)
SCALE_DTYPE = torch.float16


def group_size(head_dim: int) -> int:
    g = min(GROUP, head_dim)
    while head_dim % g:
        g //= 2
    return g


# --- quantize / pack ---------------------------------------------------------------------------------------


def _affine_codes(x: torch.Tensor, bits: int, g: int, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """uint8 codes `[..., d]` of `x` `[..., d]` with `scale`/`zero` `[..., d/g]` (quanto's op when present)."""
    flat = x.reshape(-1, g).float()
    s, z = scale.reshape(-1, 1).float(), zero.reshape(-1, 1).float()
    op = getattr(getattr(torch.ops, "quanto", None), "quantize_affine", None) if _quanto_ops() else None
    if op is not None:
        codes = op(flat, bits, 0, g, s, -z)
    else:
        codes = torch.round((flat - z) / s).clamp(0, 2**bits - 1).to(torch.uint8)
    return codes.reshape(x.shape)


_QUANTO: bool | None = None


def _quanto_ops() -> bool:
    global _QUANTO
    if _QUANTO is None:
        try:
            import optimum.quanto.library  # noqa: F401 - registers torch.ops.quanto.*

            _QUANTO = True
        except Exception:  # noqa: BLE001 - the plain torch formula is the same
            _QUANTO = False
    return _QUANTO


def quantize(x: torch.Tensor, bits: int, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`x` `[..., d]` -> (packed codes `[..., d*bits/8]` uint8, scale `[..., d/g]`, zero `[..., d/g]` fp16)."""
    groups = x.float().reshape(*x.shape[:-1], -1, g)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / (2**bits - 1)).clamp_min(1e-6).to(SCALE_DTYPE)
    zero = lo.to(SCALE_DTYPE)
    return pack(_affine_codes(x, bits, g, scale, zero), bits), scale, zero


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, g: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of quantize: `[..., d]` in `dtype` (computed in fp32)."""
    codes = unpack(packed, bits).float()
    x = codes.reshape(*codes.shape[:-1], -1, g) * scale.float()[..., None] + zero.float()[..., None]
    return x.reshape(codes.shape).to(dtype)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes `[..., d]` (values < 2^bits) -> `[..., d*bits/8]`; byte j holds codes j*k .. j*k+k-1 (k = 8/bits)."""
    if bits == 8:
        return codes
    k = 8 // bits
    c = codes.reshape(*codes.shape[:-1], -1, k)
    out = c[..., 0].clone()
    for j in range(1, k):
        out |= c[..., j] << (bits * j)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed
    k = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed[..., None] >> shifts) & (2**bits - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * k)
