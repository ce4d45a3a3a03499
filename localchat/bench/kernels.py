"""`localchat bench kernels`: each kernel vs its torch twin, and decode with int4 KV end to end, in one run.

1. Micro: `qattn.decode_attention` (Triton) vs the twin vs the path the engine had before the kernels
   (dequantize the whole cache, concatenate the tail, SDPA), on random packed caches of SmolLM2's shape
   (9 query / 3 KV heads, d=64) and Llama-3-8B's (32 / 8, d=128); `evict.gather_rotate` (Triton) vs
   the twin; `evict.select` batched over layers vs one layer at a time. Median of `reps` timed calls
   after warm-up (CUDA: synchronised). Without CUDA only the torch columns are measured.
2. End to end: one engine (LOCRET, compact positions, `--kv int4`), one document; decode tokens/s with the
   fused attention on Triton, on the twin, and with the dequantize-then-SDPA path; plus `--kv none`.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import localchat.kernels as kernels
from localchat.kernels import evict, qattn


@dataclass
class KernelConfig:
    out: Path
    model: str | None = None
    length: int = 8192
    budget: int = 1024
    decode_tokens: int = 64
    reps: int = 50
    seed: int = 0
    micro_only: bool = False
    units: tuple[int, ...] = (1024, 4096, 16384)  # cache lengths of the decode-attention rows
    command: str = ""


def _time(fn, reps: int, cuda: bool) -> float:
    """Median milliseconds per call."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - t0))
    return round(statistics.median(times), 4)


def _old_path(query, quant, tail_k, tail_v, bits, group, scaling, inv):
    """What the engine did before: the dequantized cache, concatenated, through SDPA."""
    keys, values = qattn.dequantized_keys_values(quant, bits, group, inv)
    keys = torch.cat([keys.to(query.dtype), tail_k], dim=-2)
    values = torch.cat([values.to(query.dtype), tail_v], dim=-2)
    rep = query.shape[1] // keys.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        query, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1), scale=scaling)


def micro(reps: int, device: torch.device, units=(1024, 4096, 16384)) -> list[dict]:
    from localchat.engine.qcache import group_size, quantize

    cuda = device.type == "cuda"
    triton = kernels.use_triton(torch.zeros(1, device=device))
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    g = torch.Generator().manual_seed(0)
    for name, hq, h, d in (("smollm2", 9, 3, 64), ("llama3-8b", 32, 8, 128)):
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
        for n in units:
            for bits in (4, 2):
                quant = {}
                for names in (("qk", "ks", "kz"), ("qv", "vs", "vz")):
                    quant.update(zip(names, quantize(torch.randn(1, h, n, d, generator=g), bits, group_size(d))))
                quant = {k: v.to(device) for k, v in quant.items()}
                q = torch.randn(1, hq, 1, d, generator=g).to(device, dtype)
                tk, tv = (torch.randn(1, h, 64, d, generator=g).to(device, dtype) for _ in range(2))
                args = (q, quant, tk, tv, bits, group_size(d), d**-0.5, inv.to(device))
                row = {"kernel": "decode_attention", "shape": name, "units": n, "tail": 64, "bits": bits,
                       "dtype": str(dtype).removeprefix("torch."),
                       "twin_ms": _time(lambda args=args: qattn.decode_attention_torch(*args), reps, cuda),
                       "dequant_sdpa_ms": _time(lambda args=args: _old_path(*args), reps, cuda)}
                if triton:
                    row["triton_ms"] = _time(lambda args=args: qattn.decode_attention_triton(*args), reps, cuda)
                    row["speedup_vs_dequant_sdpa"] = round(row["dequant_sdpa_ms"] / row["triton_ms"], 2)
                    row["speedup_vs_twin"] = round(row["twin_ms"] / row["triton_ms"], 2)
                rows.append(row)
        for n, k in ((1536, 1024), (6144, 4096)):
            keys, values = (torch.randn(1, h, n, d, generator=g).to(device, dtype) for _ in range(2))
            idx = torch.rand(h, n, generator=g).topk(k, -1).indices.sort(-1).values.to(device)
            args = (keys, values, idx, inv.to(device))
            row = {"kernel": "gather_rotate", "shape": name, "units": n, "kept": k,
                   "dtype": str(dtype).removeprefix("torch."),
                   "twin_ms": _time(lambda args=args: evict.gather_rotate_torch(*args), reps, cuda)}
            if triton:
                row["triton_ms"] = _time(lambda args=args: evict.gather_rotate_triton(*args), reps, cuda)
                row["speedup_vs_twin"] = round(row["twin_ms"] / row["triton_ms"], 2)
            rows.append(row)
    prios = [torch.randn(3, 1536, generator=g).to(device) for _ in range(30)]
    rows.append({"kernel": "select", "shape": "30 layers x 3 heads", "units": 1536, "kept": 1024,
                 "per_layer_ms": _time(lambda: [p.topk(1024, -1).indices.sort(-1).values for p in prios], reps, cuda),
                 "batched_ms": _time(lambda: evict.select(prios, 1024), reps, cuda)})
    return rows


