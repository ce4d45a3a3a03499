"""One decoded token through a Llama-layout model without transformers' per-call machinery.

A decode step is one token through every layer. transformers' forward builds a causal mask, output records,
keyword plumbing and decorators around each of its 30 layers (SmolLM2), which costs as much as the step's
matrix products once the weights are int4 (kernels/packed.py). `DecodeStep` runs the same modules in the same
order (norms, projections, RoPE from the model's own rotary embedding, the cache's update, SDPA, MLP), so the
hooks policies put on them (LOCRET's q/k/v, SirLLM's final norm) still fire, and gives the same logits (tests:
tests/test_decode_step.py).

It serves the models whose layers are Llama's (Llama, Mistral, Qwen2, Qwen3 without sliding windows) on the
plain cache when the model attends with plain SDPA. A policy that switched the attention function (H2O, SnapKV,
CORM, RoCo, SAGE-KV, OmniKV) or a quantized cache's fused decode keeps transformers' forward.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from localchat.engine.cache import KVCache

LAYOUTS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def supported(model, cache) -> bool:
    """Whether `DecodeStep` computes what transformers' forward would for this model and cache now."""
    config = model.config
    return (type(model).__name__ in LAYOUTS and type(cache) is KVCache and cache.extension is None
            and config._attn_implementation == "sdpa" and not getattr(config, "use_sliding_window", False)
            and getattr(config, "final_logit_softcapping", None) is None)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _hooked(module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _norm(module, dtype: torch.dtype):
    """An fp32 RMSNorm as one fused op (transformers' takes seven); the module itself if anything watches it."""
    if dtype != torch.float32 or _hooked(module) or not hasattr(module, "variance_epsilon"):
        return module
    shape, weight, eps = (module.weight.shape[-1],), module.weight, module.variance_epsilon
    return lambda x: F.rms_norm(x, shape, weight, eps)


def _mlp(module):
    """SwiGLU as its three projections (the projections stay modules: their own hooks still fire)."""
    if _hooked(module) or not all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return module
    gate, up, down, act = module.gate_proj, module.up_proj, module.down_proj, module.act_fn
    return lambda x: down(act(gate(x)) * up(x))


class DecodeStep:
    """`step(token, true_position)` -> the next token's logits `[vocab]`, the token's K/V appended to `cache`."""

    def __init__(self, model, cache: KVCache):
        self.model, self.cache = model, cache
        inner = model.model
        self.embed, self.rotary, self.norm = inner.embed_tokens, inner.rotary_emb, inner.norm
        dtype = inner.embed_tokens.weight.dtype
        self.layers = [(_norm(layer.input_layernorm, dtype), layer.self_attn, _norm(layer.post_attention_layernorm, dtype),
                        _mlp(layer.mlp)) for layer in inner.layers[: model.config.num_hidden_layers]]
        first = self.layers[0][1]
        self.head_dim = first.head_dim
        self.q_heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        self.group = self.q_heads // self.kv_heads
        self.q_norm = hasattr(first, "q_norm")  # Qwen3 normalises q and k per head before RoPE

    @torch.inference_mode()
    def step(self, token: torch.Tensor, true_position: int) -> torch.Tensor:
        cache, d = self.cache, self.head_dim
        device = token.device
        cache.set_pending_positions(torch.tensor([true_position], device=device))
        position_ids = torch.tensor([[cache.next_position(true_position)]], device=device)
        h = self.embed(token)  # [1, 1, hidden]
        cos, sin = self.rotary(h, position_ids)
        cos, sin = cos[:, None], sin[:, None]  # [1, 1, 1, d]: broadcast over heads
        for i, (norm_in, attn, norm_post, mlp) in enumerate(self.layers):
            x = norm_in(h)
            q = attn.q_proj(x).view(1, 1, -1, d).transpose(1, 2)
            k = attn.k_proj(x).view(1, 1, -1, d).transpose(1, 2)
            v = attn.v_proj(x).view(1, 1, -1, d).transpose(1, 2)
            if self.q_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            qk = _rotate(torch.cat((q, k), dim=1), cos, sin)  # q and k in one rotation
            q, k = qk[:, : self.q_heads], qk[:, self.q_heads:]
            keys, values = cache.layers[i].update(k, v)
            # the query heads of a KV head as that head's queries: K and V are read once per KV head (on this
            # CPU 15 % faster than SDPA's own grouped-query path; the same numbers)
            grouped = q.reshape(1, self.kv_heads, self.group, d)
            out = F.scaled_dot_product_attention(grouped, keys, values, scale=attn.scaling)
            h = h + attn.o_proj(out.reshape(1, 1, -1))
            h = h + mlp(norm_post(h))
        return self.model.lm_head(self.norm(h))[0, -1]
