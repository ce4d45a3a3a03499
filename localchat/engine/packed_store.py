"""Packed CPU weights kept on disk, so a start with `--weights int4` or `int8` does not quantize again.

Quantizing SmolLM2's linear layers to int4 (and its output layer to int8) takes seconds at every start; the
packed codes and scales of one model and precision are saved once under `<cache>/packed/` and loaded at the next
start in place of that work (bench/results/cpu-defaults-avx2/startup-*). An entry is named by a fingerprint of
what it was made from: the names, shapes and first and last bytes of every linear layer's weights (a fine-tune
or a merged adapter changes every value of a layer it touches; reading only the ends keeps the rest of a
memory-mapped weight file off the process's memory when the entry is loaded), the
precision, torch's version and int4 block, and the packing code itself; anything else makes a new entry. The
entries used least recently go beyond KEEP.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from localchat import paths
from localchat.kernels import packed

KEEP = 4  # entries kept (one per model and precision; SmolLM2 int4 is 95 MB)
SAMPLE = 4096  # bytes from each end of every weight in the fingerprint


def plan(model: nn.Module, bits: int) -> dict[str, int]:
    """Which linear layers are packed, at how many bits: the decoder's at `bits` (PackedLinear takes int8 where
    int4 does not fit), the output layer at 8 (a fifth of SmolLM2's weights; its int8 copy is the quality the
    grid measured)."""
    layers = {}
    for name, module in model.model.named_modules():
        if isinstance(module, nn.Linear):
            layers[f"model.{name}"] = bits
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        layers["lm_head"] = 8
    return layers


def fingerprint(model: nn.Module, layers: dict[str, int]) -> str:
    h = hashlib.sha256(f"{torch.__version__} {packed.torch_block()} ".encode())
    h.update(Path(packed.__file__).read_bytes())
    for name, bits in layers.items():
        module = model.get_submodule(name)
        for t in (module.weight, module.bias):
            if t is None:
                continue
            flat = t.detach().reshape(-1).view(torch.uint8)  # the ends only: a loaded weight is a view of the
            h.update(f"{name} {bits} {tuple(t.shape)} {t.dtype} ".encode())  # file, whose pages stay unread
            h.update(flat[:SAMPLE].numpy().tobytes() + flat[-SAMPLE:].numpy().tobytes())
    return h.hexdigest()[:24]


def folder() -> Path:
    return paths.cache_dir() / "packed"


def entry(key: str) -> Path:
    return folder() / f"{key}.safetensors"


def pack(model: nn.Module, bits: int) -> str:
    """Replace the linear layers of `model` (on the CPU) by PackedLinear, from the disk entry where one exists;
    else pack them and save the entry. Returns "loaded", "packed" or "packed (not saved: why)"."""
    layers = plan(model, bits)
    path = entry(fingerprint(model, layers))
    if path.is_file():
        try:
            state = read(path)
            _swap(model, layers, lambda name, linear: packed.PackedLinear(
                linear, layers[name], (state[f"{name}.codes"], state[f"{name}.scales"])))
            os.utime(path)  # recently used
            return "loaded"
        except Exception:  # noqa: BLE001 - a damaged or foreign entry: pack again and replace it
            path.unlink(missing_ok=True)
    done = _swap(model, layers, lambda name, linear: packed.PackedLinear(linear, layers[name]))
    state = {f"{name}.{part}": getattr(module, part).contiguous() for name, module in done.items()
             for part in ("codes", "scales")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        write(tmp, state)
        os.replace(tmp, path)
        _prune(path.parent)
    except OSError as exc:
        return f"packed (not saved: {exc.strerror or exc})"
    return "packed"


DTYPES = {"U8": torch.uint8, "I8": torch.int8, "BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32}


def write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """`tensors` as a safetensors file, each tensor's bytes written from its own memory (safetensors' save_file
    builds the whole file in memory first: 100 MB more at the first start's peak for SmolLM2)."""
    names = {dtype: name for name, dtype in DTYPES.items()}
    header, offset = {}, 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for t in tensors.values():
            f.write(t.contiguous().view(torch.uint8).reshape(-1).numpy().data)


def read(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file read into memory of our own with plain reads, each tensor 64-byte aligned in one
    allocation: safetensors' loader gives views of a mapped file at 16-byte offsets, which the int4 products
    read 20-40 % slower, and many separate allocations leave the allocator's heap larger than the tensors."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = {k: v for k, v in json.loads(f.read(size)).items() if k != "__metadata__"}
        slots, total = {}, 0
        for name, info in header.items():
            slots[name] = total
            start, end = info["data_offsets"]
            total += -(-(end - start) // 64) * 64
        memory = torch.empty(total + 64, dtype=torch.uint8)
        skew = (-memory.data_ptr()) % 64
        out = {}
        for name, info in header.items():
            start, end = info["data_offsets"]
            dtype = DTYPES[info["dtype"]]
            raw = memory[skew + slots[name]: skew + slots[name] + end - start]
            f.seek(8 + size + start)
            if f.readinto(raw.numpy()) != end - start:
                raise ValueError(f"{path.name}: {name} is cut short")
            t = raw.view(dtype).view(info["shape"])
            if t.numel() * t.element_size() != end - start:
                raise ValueError(f"{path.name}: {name} has the wrong size")
            out[name] = t
    return out


def _swap(model: nn.Module, layers: dict[str, int], make) -> dict[str, nn.Module]:
    made = {}
    with torch.inference_mode():
        for name in layers:
            parent, _, child = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            made[name] = make(name, getattr(owner, child))
        for name, module in made.items():  # only once every layer was made: a failure leaves the model as it was
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module)
    return made


def _prune(folder: Path) -> None:
    entries = sorted(folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[KEEP:]:
        old.unlink(missing_ok=True)