def end_to_end(config: KernelConfig, say):
    """Decode rows, and the engine (its device and name go into the setup)."""
    from localchat.bench.cell import Cell, load_engine, use_policy
    from localchat.bench.perf import greedy, prompt
    from localchat.bench.runner import default_chunk

    cell = Cell(task="niah_single", length=config.length, policy="locret", budget=config.budget, n=1,
                seed=config.seed, model_spec=config.model, heads="random", chunk=default_chunk(config.model),
                positions="compact", max_new_tokens=config.decode_tokens, kv="int4")
    engine = load_engine(cell)
    use_policy(engine, cell)
    ids = prompt(engine, config.length, config.seed)
    modes = [("int4, fused attention, Triton", "int4", True, "triton"),
             ("int4, fused attention, torch twin", "int4", True, "torch"),
             ("int4, dequantize then SDPA", "int4", False, None),
             ("none (full-precision cache)", "none", False, None)]
    if engine.device.type != "cuda":
        modes = modes[1:]
    rows = []
    asked = os.environ.get("LOCALCHAT_KERNELS")
    for label, kv, fused, kind in modes:
        os.environ["LOCALCHAT_KERNELS"] = kind or "torch"
        kernels.reset_backend()
        engine.configure(kv=kv, decoding=dataclasses.replace(engine.decoding, fused=fused))
        greedy(engine, ids, 4)  # warm-up (and Triton's compile)
        say(f"kernels: decode, {label}")
        done = greedy(engine, ids, config.decode_tokens)
        rows.append({"mode": label, "kv": kv, "prompt_tokens": done.prompt_tokens, "new_tokens": done.new_tokens,
                     "decode_tok_s": round(done.decode_tps, 2), "kv_mib": round(done.kv_bytes / 2**20, 2)})
    if asked is None:  # the caller's choice back
        os.environ.pop("LOCALCHAT_KERNELS", None)
    else:
        os.environ["LOCALCHAT_KERNELS"] = asked
    kernels.reset_backend()
    return rows, engine


def measure(config: KernelConfig, say=lambda s: None) -> dict:
    from localchat.bench import machine

    e2e, model, device = [], None, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not config.micro_only:
        say("kernels: end to end")
        e2e, engine = end_to_end(config, say)
        model, device = engine.name, engine.device
    say("kernels: micro")
    rows = micro(config.reps, device, config.units)
    fused = next((r for r in e2e if "Triton" in r["mode"]), None)
    old = next((r for r in e2e if "dequantize" in r["mode"]), None)
    return {
        "command": config.command,
        "setup": {"model": model, "device": device.type, "length": config.length, "budget": config.budget,
                  "positions": "compact", "heads": "random (speed only)", "decode_tokens": config.decode_tokens,
                  "reps": config.reps, "seed": config.seed, "date": time.strftime("%Y-%m-%d"),
                  "triton": kernels.use_triton(torch.zeros(1, device=device))},
        "hardware": machine.hardware(), "versions": machine.versions(),
        "micro": rows, "end_to_end": e2e,
        "decode_fused_triton_vs_dequant_sdpa": round(fused["decode_tok_s"] / old["decode_tok_s"], 2) if fused else None,
    }


def _table(rows: list[dict]) -> list[str]:
    cols = list(dict.fromkeys(c for r in rows for c in r))
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
            *("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows)]


def markdown(result: dict) -> str:
    s, hw, v = result["setup"], result["hardware"], result["versions"]
    gpu = f", GPU {hw['gpu']}" if hw.get("gpu") else ""
    ratio = result["decode_fused_triton_vs_dequant_sdpa"]
    lines = [f"# Kernels vs twins, {s['model'] or 'no model'}, {hw['cpu']} ({hw['cores']} cores{gpu})", "",
             f"Command: `{result['command']}` ({s['date']}, {s['device']}, torch {v['torch']}, transformers "
             f"{v['transformers']}, localchat {v['localchat']}, seed {s['seed']}).", ""]
    if result["end_to_end"]:
        lines += [f"## End to end: decode tokens/s, LOCRET b={s['budget']}, {s['length']}-token document, compact "
                  f"positions, {s['decode_tokens']} tokens greedy (EOS ignored), heads {s['heads']}", "",
                  *_table(result["end_to_end"]), ""]
    if ratio is not None:
        lines += [f"Fused int4 decode on Triton / dequantize-then-SDPA: {ratio}x.", ""]
    for kernel in ("decode_attention", "gather_rotate", "select"):
        rows = [{k: val for k, val in r.items() if k != "kernel"} for r in result["micro"] if r["kernel"] == kernel]
        lines += [f"## `{kernel}`: median ms per call over {s['reps']} calls", "", *_table(rows), ""]
    return "\n".join(lines)


def run(config: KernelConfig, say=lambda s: None) -> Path:
    from localchat.bench.perf import write

    return write(measure(config, say), config.out / "kernels.json", config.out / "kernels.md",
                 lambda result: markdown(result) + "\n")
