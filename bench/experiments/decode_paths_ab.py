"""The decode step's three ways (engine/decode_step.py) on one cache, alternating: C++ per layer, C++ attention
and norms between torch ops, torch only (bench/results/cpu-decode/ab_paths.txt).

SmolLM2-135M, LOCRET b=1024 with the shipped heads, a 2,000-token random prompt; 6 x (40 steps per way) on one
cache held at its length. 2 threads.

    python bench/experiments/decode_paths_ab.py int4    # and int8, fp32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import localchat  # noqa: F401 - before torch: the app's OpenMP wait policy (localchat/__init__.py)
from localchat.bench.cell import Cell, use_policy
from localchat.engine.decode_step import WAYS, DecodeStep
from localchat.engine.engine import Engine
from localchat.engine.prefill import prefill


def three_ways(model, cache, policy) -> dict[str, DecodeStep]:
    """The step as built (a C++ call per layer), without per-layer C++ calls, and without any C++ kernel."""
    steps = {way: DecodeStep(model, cache, on_qkv=policy.qkv_sink(), way=way) for way in WAYS}
    if [step.took for step in steps.values()] != list(WAYS):
        raise SystemExit(f"the steps took {[step.took for step in steps.values()]}: are the C++ kernels built?")
    return steps


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="The decode step's three ways on one cache.")
    ap.add_argument("weights", choices=["fp32", "int8", "int4"])
    w = ap.parse_args(argv).weights
    torch.set_num_threads(2)
    cell = Cell(task="niah_single", length=2048, policy="locret", budget=1024, n=1, seed=0, model_spec=None,
                heads=None, chunk=512, positions="compact", max_new_tokens=64)
    engine = Engine.load(None, weights=None if w == "fp32" else w, chunk=512, say=lambda s: None)
    use_policy(engine, cell)
    model, policy = engine.model, engine.policy
    ids = torch.randint(100, 40000, (1, 2000), generator=torch.Generator().manual_seed(0))
    cache = engine.new_cache(2000, 64)
    policy.attach(model, cache)
    with torch.inference_mode():
        for _ in prefill(model, cache, ids, chunk=512, policy=policy):
            pass
        steps = three_ways(model, cache, policy)
        token = torch.tensor([[123]])

        def rate(step, n: int = 40) -> float:
            t = time.perf_counter()
            for i in range(n):
                step.step(token, 2000 + i)
                for layer in cache.layers:  # the same cache length every step
                    layer.n -= 1
            policy.scorer.queue = [[] for _ in policy.scorer.queue]
            return n / (time.perf_counter() - t)

        for step in steps.values():
            rate(step, 5)
        rates: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(6):
            for name, step in steps.items():
                rates[name].append(rate(step))
    print(f"{w}, {cache.get_seq_length()} kept units, tok/s per 40-step run (median):",
          " | ".join(f"{name} {statistics.median(r):.1f} {[round(x, 1) for x in r]}" for name, r in rates.items()))


if __name__ == "__main__":
    main()
