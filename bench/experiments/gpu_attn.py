"""Decode attention alone at a model's shape: the split kernel over a cache of `--units` units, per call and per
token (times the layers; on CUDA the GPU's time from a replayed CUDA graph, as inside the captured step), for the
int8/int4 cache with and without the in-kernel RoPE, and the plain bf16 cache (`--caches`), in each of the
kernel's ways (`--ways`) and split targets (`--programs`): the fields of kernels/qattn.py's `Split`, passed per row.

    python bench/experiments/gpu_attn.py [--units 16527] [--q-heads 32] [--kv-heads 8] [--head-dim 128]
        [--layers 32] [--kernels FILE ...] [--programs 264,1056] [--ways group,dot,head]
        [--dot-blocks 32,64] [--warps 4,8] [--caches 8r,8,4r,0] [--out OUT.json]
`--best FILE --bits 8`: print the fastest row's settings in FILE (this script's --out) for that cache, as
gpu_decode.py's flags (--attn-way, --attn-block, --attn-programs, --attn-warps); nothing when FILE has no such row.
`--kernels FILE`: also time another version of kernels/_qattn_triton.py (an A/B in one process). Random cache
contents (speed only). On a CPU the Triton interpreter runs it (a dry run: set TRITON_INTERPRET=1, tiny shapes).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import time

import torch

from localchat.kernels import graph_attn, qattn
from localchat.kernels.quant import group_size, quantize


def inv_freq(d: int, base: float = 500000.0) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)


def cache(h: int, n: int, d: int, bits: int, dev: str) -> dict[str, torch.Tensor]:
    if not bits:
        return {name: torch.randn(1, h, n, d, device=dev, dtype=torch.bfloat16) for name in ("k", "v")}
    out = {}
    for names in (("qk", "ks", "kz"), ("qv", "vs", "vz")):
        out.update(zip(names, quantize(torch.randn(1, h, n, d, device=dev), bits, group_size(d))))
    return out


def timed(fn, repeat: int, dev: str, failed: list | None = None) -> tuple[float, float | None]:
    """(median wall milliseconds of a call, launches included; on CUDA the GPU's milliseconds per call from a
    CUDA graph of `repeat` calls replayed: the figure inside a captured decode step). Where capture fails, the
    exception is raised, or with `failed` appended to it and the GPU's figure None."""
    fn()
    times = []
    for _ in range(repeat):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000)
    wall = sorted(times)[len(times) // 2]
    if dev != "cuda":
        return wall, None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants (cuBLAS, bitsandbytes)
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(repeat):
                fn()
        graph.replay()
    except Exception as exc:
        if failed is None:
            raise
        torch.cuda.synchronize()
        failed.append(exc)
        return wall, None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    return wall, (time.perf_counter() - t0) * 1000 / repeat


def best_flags(path: str, bits: int) -> str:
    """gpu_decode.py's flags for the fastest row of the tree's kernels over a `bits` cache (rotated where
    quantized: the engine's way), or "" when the file is missing or has no such row."""
    try:
        with open(path) as f:
            rows = json.load(f)["rows"]
    except (OSError, ValueError, KeyError):
        return ""
    rows = [r for r in rows if r["kernels"] == "tree" and r["bits"] == bits and r["rotate"] == (bits > 0)
            and "error" not in r]
    if not rows:
        return ""
    r = min(rows, key=lambda r: r["ms_per_token"])
    return (f"--attn-way {r['way']} --attn-block {r['block'] or qattn.DEFAULT.block} --attn-programs {r['programs']} "
            f"--attn-warps {r.get('warps', qattn.DEFAULT.warps)}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--units", type=int, default=16527)
    p.add_argument("--tail", type=int, default=64)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--kernels", nargs="*", default=[])
    p.add_argument("--programs", default=str(qattn.DEFAULT.programs),
                   help="comma-separated split targets to time (qattn.Split.programs)")
    p.add_argument("--ways", default=",".join(qattn.WAYS),
                   help="ways to time (qattn.Split.way): group (one program per KV head and split), dot (the same on "
                        "tensor cores), head (one program per query head)")
    p.add_argument("--dot-blocks", default=str(qattn.DEFAULT.block), help="blocks to time, the dot way's (Split.block)")
    p.add_argument("--warps", default=str(qattn.DEFAULT.warps), help="warps a program to time (Split.warps)")
    p.add_argument("--caches", default="8r,8,4r,0",
                   help="caches to time: bits (8, 4, 0 = bf16), r = keys rotated in the kernel (the engine's way)")
    p.add_argument("--out")
    p.add_argument("--best", metavar="FILE", help="print the fastest settings in FILE for --bits, and stop")
    p.add_argument("--bits", type=int, default=8)
    args = p.parse_args(argv)
    if args.best:
        print(best_flags(args.best, args.bits))
        return
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    h, hq, d, n = args.kv_heads, args.q_heads, args.head_dim, args.units
    q = torch.randn(1, hq, 1, d, device=dev, dtype=torch.bfloat16)
    tk, tv = (torch.randn(1, h, args.tail, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([n, args.tail], dtype=torch.long, device=dev)
    inv = inv_freq(d).to(dev)
    versions = {"tree": None}  # None: the tree's kernels
    for path in args.kernels:
        spec = importlib.util.spec_from_file_location(f"kernels_{len(versions)}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        versions[path] = mod
    rows = []
    configs = [(way, int(b), int(p), int(w)) for way in args.ways.split(",")
               for b in (args.dot_blocks.split(",") if way == "dot" else [qattn.DEFAULT.block])
               for p in args.programs.split(",") for w in args.warps.split(",")]
    for bits, rotate in [(int(c.rstrip("r")), c.endswith("r")) for c in args.caches.split(",")]:
        main_ = cache(h, n, d, bits, dev)
        tails = (tk, tv) if bits else (None, None)
        size = sum(t.numel() * t.element_size() for t in main_.values())
        first = None
        for name, mod in versions.items():
            for way, block, programs, warps in configs:
                if mod is not None and not hasattr(mod, qattn.WAYS[way]):
                    continue  # an older kernels file without this way
                split = qattn.Split(way=way, block=block, programs=programs, warps=warps, kernels=mod)
                call = functools.partial(graph_attn.attention_triton, q, main_, *tails, lens, bits, group_size(d),
                                         d**-0.5, inv if rotate else None, split)
                row = {"kernels": name, "way": way, "block": block if way == "dot" else None,
                       "programs": programs, "warps": warps, "bits": bits, "rotate": rotate}
                try:
                    out = call().float()
                    wall, gpu = timed(call, args.repeat, dev)
                except Exception as exc:  # a kernel that does not compile or run here: its row says why
                    rows.append({**row, "error": f"{type(exc).__name__}: {exc}"[:500]})
                    print(json.dumps(rows[-1]), flush=True)
                    continue
                first = out if first is None else first
                rows.append({**row, "ms_per_call": round(wall, 4),
                             "gpu_ms_per_call": None if gpu is None else round(gpu, 4),
                             "ms_per_token": round((gpu or wall) * args.layers, 3),
                             "cache_gb_per_s": round(size / (gpu or wall) / 1e6, 1),
                             "max_diff_from_first": float((out - first).abs().max())})
                print(json.dumps(rows[-1]), flush=True)
    result = {"rows": rows, "setup": vars(args), "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
              "torch": torch.__version__}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
