"""Key error after many compact-position evictions, against fp64 (bench/results/compact-positions-drift/).

One layer shaped like SmolLM2-135M's (3 KV heads, head_dim 64, RoPE theta 1e5); `evictions` rounds of `chunk`
new keys (random, rotated at their insertion slot in fp64, then rounded to the dtype: keys as the model hands
them over), each unit scored once at insertion, top `budget` kept. Error = ||keys - fp64 reference at their
final slots|| / ||reference|| over every kept unit; "one rotation" = the same arrived keys rotated once (fp32,
rounded once), "one quantization" = un-rotated once, quantized once, rotated once at use. Prints JSON lines.
The package measured is the one on PYTHONPATH (a tree to compare), else the installed one.

    python bench/experiments/key_drift.py 1024 512 256 after
"""

from __future__ import annotations

import argparse
import json

import torch

from localchat.engine.cache import KVCache
from localchat.engine.qcache import QuantizedKVCache
from localchat.kernels.evict import select
from localchat.kernels.quant import dequantize, group_size, quantize
from localchat.kernels.rope import rope_table, rotate, shift_keys

HEADS, DIM = 3, 64
INV = 1.0 / (100000 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM))


def rot64(keys, positions):
    angles = positions.double()[..., None] * INV.double()
    half = DIM // 2
    return (keys * torch.cat([angles.cos()] * 2, -1)
            + torch.cat([-keys[..., half:], keys[..., :half]], -1) * torch.cat([angles.sin()] * 2, -1))


def rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def run(cache, dtype, budget: int, chunk: int, evictions: int):
    g = torch.Generator().manual_seed(0)
    layer, arrived, slots = cache.layers[0], [], []
    for e in range(evictions):
        n = layer.get_seq_length()
        at = torch.arange(n, n + chunk).expand(HEADS, -1)
        keys = rot64(torch.randn(HEADS, chunk, DIM, generator=g, dtype=torch.float64) * 2, at).to(dtype)
        cache.set_pending_positions(torch.arange(e * chunk, (e + 1) * chunk))
        layer.update(keys[None], keys[None])
        layer.scores[:, n:] = torch.rand(HEADS, chunk, generator=g)
        cache.keep(0, select([layer.scores], min(budget, layer.get_seq_length()))[0])
        arrived.append(keys)
        slots.append(at)
    pos = layer.positions
    src = torch.cat(arrived, 1).gather(1, pos[..., None].expand(-1, -1, DIM))
    start = torch.cat(slots, 1).gather(1, pos)
    final = torch.arange(pos.shape[-1]).expand_as(pos)
    return layer, src, start, final, rot64(src.double(), final - start)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Key error after many compact-position evictions, against fp64.")
    ap.add_argument("budget", type=int)
    ap.add_argument("chunk", type=int)
    ap.add_argument("evictions", type=int)
    ap.add_argument("label", help="the tree's name in the output rows (before, after)")
    args = ap.parse_args(argv)
    budget, chunk, evictions, label = args.budget, args.chunk, args.evictions, args.label
    common = {"evictions": evictions, "budget": budget, "chunk": chunk}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        layer, src, start, final, want = run(KVCache(1, positions="compact", inv_freq=INV), dtype,
                                             budget, chunk, evictions)
        one = rel(shift_keys(src[None], final - start, INV)[0], want)
        print(json.dumps({"tree": label, "cache": "plain", "dtype": str(dtype)[6:], **common,
                          "error": float(f"{rel(layer.keys[0], want):.4g}"), "one_rotation": float(f"{one:.4g}")}))
        if dtype == torch.float32:
            continue
        for bits in (8, 4):
            layer, src, start, final, want = run(QuantizedKVCache(1, bits=bits, positions="compact", inv_freq=INV),
                                                 dtype, budget, chunk, evictions)
            cos, sin = rope_table(start, INV)
            gs = group_size(DIM)
            once = dequantize(*quantize(rotate(src[None], cos, -sin), bits, gs), bits, gs)
            one = rel(rotate(once, *rope_table(final, INV))[0], want)
            error = rel(layer.dequantized(torch.float32)[0][0], want)
            print(json.dumps({"tree": label, "cache": f"int{bits}", "dtype": str(dtype)[6:], **common,
                              "error": float(f"{error:.4g}"), "one_quantization": float(f"{one:.4g}")}))


if __name__ == "__main__":
    main()
