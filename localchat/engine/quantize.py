"""Weight precision: `--weights nf4|int8|int4|bf16|fp16|fp32`.

  fp32 / bf16 / fp16  the model loads at that dtype.
  nf4                 CUDA only: bitsandbytes NF4 with double quantization and bf16 compute (at load time).
  int8                CUDA: bitsandbytes LLM.int8(); CPU: torch's packed int8 kernels (kernels/packed.py, per row).
  int4                CPU: torch's packed int4 layout (kernels/packed.py, groups of 32 with scale and zero), packed
                      once per model and kept on disk (engine/packed_store.py);
                      CUDA: optimum-quanto int4 (groups of 128 weights, scale + shift).

The decoder's linear layers are quantized; embeddings and norms stay at the activation dtype, and the retaining
heads are separate modules left untouched. On the CPU the output layer gets an int8 copy too (it is a fifth of
SmolLM2's weights and the largest single read of a decode step; tied to the embeddings, the fp32 table stays for
the lookups); on CUDA it stays in full precision. A GGUF source is dequantized by transformers at conversion and
re-quantized here by our choice, not kept in its own format.
"""

from __future__ import annotations

import torch

from localchat.engine.precision import WEIGHTS, check_quant  # noqa: F401 - WEIGHTS: the --weights values
from localchat.errors import UserError

FLOAT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KEEP = ["lm_head"]  # linear layers left unquantized (embeddings are not linear layers)


def check(weights: str | None, device: torch.device) -> None:
    """A UserError naming the problem for an unknown value or nf4 without CUDA."""
    check_quant(weights, None)
    if weights == "nf4" and device.type != "cuda":
        raise UserError("--weights nf4 needs a CUDA GPU (bitsandbytes); on this CPU use --weights int4 or int8")


def load_dtype(weights: str | None, default: torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """The dtype from_pretrained loads at: the float choice, else the activation dtype of the device.

    bitsandbytes int8 on CUDA computes in fp16: at bf16 it casts the inputs of every int8 matmul and warns each
    time (1,680 warnings for one short answer on an H100), so int8 on CUDA loads at fp16."""
    if weights == "int8" and device is not None and device.type == "cuda":
        return torch.float16
    return FLOAT.get(weights or "", default)


def bnb_config(weights: str | None, device: torch.device):
    """transformers' BitsAndBytesConfig for nf4 / CUDA int8, else None (untested here: no GPU in CI)."""
    if device.type != "cuda" or weights not in ("nf4", "int8"):
        return None
    from transformers import BitsAndBytesConfig

    if weights == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=torch.bfloat16, llm_int8_skip_modules=KEEP)
    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=KEEP)


def quantize_after_load(model, weights: str | None, device: torch.device) -> None:
    """int8 / int4 on a loaded model, in place: torch's packed kernels on the CPU (with an int8 output layer),
    optimum-quanto int4 (frozen, packed) on CUDA."""
    if weights not in ("int8", "int4") or (weights == "int8" and device.type == "cuda"):
        return
    if device.type == "cpu":
        from localchat.engine import packed_store

        packed_store.pack(model, 8 if weights == "int8" else 4)
        return
    from optimum.quanto import freeze, qint4, quantize

    with torch.inference_mode():  # frozen here, quanto's packed int4 tensors also work under inference_mode
        quantize(model, weights=qint4, exclude=KEEP)
        freeze(model)


def weight_bytes(model) -> int:
    """Real bytes of the parameters and buffers: packed data + scales for quantized layers (tied tensors once)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        for part in _storage_parts(t):
            if part.data_ptr() in seen:
                continue
            seen.add(part.data_ptr())
            total += part.numel() * part.element_size()
    return total


def _storage_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors behind `t`: itself, or a quanto / bitsandbytes tensor's data and scales."""
    inner = getattr(t, "__tensor_flatten__", None)
    if inner is not None:  # quanto QTensor subclasses (packed data, scale, shift)
        names, _ = inner()
        parts = []
        for name in names:
            parts.extend(_storage_parts(getattr(t, name)))
        return parts
    parts = [t]
    state = getattr(t, "quant_state", None)  # bitsandbytes Params4bit: absmax (and nested) scales
    if state is not None:
        for name in ("absmax", "code"):
            value = getattr(state, name, None)
            if isinstance(value, torch.Tensor):
                parts.append(value)
        nested = getattr(state, "state2", None)
        if nested is not None and isinstance(getattr(nested, "absmax", None), torch.Tensor):
            parts.append(nested.absmax)
    scb = getattr(t, "SCB", None)  # bitsandbytes Int8Params row scales
    if isinstance(scb, torch.Tensor):
        parts.append(scb)
    return parts
