"""The values `--weights` and `--kv` take, and the one check of them (no torch: the command line reads it)."""

from __future__ import annotations

from localchat.errors import UserError

WEIGHTS = ("fp32", "bf16", "fp16", "int8", "int4", "nf4")
KV_BITS = {"int8": 8, "int4": 4, "int2": 2}
KV_CHOICES = ("none", *KV_BITS)
KV_FLOATS = ("none", "fp32", "bf16", "fp16")  # profiles name the full-precision cache by its dtype


def kv_bits(kv: str | None) -> int:
    """Bits of a `--kv` value; 0 for none (full precision). Raises ValueError for an unknown value."""
    if kv is None or kv in KV_FLOATS:
        return 0
    if kv not in KV_BITS:
        raise ValueError(f"unknown KV cache type {kv!r}; choose one of: {', '.join(KV_CHOICES)}")
    return KV_BITS[kv]


def check_quant(weights: str | None, kv: str | None) -> None:
    """A UserError naming the first unknown value (None: not given)."""
    if weights is not None and weights not in WEIGHTS:
        raise UserError(f"unknown --weights {weights!r}; choose one of: {', '.join(WEIGHTS)}")
    if kv is not None:
        try:
            kv_bits(kv)
        except ValueError:
            raise UserError(f"unknown --kv {kv!r}; choose one of: {', '.join(KV_CHOICES)}") from None
