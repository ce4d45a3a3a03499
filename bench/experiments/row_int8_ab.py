"""A decode step with the AVX2 products on the row quantized to int8 against the same step on the fp32 row, in one
process, alternating (kernels/cpu_decode.cpp `set_row_int8`): the machine's drift hits both ways alike.
`--switch together`: the same for q/k/v and gate/up in one parallel region each against one region per product
(`set_together`); `--switch prefetch`: with and without the kernels' software prefetch (`set_prefetch`).

SmolLM2 at the default int4 weights after a ~270-token prompt (the weights' share of a step, little attention);
per round 8 steps each way, the cache cut back after each round so its length stays put.

    python bench/experiments/row_int8_ab.py [--rounds 16] [--switch row_int8|together|prefetch]
"""

from __future__ import annotations

import argparse
import statistics
import time

import localchat  # noqa: F401 - before torch: the app's OpenMP wait policy (localchat/__init__.py)
import torch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--switch", choices=("row_int8", "together", "prefetch"), default="row_int8")
    args = p.parse_args(argv)
    from localchat.engine.decode_step import DecodeStep
    from localchat.engine.engine import Engine
    from localchat.engine.sampling import GenerationSettings
    from localchat.kernels import cpu_decode

    native = cpu_decode.kernels()
    switch = getattr(native, f"set_{args.switch}", None) if native is not None else None
    if switch is None:
        raise SystemExit(f"the CPU decode kernels are not built here: {cpu_decode.reason()}")
    engine = Engine.load(None, weights="int4")
    ids = engine.encode("hello there, tell me a story about a cat. " * 20)
    cache = engine.new_cache(len(ids), 64)
    list(engine.continue_on(cache, ids, 0, GenerationSettings(max_new_tokens=1, ignore_eos=True), keep_last=True))
    step, pos, token = DecodeStep(engine.model, cache), len(ids) + 1, torch.tensor([[100]])
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for int8 in (True, False):
            switch(int8)
            step.step(token, pos)
            t = time.perf_counter()
            for _ in range(8):
                step.step(token, pos)
            times[int8].append(1000 * (time.perf_counter() - t) / 8)
            for layer in cache.layers:
                layer.n -= 9
    switch(True)
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
          f"{cache.get_seq_length() + 1} units, ms per step over {args.rounds} rounds of 8")
    labels = {"row_int8": ("row as int8", "row as fp32"), "together": ("products together", "products apart"),
              "prefetch": ("prefetch", "no prefetch")}
    for int8, label in zip((True, False), labels[args.switch]):
        v = times[int8]
        print(f"{label}: min {min(v):.2f}, median {statistics.median(v):.2f}")


if __name__ == "__main__":
    main()
