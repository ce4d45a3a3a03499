"""Switching a model's attention function: policies and the quantized decode plug in through transformers'
public `AttentionInterface` by name, and read their per-layer payload from the attention module. Functions are
registered at their first use, so importing a policy stays cheap (`localchat plan` loads no attention code)."""

from __future__ import annotations

import torch

from localchat.engine.heads import attention_modules
from localchat.errors import UserError

_REGISTERED: set[str] = set()


def register(impl: str, fn) -> None:
    """Register `fn` as the attention function `impl`, with SDPA's causal masks (once per name)."""
    if impl in _REGISTERED:
        return
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(impl, fn)
    AttentionMaskInterface.register(impl, sdpa_mask)
    _REGISTERED.add(impl)


def sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' own SDPA attention (what the registered functions fall back to or wrap)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def switchable(model) -> bool:
    """False when the model's attention holds what SDPA cannot compute (gpt-oss's per-head sinks): its own
    attention function must stay."""
    return not any(hasattr(m, "sinks") for m in attention_modules(model) if m is not None)


class AttentionSwitch:
    """Switch `model` to the attention function `fn`, registered as `impl`, and set `attr` = `payload` on every
    attention layer (the function reads it there); `close()` restores the model."""

    def __init__(self, model, impl: str, attr: str, payload, fn):
        if not switchable(model):
            raise UserError(f"{type(model).__name__} has attention sinks that SDPA cannot compute; this policy needs "
                            f"SDPA: choose another --policy (locret, sirllm, streaming, full)")
        register(impl, fn)
        self.model, self.attr = model, attr
        self.previous = model.config._attn_implementation
        self.modules = [m for m in attention_modules(model) if m is not None]
        model.set_attn_implementation(impl)
        if model.config._attn_implementation != impl:
            raise UserError(f"{type(model).__name__} cannot switch its attention function; this policy needs it")
        for m in self.modules:
            setattr(m, attr, payload)

    def close(self) -> None:
        for m in self.modules:
            if hasattr(m, self.attr):
                delattr(m, self.attr)
        if self.model.config._attn_implementation != self.previous:
            self.model.set_attn_implementation(self.previous)


# --- a prefill chunk's attention on the CPU ---------------------------------------------------------------------------

CHUNK_IMPL = "localchat_chunk"  # SDPA, except a CPU chunk's attention through kernels/cpu_prefill.h
_CHUNK_ATTENTION: list[bool] = []  # a setting made by set_chunk_attention, else on where the kernel is built


def plain(config) -> bool:
    """Whether the model attends through SDPA (directly or by `chunk_attention`), not a policy's own function."""
    return config._attn_implementation in ("sdpa", CHUNK_IMPL)


def set_chunk_attention(on: bool | None) -> None:
    """Use the C++ chunk attention where it serves (True), SDPA always (False), or the default (None: on)."""
    _CHUNK_ATTENTION[:] = [] if on is None else [bool(on)]


def chunk_kernel():
    """The C++ kernels' `chunk_attention` (AVX512-BF16 CPUs), or None: not built, not this CPU, or switched off."""
    if _CHUNK_ATTENTION and not _CHUNK_ATTENTION[-1]:
        return None
    from localchat.kernels import cpu_decode

    return getattr(cpu_decode.kernels(), "chunk_attention", None)


def chunk_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                    is_causal=None, **kwargs):
    """transformers' attention function for CHUNK_IMPL: a chunk of fp32 queries on the CPU (one sequence, one bool
    mask for every head, head size a multiple of 64) through the C++ kernel, in bf16 dot products with fp32 sums;
    anything else (one decoded token, soft-capping, a float mask) through SDPA."""
    kernel = chunk_kernel()
    q_len, d = query.shape[2], query.shape[3]
    mask = attention_mask
    if (kernel is None or query.device.type != "cpu" or q_len < 2 or dropout or query.shape[0] != 1
            or query.dtype != torch.float32 or key.dtype != torch.float32 or value.dtype != torch.float32
            or d % 64 or value.shape[-1] != d or kwargs.get("softcap") is not None
            or kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None
            or (mask is None and not (is_causal if is_causal is not None else getattr(module, "is_causal", True)))
            or (mask is not None and (mask.dtype != torch.bool or mask.numel() != q_len * key.shape[2]))):
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                    **kwargs)
    if mask is None:
        mask = _NO_MASK
    elif mask.stride(-1) != 1:
        mask = mask.contiguous()
    scale = scaling if scaling is not None else d ** -0.5
    return kernel(query, key, value, mask, float(scale)), None


def use_chunk_attention(model) -> bool:
    """Switch an SDPA model on the CPU to CHUNK_IMPL where the kernel is built; True if it did."""
    if model.config._attn_implementation != "sdpa" or not switchable(model) or chunk_kernel() is None:
        return False
    register(CHUNK_IMPL, chunk_attention)
    model.set_attn_implementation(CHUNK_IMPL)
    return model.config._attn_implementation == CHUNK_IMPL


_NO_MASK = torch.empty(0, dtype=torch.bool)  # the kernel's causal mask: each query sees the keys up to its own
