"""Decode speed after a long read, by way through a step and by weight precision (the GPU's decode figures).

For each `--weights`: one engine (LOCRET at `--budget`, `--kv` cache, retaining heads of d_R = `--d-r`, random:
speed does not depend on their weights) reads `--length` random tokens once; then, each on a copy of that cache,
`--tokens` greedy tokens are decoded in each of these ways (`--ways`):
  graph        a decoded token is one CUDA graph replay (engine/graph_step.py; the default on CUDA)
  graph-gemv   the same with each norm and the SiLU product inside the product that reads it (GraphStep's
               `gemv=True`: Triton GEMVs for float weights in place of cuBLAS's; with nf4 or int8 weights the same
               as graph)
  graph-unfused  the same without kernels/fused.py's kernels (`fused=False`: the norms, RoPE and SiLU product op
               by op)
  eager step   the same model without transformers' per-call machinery, op by op (engine/decode_step.py)
  forward      transformers' forward at every step
Per row: decode tokens/s over the answer, and steady (from the second token on: a graph way's first step on a copy
of the cache captures the graph, 0.1-0.2 s), and the GPU's busy share of a step: the GPU time of a step (kernel
time from the profiler over `--profile-tokens` steps after the second token; for the graph also the time of
back-to-back replays, over the steady time per token) over the wall time per token. On a CPU (the dry
run) the graph way is not taken and its row says so.

    python bench/experiments/gpu_decode.py --model DIR --weights nf4,bf16,int8 --out OUT
        [--attn-way dot --attn-block 64 --attn-programs 1056 --attn-warps 8]   # the split kernel's settings
                                                 # in the graph ways (kernels/qattn.py `Split`; the eager ways
                                                 # read the quantized cache with the engine's default)
Writes OUT/gpu_decode.json and OUT/gpu_decode.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

from localchat.bench.perf import sync
from localchat.engine.engine import Decoding, Engine
from localchat.engine.events import Done, Error, Notice, Token
from localchat.engine.graph_step import GraphStep
from localchat.engine.heads import RetainingHeads
from localchat.engine.policies import make_policy
from localchat.engine.sampling import GenerationSettings
from localchat.errors import UserError
from localchat.kernels import qattn

WAYS = ("graph", "graph-gemv", "graph-unfused", "eager step", "forward")
TOP = 8  # the kernels named per row: the most GPU time per token


def _done(events, notes: list | None = None, on_token=None) -> Done:
    """The Done event; the engine's notices into `notes`; `on_token()` called as each token comes."""
    for event in events:
        if isinstance(event, Token) and on_token is not None:
            on_token()
        if isinstance(event, Notice) and notes is not None:
            notes.append(event.message)
        if isinstance(event, Error):
            raise SystemExit(f"error: {event.message}")
        if isinstance(event, Done):
            return event
    raise RuntimeError("no Done event")


def _way(engine: Engine, way: str, split: qattn.Split, steps: list | None = None) -> None:
    """Set the engine's decoding for `way`: a graph way builds its steps with the way's settings (each one also
    put in `steps`, where given)."""
    def make(model, cache, heads) -> GraphStep:
        step = GraphStep(model, cache, heads, fused=way != "graph-unfused", gemv=way == "graph-gemv", split=split)
        if steps is not None:
            steps.append(step)
        return step

    graph = way.startswith("graph")
    engine.configure(decoding=Decoding(lean=way != "forward", graph=graph, make_step=make if graph else None))


