"""KVzap scorers (NVIDIA, 2026, arXiv 2601.07891; NVIDIA/kvpress `kvzap_press.py`): one small module per
layer maps the hidden state a layer's attention reads (after its input norm) to one log-scale score per KV head.

A release is a folder as kvpress's `save_pretrained` writes it (the hub's `nvidia/KVzap-{linear,mlp}-<model>`):
  config.json        {"model_type": "kvzap", "input_dim": hidden size, "output_dim": KV heads,
                      "hidden_dim": null (linear) or the MLP's width, "n_modules": layers, ...}
  model.safetensors  linear: `layers.<i>.weight` [H_kv, D], `layers.<i>.bias` [H_kv]
                     mlp:    `layers.<i>.0.weight` [W, D], `layers.<i>.0.bias` [W],
                             `layers.<i>.2.weight` [H_kv, W], `layers.<i>.2.bias` [H_kv]   (Linear, GELU, Linear)
localchat reads such a folder as it is (`--heads DIR`), fetched ones too (planning/heads_fetch.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from localchat.errors import UserError, first_line

CONFIG, WEIGHTS = "config.json", "model.safetensors"
KEY = re.compile(r"^layers\.(\d+)\.(?:(0|2)\.)?(weight|bias)$")


def is_kvzap(directory: Path | str | None) -> bool:
    """Whether `directory` holds a KVzap scorer (its config.json says model_type "kvzap"). No torch."""
    if directory is None:
        return False
    try:
        config = json.loads((Path(directory) / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") == "kvzap"


def read_config(directory: Path | str) -> dict:
    """The release's config.json, checked: input_dim, output_dim, n_modules positive ints, hidden_dim null or one.
    One UserError line otherwise. No torch."""
    path = Path(directory) / CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read the KVzap scorer in {directory}: {first_line(exc, 160)}") from None
    if not isinstance(config, dict) or config.get("model_type") != "kvzap":
        raise UserError(f"{path} is not a KVzap config (model_type \"kvzap\")")
    for key in ("input_dim", "output_dim", "n_modules"):
        if not isinstance(config.get(key), int) or isinstance(config.get(key), bool) or config[key] < 1:
            raise UserError(f"{path}: {key} must be a positive integer (got {config.get(key)!r})")
    hidden = config.get("hidden_dim")
    if hidden is not None and (not isinstance(hidden, int) or isinstance(hidden, bool) or hidden < 1):
        raise UserError(f"{path}: hidden_dim must be null (linear) or a positive integer (got {hidden!r})")
    return config


def variant(config: dict) -> str:
    return "linear" if config.get("hidden_dim") is None else "mlp"


def parameters(config: dict, layers: int | None = None) -> int:
    """The scorer's parameter count (over `layers` of its modules; default all)."""
    d, h, w = config["input_dim"], config["output_dim"], config.get("hidden_dim")
    per = d * h + h if w is None else d * w + w + w * h + h
    return per * (config["n_modules"] if layers is None else layers)


def check_fits(config: dict, hidden: int, kv_heads: int, layers: int, source: str) -> None:
    """One UserError line when a scorer of `config` was not made for a model of this shape."""
    want = {"input_dim": hidden, "output_dim": kv_heads, "n_modules": layers}
    wrong = [f"{k} {config[k]} (the model: {v})" for k, v in want.items() if config[k] != v]
    if wrong:
        raise UserError(f"the KVzap scorer in {source} was made for another model: {', '.join(wrong)}")


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a release of `config` holds, with its shape."""
    d, h, w = config["input_dim"], config["output_dim"], config.get("hidden_dim")
    out: dict[str, tuple[int, ...]] = {}
    for i in range(config["n_modules"]):
        if w is None:
            out.update({f"layers.{i}.weight": (h, d), f"layers.{i}.bias": (h,)})
        else:
            out.update({f"layers.{i}.0.weight": (w, d), f"layers.{i}.0.bias": (w,),
                        f"layers.{i}.2.weight": (h, w), f"layers.{i}.2.bias": (h,)})
    return out


def check_tensors(shapes: dict[str, tuple[int, ...]], config: dict, source: str) -> None:
    """`shapes` (key -> shape, as the safetensors header lists them) are exactly a release of `config`."""
    want = expected_shapes(config)
    missing = sorted(set(want) - set(shapes), key=_order)
    extra = sorted(set(shapes) - set(want), key=_order)
    if missing or extra:
        what = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
        raise UserError(f"{source} is not the KVzap scorer its config.json describes ({what}; "
                        f"{len(shapes)} tensors, {len(want)} expected)")
    for key in sorted(want, key=_order):
        if tuple(shapes[key]) != want[key]:
            raise UserError(f"{source}: {key} is {list(shapes[key])}, its config.json says {list(want[key])}")


def _order(key: str):
    m = KEY.match(key)
    return (int(m.group(1)), key) if m else (-1, key)


def header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The tensor shapes a safetensors file lists in its header (no tensor read); floating dtypes only."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as st:
            shapes = {}
            for k in st.keys():
                sl = st.get_slice(k)
                if sl.get_dtype() not in ("F32", "F16", "BF16", "F64"):
                    raise UserError(f"{path}: {k} holds {sl.get_dtype()}, not floating-point weights")
                shapes[k] = tuple(sl.get_shape())
            return shapes
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - OSError, or safetensors' own error for a damaged file
        raise UserError(f"cannot read {path} as KVzap weights (safetensors): {first_line(exc, 120)}") from None


def check_release(directory: Path | str, source: str | None = None) -> dict:
    """The config of the release in `directory` once its weights' names and shapes match it (no tensor read)."""
    directory = Path(directory)
    config = read_config(directory)
    weights = directory / WEIGHTS
    if not weights.is_file():
        raise UserError(f"no {WEIGHTS} beside {directory / CONFIG}: the KVzap release is incomplete")
    check_tensors(header_shapes(weights), config, source or str(directory))
    return config
