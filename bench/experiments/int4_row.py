"""`int4_row` (kernels/cpu_decode.cpp, AVX-512) against torch's `_weight_int4pack_mm_for_cpu` on one row
(bench/results/cpu-decode/int4_row.txt).

The seven products of a SmolLM2 layer (q, k, v, o, gate, up, down), each over 30 packed copies so that the
weights come from memory as in a real step. 2 threads. Needs an AVX-512 CPU: elsewhere the kernel is not built.

    python bench/experiments/int4_row.py
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from localchat.kernels import cpu_decode
from localchat.kernels.packed import GROUP, PackedLinear

SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))  # rows, inputs


def per_call_us(f, reps: int = 20) -> float:
    f()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t) / reps * 1e6 / 30


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description="int4_row against torch's int4 kernel on one row.").parse_args(argv)
    torch.set_num_threads(2)
    native = cpu_decode.kernels()
    if not hasattr(native, "int4_row"):
        raise SystemExit("int4_row is built only on an AVX-512 CPU; this one has none")
    theirs_total = ours_total = 0.0
    for rows, inputs in SHAPES:
        layers = [PackedLinear(nn.Linear(inputs, rows, bias=False), 4) for _ in range(30)]
        x = torch.randn(1, inputs)
        xb = x.bfloat16()
        theirs = per_call_us(lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p.codes, GROUP, p.scales)
                                      for p in layers])
        ours = per_call_us(lambda: [native.int4_row(x, p.codes, p.scales, GROUP, rows) for p in layers])
        theirs_total += theirs
        ours_total += ours
        print(f"{rows} x {inputs}: torch {theirs:.1f} us, int4_row {ours:.1f} us")
    print(f"a step's int4 products (30 layers): torch {theirs_total * 30 / 1e3:.2f} ms, "
          f"int4_row {ours_total * 30 / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
