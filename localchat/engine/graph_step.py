"""A decoded token as one replay of a CUDA graph: the GPU twin of the CPU decode step (engine/decode_step.py).

LOCRET's cache has a fixed capacity (budget + local tail + answer), so a step can run with fixed shapes: every
layer reads the cache's buffers at their capacity, and what changes from token to token lives in one small
device tensor (`inputs`: the token, the slot it writes, its RoPE and true positions, the lengths held).
`GraphStep` runs the step's body once eagerly to warm up, captures it as a `torch.cuda.CUDAGraph` and replays it
per token; the host only writes `inputs` and moves the cache's lengths. Inside the body, per layer: the norms,
the projections (called past their hooks), RoPE, the new unit's K/V, score and position written at its slot
(`index_copy_` at a device index), attention over the held units (kernels/graph_attn.py: the plain cache, or the
quantized cache's packed part plus its tail, lengths read on the device), the MLP; then the final norm and the
logits. The retaining heads score the new unit inside the step (LOCRET); eviction, the tail's quantization and
the chat's bookkeeping stay outside, between replays. The element-wise ops are kernels/fused.py's fused kernels;
with `gemv=True` each norm and the SiLU product run inside the product that reads them.

A graph is bound to the buffers it read at capture: when the cache grows (a reallocation), keeps key remainders
for the first time, or another cache comes, the step captures again. On a CPU (the tests) or when capture fails
the same body runs eagerly. `why_not(model, cache, heads)` says what keeps a model from this step (the engine
says it once and decodes eagerly). Layers served: Llama's (Mistral), Qwen2's, Qwen3's, and Phi-3's (q/k/v and
gate/up in one projection each).
"""

from __future__ import annotations

import weakref

import torch

from localchat.engine.attention import plain
from localchat.engine.cache import KVCache
from localchat.engine.decode_step import LAYOUTS
from localchat.engine.qcache import QuantizedKVCache
from localchat.kernels import fused, graph_attn, qattn
from localchat.kernels.fused import join_linears, serves
from localchat.kernels.quant import group_size

TOKEN, SLOT, ROPE, TRUE, TAIL_SLOT, MAIN, TAIL = range(7)  # the fields of `inputs`
GRAPH_LAYOUTS = (*LAYOUTS, "Phi3ForCausalLM")  # Phi-3: q/k/v in one projection, gate and up in one


def _watched(model, heads) -> str | None:
    """The name of a module something watches (a policy's hook), but q/k/v projections whose scorer `heads`
    stand in for inside the step."""
    qkv = ("q_proj", "k_proj", "v_proj", "qkv_proj")
    for name, module in model.named_modules():
        if module._forward_hooks or module._forward_pre_hooks:
            if heads is not None and name.rsplit(".", 1)[-1] in qkv:
                continue
            return name
    return None


def why_not(model, cache, heads=None) -> str | None:
    """None when `GraphStep` computes what transformers' forward would for this model and cache; else why not,
    in a few words."""
    config = model.config
    if type(model).__name__ not in GRAPH_LAYOUTS:
        return f"{type(model).__name__} layers are not Llama's"
    if getattr(config, "partial_rotary_factor", None) not in (None, 1.0):
        return "RoPE on part of each head"
    if type(cache) not in (KVCache, QuantizedKVCache) or cache.extension is not None:
        return "the policy keeps part of the cache elsewhere"
    if not plain(config):
        return f"the policy reads attention through its own function ({config._attn_implementation})"
    if getattr(config, "use_sliding_window", False) or getattr(config, "final_logit_softcapping", None) is not None:
        return "sliding-window attention or logit soft-capping"
    watched = _watched(model, heads)
    if watched:
        return f"the policy watches {watched}"
    layers = cache.layers
    if any(layer._s is None for layer in layers):
        return "an empty cache"
    if len({(layer.n, getattr(layer, "nq", 0)) for layer in layers}) != 1:
        return "layers hold different counts of units"
    return None


