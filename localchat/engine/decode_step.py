"""One decoded token through a Llama-layout model without transformers' per-call machinery.

A decode step is one token through every layer. transformers' forward builds a causal mask, output records,
keyword plumbing and decorators around each of its 30 layers (SmolLM2), which costs as much as the step's
matrix products once the weights are int4 (kernels/packed.py). `DecodeStep` runs the same modules in the same
order (norms, projections, RoPE from the model's own rotary embedding, the cache's update, SDPA, MLP), so the
hooks policies put on them (LOCRET's q/k/v, SirLLM's final norm) still fire, and gives the same logits (tests:
tests/engine/test_decode_step.py).

LOCRET's retaining heads take each token's pre-RoPE q/k/v from hooks on the projections; where a layer runs in one
C++ call, `on_qkv` (the policy's `qkv_sink()`) takes them instead. (Joining q/k/v and gate/up into one product
each was measured too: on the CPU the old weights' memory is not given back, +500 MiB of RSS for SmolLM2 fp32.)

Three ways through a step, the first that applies (all give transformers' logits; tests/engine/test_decode_step.py):
  layers  an fp32 model on the CPU: one C++ call per layer (kernels/cpu_decode.cpp `layer_step`: norms, the
          packed or fp32 products, RoPE, the cache write, attention, SwiGLU); Python only between layers
  ops     the same C++ attention and norms between torch ops, where a layer cannot go whole (a hooked module,
          another activation, weights of another kind)
  torch   torch's ops: other devices and dtypes, no C++ compiler; Qwen3 (per-head q/k norms) on an fp32 CPU
          model takes this way with the C++ attention and norms
Measured on the 2-core EPYC, SmolLM2 int4 at 1,120 kept units, alternating on one cache: layers 80.5, ops 57.7,
torch 44.6 tok/s (bench/results/cpu-decode/ab_paths.txt).

It serves the models whose layers are Llama's (Llama, Mistral, Qwen2, Qwen3 without sliding windows) on the
plain cache when the model attends with plain SDPA. A policy that switched the attention function (H2O, SnapKV,
CORM, RoCo, SAGE-KV, OmniKV) or a quantized cache's fused decode keeps transformers' forward.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from localchat.engine.attention import plain
from localchat.engine.cache import KVCache
from localchat.kernels import cpu_decode
from localchat.kernels.fused import rotate
from localchat.kernels.packed import GROUP, PackedLinear

LAYOUTS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def supported(model, cache) -> bool:
    """Whether `DecodeStep` computes what transformers' forward would for this model and cache now."""
    config = model.config
    return (type(model).__name__ in LAYOUTS and type(cache) is KVCache and cache.extension is None
            and plain(config) and not getattr(config, "use_sliding_window", False)
            and getattr(config, "final_logit_softcapping", None) is None)