def _tokens(engine: Engine, n: int, seed: int) -> list[int]:
    """`n` random token ids from the middle of the vocabulary (no special tokens)."""
    vocab = engine.model.config.vocab_size
    return torch.randint(vocab // 8, vocab // 2, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _decode(engine: Engine, cache, at: int, tokens: int, seed: int, notes=None, on_token=None) -> tuple[Done, object]:
    """`tokens` greedy tokens after a 16-token follow-up on a copy of `cache`; (Done, the copy)."""
    copy = cache.clone()
    follow = _tokens(engine, 16, seed)
    settings = GenerationSettings(max_new_tokens=tokens, ignore_eos=True)
    return _done(engine.continue_on(copy, follow, at, settings), notes, on_token), copy


def steady_rate(times: list[float]) -> float | None:
    """Tokens/s from the second token to the last: the steps after the first, which on a copy of the cache
    also captures the graph (the first token comes from the read's logits, the second after that step)."""
    if len(times) < 3 or times[-1] <= times[1]:
        return None
    return (len(times) - 2) / (times[-1] - times[1])


def _kernel_ms(engine: Engine, cache, at: int, tokens: int) -> tuple[float | None, str | None, float | None]:
    """(GPU kernel time per decoded token over `tokens` steps, from the profiler; the TOP kernels by that time;
    kernels launched per token), all None off CUDA. The profiler starts at the second token: the first step on a
    copy of the cache (a graph way's capture, its eager body included) is not counted."""
    if engine.device.type != "cuda":
        return None, None, None
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CUDA])
    seen = []

    def start_at_second() -> None:
        seen.append(1)
        if len(seen) == 2:
            sync(engine.device)
            prof.start()

    _decode(engine, cache, at, tokens + 2, seed=1, on_token=start_at_second)
    sync(engine.device)
    prof.stop()
    events = prof.key_averages()
    steps = max(len(seen) - 2, 1)  # the steps after the second token
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:TOP]
    named = "; ".join(f"{e.key[:60]} {e.self_device_time_total / 1000 / steps:.3f} ms x{e.count}" for e in top)
    kernels = sum(e.count for e in events if e.self_device_time_total > 0) / steps
    return sum(e.self_device_time_total for e in events) / 1000 / steps, named, kernels


