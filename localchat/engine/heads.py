"""LOCRET retaining heads: one small MLP per layer that scores each cache unit once, at insertion.

R(x_k) = fc2(act(fc1([Q_k | K_k | V_k])))  with Q, K, V the pre-RoPE projections of token k (bias
included), fc1: (H_q + 2·H_kv)·d_head -> d_R and fc2: d_R -> H_kv, no biases, act = the model's
hidden_act (docs/methods/locret.md §2.3). Weights are safetensors with a JSON config next to them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from localchat.engine import weights_check
from localchat.engine.heads_files import CONFIG, WEIGHTS, read_config
from localchat.engine.layer_kinds import layer_kinds
from localchat.errors import UserError, first_line


def attention_modules(model) -> list[nn.Module | None]:
    """The self-attention module of every decoder layer (Llama / Qwen / Mistral / Phi-3 layouts); None for a
    layer without one (a linear-attention layer)."""
    return [getattr(layer, "self_attn", None) for layer in model.model.layers]


def head_shape(model) -> dict:
    """The head-relevant shape of a model (or of a transformers config)."""
    cfg = getattr(model, "config", model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = {
        "layers": cfg.num_hidden_layers,
        "q_heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "head_dim": head_dim,
        "act": getattr(cfg, "hidden_act", None) or cfg.hidden_activation,  # Gemma names it hidden_activation
    }
    if getattr(cfg, "model_type", "") in GATED_Q:
        shape["q_gate"] = True  # the q projection also gives the output gate: 2 x H_q x d wide
    grows = [i for i, kind in enumerate(layer_kinds(cfg)) if kind.grows]
    if len(grows) < shape["layers"]:  # a hybrid: heads only for the layers whose cache grows (the evicted ones)
        shape["scored"] = grows
    return shape


GATED_Q = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def qkv_width(shape: dict) -> int:
    """The width of a layer's pre-RoPE q|k|v row (what a head reads)."""
    q = shape["q_heads"] * (2 if shape.get("q_gate") else 1)
    return (q + 2 * shape["kv_heads"]) * shape["head_dim"]


class RetainingHead(nn.Module):
    def __init__(self, in_dim: int, d_r: int, kv_heads: int, act: str):
        super().__init__()
        self.fc1 = nn.Linear(in_dim, d_r, bias=False)
        from transformers.activations import ACT2FN  # at first use: importing heads stays cheap

        self.act = ACT2FN[act]
        self.fc2 = nn.Linear(d_r, kv_heads, bias=False)

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        """`qkv` `[T, (H_q + 2·H_kv)·d]` -> scores `[T, H_kv]`."""
        return self.fc2(self.act(self.fc1(qkv)))


class RetainingHeads(nn.Module):
    def __init__(self, shape: dict, d_r: int = 1024, meta: dict | None = None):
        super().__init__()
        self.shape = dict(shape)
        self.d_r = d_r
        self.meta = dict(meta or {})
        in_dim = qkv_width(shape)
        self.scored = list(shape.get("scored", range(shape["layers"])))  # the layers with a head
        # keyed by layer index: a model's every layer gives `layers.0.fc1.weight`, ... as a list of heads would
        self.layers = nn.ModuleDict(
            {str(i): RetainingHead(in_dim, d_r, shape["kv_heads"], shape["act"]) for i in self.scored})

    def head(self, i: int) -> RetainingHead | None:
        """Layer i's head (None: a layer the heads do not score, one that does not grow with the document)."""
        return self.layers[str(i)] if str(i) in self.layers else None

    @classmethod
    def random(cls, model, d_r: int = 1024, seed: int = 0) -> RetainingHeads:
        """Untrained heads (the paper's ablation: eviction by noise); `model` may also be a `head_shape` dict."""
        torch.manual_seed(seed)
        return cls(model if isinstance(model, dict) else head_shape(model), d_r, {"kind": "random", "seed": seed})

    def save(self, directory: str | Path, dtype: torch.dtype = torch.float16) -> None:
        """Weights as `dtype` (fp16 halves the shipped file; scores only rank units) + a JSON config."""
        save_heads(Path(directory), {k: v.detach().to(dtype) for k, v in self.state_dict().items()}, self.shape,
                   self.d_r, self.meta)

    @classmethod
    def load(cls, directory: str | Path) -> RetainingHeads:

        directory = Path(directory)
        if (directory / weights_check.STAMP).is_file():  # fetched heads carry their sha256: never use damaged ones
            damage = weights_check.problem(directory)
            if damage:
                raise UserError(f"the retaining heads in {directory} are damaged ({damage}); fetch them again "
                                f"(`localchat heads fetch MODEL` after deleting {directory}) or pass other --heads")
        config = read_config(directory)
        try:
            tensors = load_file(directory / WEIGHTS)
        except Exception as exc:  # noqa: BLE001 - OSError, or safetensors' own error for a damaged file
            raise UserError(f"cannot read retaining heads in {directory}: {WEIGHTS} is missing or damaged "
                            f"({first_line(exc, 120)}); train, import or fetch "
                            f"them again") from None
        try:
            shape, d_r = config.pop("shape"), config.pop("d_r")
            heads = cls(shape, d_r, config)
            missing, unexpected = heads.load_state_dict(tensors, strict=False)
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:  # not heads, or other shapes
            raise UserError(f"{directory} does not hold retaining heads localchat can read ({type(exc).__name__}: "
                            f"{first_line(exc, 120)}); train or import them again") from None
        if missing or unexpected:  # untrained heads evict at random: never load them silently
            raise UserError(f"retaining heads in {directory} do not match: missing {missing[:3]}, unexpected {unexpected[:3]}")
        return heads

    def check_fits(self, model) -> None:

        if head_shape(model) != self.shape:
            raise UserError(f"these retaining heads were made for shape {self.shape}, not {head_shape(model)}")


