"""Switching a model's attention function: policies and the quantized decode plug in through transformers'
public `AttentionInterface` by name, and read their per-layer payload from the attention module. Functions are
registered at their first use, so importing a policy stays cheap (`localchat plan` loads no attention code)."""

from __future__ import annotations

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
