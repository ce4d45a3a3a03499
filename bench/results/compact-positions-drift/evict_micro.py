"""Time one eviction of a whole SmolLM2-135M-shaped cache (30 layers, 3 KV heads, d=64): budget + chunk units
in, budget kept per head, compact positions. Prints one JSON line. Run with the tree to measure first on
PYTHONPATH (see README.md)."""

import json
import sys
import time

import torch

from localchat.engine.cache import KVCache
from localchat.kernels.evict import select

LAYERS, HEADS, DIM = 30, 3, 64
dtype = getattr(torch, sys.argv[1])
budget, chunk, reps = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
inv = 1.0 / (100000 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM))
g = torch.Generator().manual_seed(0)
cache = KVCache(LAYERS, reserve=budget + chunk, positions="compact", inv_freq=inv)
keys = torch.randn(1, HEADS, budget + chunk, DIM, generator=g).to(dtype)
times = []
for r in range(reps + 1):
    for layer in cache.layers:
        layer.crop(-layer.get_seq_length()) if layer.get_seq_length() else None
        layer.update(keys, keys)
        layer.scores.copy_(torch.rand(HEADS, budget + chunk, generator=g))
    t0 = time.perf_counter()
    for i, idx in enumerate(select([layer.scores for layer in cache.layers], budget)):
        cache.keep(i, idx)
    if r:  # the first is a warm-up (and the remainders' one-time allocation)
        times.append(time.perf_counter() - t0)
times.sort()
print(json.dumps({"dtype": sys.argv[1], "budget": budget, "chunk": chunk, "median_ms": round(1000 * times[len(times) // 2], 3),
                  "min_ms": round(1000 * times[0], 3), "reps": reps}))
