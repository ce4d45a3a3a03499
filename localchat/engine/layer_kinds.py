"""What each decoder layer keeps, read from a model's config (a config.json dict or a transformers config); no torch.

  global  full attention: its cache grows with the document; the policy's budget bounds it
  window  sliding-window attention: holds at most its window (`window` - 1 past tokens between forwards)
  state   linear attention (Gated DeltaNet): a fixed-size recurrent and convolution state

`rope` is False for a layer that applies no rotary embedding (SmolLM3's NoPE layers): its keys never move.
The defaults below are transformers' own for configs that leave `layer_types` out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GLOBAL, WINDOW, STATE = "global", "window", "state"
_TYPES = {"full_attention": GLOBAL, "sliding_attention": WINDOW, "linear_attention": STATE}
_PATTERNS = {  # model_type -> the layer type of layer i when the config lists none
    "gemma3_text": lambda i, c: "sliding_attention" if (i + 1) % int(c.get("sliding_window_pattern", 6)) else "full_attention",
    "gpt_oss": lambda i, c: "sliding_attention" if (i + 1) % 2 else "full_attention",
    "qwen3_next": lambda i, c: "linear_attention" if (i + 1) % int(c.get("full_attention_interval", 4)) else "full_attention",
    "qwen3_5_text": lambda i, c: "linear_attention" if (i + 1) % int(c.get("full_attention_interval", 4)) else "full_attention",
}
_PATTERNS["gemma3"] = _PATTERNS["gemma3_text"]
_PATTERNS["qwen3_5"] = _PATTERNS["qwen3_5_moe"] = _PATTERNS["qwen3_5_moe_text"] = _PATTERNS["qwen3_5_text"]


@dataclass(frozen=True)
class LayerKind:
    kind: str  # GLOBAL, WINDOW or STATE
    window: int | None = None  # WINDOW: tokens a query sees, itself included (transformers' sliding_window)
    rope: bool = True

    @property
    def grows(self) -> bool:
        """True when the layer's cache grows with the document (what eviction bounds)."""
        return self.kind == GLOBAL


def _as_dict(config: Any) -> dict:
    if isinstance(config, dict):
        text = config.get("text_config")
        return {**config, **text} if isinstance(text, dict) else config
    get_text = getattr(config, "get_text_config", None)
    config = get_text(decoder=True) if callable(get_text) else config
    return config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))


def layer_kinds(config: Any) -> list[LayerKind]:
    """One LayerKind per decoder layer of `config`."""
    c = _as_dict(config)
    n = int(c["num_hidden_layers"])
    kind = str(c.get("model_type") or "")
    types = c.get("layer_types")
    if not types:
        pattern = _PATTERNS.get(kind)
        types = [pattern(i, c) for i in range(n)] if pattern else ["full_attention"] * n
    window = c.get("sliding_window")
    rope = c.get("no_rope_layers") or [1] * n  # SmolLM3: 1 = the layer uses RoPE
    out = []
    for i, t in enumerate(types[:n]):
        k = _TYPES.get(t)
        if k is None:
            raise ValueError(f"layer {i} has a kind the engine does not know ({t})")
        if k == WINDOW and not window:
            k = GLOBAL  # a sliding layer without a window attends to everything
        out.append(LayerKind(k, int(window) if k == WINDOW else None, bool(rope[i])))
    return out


SINKS = ("gpt_oss",)  # model types whose attention adds learned per-head sinks (SDPA cannot compute them)


def has_sinks(config: Any) -> bool:
    """True when the model's attention holds per-head sinks: its own attention function must stay."""
    return str(_as_dict(config).get("model_type") or "") in SINKS


def hybrid(kinds: list[LayerKind]) -> bool:
    """True when some layer's cache does not grow with the document."""
    return any(not k.grows for k in kinds)


def summary(kinds: list[LayerKind]) -> str:
    """`"3 global, 15 window (512)"`: the layers by kind, for `plan` and error messages."""
    parts = []
    for k in (GLOBAL, WINDOW, STATE):
        layers = [x for x in kinds if x.kind == k]
        if layers:
            windows = sorted({x.window for x in layers if x.window})
            parts.append(f"{len(layers)} {k}" + (f" ({', '.join(map(str, windows))})" if windows else ""))
    nope = sum(not x.rope for x in kinds)
    return ", ".join(parts) + (f"; {nope} without RoPE" if nope else "")
