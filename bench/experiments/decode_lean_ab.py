"""The lean decode step (engine/decode_step.py) against transformers' forward on one cache, alternating
(bench/results/cpu-decode/ab_lean.txt).

SmolLM2-135M, LOCRET b=1024 with random heads, a 2,000-token random prompt, then 6 x (48 lean steps, 48 steps
through transformers' forward) on the same cache; tok/s per 48-step run and their medians. 2 threads.

    python bench/experiments/decode_lean_ab.py int4     # and int8, fp32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import localchat  # noqa: F401 - before torch: the app's OpenMP wait policy (localchat/__init__.py)
from localchat.bench.cell import Cell, use_policy
from localchat.engine.decode_step import DecodeStep
from localchat.engine.engine import Engine
from localchat.engine.prefill import evict_while_decoding, forward, prefill


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="The lean decode step against transformers' forward.")
    ap.add_argument("weights", choices=["fp32", "int8", "int4"])
    w = ap.parse_args(argv).weights
    torch.set_num_threads(2)
    cell = Cell(task="niah_single", length=2048, policy="locret", budget=1024, n=1, seed=0, model_spec=None,
                heads="random", chunk=512, positions="compact", max_new_tokens=64)
    engine = Engine.load(None, weights=None if w == "fp32" else w, chunk=512)
    use_policy(engine, cell)
    model, policy = engine.model, engine.policy
    ids = torch.randint(100, 40000, (1, 2000))
    cache = engine.new_cache(2000, 64)
    policy.attach(model, cache)
    with torch.inference_mode():
        for _ in prefill(model, cache, ids, chunk=512, policy=policy):
            pass
        lean = DecodeStep(model, cache, on_qkv=policy.qkv_sink())
        token, pos = torch.tensor([[123]]), [2000]

        def rate(use_lean: bool, n: int = 48) -> float:
            t = time.perf_counter()
            for _ in range(n):
                lean.step(token, pos[0]) if use_lean else forward(model, cache, token, pos[0])
                policy.observe(cache, 1, token)
                evict_while_decoding(cache, policy)
                pos[0] += 1
            return n / (time.perf_counter() - t)

        rate(True, 8)
        rate(False, 8)
        runs: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(6):
            for use_lean in (True, False):
                runs[use_lean].append(rate(use_lean))
    lean, plain = runs[True], runs[False]
    print(w, f"lean tok/s median {statistics.median(lean):.1f} {[round(x, 1) for x in lean]} | transformers forward "
             f"{statistics.median(plain):.1f} {[round(x, 1) for x in plain]} | units {cache.get_seq_length()}")


if __name__ == "__main__":
    main()