def _hooked(module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _norm(module, dtype: torch.dtype, native):
    """An fp32 RMSNorm as one op (transformers' takes seven; `native`: the C++ kernel, one pass); the module
    itself if anything watches it."""
    if dtype != torch.float32 or _hooked(module) or not hasattr(module, "variance_epsilon"):
        return module
    shape, weight, eps = (module.weight.shape[-1],), module.weight, module.variance_epsilon
    if native is not None and weight.device.type == "cpu" and weight.dtype == torch.float32:
        return lambda x: native.rms_norm(x, weight, eps)
    return lambda x: F.rms_norm(x, shape, weight, eps)


def _qkv(attn):
    """x -> the layer's pre-RoPE `[1, (H_q + 2 H_kv) d]` from its three projections (their hooks fire)."""
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    return lambda x: torch.cat([p(x)[0] for p in parts], dim=-1)


def _mlp(module):
    """SwiGLU as its three projections (the projections stay modules: their own hooks still fire)."""
    if _hooked(module) or not all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return module
    gate, up, down, act = module.gate_proj, module.up_proj, module.down_proj, module.act_fn
    return lambda x: down(act(gate(x)) * up(x))


def _row(module):
    """A linear layer as `layer_step` takes it: ([weight or codes, scales, bias], [bits, out_features, group,
    block]), or None for a kind it does not know (quantized layers of other libraries, half-precision weights)."""
    none = torch.empty(0)
    if type(module) is PackedLinear:
        return [module.codes, module.scales, none if module.bias is None else module.bias], \
            [module.bits, module.out_features, GROUP, module.block]
    if type(module) is nn.Linear and module.weight.dtype == torch.float32:
        return [module.weight, none, none if module.bias is None else module.bias], [32, module.out_features, 0, 0]
    return None


def _layer_plan(layer, on_qkv, act: str):
    """What `layer_step` (kernels/cpu_decode.cpp) needs for one layer, or None where the layer must run op by op:
    something watches one of its modules (but q/k/v hooks whose owner takes `on_qkv`), other weights, another
    activation than SiLU, norms with other epsilons."""
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    watched = [*norms, mlp, *linears[3:]] + (linears[:3] if on_qkv is None else [])
    if act != "silu" or any(_hooked(m) for m in watched) or not all(hasattr(n, "variance_epsilon") for n in norms) \
            or norms[0].variance_epsilon != norms[1].variance_epsilon:
        return None
    rows = [_row(m) for m in linears]
    if any(r is None for r in rows):
        return None
    weights = [t for tensors, _ in rows for t in tensors]
    meta = [x for _, numbers in rows for x in numbers]
    return (norms[0].weight, norms[1].weight, norms[0].variance_epsilon, weights, meta)


WAYS = ("layers", "ops", "torch")  # the module docstring's three ways, fastest first


class DecodeStep:
    """`step(token, true_position)` -> the next token's logits `[vocab]`, the token's K/V appended to `cache`.
    `on_qkv(layer_idx, qkv)` takes each layer's pre-RoPE q/k/v `[1, (H_q + 2 H_kv) d]` (LOCRET's scorer).
    `way`: the fastest of `WAYS` the step may take ("layers", the default: the first that applies; "ops": no
    whole-layer C++ call; "torch": no C++ kernel); `took` says which it took."""

    def __init__(self, model, cache: KVCache, on_qkv=None, way: str = "layers"):
        if way not in WAYS:
            raise ValueError(f"decode step way {way!r}: use one of {', '.join(WAYS)}")
        self.model, self.cache = model, cache
        inner = model.model
        self.embed, self.rotary, self.norm = inner.embed_tokens, inner.rotary_emb, inner.norm
        dtype = inner.embed_tokens.weight.dtype
        # the C++ attention and RMSNorm (kernels/cpu_decode.py) for an fp32 model on the CPU
        native = cpu_decode.kernels() if (dtype == torch.float32 and self.embed.weight.device.type == "cpu"
                                          and way != "torch") else None
        self.native = native is not None
        self.layers = [(_norm(layer.input_layernorm, dtype, native), layer.self_attn, _qkv(layer.self_attn),
                        _norm(layer.post_attention_layernorm, dtype, native), _mlp(layer.mlp))
                       for layer in inner.layers[: model.config.num_hidden_layers]]
        first = self.layers[0][1]
        self.head_dim = first.head_dim
        self.q_heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        self.group = self.q_heads // self.kv_heads
        self.q_norm = hasattr(first, "q_norm")  # Qwen3 normalises q and k per head before RoPE
        # RoPE, the cache write and attention in one C++ call per layer (fp32 buffers on the CPU, no Qwen3 norms)
        self.kernels = native if native is not None and not self.q_norm and self._plain_fp32(cache) else None
        # whole layers in one C++ call each where every layer allows it
        self.on_qkv = on_qkv
        plans = [_layer_plan(layer, on_qkv, getattr(model.config, "hidden_act", ""))
                 for layer in inner.layers[: model.config.num_hidden_layers]] \
            if self.kernels is not None and way == "layers" else [None]
        self.plans = plans if all(p is not None for p in plans) else None

    @property
    def took(self) -> str:
        """The way a step takes: "layers", "ops" or "torch"."""
        return "layers" if self.plans is not None else "ops" if self.kernels is not None else "torch"

    @staticmethod
    def _plain_fp32(cache: KVCache) -> bool:
        return all(layer._k is not None and layer._k.dtype == torch.float32 and layer._v.dtype == torch.float32
                   and layer._k.device.type == "cpu" for layer in cache.layers)

    @torch.inference_mode()
    def step(self, token: torch.Tensor, true_position: int) -> torch.Tensor:
        if self.plans is not None:
            return self._layer_steps(token, true_position)
        if self.kernels is not None:
            return self._native_step(token, true_position)
        cache, d = self.cache, self.head_dim
        device = token.device
        cache.set_pending_positions(torch.tensor([true_position], device=device))
        position_ids = torch.tensor([[cache.next_position(true_position)]], device=device)
        h = self.embed(token)  # [1, 1, hidden]
        cos, sin = self.rotary(h, position_ids)
        cos, sin = cos[:, None], sin[:, None]  # [1, 1, 1, d]: broadcast over heads
        hq, hkv = self.q_heads * d, self.kv_heads * d
        for i, (norm_in, attn, qkv_of, norm_post, mlp) in enumerate(self.layers):
            qkv = qkv_of(norm_in(h))  # [1, (H_q + 2 H_kv) d]
            q = qkv[:, :hq].view(1, -1, 1, d)
            k = qkv[:, hq : hq + hkv].view(1, -1, 1, d)
            v = qkv[:, hq + hkv :].view(1, -1, 1, d)
            if self.q_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            qk = rotate(torch.cat((q, k), dim=1), cos, sin)  # q and k in one rotation
            q, k = qk[:, : self.q_heads], qk[:, self.q_heads:]
            keys, values = cache.layers[i].update(k, v)
            # the query heads of a KV head as that head's queries: K and V are read once per KV head (on this
            # CPU 15 % faster than SDPA's own grouped-query path; the same numbers)
            grouped = q.reshape(1, self.kv_heads, self.group, d)
            out = cpu_decode.attention(grouped, keys, values, attn.scaling) if self.native else None
            if out is None:
                out = F.scaled_dot_product_attention(grouped, keys, values, scale=attn.scaling)
            h = h + attn.o_proj(out.reshape(1, 1, -1))
            h = h + mlp(norm_post(h))
        return self.model.lm_head(self.norm(h))[0, -1]

    def _start(self, token: torch.Tensor, true_position: int):
        """The token's hidden state `[1, 1, hidden]` and its rotation `cos`, `sin` `[d]` (for the C++ ways)."""
        h = self.embed(token)
        cos, sin = self.rotary(h, torch.tensor([[self.cache.next_position(true_position)]]))
        return h, cos.reshape(-1), sin.reshape(-1)

    def _layer_steps(self, token: torch.Tensor, true_position: int) -> torch.Tensor:
        cache, native, on_qkv = self.cache, self.kernels, self.on_qkv
        h, cos, sin = self._start(token, true_position)
        h = h.view(1, -1)
        for i, (norm_in, norm_post, eps, weights, meta) in enumerate(self.plans):
            layer = cache.layers[i]
            slot = layer.take_slot()  # the kernel writes the slot's K, V, score and position
            h, qkv = native.layer_step(h, norm_in, norm_post, eps, weights, meta, cos, sin, layer._k, layer._v,
                                       layer._s, layer._p, slot, true_position, self.layers[i][1].scaling,
                                       self.q_heads, self.kv_heads)
            if on_qkv is not None:
                on_qkv(i, qkv)
        return self.model.lm_head(self.norm(h.view(1, 1, -1)))[0, -1]

    def _native_step(self, token: torch.Tensor, true_position: int) -> torch.Tensor:
        cache, native = self.cache, self.kernels
        h, cos, sin = self._start(token, true_position)
        for i, (norm_in, attn, qkv_of, norm_post, mlp) in enumerate(self.layers):
            qkv = qkv_of(norm_in(h))
            layer = cache.layers[i]
            slot = layer.open_slot(true_position)
            out = native.attend_token(qkv, cos, sin, layer._k, layer._v, slot, attn.scaling, self.q_heads,
                                      self.kv_heads)
            h = h + attn.o_proj(out.view(1, 1, -1))
            h = h + mlp(norm_post(h))
        return self.model.lm_head(self.norm(h))[0, -1]