OFFICIAL_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.fc([12])\.weight$")


def official_heads(state: dict) -> dict[str, torch.Tensor]:
    """The head tensors of an official state dict (`model.layers.N.self_attn.fc1/fc2.weight`), under our keys
    (`layers.N.fc1.weight`); every other tensor is left out."""
    found = {}
    for key, value in state.items():
        m = OFFICIAL_KEY.search(key)
        if m:
            found[f"layers.{m.group(1)}.fc{m.group(2)}.weight"] = value
    return found


def read_official(path: Path) -> dict[str, torch.Tensor]:
    """The head tensors of one official file: safetensors, or a `torch.save` state dict (the releases' .bin),
    read with weights_only=True; one UserError line when the file is neither."""

    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), "pt") as st:
                return official_heads({k: st.get_tensor(k) for k in st.keys() if OFFICIAL_KEY.search(k)})
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a file torch.save wrote in its legacy format cannot be mapped
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - OSError, pickle and zip errors, safetensors' own
        why = first_line(exc, 120)
        raise UserError(f"cannot read {path} as LOCRET retaining heads (a .bin state dict or .safetensors): {why}") \
            from None
    if not isinstance(state, dict):
        raise UserError(f"{path} holds a {type(state).__name__}, not a state dict of LOCRET retaining heads")
    return official_heads(state)


def check_official(found: dict[str, torch.Tensor], shape: dict, source: str, d_r: int | None = None) -> int:
    """d_R when `found` holds heads for every layer of a model of `shape` (fc1 `[d_R, (H_q + 2 H_kv) d]`,
    fc2 `[H_kv, d_R]`, floating point; `d_r` when given is the only width allowed); else one UserError line."""

    if not found:
        raise UserError(f"no LOCRET retaining-head weights (model.layers.N.self_attn.fc1/fc2.weight) in {source}")
    want = {f"layers.{i}.fc{j}.weight" for i in range(shape["layers"]) for j in (1, 2)}
    if set(found) != want:
        layers = len({k.split(".")[1] for k in found})
        missing = sorted(want - set(found), key=lambda k: int(k.split(".")[1]))
        raise UserError(f"{source} does not fit: it has retaining heads for {layers} layers, the model has "
                        f"{shape['layers']}" + (f" (missing {missing[0]})" if layers == shape["layers"] else ""))
    width = d_r or found["layers.0.fc1.weight"].shape[0]
    in_dim = qkv_width(shape)
    for key in sorted(found, key=lambda k: (int(k.split(".")[1]), k)):
        t = found[key]
        expected = (width, in_dim) if key.endswith("fc1.weight") else (shape["kv_heads"], width)
        if tuple(t.shape) != expected:
            raise UserError(f"{source} does not fit: {key} is {list(t.shape)}, expected {list(expected)} "
                            f"(heads for another model?)")
        if not t.is_floating_point():
            raise UserError(f"{source}: {key} holds {t.dtype}, not floating-point weights")
    return width


