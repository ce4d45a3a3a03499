"""Switching a model's attention function: policies and the quantized decode plug in through transformers'
public `AttentionInterface` by name, and read their per-layer payload from the attention module."""

from __future__ import annotations

from localchat.engine.heads import attention_modules
from localchat.errors import UserError


class AttentionSwitch:
    """Switch `model` to the registered attention function `impl` and set `attr` = `payload` on every
    attention layer (the function reads it there); `close()` restores the model."""

    def __init__(self, model, impl: str, attr: str, payload):
        self.model, self.attr = model, attr
        self.previous = model.config._attn_implementation
        self.modules = attention_modules(model)
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
