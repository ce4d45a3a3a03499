"""The rounding remainder of half-precision keys, so that compact positions can re-rotate them without drift.

In compact positions every eviction rotates each kept key to its new slot. Rounding the result to bf16 or fp16
each time adds one rounding per eviction: after 256 evictions (128K tokens at chunk 512) a bf16 key is about
22x further from its exact value than after one rotation (bench/results/compact-positions-drift). So a key
in a half-precision compact cache carries, beside its value `w`, an int8 remainder `r`: its exact value is
`w + r * step(w)`, with `step(w)` = 1/256 of the spacing of the dtype around `w` (a power of two). An eviction
rotates `w + r * step(w)` in fp32 and splits the result again: `w` is the nearest value of the dtype (what
attention reads, so one rounding from exact), `r` what rounding dropped, to 1/256 of a spacing. The error
left after an eviction is then at most half a step, 1/512 of a spacing, and 256 evictions add up to about
1/16 of one rounding (a random walk), instead of 16 roundings.

`|exact - w|` is at most half a spacing, so `r` fits in [-128, 128]; it is clamped to +-127 (the last 1/256 of
a spacing, in the rare case the exact value sits right at the middle). Keys enter with `r = 0`: as they come
from the model, they are exact. fp32 keys carry no remainder: its rounding error (2^-24) does not add up to
anything measurable (1e-6 after 256 evictions, against 2e-3 for one bf16 rounding).
"""

from __future__ import annotations

import torch

STEPS = 256  # steps of the remainder per spacing of the dtype
LIMIT = 127  # the remainder is an int8 in [-LIMIT, LIMIT]


def carries_rest(dtype: torch.dtype) -> bool:
    """True for the dtypes whose keys carry a remainder in compact positions (bf16, fp16)."""
    return dtype.is_floating_point and torch.finfo(dtype).bits < 32


def step(keys: torch.Tensor) -> torch.Tensor:
    """fp32 value of one remainder step for each element of `keys` (a half-precision tensor)."""
    return _step(keys.float(), keys.dtype)


def _step(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    bits = w.view(torch.int32) & 0x7F800000  # the power of two at or below |w| (0 for 0), from fp32 `w`
    return bits.view(torch.float32).clamp_min_(info.smallest_normal).mul_(info.eps / STEPS)  # subnormals: the smallest


def join(keys: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """fp32 keys `w + r * step(w)`."""
    w = keys.float()
    return w.addcmul_(rest.float(), _step(w, keys.dtype))


def split(exact: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `exact` -> (nearest `dtype` values, int8 remainders rounded half up, as the Triton kernel does)."""
    keys = exact.to(dtype)
    w = keys.float()
    rest = (exact - w).div_(_step(w, dtype)).add_(0.5).floor_().clamp_(-LIMIT, LIMIT)
    return keys, rest.to(torch.int8)
