"""Memory: what this machine has (detection, a fingerprint) and what a model needs (the memory model).

The memory model (docs/design.md §3, docs/methods/locret.md §2.6) in bytes:
  weights      parameters x bytes per parameter (4-bit: linear layers only, 0.5 byte + one fp32 scale per 64);
               MoE experts, linear-attention projections and a vision tower the causal-LM class loads counted
  kv           (budget + chunk + n_loc + max_new) units x global layers x KV heads x (K + V at the cache dtype
               + an fp32 score + an int64 position + in compact bf16/fp16 the key's int8 remainder): what
               engine/cache.py allocates. A quantized cache
               (engine/qcache.py) holds packed codes + an fp16 scale and zero per group instead of K + V,
               and a full-precision tail of chunk + RESIDUAL units per global layer
  window       a hybrid's sliding-window layers: (window - 1 + chunk) plain units each while a chunk is read
               (window - 1 after), never more, whatever the document
  state        a hybrid's linear-attention layers (Gated DeltaNet): a fixed recurrent state (fp32) and
               convolution state each, whatever the document
  kv copy      a quantized cache only: each forward reads one layer's units through a full-precision copy
               (keys and values at the activation dtype, dequantized BLOCK_UNITS at a time), then frees it
  activations  one chunk through one layer (residual, norm, q/k/v, MLP gate/up/product) + last logits
  scratch      one chunk's attention: K/V repeated to the query heads (SDPA with a mask) + the mask
  heads        the retaining heads' weights and one chunk of their input and hidden layer
  scores       what a policy's scoring adds (Policy.score_bytes): fp32 attention rows (H2O, RoCo, SnapKV,
               CORM) and CORM's messages; 0 for LOCRET and the rest
  margin       room for the runtime (1 GiB on CUDA by default)
"""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
from dataclasses import dataclass, field
from pathlib import Path

from localchat.engine.layer_kinds import STATE, WINDOW, LayerKind, layer_kinds

GIB = 1024**3
MIB = 1024**2

# Bits per element for each dtype name a profile may use.
DTYPE_BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "int8": 8, "nf4": 4, "int4": 4, "int2": 2}
QUANT_GROUP = 64  # elements per scale for the quantized dtypes
# The engine's cache layout as this model counts it, read without torch (tests/planning/test_light.py checks them
# against kernels/quant.py's GROUP, engine/cache.py's REST_BYTES, engine/qcache.py's RESIDUAL, kernels/qattn.py's
# BLOCK_UNITS)
KV_GROUP = 64  # head_dim elements per scale and zero of a quantized unit (fewer when head_dim is smaller)
REST_BYTES = 1  # bytes of key remainder per key element, compact positions in bf16/fp16
RESIDUAL = 128  # a quantized cache's tail quantized once it holds this many units
BLOCK_UNITS = 1024  # units a quantized layer dequantizes at a time


def dtype_name(dtype) -> str:
    """A torch dtype's name in this memory model: fp32, fp16, else bf16."""
    name = str(dtype).removeprefix("torch.")
    return {"float32": "fp32", "float16": "fp16"}.get(name, "bf16")


