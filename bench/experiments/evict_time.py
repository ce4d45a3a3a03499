"""Time one eviction of a whole SmolLM2-135M-shaped cache (bench/results/compact-positions-drift/).

30 layers, 3 KV heads, d=64: budget + chunk units in, budget kept per head, compact positions. Prints one JSON
line. The package measured is the one on PYTHONPATH (a tree to compare), else the installed one.

    python bench/experiments/evict_time.py bfloat16 1024 512 30
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import localchat  # noqa: F401 - before torch: the app's OpenMP wait policy (localchat/__init__.py)
from localchat.engine.cache import KVCache
from localchat.kernels.evict import select

LAYERS, HEADS, DIM = 30, 3, 64


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Time one eviction of a SmolLM2-135M-shaped cache.")
    ap.add_argument("dtype", help="a torch dtype name: bfloat16, float16, float32")
    ap.add_argument("budget", type=int)
    ap.add_argument("chunk", type=int)
    ap.add_argument("reps", type=int)
    args = ap.parse_args(argv)
    dtype, budget, chunk, reps = getattr(torch, args.dtype), args.budget, args.chunk, args.reps
    inv = 1.0 / (100000 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM))
    g = torch.Generator().manual_seed(0)
    cache = KVCache(LAYERS, reserve=budget + chunk, positions="compact", inv_freq=inv)
    keys = torch.randn(1, HEADS, budget + chunk, DIM, generator=g).to(dtype)
    times = []
    for r in range(reps + 1):
        for layer in cache.layers:
            if layer.get_seq_length():
                layer.crop(-layer.get_seq_length())
            layer.update(keys, keys)
            layer.scores.copy_(torch.rand(HEADS, budget + chunk, generator=g))
        t0 = time.perf_counter()
        for i, idx in enumerate(select([layer.scores for layer in cache.layers], budget)):
            cache.keep(i, idx)
        if r:  # the first is a warm-up (and the remainders' one-time allocation)
            times.append(time.perf_counter() - t0)
    times.sort()
    print(json.dumps({"dtype": args.dtype, "budget": budget, "chunk": chunk,
                      "median_ms": round(1000 * times[len(times) // 2], 3), "min_ms": round(1000 * times[0], 3),
                      "reps": reps}))


if __name__ == "__main__":
    main()