def _plain(linear) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) of a float `nn.Linear`, else None (quantized layers keep their own products)."""
    return (linear.weight, linear.bias) if type(linear) is torch.nn.Linear else None


class GraphStep:
    """`step(token, true_position)` -> the next token's logits `[vocab]`, the token's unit added to `cache` with its
    K/V, original position and (with `heads`: LOCRET's retaining heads) its score. `capture`: replay a CUDA graph
    (default: on a CUDA device); `reason` says why it runs eagerly when capture failed.

    The engine builds it with the defaults; bench/experiments/gpu_decode.py times the others:
      fused  the residual adds, norms, RoPE and SiLU product as kernels/fused.py's kernels where they serve (True);
             False: op by op
      gemv   with `fused`, each norm and the SiLU product computed inside the product that reads it
             (fused.norm_linear, silu_linear: Triton GEMVs, 3 launches a layer fewer) where the weights are plain
             (False: off until a GPU has timed these GEMVs against cuBLAS's)
      split  decode attention's split kernel settings (kernels/qattn.py `Split`; None: its defaults)"""

    def __init__(self, model, cache: KVCache, heads=None, capture: bool | None = None, *, fused: bool = True,
                 gemv: bool = False, split: qattn.Split | None = None):
        self.model, self.heads = model, heads
        self._cache = weakref.ref(cache)  # an engine keeps its last step: it must not keep a finished chat's cache
        inner = model.model
        device = inner.embed_tokens.weight.device
        self.layers = inner.layers[: model.config.num_hidden_layers]
        self.quantized = isinstance(cache, QuantizedKVCache)
        attn = self.layers[0].self_attn
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.q_heads, self.kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
        self.qkv_sizes = (self.q_heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
        self.inputs = torch.zeros(7, dtype=torch.long, device=device)
        self.capture = device.type == "cuda" if capture is None else capture
        self.graph = self.out = None
        self.bound = None  # the buffers the graph was captured on
        self.reason: str | None = None
        self.heads_dtype = next(heads.parameters()).dtype if heads is not None else None
        self.split = split
        self.fused = fused and serves(model)
        # q/k/v and gate/up as one product each, where they are plain linear layers (bf16/fp32 weights)
        self.qkv = [join_linears(layer.self_attn, "joined_qkv", [getattr(layer.self_attn, f"{n}_proj")
                                                                  for n in "qkv"])
                    if self.fused and hasattr(layer.self_attn, "q_proj") else None for layer in self.layers]
        self.gate_up = [join_linears(layer.mlp, "joined_gate_up", [layer.mlp.gate_proj, layer.mlp.up_proj])
                        if self.fused and hasattr(layer.mlp, "gate_proj") else None for layer in self.layers]
        # (weight, bias) of the products a norm or the SiLU product feeds, for the GEMVs; None where not plain
        gemv = self.fused and gemv
        self.gemv_qkv = [(self.qkv[i] or _plain(getattr(layer.self_attn, "qkv_proj", None))) if gemv else None
                         for i, layer in enumerate(self.layers)]
        self.gemv_gate_up = [(self.gate_up[i] or _plain(getattr(layer.mlp, "gate_up_proj", None))) if gemv else None
                             for i, layer in enumerate(self.layers)]
        self.gemv_down = [_plain(layer.mlp.down_proj) if gemv else None for layer in self.layers]

    @property
    def cache(self) -> KVCache | None:
        return self._cache()

    # --- host side: the cache's lengths, the inputs, capture and replay ----------------------------------------

    def _room(self) -> tuple[int, int, int, int]:
        """Make room for one unit in every layer and count it in; (slot, tail slot, main length, tail length)."""
        slot = tail_slot = main = tail = 0
        for layer in self.cache.layers:
            n = layer.n
            if self.quantized:
                if layer.nt >= layer.residual and layer.nt > 0:  # as QuantizedKVLayer.update: bound the tail
                    layer._quantize_tail()
                like = layer._tk if layer._tk is not None else self._like(layer)
                layer._grow_units(n + 1, like)
                layer._grow_tail(layer.nt + 1, like, like)
                slot, tail_slot, main, tail = n, layer.nt, layer.nq, layer.nt + 1
            else:
                layer._ensure(n + 1, layer._k, layer._v)
                slot, main = n, n + 1
            layer.n = n + 1
        return slot, tail_slot, main, tail

    def _like(self, layer) -> torch.Tensor:
        return torch.zeros((1, layer._q["qk"].shape[1], 1, layer.head_dim), dtype=layer.dtype, device=layer._s.device)

    def buffers(self) -> tuple:
        """Where every buffer the step writes or reads lies, and its shape: a change means capture again."""
        out = []
        for layer in self.cache.layers:
            ts = [layer._s, layer._p, layer._r]
            ts += [*layer._q.values(), layer._tk, layer._tv] if self.quantized else [layer._k, layer._v]
            out += [None if t is None else (t.data_ptr(), t.shape) for t in ts]
        return tuple(out)

    @torch.inference_mode()
    def step(self, token: int | torch.Tensor, true_position: int) -> torch.Tensor:
        slot, tail_slot, main, tail = self._room()
        rope = slot if self.cache.positions == "compact" else true_position
        token = token if isinstance(token, int) else int(token.reshape(-1)[0])
        values = [token, slot, rope, true_position, tail_slot, main, tail]
        self.inputs.copy_(torch.tensor(values, dtype=torch.long))
        if not self.capture:
            return self.body()
        bound = self.buffers()
        if self.graph is None or bound != self.bound:
            self._capture(bound)
        if self.graph is None:  # capture failed: eager from now on
            return self.body()
        self.graph.replay()
        return self.out.clone()

    def _capture(self, bound) -> None:
        self.graph = self.out = None
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS sets up (writes this step's unit)
                eager = self.body().clone()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self.body()
            graph.replay()  # the same step again: the replay must give what the eager body gave
            agree = torch.allclose(out.float(), eager.float(), rtol=1e-2, atol=1e-2 * float(eager.abs().max()))
        except Exception as exc:  # noqa: BLE001 - a layer that cannot be captured: decode eagerly
            self.capture = False
            self.reason = f"capture failed ({type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''})"
            return
        if not agree:
            self.capture = False
            self.reason = "the captured step's logits differ from the eager step's"
            return
        self.graph, self.out, self.bound = graph, out, bound

    # --- device side: the step's body (fixed shapes; captured) ---------------------------------------------------

    def _qkv(self, i: int, layer, pending, h):
        """(q/k/v side by side where one product gave them, else None; (q, k, v); the residual): the input norm,
        with the last MLP's output added in (fused), and the q/k/v product(s)."""
        attn = layer.self_attn
        if self.gemv_qkv[i] is not None:  # the norm inside the product
            joined, h = fused.norm_linear(pending, h, layer.input_layernorm, *self.gemv_qkv[i])
            return joined, joined.split(self.qkv_sizes, dim=-1), h
        if self.fused:
            x, h = fused.add_rms_norm(pending, h, layer.input_layernorm)
        else:
            x = layer.input_layernorm(h)
        if hasattr(attn, "qkv_proj"):  # Phi-3 (called past its hook, as the others)
            joined = attn.qkv_proj.forward(x)
        elif self.qkv[i] is not None:
            joined = torch.nn.functional.linear(x, *self.qkv[i])
        else:
            return None, (attn.q_proj.forward(x), attn.k_proj.forward(x), attn.v_proj.forward(x)), h
        return joined, joined.split(self.qkv_sizes, dim=-1), h

    def _mlp(self, i: int, layer, attended, h):
        """(the MLP's output, the residual with the attention's output added) through the fused ops: the norm
        inside the gate/up product and the SiLU product inside the down product where the GEMVs serve."""
        mlp = layer.mlp
        if self.gemv_gate_up[i] is not None:
            gate_up, h = fused.norm_linear(attended, h, layer.post_attention_layernorm, *self.gemv_gate_up[i])
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            x, h = fused.add_rms_norm(attended, h, layer.post_attention_layernorm)
            if hasattr(mlp, "gate_up_proj"):  # Phi-3
                gate, up = mlp.gate_up_proj.forward(x).chunk(2, dim=-1)
            elif self.gate_up[i] is not None:
                gate, up = torch.nn.functional.linear(x, *self.gate_up[i]).chunk(2, dim=-1)
            else:
                gate, up = mlp.gate_proj.forward(x), mlp.up_proj.forward(x)
        if self.gemv_down[i] is not None:
            return fused.silu_linear(gate, up, *self.gemv_down[i]), h
        return mlp.down_proj.forward(fused.silu_mul(gate, up)), h

    def body(self) -> torch.Tensor:
        """The step's device work from `inputs` (the layers, the cache's writes, the logits): what a graph
        captures."""
        inputs, d = self.inputs, self.head_dim
        slot, tail_slot, lens = inputs[SLOT:SLOT + 1], inputs[TAIL_SLOT:TAIL_SLOT + 1], inputs[MAIN:TAIL + 1]
        true = inputs[TRUE:TRUE + 1]
        inner = self.model.model
        h = inner.embed_tokens(inputs[TOKEN:TOKEN + 1].view(1, 1))  # [1, 1, hidden]
        cos, sin = inner.rotary_emb(h, inputs[ROPE:ROPE + 1].view(1, 1))
        cos, sin = cos[:, None], sin[:, None]  # [1, 1, 1, d]
        pending = None  # the last MLP's output, added to h inside the next norm (fused)
        for i, layer in enumerate(self.layers):
            attn, held = layer.self_attn, self.cache.layers[i]
            joined, (q, k, v), h = self._qkv(i, layer, pending, h)
            score = None  # the new unit's score, from its pre-RoPE q/k/v (LOCRET's retaining heads)
            if self.heads is not None:
                qkv = joined[0] if joined is not None else torch.cat((q[0], k[0], v[0]), dim=-1)
                score = fused.heads_score(self.heads.head(i), qkv, kernel=self.fused)  # rope_write adds it up
            q, k, v = (t.view(1, 1, -1, d).transpose(1, 2) for t in (q, k, v))  # [1, H, 1, d]
            if hasattr(attn, "q_norm"):  # Qwen3
                q, k = attn.q_norm(q), attn.k_norm(k)
            # RoPE; K/V (at the tail's slot in a quantized cache), score, true position, key remainder
            dst = (held._tk, held._tv, None, tail_slot) if self.quantized else (held._k, held._v, held._r, slot)
            q = fused.rope_write(q, k, v, cos, sin, dst[0], dst[1], held._s, held._p, dst[2], dst[3], slot, true,
                                 score, kernel=self.fused, score_dtype=self.heads_dtype)
            query = q.reshape(1, self.q_heads, 1, d)
            if self.quantized:
                out = graph_attn.attention(query, held._q, held._tk, held._tv, lens, held.bits, group_size(d),
                                           self.scaling, held.inv_freq, self.split)
            else:
                out = graph_attn.attention(query, {"k": held._k, "v": held._v}, None, None, lens, 0, d,
                                           self.scaling, split=self.split)
            attended = attn.o_proj.forward(out.view(1, 1, -1))
            if self.fused:
                pending, h = self._mlp(i, layer, attended, h)
            else:
                h = h + attended
                h = h + layer.mlp(layer.post_attention_layernorm(h))
        if self.fused:
            x, _ = fused.add_rms_norm(pending, h, inner.norm)
            return self.model.lm_head(x)[0, -1]
        return self.model.lm_head(inner.norm(h))[0, -1]