def _replay_ms(engine: Engine, step: GraphStep, repeats: int = 50) -> float | None:
    """Milliseconds per replay of `step`'s captured graph, back to back (the GPU's own time per token)."""
    if engine.device.type != "cuda" or step.graph is None:
        return None
    sync(engine.device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        step.graph.replay()
    sync(engine.device)
    return 1000 * (time.perf_counter() - t0) / repeats


def measure(args) -> dict:
    split = qattn.Split(way=args.attn_way, block=args.attn_block, programs=args.attn_programs, warps=args.attn_warps)
    rows = []
    for weights in args.weights.split(","):
        engine = Engine.load(None if args.model == "default" else args.model, weights=None if weights in ("", "as-stored") else weights, kv=args.kv)
        heads = RetainingHeads.random(engine.model, d_r=args.d_r)
        engine.set_policy(make_policy("locret", budget=args.budget, heads=heads), "compact")
        if args.chunk:
            engine.configure(chunk=args.chunk)
        ids = _tokens(engine, args.length, 0)
        cache = engine.new_cache(args.length, args.tokens)
        sync(engine.device)
        read = _done(engine.continue_on(cache, ids, 0, GenerationSettings(max_new_tokens=1, ignore_eos=True),
                                        keep_last=True))
        peak = torch.cuda.max_memory_allocated() / 2**30 if engine.device.type == "cuda" else None
        at = args.length + 1
        for way in args.ways.split(","):
            _way(engine, way, split)
            notes = []  # the engine's one line when it decodes eagerly
            _decode(engine, cache, at, 4, seed=2, notes=notes)  # warm-up (a capture, Triton)
            times, steps = [], []
            _way(engine, way, split, steps)
            done, _ = _decode(engine, cache, at, args.tokens, seed=3, notes=notes,
                              on_token=lambda times=times: times.append(time.perf_counter()))
            steady = steady_rate(times)
            step = steps[-1] if steps else None
            took = step is not None and step.graph is not None and not step.reason
            ms_token = 1000 * done.decode_s / max(done.new_tokens - 1, 1)
            rate = steady or 1e3 / ms_token  # tokens/s for the busy shares: the capture left out where it can be
            replay = _replay_ms(engine, step) if took else None
            kernel, top, launches = _kernel_ms(engine, cache, at, args.profile_tokens)
            rows.append({
                "weights": weights, "way": way if not way.startswith("graph") or took else f"{way} (not taken: {'; '.join(notes) or 'not CUDA'})",
                "decode_tok_s": round(done.decode_tps, 1), "ms_per_token": round(ms_token, 3),
                "steady_tok_s": None if steady is None else round(steady, 1),
                "gpu_kernel_ms_per_token": None if kernel is None else round(kernel, 3),
                "gpu_kernels_per_token": None if launches is None else round(launches, 1),
                "gpu_busy_share": None if kernel is None else round(min(kernel * rate / 1e3, 1.0), 3),
                "replay_ms": None if replay is None else round(replay, 3),
                "replay_busy_share": None if replay is None else round(min(replay * rate / 1e3, 1.0), 3),
                "prefill_tok_s": round(read.prefill_tps, 1), "kv_units_per_head": done.kv_tokens,
                "peak_gib_after_read": None if peak is None else round(peak, 2),
                "top_kernels": top,
            })
            print(json.dumps(rows[-1]), flush=True)
        del engine, cache
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return {"rows": rows, "setup": vars(args), "device": _device(), "commit": _commit(),
            "versions": {"torch": torch.__version__}}


def _device() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def markdown(result: dict) -> str:
    s = result["setup"]
    cols = ["weights", "way", "decode_tok_s", "steady_tok_s", "ms_per_token", "gpu_kernel_ms_per_token",
            "gpu_kernels_per_token", "gpu_busy_share",
            "replay_ms", "replay_busy_share", "prefill_tok_s", "kv_units_per_head", "peak_gib_after_read"]
    lines = [f"# Decode by way and weights: {Path(s['model']).name} on {result['device']} (random weights, speed only)",
             "", f"Command: `{s['command']}` (commit {result['commit']})", "",
             f"LOCRET b={s['budget']}, --kv {s['kv']}, random heads d_R={s['d_r']}, {s['length']:,} random tokens "
             f"read once, then {s['tokens']} greedy tokens on a copy of the cache per way. Decode attention in "
             f"the graph ways: the {s['attn_way']} split kernel, {s['attn_programs']} programs targeted, "
             f"{s.get('attn_warps', 4)} warps each"
             + (f", blocks of {s['attn_block']} units." if s["attn_way"] == "dot" else "."), "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join("" if r[c] is None else str(r[c]) for c in cols) + " |" for r in result["rows"]]
    lines += ["", "Kernels with the most GPU time per token:", ""]
    lines += [f"- {r['weights']}, {r['way']}: {r['top_kernels']}" for r in result["rows"] if r.get("top_kernels")]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a model folder or hub id; default: the embedded SmolLM2")
    p.add_argument("--weights", default="nf4,bf16,int8", help="comma-separated --weights values")
    p.add_argument("--kv", default="int8")
    p.add_argument("--ways", default=",".join(WAYS), help="comma-separated: " + ", ".join(WAYS))
    p.add_argument("--budget", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=0, help="prefill chunk (0: the model's default)")
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--profile-tokens", type=int, default=16)
    p.add_argument("--d-r", type=int, default=1024)
    p.add_argument("--attn-way", default=qattn.DEFAULT.way, choices=list(qattn.WAYS),
                   help="the split kernel's way in the graph ways (qattn.Split.way)")
    p.add_argument("--attn-block", type=int, default=qattn.DEFAULT.block, help="units a block, the dot way's")
    p.add_argument("--attn-programs", type=int, default=qattn.DEFAULT.programs, help="the split planner's target")
    p.add_argument("--attn-warps", type=int, default=qattn.DEFAULT.warps, help="warps a split kernel's program")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.command = "python bench/experiments/gpu_decode.py " + " ".join(argv or __import__("sys").argv[1:])
    try:
        result = measure(args)
    except UserError as exc:
        raise SystemExit(f"error: {exc}") from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_decode.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "gpu_decode.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
