"""Where the time of a LOCRET prefill goes: one un-profiled read for the wall time, then the same read under
torch.profiler, its device time put in buckets (the GPU's prefill figures; on a CPU the same for a dry run).

Buckets, first match wins, on the names of the profiled ops and of two ranges the engine names:
  retaining heads    the heads' scoring of each chunk (the engine's range `heads.HEADS_RANGE`)
  eviction           selecting and gathering the kept units after a chunk (the engine's range `prefill.EVICT_RANGE`)
  nf4 dequantize     bitsandbytes' dequantization of 4-bit weights for a chunk's matmul
  matmul             aten::mm / addmm / bmm / linear / matmul, bitsandbytes' int8 products
  attention          scaled_dot_product / flash / efficient / cudnn attention
  copy/gather        copy_, gather, index ops, cat (cache writes)
  elementwise        the rest of aten's pointwise ops (RoPE, norms, activations)
Marked ranges count their kernels once: the ops inside them are left out of the other buckets. On a GPU a kernel
goes to the bucket of the host op that launched it (bitsandbytes' and our attention kernels by their own names).

    python bench/experiments/gpu_prefill_profile.py --model DIR --weights nf4 --kv int8 --budget 16384 \\
        --length 32768 --out OUT
Writes OUT/prefill_profile.json and OUT/prefill_profile.md. On a CPU the times are the CPU's (a dry run).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch

from localchat.engine.heads import HEADS_RANGE
from localchat.engine.prefill import EVICT_RANGE

BUCKETS = [
    ("nf4 dequantize", r"dequantize_4bit|dequantize_blockwise|kDequantize"),
    ("matmul", r"aten::(addmm|mm|bmm|linear|matmul)$|int8_linear|int8_mm|igemmlt|gemv_4bit"),
    ("attention", r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention|qattn"),
    ("copy/gather", r"aten::(copy_|gather|index|index_select|index_copy_|cat|scatter)"),
    ("elementwise", r"aten::"),
]
MARKS = {"retaining heads": HEADS_RANGE, "eviction": EVICT_RANGE}


def _bucket(name: str) -> str:
    return next((b for b, pattern in BUCKETS if re.search(pattern, name)), "other")


def _marked(event) -> str | None:
    """The mark this host event runs inside (itself included), if any."""
    while event is not None:
        if event.name in MARKS.values():
            return event.name
        event = event.cpu_parent
    return None


def buckets(events, on_device: bool) -> dict[str, float]:
    """Milliseconds per bucket from the profiler's event tree (`prof.events()`).

    On a GPU each host op's own kernels go to the op's bucket (a kernel whose name matches a bucket, such as
    bitsandbytes' dequantization, to that one); kernels no host op launched go to "other". On a CPU each op's
    self time goes to its bucket. A marked range counts everything under it, once."""
    out = {name: 0.0 for name in [*MARKS, *(b for b, _ in BUCKETS), "other"]}
    label = {mark: name for name, mark in MARKS.items()}
    attached = 0.0
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or e.is_async:
            continue
        mark = _marked(e)
        if on_device:
            for k in e.kernels:
                attached += k.duration
                bucket = label[mark] if mark else _bucket(k.name)
                out[bucket if bucket != "other" else _bucket(e.name)] += k.duration / 1000
        elif mark is None:
            out[_bucket(e.name)] += e.self_cpu_time_total / 1000
        elif e.name == mark and _marked(e.cpu_parent) is None:
            out[label[mark]] += e.cpu_time_total / 1000
    if on_device:  # kernels launched outside any host op (a Triton launch from Python, say)
        kernels = sum(e.device_time_total for e in events
                      if e.device_type != torch.autograd.DeviceType.CPU and not e.is_user_annotation)
        out["other"] += max(kernels - attached, 0.0) / 1000
    return out


def read(engine, ids, tokens: int):
    from localchat.engine.events import Done, Error
    from localchat.engine.sampling import GenerationSettings

    cache = engine.new_cache(len(ids), 1)
    for event in engine.continue_on(cache, ids, 0, GenerationSettings(max_new_tokens=1, ignore_eos=True)):
        if isinstance(event, Error):
            raise SystemExit(f"error: {event.message}")
        if isinstance(event, Done):
            return event


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--weights", default="nf4")
    p.add_argument("--kv", default="int8")
    p.add_argument("--budget", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=0, help="prefill chunk (0: the model's default)")
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--d-r", type=int, default=1024)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    from localchat.engine.engine import Engine
    from localchat.engine.heads import RetainingHeads
    from localchat.engine.policies import make_policy
    from localchat.errors import UserError

    try:
        engine = Engine.load(args.model, weights=args.weights, kv=args.kv)
    except UserError as exc:
        raise SystemExit(f"error: {exc}") from None
    engine.set_policy(make_policy("locret", budget=args.budget, heads=RetainingHeads.random(engine.model, d_r=args.d_r)),
                      "compact")
    if args.chunk:
        engine.configure(chunk=args.chunk)
    vocab = engine.model.config.vocab_size
    ids = torch.randint(vocab // 8, vocab // 2, (args.length,), generator=torch.Generator().manual_seed(0)).tolist()
    read(engine, ids[:2048], 1)  # warm-up
    wall = read(engine, ids, 1)
    on_device = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        read(engine, ids, 1)
        if on_device:
            torch.cuda.synchronize()
    profiled_s = time.perf_counter() - t0
    split = buckets(prof.events(), on_device)
    own = "self_device_time_total" if on_device else "self_cpu_time_total"
    ops = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    ops.sort(key=lambda e: getattr(e, own), reverse=True)
    total = sum(split.values())
    result = {
        "command": "python bench/experiments/gpu_prefill_profile.py " + " ".join(argv or __import__("sys").argv[1:]),
        "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu",
        "prefill_tok_s": round(wall.prefill_tps, 1), "prefill_s": round(wall.prefill_s, 3),
        "profiled_s": round(profiled_s, 3), "device_ms": round(total, 3),
        "busy_share": round(total / 1000 / profiled_s, 3) if profiled_s else None,
        "buckets_ms": {k: round(v, 3) for k, v in split.items()},
        "top_ops": [(e.key, e.count, round(getattr(e, own) / 1000, 1)) for e in ops[:15]],
        "setup": vars(args),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_profile.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# LOCRET prefill profile: {Path(args.model).name}, {args.weights}, on {result['device']} "
             "(random weights, speed only)", "", f"Command: `{result['command']}`", "",
             f"{args.length:,} tokens, b={args.budget}, --kv {args.kv}: prefill {result['prefill_tok_s']} tok/s "
             f"un-profiled; profiled read {result['profiled_s']} s, device time {result['device_ms']} ms "
             f"(busy {result['busy_share']}).", "", "| bucket | device ms | share |", "|---|---|---|"]
    lines += [f"| {k} | {v:.1f} | {v / total:.1%} |" if total else f"| {k} | {v:.1f} | |" for k, v in split.items()]
    lines += ["", "| op (top 15 by device time) | calls | device ms |", "|---|---|---|"]
    lines += [f"| {k} | {c} | {ms} |" for k, c, ms in result["top_ops"]]
    (out / "prefill_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
