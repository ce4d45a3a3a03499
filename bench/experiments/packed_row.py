"""`packed_row` (kernels/cpu_decode.cpp: one fp32 row times packed int8 / int4 weights) against torch's packed
kernels and fp32 on one row (bench/results/cpu-decode/int4_row.txt on AVX-512, cpu-defaults-avx2/ on AVX2).

The seven products of a SmolLM2 layer (q, k, v, o, gate, up, down), each over 30 copies so that the weights come
from memory as in a real step, and the output layer (49,152 x 576, int8 as the engine packs it, and int4). 2
threads; run it on a quiet machine (a busy core stalls every parallel region by a scheduler slice).

    python bench/experiments/packed_row.py
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import localchat  # noqa: F401 - before torch: the app's OpenMP wait policy (localchat/__init__.py)
from localchat.kernels import cpu_decode
from localchat.kernels.packed import GROUP, PackedLinear

SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))  # rows, inputs
OUTPUT = (49152, 576)


def per_call_us(f, copies: int, reps: int = 20) -> float:
    f()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t) / reps * 1e6 / copies


def torch_kernel(p: PackedLinear, xb: torch.Tensor):
    if p.bits == 8:
        return lambda: torch.ops.aten._weight_int8pack_mm(xb, p.codes, p.scales)
    return lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p.codes, GROUP, p.scales)


def compare(native, rows: int, inputs: int, copies: int) -> dict[str, float]:
    """Microseconds per call: fp32, then torch's and packed_row's int8 and int4."""
    x = torch.randn(1, inputs)
    xb = x.bfloat16()
    dense = [torch.randn(rows, inputs) for _ in range(copies)]
    out = {}
    out["fp32"] = per_call_us(lambda: [torch.nn.functional.linear(x, w) for w in dense], copies)
    dense.clear()  # free them before the packed copies
    for bits in (8, 4):
        layers = [PackedLinear(nn.Linear(inputs, rows, bias=False), bits) for _ in range(copies)]
        out[f"torch int{bits}"] = per_call_us(lambda layers=layers: [torch_kernel(p, xb)() for p in layers], copies)
        out[f"ours int{bits}"] = per_call_us(
            lambda layers=layers: [native.packed_row(x, p.codes, p.scales, p.bits, rows, GROUP, p.block) for p in layers], copies)
    return out


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description="packed_row against torch's packed kernels and fp32 on one row.").parse_args(argv)
    torch.set_num_threads(2)
    native = cpu_decode.kernels()
    if native is None or not hasattr(native, "packed_row"):
        raise SystemExit(f"the C++ kernels are not built here: {cpu_decode.reason()}")
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, 2 threads, microseconds per call")
    totals: dict[str, float] = {}
    for rows, inputs in SHAPES:
        got = compare(native, rows, inputs, 30)
        for k, v in got.items():
            totals[k] = totals.get(k, 0.0) + v
        print(f"{rows} x {inputs}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()))
    print("a step's layer products (30 layers), ms: " + ", ".join(f"{k} {v * 30 / 1e3:.2f}" for k, v in totals.items()))
    got = compare(native, *OUTPUT, 2)
    print(f"output layer {OUTPUT[0]} x {OUTPUT[1]}, ms: " + ", ".join(f"{k} {v / 1e3:.2f}" for k, v in got.items()))


if __name__ == "__main__":
    main()