def save_heads(directory: Path, tensors: dict[str, torch.Tensor], shape: dict, d_r: int, meta: dict) -> None:
    """Heads as localchat reads them: `tensors` (our keys, at their own dtype) in WEIGHTS, the config in CONFIG."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, directory / WEIGHTS)
    config = {"shape": dict(shape), "d_r": d_r, **meta}
    (directory / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def import_official(source: str | Path, config, out: str | Path) -> Path:
    """Heads from an official LOCRET file (a release's heads-only .bin, or a checkpoint with the heads inside:
    a file, or a directory of .safetensors or .bin files) for the model of `config`, saved in `out` at the
    release's dtype (bf16: converted exactly)."""

    source = Path(source)
    if source.is_dir():
        files = sorted(source.glob("*.safetensors")) or sorted(source.glob("*.bin"))
    elif source.is_file():
        files = [source]
    else:
        raise UserError(f"{source} does not exist: pass the release's .bin file (or a checkpoint directory)")
    found: dict[str, torch.Tensor] = {}
    for f in files:
        found.update(read_official(f))
    shape = head_shape(config)
    d_r = check_official(found, shape, str(source))
    save_heads(Path(out), found, shape, d_r, {"kind": "imported", "source": str(source)})
    return Path(out)


def hook_qkv(model, on_qkv) -> list:
    """Forward hooks that call `on_qkv(layer_idx, qkv)` with the pre-RoPE `[T, (H_q + 2·H_kv)·d]` of each
    layer (q/k/v projections, or a fused qkv_proj); return the hook handles."""
    handles = []
    for i, attn in enumerate(attention_modules(model)):
        if attn is None:
            continue
        if hasattr(attn, "qkv_proj"):
            handles.append(attn.qkv_proj.register_forward_hook(lambda m, a, out, i=i: on_qkv(i, out[0])))
            continue
        parts: dict[str, torch.Tensor] = {}
        for name in ("q", "k", "v"):
            def hook(module, args, out, i=i, name=name, parts=parts):
                parts[name] = out[0]
                if name == "v":
                    on_qkv(i, torch.cat([parts.pop("q"), parts.pop("k"), parts.pop("v")], dim=-1))
            handles.append(getattr(attn, f"{name}_proj").register_forward_hook(hook))
    return handles


HEADS_RANGE = "localchat.heads"  # the profiler's name for a chunk's scoring (bench/experiments/gpu_prefill_profile.py)


class UnitScorer:
    """A trained module per scored layer turns each new token's input `[T, D]` into scores `[H_kv, T]`; after a
    forward, `take(i)` gives layer i's. A one-token forward (a decoding step) is not scored at once: its input
    waits in a queue, and `flush()` scores every queued token of every layer in one batch when the scores are next
    needed (before an eviction, at the end of a generation). The module is per token, so the scores are the same.
    Subclasses put the hooks that feed `take_input` (LOCRET's heads: q/k/v; KVzap: the input norm)."""

    range_name = HEADS_RANGE

    def __init__(self, model, heads: nn.Module, layers: int):
        p = next(model.parameters())
        self.heads = heads.to(device=p.device, dtype=p.dtype if p.dtype != torch.float16 else torch.float32)
        self.heads.eval().requires_grad_(False)
        self.dtype = next(self.heads.parameters()).dtype
        self.by_layer = [self.heads.head(i) for i in range(layers)]  # None: a layer without a module
        self.last = max(i for i, m in enumerate(self.by_layer) if m is not None)
        self.new: list[torch.Tensor | None] = [None] * layers
        self.queue: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        self.handles: list = []

    def take_input(self, i: int, x: torch.Tensor) -> None:
        """Layer i's input for its module, `[T, D]`; a chunk's scoring is a profiler range (`range_name`)."""
        if self.by_layer[i] is None:
            return
        if x.shape[0] == 1:
            self.queue[i].append(x)
        else:
            with torch.profiler.record_function(self.range_name):
                self.new[i] = self._run(i, x)

    def _run(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self.by_layer[i](x.to(self.dtype)).T.float()  # [H_kv, T]

    def take(self, i: int) -> torch.Tensor:
        scores, self.new[i] = self.new[i], None
        return scores

    def queued(self) -> int:
        """Single tokens waiting to be scored (the same count in every scored layer)."""
        return len(self.queue[self.last])

    def flush(self) -> list[torch.Tensor | None]:
        """Scores `[H_kv, P]` per layer of the P queued tokens, oldest first; empties the queue."""
        out = [self._run(i, torch.cat(q)) if q else None for i, q in enumerate(self.queue)]
        self.queue = [[] for _ in self.queue]
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class HeadScorer(UnitScorer):
    """LOCRET's retaining heads on each layer's pre-RoPE q/k/v (forward hooks on the projections)."""

    def __init__(self, model, heads: RetainingHeads):
        heads.check_fits(model)
        super().__init__(model, heads, heads.shape["layers"])
        self.handles = hook_qkv(model, self.take_qkv)

    def take_qkv(self, i: int, qkv: torch.Tensor) -> None:
        """Layer i's pre-RoPE q/k/v `[T, (H_q + 2 H_kv) d]` (what the hooks, or a C++ decode step, give)."""
        self.take_input(i, qkv)
