"""A decode step with its parallel loops on the kernels' own pool (kernels/cpu_pool.h, `set_pool`: threads that
spin an adaptive window, then sleep) against OpenMP under the app's sleeping wait, alternating in one process, on
a quiet machine or beside other work (`--load`, as wait_policy.py's). Each round checks that both ways give the
same logits, bit for bit.

SmolLM2 at the default int4 weights over ~1,180 units (wait_policy.py's `steady_step`); per round 8 steps each
way, the cache cut back after each step so its length stays put.

    python bench/experiments/pool_ab.py [--rounds 20] [--spin 200] [--load none|busy3|torch2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch
from wait_policy import LOADS, steady_step

import localchat  # noqa: F401 - before torch: the app's OpenMP wait policy (localchat/__init__.py)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--spin", type=int, default=200, help="the pool's longest spin, microseconds")
    p.add_argument("--load", choices=("none", *LOADS), default="none")
    args = p.parse_args(argv)
    from localchat.kernels import cpu_decode

    native = cpu_decode.kernels()
    if native is None:
        raise SystemExit(f"the CPU decode kernels are not built here: {cpu_decode.reason()}")
    one, cache = steady_step()
    ways = {"pool": args.spin, "OpenMP": 0}
    times: dict[str, list[float]] = {w: [] for w in ways}
    load = [subprocess.Popen(cmd) for cmd in LOADS.get(args.load, [])]
    try:
        time.sleep(1)
        for _ in range(args.rounds):  # ways interleaved: the machine's drift hits both alike
            first = {}
            for way, spin in ways.items():
                native.set_pool(spin)
                first[way] = one()
                t = time.perf_counter()
                for _ in range(8):
                    one()
                times[way].append(1000 * (time.perf_counter() - t) / 8)
            if not torch.equal(first["pool"], first["OpenMP"]):
                raise SystemExit("the pool's logits differ from OpenMP's")
    finally:
        native.set_pool(args.spin)
        for proc in load:
            proc.kill()
    print(f"load {args.load}, spin {args.spin} us, {args.rounds} rounds of 8 steps a way, SmolLM2 int4 at "
          f"{cache.get_seq_length() + 1} units, {torch.get_num_threads()} threads; ms per step, same logits each round")
    for way, v in times.items():
        print(f"{way}: median {statistics.median(v):.2f}, min {min(v):.2f}")


if __name__ == "__main__":
    main()
