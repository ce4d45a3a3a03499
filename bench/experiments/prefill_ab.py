"""A document's read on the CPU with each way of a chunk's arithmetic, alternating in one process on one loaded
engine (bench/results/cpu-prefill/ab.txt), and where the time of one read goes (`--profile`: profile.txt).

The ways: `fast` (the default where the CPU has them: the chunk's products as int8 x int8 -> int32 sums,
kernels/cpu_prefill.h, and its attention in bf16 dot products with fp32 sums, `chunk_attention`), `int8` (the int8
products, attention through SDPA in fp32) and `float` (the weight dequantized for bf16 products on AVX-512, SDPA).
SmolLM2-135M-Instruct int4, LOCRET at the card's settings with the shipped heads, compact positions, chunk 512, the
bench's perf prompt (a niah_single document at half depth, about 7.7K tokens), 16 greedy tokens, 2 threads.

    python bench/experiments/prefill_ab.py --rounds 5
    python bench/experiments/prefill_ab.py --profile
"""

from __future__ import annotations

import argparse
import statistics

import torch

import localchat  # noqa: F401 - before torch: the app's OpenMP wait policy (localchat/__init__.py)
from localchat.bench.cell import Cell, load_engine, use_policy
from localchat.bench.perf import greedy, prompt
from localchat.engine import attention
from localchat.kernels import packed

WAYS = {"fast": ("int8", True), "int8": ("int8", False), "float": ("float", False)}


def use(way: str) -> None:
    products, attend = WAYS[way]
    packed.set_chunk_products(products)
    attention.set_chunk_attention(attend)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="A document's read with each way of a chunk's arithmetic.")
    ap.add_argument("--rounds", type=int, default=5, help="reads per way, alternating (default 5)")
    ap.add_argument("--length", type=int, default=7600, help="document tokens (default 7600)")
    ap.add_argument("--profile", action="store_true", help="instead: torch's profiler over one read per way")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    cell = Cell(task="niah_single", length=args.length, policy="locret", budget=None, n=1, seed=0, model_spec=None,
                heads=None, chunk=512, positions="compact", max_new_tokens=16, weights="int4")
    engine = load_engine(cell)
    use_policy(engine, cell)
    ids = prompt(engine, args.length, 0)
    kernel = attention.chunk_kernel() is not None
    print(f"chunk attention kernel: {'built' if kernel else 'not on this CPU'}; {len(ids)} prompt tokens")
    for way in WAYS:  # a first read each: buffers, the kernels' first calls
        use(way)
        greedy(engine, ids, 2)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for way in WAYS:
            use(way)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                done = greedy(engine, ids, 2)
            print(f"\n## {way}: {done.prefill_tps:.1f} tokens/s under the profiler\n")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50))
        return
    reads: dict[str, list[float]] = {way: [] for way in WAYS}
    for r in range(args.rounds):
        for way in WAYS:
            use(way)
            done = greedy(engine, ids, 16)
            reads[way].append(done.prefill_tps)
            print(f"round {r + 1} {way:>5}: read {done.prefill_tps:7.1f} tokens/s, decode {done.decode_tps:5.1f} "
                  f"tokens/s, answer {done.text[:48]!r}", flush=True)
    base = statistics.median(reads["float"])
    for way, tps in reads.items():
        print(f"{way:>5}: median read {statistics.median(tps):7.1f} tokens/s ({statistics.median(tps) / base:.2f}x "
              f"float), min {min(tps):.1f}, max {max(tps):.1f}")


if __name__ == "__main__":
    main()
