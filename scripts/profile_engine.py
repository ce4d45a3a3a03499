"""Where LOCRET's time goes: a torch.profiler profile of chunked prefill and of decode, default model.

Run:  python scripts/profile_engine.py --device cpu --length 8192 --out bench/results/profile-smollm2-cpu
      (add --kv int4 for the quantized cache; --device cuda profiles CUDA time too)
Writes OUT.md (settings, top-15 ops by self time, time per op bucket) and OUT.json (the same, every op).

The profiled code is the engine's own path: `Engine.generate(ids, GenerationSettings(ignore_eos=True))`
on a niah_single document (localchat.bench.perf._prompt). One profiler covers the prompt up to the first
token (the chunked prefill with its evictions), a second one the decode steps. One warm-up run comes
first, then one un-profiled run for wall times, then the profiled run. Self time is CPU self time on
cpu and CUDA (kernel) self time on cuda. Buckets come from op names only: generic ops (mul, copy_, cat)
that the quantized cache, RoPE or eviction call land in the bucket of their name, not of their caller.
Speed does not depend on the heads' weights, only on their size: `--heads random` (the default) is fine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from localchat.bench import machine  # noqa: E402
from localchat.bench.cell import Cell, use_policy  # noqa: E402
from localchat.bench.perf import _prompt  # noqa: E402
from localchat.engine.engine import Engine  # noqa: E402
from localchat.engine.events import Done, Error, Token  # noqa: E402
from localchat.engine.sampling import GenerationSettings  # noqa: E402

BUCKETS = [  # first match wins; quantization first (bitwise ops), matmul before elementwise (addmm vs add)
    ("quantization", r"quanto|quantize|bitwise_|__rshift__|__and__|__lshift__|__or__"),
    ("attention (sdpa)", r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention"),
    ("matmul/linear", r"^aten::(addmm|mm|linear|bmm|matmul)$"),
    ("eviction selection (topk/sort)", r"^aten::(topk|sort)$"),
    ("gather/copy", r"^aten::(gather|copy_|index\w*|cat)$"),
    ("rotation/elementwise", r"^aten::(cos|sin|mul|add|neg)_?$"),
]


def bucket(name: str) -> str:
    return next((b for b, pattern in BUCKETS if re.search(pattern, name)), "other")


def run(engine, ids: list[int], new: int, profiled: bool) -> dict:
    """One generate() call; with `profiled`, one profiler up to the first token and one after it."""
    cuda = engine.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    profs = [profile(activities=acts, record_shapes=False) for _ in range(2)] if profiled else []
    walls = []
    events = engine.generate(ids, GenerationSettings(max_new_tokens=new, ignore_eos=True))
    if profs:
        profs[0].start()
    t0 = time.perf_counter()
    for ev in events:
        if isinstance(ev, Error):
            raise RuntimeError(ev.message)
        if isinstance(ev, Token) and not walls:  # prefill (and the first token's argmax) ends here
            walls.append(time.perf_counter() - t0)
            if profs:
                profs[0].stop()
                profs[1].start()
            t0 = time.perf_counter()
        if isinstance(ev, Done):
            walls.append(time.perf_counter() - t0)
            if profs:
                profs[1].stop()
            return {"done": ev, "walls": walls, "profs": profs}
    raise RuntimeError("the engine ended without a Done event")


def summarize(prof, wall_s: float, cuda: bool) -> dict:
    ops = []
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CPU:  # kernels: counted in the op that launched them
            continue
        self_us = e.self_device_time_total if cuda else e.self_cpu_time_total
        ops.append({"op": e.key, "calls": e.count, "self_ms": round(self_us / 1000, 3), "bucket": bucket(e.key)})
    ops.sort(key=lambda o: -o["self_ms"])
    total = sum(o["self_ms"] for o in ops) or 1e-9
    for o in ops:
        o["share"] = round(o["self_ms"] / total, 4)
    buckets = {}
    for o in ops:
        b = buckets.setdefault(o["bucket"], {"bucket": o["bucket"], "self_ms": 0.0, "ops": []})
        b["self_ms"] += o["self_ms"]
        b["ops"].append(o["op"])
    groups = sorted(buckets.values(), key=lambda b: -b["self_ms"])
    for b in groups:
        b["self_ms"], b["share"], b["ops"] = round(b["self_ms"], 3), round(b["self_ms"] / total, 4), b["ops"][:4]
    return {"profiled_wall_s": round(wall_s, 3), "total_self_ms": round(total, 3),
            "self_over_wall": round(total / 1000 / wall_s, 3), "buckets": groups, "ops": ops}


def git_state() -> dict:
    """The commit and the files that differ from it: the results belong to this working tree."""
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {"commit": git("rev-parse", "HEAD"), "dirty": git("status", "--porcelain").splitlines()}


def tables(name: str, s: dict, kind: str) -> list[str]:
    lines = [f"## {name}: profiled wall {s['profiled_wall_s']} s, {kind} self time in ops {s['total_self_ms']:.0f} ms "
             f"({s['self_over_wall']:.0%} of the wall)", "", "| bucket | self ms | share | top ops |", "|---|---|---|---|"]
    lines += [f"| {b['bucket']} | {b['self_ms']:.1f} | {b['share']:.1%} | {', '.join(b['ops'])} |" for b in s["buckets"]]
    lines += ["", "| op (top 15 by self time) | calls | self ms | share | bucket |", "|---|---|---|---|---|"]
    lines += [f"| {o['op']} | {o['calls']} | {o['self_ms']:.1f} | {o['share']:.1%} | {o['bucket']} |" for o in s["ops"][:15]]
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--length", type=int, default=8192, help="document tokens")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--kv", choices=["none", "int4", "int8"], default="none")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--heads", choices=["random", "default"], default="random")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="writes OUT.md and OUT.json")
    args = ap.parse_args()
    command = shlex.join(["python", "scripts/profile_engine.py", *sys.argv[1:]])
    torch.manual_seed(args.seed)  # random heads
    engine = Engine.load(None, chunk=args.chunk, device=torch.device(args.device), kv=args.kv)
    use_policy(engine, Cell(task="niah_single", length=args.length, policy="locret", budget=args.budget, n=1,
                            seed=args.seed, model_spec=None, heads="random" if args.heads == "random" else None,
                            chunk=args.chunk, positions="compact", max_new_tokens=args.decode_tokens,
                            kv=None if args.kv == "none" else args.kv))
    ids = _prompt(engine, args.length, args.seed)
    cuda = engine.device.type == "cuda"
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    say(f"profile: {len(ids)} prompt tokens; warm-up run")
    run(engine, ids, args.decode_tokens, profiled=False)
    say("profile: timed run (no profiler)")
    done = run(engine, ids, args.decode_tokens, profiled=False)["done"]
    say("profile: profiled run")
    p = run(engine, ids, args.decode_tokens, profiled=True)
    kind = "CUDA" if cuda else "CPU"
    pol = engine.policy
    result = {
        "command": command,
        "setup": {"model": engine.name, "device": engine.device.type, "length": args.length,
                  "prompt_tokens": len(ids), "budget": pol.budget, "stabilizers": getattr(pol, "stabilizers", None),
                  "local": pol.local, "chunk": engine.chunk, "kv": args.kv, "heads": args.heads, "seed": args.seed,
                  "decode_tokens": args.decode_tokens, "positions": engine.positions, "self_time": kind,
                  "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "date": time.strftime("%Y-%m-%d"),
                  "prompt": "niah_single document at depth 0.5 in the app's layout (bench.perf._prompt)"},
        "hardware": machine.hardware(), "versions": machine.versions(), "git": git_state(),
        "wall": {"prefill_s": round(done.prefill_s, 3), "prefill_tok_s": round(done.prefill_tps, 1),
                 "decode_s": round(done.decode_s, 3), "new_tokens": done.new_tokens,
                 "decode_tok_s": round(done.decode_tps, 2), "kv_units_per_head": done.kv_tokens,
                 "kv_mib": round(done.kv_bytes / 2**20, 2)},
        "prefill": summarize(p["profs"][0], p["walls"][0], cuda),
        "decode": summarize(p["profs"][1], p["walls"][1], cuda),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    s, hw, v, w = result["setup"], result["hardware"], result["versions"], result["wall"]
    gpu = f", GPU {hw['gpu']}" if cuda else ""
    md = [
        f"# Profile: LOCRET prefill and decode, {s['model']}, {s['device']} ({hw['cpu']}, {hw['cores']} cores{gpu})", "",
        f"Command: `{command}` ({s['date']}, torch {v['torch']}, transformers {v['transformers']}, "
        f"torch threads {hw['torch_threads']}, OMP_NUM_THREADS={s['omp_num_threads']}; git {result['git']['commit'][:7]}"
        f"{' + uncommitted changes (listed in the json)' if result['git']['dirty'] else ''}).", "",
        f"Setup: {s['length']}-token niah_single document ({s['prompt_tokens']} prompt tokens), chunk {s['chunk']}, "
        f"LOCRET b={s['budget']}, n_s={s['stabilizers']}, n_loc={s['local']}, {s['positions']} positions, heads "
        f"{s['heads']}, kv {s['kv']}, seed {s['seed']}; decode {s['decode_tokens']} tokens (greedy, EOS ignored).", "",
        "Summary: (not written yet; read the tables below).", "",
        f"Wall time (un-profiled run after a warm-up): prefill {w['prefill_s']} s ({w['prefill_tok_s']} tok/s), "
        f"decode {w['new_tokens']} tokens in {w['decode_s']} s ({w['decode_tok_s']} tok/s); KV held "
        f"{w['kv_units_per_head']} units per head, {w['kv_mib']} MiB.", "",
        f"Shares are of the {kind} self time summed over ops (record_shapes off); buckets match op names "
        f"(see the script), so generic ops called by the cache or the policy count under their own name.", "",
        *tables("Prefill (prompt to first token)", result["prefill"], kind),
        *tables(f"Decode ({w['new_tokens'] - 1} forward steps)", result["decode"], kind),
    ]
    Path(f"{out}.md").write_text("\n".join(md), encoding="utf-8")
    print("\n".join(md))


if __name__ == "__main__":
    main()
