"""OpenMP's wait between parallel regions: a decode step with the app's sleeping wait (OMP_WAIT_POLICY=PASSIVE,
localchat/__init__.py) against short spins (GOMP_SPINCOUNT), each in a fresh process (libgomp reads them once).

A step of SmolLM2 at the default int4 weights over ~1,180 units starts about 150 parallel regions; with a sleeping
wait the second thread is woken for each. `--load` puts other work on the cores for the whole run: `busy3`, three
single-thread busy loops at nice 5 (the case that made the app sleep, omp-wait.txt), or `torch2`, a 2-thread torch
process multiplying rows (another engine on the same cores).

    python bench/experiments/wait_policy.py [--rounds 4] [--spins 1000,3000] [--load none|busy3|torch2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LOADS = {
    "busy3": [["nice", "-n", "5", sys.executable, "-c", "while True: pass"]] * 3,
    "torch2": [[sys.executable, "-c", "import torch\ntorch.set_num_threads(2)\nw = torch.randn(4096, 4096)\n"
                "x = torch.randn(1, 4096)\nwhile True:\n    x @ w"]],
}


def steady_step(units: int = 1180):
    """SmolLM2 at the default int4 weights after the bench's 7,600-token document cut to `units` tokens: `one()`
    decodes a token and cuts the cache back, so every call steps over the same length; and the cache."""
    import torch

    import localchat  # noqa: F401 - before torch: the app's OpenMP wait policy (localchat/__init__.py)
    from localchat.bench.perf import prompt
    from localchat.engine.decode_step import DecodeStep
    from localchat.engine.engine import Engine
    from localchat.engine.sampling import GenerationSettings

    engine = Engine.load(None, weights="int4")
    ids = prompt(engine, 7600, 0)[:units]
    cache = engine.new_cache(len(ids), 64)
    list(engine.continue_on(cache, ids, 0, GenerationSettings(max_new_tokens=1, ignore_eos=True), keep_last=True))
    step, token, pos = DecodeStep(engine.model, cache), torch.tensor([[100]]), len(ids) + 1

    def one():
        logits = step.step(token, pos)
        for layer in cache.layers:  # the same length every step
            layer.n -= 1
        return logits

    return one, cache


def child(steps: int) -> None:
    one, cache = steady_step()
    times = []
    for i in range(steps + 5):
        t = time.perf_counter()
        one()
        if i >= 5:  # after a warm-up
            times.append(1000 * (time.perf_counter() - t))
    print(json.dumps({"units": cache.get_seq_length(), "median_ms": statistics.median(times), "min_ms": min(times)}))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--spins", default="1000,3000", help="GOMP_SPINCOUNT values beside the app's sleeping wait")
    p.add_argument("--load", choices=("none", *LOADS), default="none")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.steps)
    ways = [None, *(int(s) for s in args.spins.split(","))]
    load = [subprocess.Popen(cmd) for cmd in LOADS.get(args.load, [])]
    got: dict[int | None, list[dict]] = {w: [] for w in ways}
    try:
        time.sleep(1)
        for _ in range(args.rounds):  # ways interleaved: the machine's drift hits them alike
            for way in ways:
                env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
                env["OMP_NUM_THREADS"] = "2"
                if way is not None:
                    env["GOMP_SPINCOUNT"] = str(way)
                done = subprocess.run([sys.executable, __file__, "--child", "--steps", str(args.steps)], env=env,
                                      capture_output=True, text=True, check=True)
                got[way].append(json.loads(done.stdout.strip().splitlines()[-1]))
    finally:
        for proc in load:
            proc.kill()
    print(f"load {args.load}, {args.rounds} rounds, {args.steps} steps a process, SmolLM2 int4 at "
          f"{got[None][0]['units']} units, 2 threads; ms per step: median of each process's median (their range)")
    for way, rows in got.items():
        medians = [r["median_ms"] for r in rows]
        label = "OMP_WAIT_POLICY=PASSIVE (the app's)" if way is None else f"GOMP_SPINCOUNT={way}"
        print(f"{label}: {statistics.median(medians):.2f} ({min(medians):.2f}-{max(medians):.2f}), "
              f"best step {min(r['min_ms'] for r in rows):.2f}")


if __name__ == "__main__":
    main()
