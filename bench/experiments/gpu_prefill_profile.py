"""Where the time of a LOCRET prefill goes: one un-profiled read for the wall time, then the same read under
torch.profiler, its device time put in buckets (the GPU's prefill figures; on a CPU the same for a dry run).

Buckets, first match wins, on the names of the profiled ops and of two ranges this script marks:
  retaining heads    the heads' scoring of each chunk (`HeadScorer._run`, marked)
  eviction           selecting and gathering the kept units after a chunk (`prefill.evict`, marked)
  nf4 dequantize     bitsandbytes' dequantization of 4-bit weights for a chunk's matmul
  matmul             aten::mm / addmm / bmm / linear / matmul, bitsandbytes' int8 products
  attention          scaled_dot_product / flash / efficient / cudnn attention
  copy/gather        copy_, gather, index ops, cat (cache writes)
  elementwise        the rest of aten's pointwise ops (RoPE, norms, activations)
Marked ranges count their kernels once: the ops inside them are left out of the other buckets.

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

BUCKETS = [
    ("nf4 dequantize", r"dequantize_4bit|dequantize_blockwise|kDequantize"),
    ("matmul", r"aten::(addmm|mm|bmm|linear|matmul)$|int8_linear|int8_mm|igemmlt|gemv_4bit"),
    ("attention", r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention|qattn"),
    ("copy/gather", r"aten::(copy_|gather|index|index_select|index_copy_|cat|scatter)"),
    ("elementwise", r"aten::"),
]
MARKS = {"retaining heads": "localchat.heads", "eviction": "localchat.evict"}
TIMES = ("self_device_time_total", "device_time_total")  # on a CPU (a dry run): the CPU's, set in main


def _mark(obj, name: str, label: str):
    """Wrap `obj.name` in a profiler range named `label`."""
    real = getattr(obj, name)

    def marked(*args, **kwargs):
        with torch.profiler.record_function(label):
            return real(*args, **kwargs)

    setattr(obj, name, marked)


def _device_ms(event) -> float:
    return getattr(event, TIMES[0], 0.0) / 1000


def buckets(events) -> dict[str, float]:
    """Device milliseconds per bucket from `key_averages()` rows."""
    out = {name: 0.0 for name in [*MARKS, *(b for b, _ in BUCKETS), "other"]}
    for label, mark in MARKS.items():
        out[label] = sum(getattr(e, TIMES[1], 0.0) for e in events if e.key == mark) / 1000
    inside = sum(out[label] for label in MARKS)
    for e in events:
        if e.key in MARKS.values():
            continue
        ms = _device_ms(e)
        bucket = next((b for b, pattern in BUCKETS if re.search(pattern, e.key)), "other")
        out[bucket] += ms
    # the marked ranges' kernels were also counted by op: take them out of the op buckets, largest first
    for b in sorted((b for b, _ in BUCKETS), key=lambda b: -out[b]):
        take = min(out[b], inside)
        out[b] -= take
        inside -= take
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

    from localchat.engine import heads as heads_mod, prefill as prefill_mod
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
        engine.chunk = args.chunk
    vocab = engine.model.config.vocab_size
    ids = torch.randint(vocab // 8, vocab // 2, (args.length,), generator=torch.Generator().manual_seed(0)).tolist()
    read(engine, ids[:2048], 1)  # warm-up
    wall = read(engine, ids, 1)
    _mark(heads_mod.HeadScorer, "_run", MARKS["retaining heads"])
    _mark(prefill_mod, "evict", MARKS["eviction"])
    global TIMES
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    if engine.device.type != "cuda":
        TIMES = ("self_cpu_time_total", "cpu_time_total")
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        read(engine, ids, 1)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
    profiled_s = time.perf_counter() - t0
    events = prof.key_averages()
    split = buckets(events)
    total = sum(split.values())
    result = {
        "command": "python bench/experiments/gpu_prefill_profile.py " + " ".join(argv or __import__("sys").argv[1:]),
        "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu",
        "prefill_tok_s": round(wall.prefill_tps, 1), "prefill_s": round(wall.prefill_s, 3),
        "profiled_s": round(profiled_s, 3), "device_ms": round(total, 3),
        "busy_share": round(total / 1000 / profiled_s, 3) if profiled_s else None,
        "buckets_ms": {k: round(v, 3) for k, v in split.items()},
        "top_ops": [(e.key, e.count, round(_device_ms(e), 1))
                    for e in sorted(events, key=_device_ms, reverse=True)[:15]],
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
