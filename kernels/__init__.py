"""Triton kernels for the engine's hot paths, each with a plain-torch twin (installed as localchat.kernels).

| kernel | what | twin (reference, and the CPU path) |
|---|---|---|
| `qattn.decode_attention` | one decoded token's attention over the quantized retained cache (int8/4/2 codes + scales), dequantized on the fly, keys rotated to their slots (compact positions), merged with the full-precision tail | dequantize the whole cache, rotate, softmax attention |
| `graph_attn.attention` | the same for a captured decode step (engine/graph_step.py): buffers at capacity, the lengths held read from device memory, the plain cache too | mask the slots past each length, softmax attention |
| `fused.add_rms_norm`, `fused.heads_score`, `fused.rope_write`, `fused.silu_mul` | a captured decode step's residual add + RMSNorm, retaining head, query and key RoPE with the new unit's writes, and SiLU product: one kernel each | the eager ops |
| `evict.gather_rotate` | the per-head eviction gather of K and V rows, with the compact-position key re-rotation fused in | `torch.gather` + `rope.shift_keys` |
| `evict.gather_rotate_rest` | the same for bf16/fp16 keys that carry an int8 rounding remainder (`keyrest.py`): rotated from key + remainder, split again | gather + `keyrest.join` + `rope.shift_keys` + `keyrest.split` |
| `evict.select` | top-b per KV head of every layer in one batched top-k + sort (torch on every device) | one top-k + sort per layer |

Two CPU-only modules sit beside them: `packed.py` (int8/int4 weight-only linear layers on torch's packed CPU
kernels) and `cpu_decode.py` (the decode step's C++ kernels, built once per machine; torch's ops stand in).

Dispatch is chosen once, at first use: Triton when CUDA and Triton are both present, the twin elsewhere.
`LOCALCHAT_KERNELS=torch` forces the twins; `LOCALCHAT_KERNELS=triton` with `TRITON_INTERPRET=1` runs the
kernels on CPU tensors through Triton's interpreter (slow: for tests). Without that pair a kernel is only
launched on CUDA tensors.
"""

from __future__ import annotations

import os

import torch

_BACKEND: str | None = None


def _triton_present() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - no Triton (macOS, Windows, a broken install): the twins
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def backend() -> str:
    """"triton" or "torch", chosen once (see the module doc)."""
    global _BACKEND
    if _BACKEND is None:
        asked = os.environ.get("LOCALCHAT_KERNELS", "").strip().lower()
        if asked not in ("", "torch", "triton"):
            raise ValueError(f"LOCALCHAT_KERNELS={asked!r}: use torch or triton")
        if asked == "torch" or not _triton_present():
            _BACKEND = "torch"
        elif torch.cuda.is_available() or (asked == "triton" and interpreting()):
            _BACKEND = "triton"
        else:
            _BACKEND = "torch"
    return _BACKEND


def use_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernel should run on tensors like `t`."""
    return backend() == "triton" and (t.is_cuda or interpreting())


def reset_backend() -> None:
    """Choose again at the next use (tests)."""
    global _BACKEND
    _BACKEND = None