def dtype_bits(name: str) -> int:
    try:
        return DTYPE_BITS[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of: {', '.join(DTYPE_BITS)}") from None


def quantized(name: str) -> bool:
    return dtype_bits(name) < 16


def elem_bytes(name: str) -> float:
    """Bytes per element, with the per-group scale of a quantized dtype (fp32 weights' absmax, fp16 KV scales)."""
    bits = dtype_bits(name)
    return bits / 8 + (4 / QUANT_GROUP if bits < 16 else 0.0)


# --- this machine ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    kind: str  # "cuda" or "cpu"
    name: str
    total: int  # bytes
    free: int  # bytes available now
    capability: str | None = None  # "8.9"
    driver: str | None = None

    @property
    def fingerprint(self) -> str:
        """Stable across runs (not the free memory): what a tuned profile is keyed to."""
        parts = [self.kind, self.name, f"{round(self.total / GIB)}GiB"]
        if self.capability:
            parts.append(f"sm{self.capability}")
        if self.driver:
            parts.append(f"driver {self.driver}")
        return " | ".join(parts)

    def describe(self) -> str:
        extra = f", compute {self.capability}" if self.capability else ""
        return f"{self.name} ({self.kind}, {self.total / GIB:.1f} GiB, {self.free / GIB:.1f} GiB free{extra})"


def cpu_memory() -> tuple[int, int]:
    """(total, available) RAM in bytes."""
    try:
        info = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
        return info["MemTotal"], info.get("MemAvailable", info.get("MemFree", 0))
    except (OSError, KeyError, ValueError, IndexError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total // 2


def _cuda_driver() -> str | None:
    import torch

    try:
        v = int(torch._C._cuda_getDriverVersion())  # e.g. 12040 (the CUDA version the driver supports)
        return f"cuda {v // 1000}.{v % 1000 // 10}"
    except Exception:  # noqa: BLE001 - a private call; the fingerprint works without it
        return None


GPU_CAP_ENV = "LOCALCHAT_GPU_MEMORY_GB"


def gpu_cap(env: dict | None = None) -> int | None:
    """Bytes this process may use on the GPU (`LOCALCHAT_GPU_MEMORY_GB`: share a card, or stand for a smaller
    one), or None; a bad value is one line."""
    from localchat.errors import UserError

    text = (os.environ if env is None else env).get(GPU_CAP_ENV, "").strip()
    if not text:
        return None
    try:
        gb = float(text)
    except ValueError:
        gb = float("nan")
    if not (gb > 0 and gb < 1e6):
        raise UserError(f"{GPU_CAP_ENV} must be a number of GB above 0 (got {text!r}); e.g. {GPU_CAP_ENV}=24")
    return int(gb * GIB)


GPU_DRIVER_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")  # CUDA, ROCm, WSL


def may_have_gpu() -> bool:
    """False only where no GPU driver shows (Linux without its device files): torch, seconds to import, then
    need not be asked. Elsewhere, or once torch is imported, torch answers."""
    if "torch" in sys.modules or sys.platform != "linux":
        return True
    return any(os.path.exists(path) for path in GPU_DRIVER_FILES)


def detect(device: str | None = None) -> Device:
    """The device the engine would use: the first CUDA GPU, else this CPU's RAM. Under `LOCALCHAT_GPU_MEMORY_GB`
    the GPU's allocator is capped there (torch's per-process fraction) and the plan sees the capped card."""
    if device != "cpu" and may_have_gpu():
        import torch

        if torch.cuda.is_available():
            return _cuda_device(torch)
    total, available = cpu_memory()
    return Device("cpu", cpu_model() or platform.machine(), total, available)


def _cuda_device(torch) -> Device:
    """The first CUDA GPU (capped by LOCALCHAT_GPU_MEMORY_GB)."""
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    cap = gpu_cap()
    if cap is not None and cap < total:
        torch.cuda.set_per_process_memory_fraction(cap / total, index)
        free, total = min(free, cap - torch.cuda.memory_reserved(index)), cap
    return Device("cuda", props.name, total, free, f"{props.major}.{props.minor}", _cuda_driver())


# --- the model's shape ------------------------------------------------------------------------------

# transformers' defaults for the fields a published config.json may leave out (google/gemma-3-*'s text_config
# names only what differs from them); tests/planning/test_hybrid.py keeps them equal to transformers' own
CONFIG_DEFAULTS = {
    "gemma3_text": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "max_position_embeddings": 131072, "tie_word_embeddings": True, "attention_bias": False,
                    "sliding_window": 4096},
    "gpt_oss": {"sliding_window": 128, "tie_word_embeddings": False, "attention_bias": True},
    "siglip_vision_model": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                            "num_channels": 3, "image_size": 224, "patch_size": 16},
}
NORMS = {"gemma3_text": 4}  # RMSNorms per decoder layer (input, post-attention, pre- and post-feed-forward)
QK_NORM = ("gemma3_text", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
GATED = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # q_proj makes the query and its output gate
VISION = ("gemma3",)  # multimodal types whose causal-LM class loads the vision tower (transformers' auto mapping)


def config_dict(cfg) -> dict:
    """A config.json dict or a transformers config as one flat dict of the decoder's fields: a multimodal
    config's text_config over its own fields (`model_type` the text's, `outer_type` the checkpoint's),
    transformers' defaults where the file names none."""
    if not isinstance(cfg, dict):
        cfg = cfg.to_dict()
    text = cfg.get("text_config")
    flat = {**cfg, **text, "outer_type": cfg.get("model_type")} if isinstance(text, dict) else dict(cfg)
    return {**CONFIG_DEFAULTS.get(str(flat.get("model_type") or ""), {}), **flat}


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    tied: bool
    attn_bias: bool = False  # biases on q, k, v (Qwen2; gpt-oss also on o: o_bias)
    window: int = 0  # max_position_embeddings
    name: str = "model"
    kinds: tuple[LayerKind, ...] = ()  # one per layer (engine/layer_kinds.py); () = every layer global
    o_bias: bool = False  # a bias on the attention output too (attention_bias outside Qwen2)
    q_gate: bool = False  # the query projection also makes an output gate (Qwen3-Next, Qwen3.5)
    qk_norm: bool = False  # RMSNorms of head_dim on queries and keys
    sinks: bool = False  # one attention-sink logit per query head (gpt-oss)
    norms: int = 2  # RMSNorms of `hidden` per layer
    experts: int = 0  # routed experts per MoE layer (0: dense MLPs)
    top_k: int = 0  # experts a token goes through
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # the shared expert (Qwen3-Next, Qwen3.5-MoE), with its one-unit gate
    expert_bias: bool = False  # biases on the experts and the router (gpt-oss)
    dense_layers: int = 0  # MoE models: layers with a dense MLP instead (Qwen3-Next's mlp_only_layers)
    linear: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)  # Gated DeltaNet: k heads, v heads, k dim, v dim, conv kernel
    state_dtype: str = "fp32"  # the recurrent state's (transformers keeps it in fp32: mamba_ssm_dtype)
    vision: int = 0  # parameters of a vision tower the causal-LM class loads beside the text model

    @classmethod
    def from_config(cls, cfg, name: str = "model") -> Shape:
        """From a transformers config object or a config.json dict (a multimodal one: its text_config)."""
        c = config_dict(cfg)
        get = c.get
        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        kind = str(get("model_type") or "")
        bias = get("attention_bias")
        if bias is None:
            bias = kind == "qwen2"
        kinds = tuple(layer_kinds(c))
        experts = int(get("num_local_experts") or get("num_experts") or 0)
        sparse = [i for i in range(len(kinds)) if experts and i not in (get("mlp_only_layers") or [])
                  and (i + 1) % int(get("decoder_sparse_step") or 1) == 0]
        linear = tuple(int(get(k) or 0) for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                                  "linear_value_head_dim", "linear_conv_kernel_dim"))
        return cls(
            layers=int(get("num_hidden_layers")), hidden=hidden, q_heads=heads,
            kv_heads=int(get("num_key_value_heads") or heads), head_dim=int(get("head_dim") or hidden // heads),
            vocab=int(get("vocab_size")), intermediate=int(get("intermediate_size") or 0),
            tied=bool(get("tie_word_embeddings", False)), attn_bias=bool(bias),
            window=int(get("max_position_embeddings") or 0), name=name,
            kinds=kinds if any(not k.grows for k in kinds) else (),
            o_bias=bool(bias) and kind != "qwen2", q_gate=kind in GATED,
            qk_norm=kind in QK_NORM, sinks=kind == "gpt_oss", norms=NORMS.get(kind, 2),
            experts=experts, top_k=int(get("num_experts_per_tok") or get("experts_per_token") or 0) if experts else 0,
            expert_intermediate=int(get("moe_intermediate_size") or get("intermediate_size") or 0) if experts else 0,
            shared_intermediate=int(get("shared_expert_intermediate_size") or 0) if experts else 0,
            expert_bias=kind == "gpt_oss", dense_layers=len(kinds) - len(sparse) if experts else 0,
            linear=linear if linear[1] else (0, 0, 0, 0, 0),
            state_dtype=dtype_name(get("mamba_ssm_dtype") or "float32"),
            vision=_vision_params(get("vision_config"), hidden) if get("outer_type") in VISION else 0,
        )

    @classmethod
    def from_card(cls, card) -> Shape | None:
        """From a model card's [shape] table (no config file, no network); None when the card lacks a field. A
        hybrid card names its `sliding_window` and `global_layers` (the others slide); the config.json fields of
        experts, linear attention or a vision tower go in [shape.config], nested as in the file."""
        s = card.shape
        keys = ("layers", "hidden", "q_heads", "kv_heads", "head_dim", "vocab", "intermediate", "tied", "native_window")
        if not all(k in s for k in keys):
            return None
        names = {"layers": "num_hidden_layers", "hidden": "hidden_size", "q_heads": "num_attention_heads",
                 "kv_heads": "num_key_value_heads", "head_dim": "head_dim", "vocab": "vocab_size",
                 "intermediate": "intermediate_size", "tied": "tie_word_embeddings", "attn_bias": "attention_bias",
                 "native_window": "max_position_embeddings", "model_type": "model_type"}
        cfg = {config: s[key] for key, config in names.items() if key in s}
        cfg.setdefault("attention_bias", False)
        if s.get("sliding_window"):
            cfg["sliding_window"] = s["sliding_window"]
        if "global_layers" in s:
            cfg["layer_types"] = ["full_attention" if i in s["global_layers"] else "sliding_attention"
                                  for i in range(int(s["layers"]))]
        return cls.from_config({**cfg, **s.get("config", {})}, name=card.name)

    @property
    def global_layers(self) -> int:
        """Layers whose cache grows with the document: every layer but a hybrid's window and state layers."""
        return sum(k.grows for k in self.kinds) if self.kinds else self.layers

    def of_kind(self, kind: str) -> list[LayerKind]:
        return [k for k in self.kinds if k.kind == kind]

    @property
    def mlp_width(self) -> int:
        """A token's MLP activations: the dense MLP's, or the experts' it goes through and the shared one's."""
        moe = self.top_k * self.expert_intermediate + self.shared_intermediate
        return max(self.intermediate if self.dense_layers or not self.experts else 0, moe if self.experts else 0)

    def params(self) -> dict[str, int]:
        """Parameter counts: `embed`, `lm_head` (0 when tied), `linear` (attention, linear attention, MLPs and
        experts), `other` (norms, biases, sinks, routers, convolutions, a vision tower)."""
        h, d = self.hidden, self.head_dim
        q, kv = self.q_heads * d, self.kv_heads * d
        attention = h * (q * (2 if self.q_gate else 1) + 2 * kv) + q * h
        attention_other = ((q + 2 * kv) if self.attn_bias else 0) + (h if self.o_bias else 0) \
            + (2 * d if self.qk_norm else 0) + (self.q_heads if self.sinks else 0)
        kh, vh, kd, vd, kernel = self.linear
        state_layers = len(self.of_kind(STATE))
        qkvz = 2 * kh * kd + 2 * vh * vd
        linear_attn = h * (qkvz + 2 * vh) + vh * vd * h  # in_proj_qkvz + in_proj_ba, out_proj
        linear_other = (2 * kh * kd + vh * vd) * kernel + 2 * vh + vd  # conv1d, dt_bias + A_log, gated norm
        attention_layers = self.layers - state_layers
        dense = 3 * h * self.intermediate
        moe_layers = self.layers - self.dense_layers if self.experts else 0
        experts = self.experts * 3 * h * self.expert_intermediate + (3 * h * self.shared_intermediate + h
                                                                      if self.shared_intermediate else 0)
        moe_other = self.experts * h + (self.experts * (2 * self.expert_intermediate + h) + self.experts
                                        if self.expert_bias else 0)
        mlp = moe_layers * experts + (self.layers - moe_layers) * dense
        return {
            "embed": self.vocab * h,
            "lm_head": 0 if self.tied else self.vocab * h,
            "linear": attention_layers * attention + state_layers * linear_attn + mlp,
            "other": attention_layers * attention_other + state_layers * linear_other + moe_layers * moe_other
            + self.layers * self.norms * h + h + self.vision,
        }

    def total_params(self) -> int:
        return sum(self.params().values())


def _vision_params(vision: dict | None, text_hidden: int) -> int:
    """A SigLIP vision tower (patch and position embeddings, its encoder layers, the final norm) and Gemma 3's
    projector into the text model (a matrix and an RMSNorm)."""
    if not isinstance(vision, dict):
        return 0
    v = {**CONFIG_DEFAULTS["siglip_vision_model"], **vision}
    h, inter, patch = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["patch_size"])
    patches = (int(v["image_size"]) // patch) ** 2
    embeddings = int(v["num_channels"]) * patch * patch * h + h + patches * h
    layer = 4 * (h * h + h) + 2 * (h * inter) + inter + h + 4 * h
    return embeddings + int(v["num_hidden_layers"]) * layer + 2 * h + h * text_hidden + h


def read_config(path: str | Path) -> dict:
    """config.json of a model directory (or the file itself); ValueError with a one-line reason."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read {file}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} line {exc.lineno}: {exc.msg}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{file} is not UTF-8 text") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} is not a JSON object (a model config maps names to values)")
    return config


# --- the memory model --------------------------------------------------------------------------------


def weight_bytes(shape: Shape, weights: str = "bf16", act: str = "bf16", kind: str = "cuda") -> int:
    """Weights at `weights`; quantized dtypes apply to the linear layers only. On CUDA (bitsandbytes, quanto) the
    embeddings, lm_head and norms stay at 16 bits. On a CPU (kernels/packed.py) they stay at `act`, int4 codes
    carry a bf16 scale and zero per 32 weights, int8 a bf16 scale per row, and the output layer gets an int8
    copy (a tied one too: the embeddings keep their table for the lookups)."""
    p = shape.params()
    if not quantized(weights):
        return int(shape.total_params() * elem_bytes(weights))
    if kind != "cpu":
        return int(p["linear"] * elem_bytes(weights)) + 2 * (p["embed"] + p["lm_head"] + p["other"])
    per_weight = 0.5 + 4 / 32 if weights == "int4" else 1.0
    head = shape.vocab * (shape.hidden + 2)
    return int(p["linear"] * per_weight + head + elem_bytes(act) * (p["embed"] + p["lm_head"] + p["other"]))


def kv_unit_bytes(shape: Shape, kv: str = "bf16", compact: bool = False) -> int:
    """One unit in every layer whose cache grows (a hybrid's global layers) and KV head: K and V at `kv`
    (quantized: packed codes with an fp16 scale and zero per group of head_dim), an fp32 score and an int64
    position; in compact positions at bf16/fp16, the key's int8 remainder that keeps re-rotated keys exact
    (engine/cache.py)."""
    return int(round(shape.global_layers * shape.kv_heads * _head_bytes(shape, kv, compact)))


def _head_bytes(shape: Shape, kv: str, compact: bool) -> float:
    """One unit in one layer and KV head (kv_unit_bytes)."""
    d = shape.head_dim
    if quantized(kv):
        return 2 * d * dtype_bits(kv) // 8 + 4 * (d // group_size(d)) * 2 + 4 + 8
    return 2 * d * elem_bytes(kv) + 4 + 8 + _rest_bytes(shape, kv, compact)


def window_units(shape: Shape, chunk: int) -> int:
    """Units the window layers hold at most, over all of them: each its window - 1 past units and, while a chunk
    is read, that chunk's (a window layer never holds more, however long the document)."""
    return sum(k.window - 1 + chunk for k in shape.of_kind(WINDOW))


def window_bytes(shape: Shape, act: str, chunk: int, compact: bool = False) -> int:
    """The window layers' cache while a chunk is read (window_units): plain units at the activations' dtype
    (a quantized cache packs what eviction keeps, never a window), with their score and position."""
    return int(round(window_units(shape, chunk) * shape.kv_heads * _head_bytes(shape, act, compact)))


def state_bytes(shape: Shape, act: str) -> int:
    """The linear-attention layers' fixed state (transformers' Gated DeltaNet, models/qwen3_next): per layer a
    recurrent state [v heads, k dim, v dim] at `state_dtype` (fp32) and a convolution state
    [2 x k heads x k dim + v heads x v dim, conv kernel] at the activations' dtype."""
    kh, vh, kd, vd, kernel = shape.linear
    recurrent = vh * kd * vd * elem_bytes(shape.state_dtype)
    conv = (2 * kh * kd + vh * vd) * kernel * elem_bytes(act)
    return int(len(shape.of_kind(STATE)) * (recurrent + conv))


def group_size(head_dim: int) -> int:
    """head_dim elements per scale and zero of a quantized unit (kernels/quant.py's rule)."""
    g = min(KV_GROUP, head_dim)
    while head_dim % g:
        g //= 2
    return g


def _rest_bytes(shape: Shape, kv: str, compact: bool) -> int:
    """The int8 key remainder per unit and KV head of a plain cache in compact bf16/fp16 (engine/cache.py)."""
    return shape.head_dim * REST_BYTES if compact and kv in ("bf16", "fp16") else 0


def kv_tail_bytes(shape: Shape, kv: str, act: str, chunk: int) -> int:
    """A quantized cache's full-precision tail (chunk + RESIDUAL units per global layer, at `act`); 0 for a
    plain one."""
    if not quantized(kv):
        return 0
    return int((chunk + RESIDUAL) * shape.global_layers * shape.kv_heads * 2 * shape.head_dim * elem_bytes(act))


def evict_bytes(shape: Shape, kv: str, act: str, budget: int, *, per_head: bool, compact: bool) -> int:
    """An eviction's scratch in one layer: the kept units gathered before they move into place. A quantized cache
    gathers packed rows (every head); a plain one gathers K and V (and, compact in bf16/fp16, the remainders),
    one KV head at a time on the CPU with the rotation's fp32 temporaries, every head at once on a GPU."""
    if quantized(kv):
        return budget * (kv_unit_bytes(shape, kv) // max(shape.global_layers, 1))
    d, heads = shape.head_dim, 1 if per_head else shape.kv_heads
    kept = 2 * d * elem_bytes(kv) + _rest_bytes(shape, kv, compact)
    rotation = 6 * d * 4 if compact and per_head else 0  # fp32 key, cos/sin halves, rotated halves (kernels/rope.py)
    return int(budget * heads * (kept + rotation))


def kv_copy_bytes(shape: Shape, kv: str, act: str, kv_len: int) -> int:
    """A quantized cache's transient copy of one layer (`kv_len` units, K and V at `act`) plus the temporaries of
    dequantizing one block (codes unpacked, fp32 math, the rotation); 0 for a plain cache."""
    if not quantized(kv):
        return 0
    per_unit = shape.kv_heads * shape.head_dim
    return int(2 * kv_len * per_unit * elem_bytes(act) + BLOCK_UNITS * per_unit * 40)


def split_bytes(unit: int, depth: int, offloaded: int, prompt: int, answer: int = 0, held: int = 0) -> tuple[int, int]:
    """(device, host) bytes of the K/V of `prompt` new prompt tokens and `answer` answer tokens (`unit` bytes a
    token over all `depth` layers) when `offloaded` layers keep the prompt in host memory. Reading streams up
    to two of those through the device whole (the `held` tokens too); the answer stays on the device."""
    streamed = min(2, offloaded)
    new = prompt + answer
    device = unit * ((depth - offloaded) * new + streamed * (held + new) + offloaded * answer) // depth
    return device, unit * offloaded * prompt // depth


def kv_units(budget: int, chunk: int, local: int, max_new: int) -> int:
    """The cache's peak length per KV head: what Engine.new_cache reserves for an evicting policy."""
    return budget + chunk + local + max_new


def activation_bytes(shape: Shape, chunk: int, act: str = "bf16") -> int:
    """One chunk through one layer (freed layer by layer: the widest kind's) plus the last position's fp32
    logits. A linear-attention layer adds the fp32 working set of transformers' chunked gated delta rule."""
    q, kv = shape.q_heads * shape.head_dim * (2 if shape.q_gate else 1), shape.kv_heads * shape.head_dim
    per_token = (4 * shape.hidden + 3 * shape.mlp_width + q + 2 * kv) * elem_bytes(act)
    kh, vh, kd, vd, _ = shape.linear
    if shape.of_kind(STATE):
        projected = (4 * shape.hidden + 3 * shape.mlp_width + 2 * kh * kd + 2 * vh * vd + 2 * vh) * elem_bytes(act)
        # q, k (repeated to the v heads), v, k_beta, v_beta, the solved values and decayed keys, the output, and
        # three 64 x 64 within-chunk matrices per 64 tokens, in fp32 (qwen3_next's torch_chunk_gated_delta_rule)
        per_token = max(per_token, projected + 4 * vh * (6 * kd + 4 * vd + 3 * 64))
    return int(chunk * per_token) + 4 * shape.vocab


def scratch_bytes(shape: Shape, chunk: int, kv_len: int, act: str = "bf16") -> int:
    """One chunk's attention in a global layer: K and V repeated to the query heads over `kv_len` keys, the
    boolean mask, and the attention output. No attention matrix: SDPA's kernels work in blocks."""
    repeated = 2 * shape.q_heads * kv_len * shape.head_dim * elem_bytes(act) if shape.q_heads != shape.kv_heads else 0
    return int(repeated + chunk * kv_len + chunk * shape.q_heads * shape.head_dim * elem_bytes(act))


def heads_bytes(shape: Shape, d_r: int, chunk: int, act: str = "bf16", kvzap: dict | None = None) -> int:
    """Retaining heads (one per layer the policy scores: a hybrid's global layers): weights (stored at the
    model's dtype) and one chunk's input and hidden layer. `kvzap`: a KVzap scorer's release config instead
    (engine/kvzap.py): its modules of the scored layers and one chunk's hidden layer and scores."""
    if kvzap is not None:
        from localchat.engine.kvzap import parameters

        width = kvzap.get("hidden_dim") or 0
        b = elem_bytes(act)
        return int((parameters(kvzap, shape.global_layers) + chunk * (width + kvzap["output_dim"])) * b)
    if d_r <= 0:
        return 0
    in_dim = (shape.q_heads + 2 * shape.kv_heads) * shape.head_dim
    b = elem_bytes(act)
    weights = shape.global_layers * (in_dim * d_r + d_r * shape.kv_heads) * b
    return int(weights + chunk * (in_dim + d_r) * b)


@dataclass
class Estimate:
    weights: int
    kv: int  # the layers whose cache grows with the document (a hybrid's global layers)
    activations: int
    scratch: int
    heads: int
    margin: int
    notes: list[str] = field(default_factory=list)
    scores: int = 0  # what the policy's scoring adds (attention rows in fp32, CORM's messages)
    kv_copy: int = 0  # a quantized cache's full-precision copy of one layer during a forward
    evict: int = 0  # an eviction's scratch in one layer (evict_bytes)
    window: int = 0  # a hybrid's sliding-window layers while a chunk is read (window_bytes)
    state: int = 0  # a hybrid's linear-attention layers' fixed state (state_bytes)
    scorer: str = "retaining heads"  # what scores the units ("KVzap scorer")

    @property
    def used(self) -> int:
        """Peak bytes the engine itself uses (everything but the margin)."""
        transient = max(self.activations + self.scratch + self.kv_copy, self.evict)  # a forward, or an eviction
        return self.weights + self.kv + self.window + self.state + transient + self.heads + self.scores

    @property
    def total(self) -> int:
        return self.used + self.margin

    @property
    def cache(self) -> int:
        """The whole cache: the growing layers', the windows and the fixed state."""
        return self.kv + self.window + self.state

    def rows(self) -> list[tuple[str, int]]:
        hybrid = self.window or self.state
        rows = [("weights", self.weights), ("KV cache (global)" if hybrid else "KV cache", self.kv)]
        rows += [("KV cache (window)", self.window)] if self.window else []
        rows += [("linear state", self.state)] if self.state else []
        rows += [("KV copy (1 layer)", self.kv_copy)] if self.kv_copy else []
        rows += [("activations", self.activations), ("attention scratch", self.scratch)]
        forward = self.activations + self.scratch + self.kv_copy  # the rows add up to the total:
        rows += [("eviction, beyond", self.evict - forward)] if self.evict > forward else []  # the larger transient
        rows += [(self.scorer, self.heads)]
        return rows + ([("policy scores", self.scores)] if self.scores else []) + [("margin", self.margin)]


def estimate(shape: Shape, *, budget: int, chunk: int, local: int = 0, max_new: int = 0, weights: str = "bf16",
             kv: str = "bf16", act: str = "bf16", d_r: int = 0, margin: int = 0,
             weights_exact: int | None = None, policy=None, compact: bool = False, kind: str = "cuda",
             kvzap: dict | None = None) -> Estimate:
    """Peak memory of a LOCRET prefill + answer at these settings. `weights_exact`: the loaded model's bytes;
    `policy`: the Policy, whose scoring may need memory of its own (its `score_bytes`), or None. The budget
    bounds the global layers; a hybrid's window layers hold their window and the chunk being read, its
    linear-attention layers their fixed state, whatever the budget or the document."""
    units = kv_units(budget, chunk, local, max_new)
    return Estimate(
        weights=weights_exact if weights_exact is not None else weight_bytes(shape, weights, act, kind),
        kv=units * kv_unit_bytes(shape, kv, compact) + kv_tail_bytes(shape, kv, act, chunk),
        window=window_bytes(shape, act, max(chunk, 1), compact),
        state=state_bytes(shape, act),
        kv_copy=kv_copy_bytes(shape, kv, act, budget + local + max(chunk, max_new)),
        evict=evict_bytes(shape, kv, act, budget + local, per_head=kind == "cpu", compact=compact),
        activations=activation_bytes(shape, chunk, act),
        scratch=scratch_bytes(shape, chunk, budget + chunk + local, act),
        heads=heads_bytes(shape, d_r, chunk, act, kvzap),
        scorer="KVzap scorer" if kvzap is not None else "retaining heads",
        margin=margin,
        scores=policy.score_bytes(shape.global_layers, shape.q_heads, shape.kv_heads, chunk, budget + chunk + local)
        if policy is not None else 0,
    )


def model_bytes(model) -> int:
    """Bytes of a loaded model's parameters and buffers (tied weights counted once); quantized layers count
    their packed data and scales (engine/quantize.py)."""
    from localchat.engine.quantize import weight_bytes

    return weight_bytes(model)


# --- measuring ----------------------------------------------------------------------------------------


def _proc_status_bytes(field: str) -> int:
    """A byte figure of /proc/self/status (e.g. VmRSS, VmHWM); elsewhere the peak RSS so far."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return max_rss_bytes()


def rss_bytes() -> int:
    """Resident set size of this process now."""
    return _proc_status_bytes("VmRSS")


def reset_peak_rss() -> bool:
    """Reset the process's peak RSS (VmHWM) to the current RSS (Linux >= 4.0). False where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """VmHWM: the peak RSS since start or since reset_peak_rss()."""
    return _proc_status_bytes("VmHWM")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def max_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
