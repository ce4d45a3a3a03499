"""`localchat plan` and `localchat profile list|show|validate|tune`: parsing and printing; the settings come from
planning/resolve.py, the engine from planning/load.py."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from localchat.args import resolve_spec
from localchat.config import RunSpec
from localchat.errors import UserError
from localchat.planning import profiles
from localchat.planning.memory import GIB, MIB, Device, Shape, detect, quantized
from localchat.planning.planner import Plan, decode_choices, make_plan, verify
from localchat.planning.resolve import (
    Target,
    fixed_fields,
    model_facts,
    plan_request,
    plan_spec,
    settled_params,
    shipped_heads_dir,
)


def add_parsers(sub, model_flags) -> None:
    plan = sub.add_parser("plan", help="print the memory plan (weights / KV / activations / margin, budget, chunk) "
                                       "without loading the model")
    _plan_flags(plan)
    plan.add_argument("--verify", action="store_true",
                      help="load the model, run one chunk on a full cache and compare the real peak with the plan")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    model_flags(plan, sub=True)

    prof = sub.add_parser("profile", help="device profiles: list, show, validate, tune")
    psub = prof.add_subparsers(dest="profile_command", required=True)
    psub.add_parser("list", help="the built-in and your profiles")
    show = psub.add_parser("show", help="every setting in force, with where it came from")
    show.add_argument("name", nargs="?", help="the profile to show (default: the one in force)")
    _plan_flags(show)
    model_flags(show, sub=True)
    psub.add_parser("validate", help="check config.toml and the built-in profiles")
    tune = psub.add_parser("tune", help="measure this machine (speed per chunk size, peak memory) and save a profile")
    tune.add_argument("--name", help="the profile's name (default: tuned-<device>)")
    tune.add_argument("--tokens", type=int, default=4096, help="prompt length for the measurements (default 4096)")
    tune.add_argument("--chunks", default="256,512,1024,2048", help="chunk sizes to measure (default 256,512,1024,2048)")
    tune.add_argument("--thread-counts", help="CPU threads to measure at the chosen chunk (default: 1, half the "
                                              "cores and every core)")
    tune.add_argument("--out", type=Path, help="also write the measured figures as JSON here")
    _plan_flags(tune)
    model_flags(tune, sub=True)


def _plan_flags(p) -> None:
    # SUPPRESS: a value given before the subcommand (`localchat --kv int8 plan`) is kept
    p.add_argument("--weights", choices=profiles.WEIGHT_DTYPES, default=argparse.SUPPRESS,
                   help="weight dtype to plan for (default: the plan chooses)")
    p.add_argument("--kv", choices=profiles.KV_DTYPES, default=argparse.SUPPRESS,
                   help="retained KV-cache type to plan for (default: the plan chooses)")
    p.add_argument("--margin-mib", type=int, default=None, help="memory left free (default 1024 on CUDA, 512 on CPU)")
    p.add_argument("--memory-gb", type=float, default=None, help="plan for this much memory instead of what is free")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="with --memory-gb: plan for a GPU (bf16, 1 GiB margin) or a CPU (fp32)")


# --- the plan -------------------------------------------------------------------------------------------------


def _target(args, device: Device) -> Target:
    """The memory the plan is for: --memory-gb, a profile made for another device, or what is free here."""
    config = {} if (args.profile or "").lower() == "none" else profiles.read_config()
    profile, _ = profiles.choose_profile(args.profile, os.environ, config)
    if args.memory_gb is not None:
        if not args.memory_gb > 0:
            raise UserError(f"--memory-gb must be a positive number (got {args.memory_gb})")
        kind = args.device or device.kind
        if not args.device and profile is not None and profile.meta.get("device"):
            kind = "cpu" if str(profile.meta["device"]).lower() == "cpu" else "cuda"
        return Target(int(args.memory_gb * GIB), f"--memory-gb {args.memory_gb:g}", kind)
    if profile is not None and "memory_gb" in profile.meta and profiles.device_mismatch(profile, device):
        return Target(int(profile.meta["memory_gb"] * GIB), f"{profile.meta.get('description', profile.name)}, "
                                                             f"from {profile.label}", "cuda")
    return Target.of(device)


def plan_for(args, quiet: bool = False) -> tuple[RunSpec, Plan, Device]:
    """The RunSpec `args` resolve to on the plan's target, and the plan that prints (for a policy the budget
    bounds, the one the spec was made with; else a plan of the same settings that says what the memory holds)."""
    device = detect()
    target = _target(args, device)
    spec = resolve_spec(args, device=device, target=target, quiet=quiet)
    shape, card = model_facts(spec.model)
    plan = spec.plan
    if plan is None:
        req = plan_request(spec, card, target.kind, fixed={"chunk", "weights", "kv"} | ({"budget"} if spec.policy.budget else set()))
        plan = make_plan(shape, target.memory, req, kind=target.kind, memory_source=target.source)
    if quantized(plan.request.weights):
        plan.notes.append(f"weights {plan.request.weights}: linear layers only (embeddings, lm_head and norms at "
                          f"16 bits); `--weights {plan.request.weights}` loads them so")
    if plan.kv != "none":
        plan.notes.append(f"KV cache {plan.kv}: retained units packed with a fp16 scale and zero per 64 "
                          f"values; the newest chunk stays full precision until the next eviction")
    heads = heads_note(spec, card)
    if heads:
        plan.notes.append(heads)
    if spec.profile:
        profile = profiles.find(spec.profile)
        plan.notes.insert(0, f"{profile.label} ({spec.sources.get('profile', '')})")
    return spec, plan, device


def heads_note(spec: RunSpec, card) -> str | None:
    """Where LOCRET's heads will come from when that is an official release: fetched already, or not yet; for
    KVzap, which scorer, its size and where it comes from."""
    from localchat.planning.heads_fetch import Release, cached_heads

    if spec.policy.name == "kvzap":
        return kvzap_note(spec, card)

    release = Release.of(card) if card is not None else None
    if release is None or spec.policy.heads or not spec.policy.has_heads() or shipped_heads_dir(card):
        return None
    directory = cached_heads(card)
    if directory:
        return f"retaining heads: the official release {release.describe()}, fetched into {directory}"
    return (f"retaining heads: the official release {release.describe()}, not fetched yet: "
            f"`localchat heads fetch {card.id}` downloads it once (or the first run does)")


def kvzap_note(spec: RunSpec, card) -> str:
    from localchat.engine import kvzap
    from localchat.planning.resolve import heads_dir_for, kvzap_config, shipped_kvzap_dir

    p = spec.policy
    if p.heads == "random":
        return "scorer: KVzap, random (an ablation: untrained linear modules)"
    directory = heads_dir_for(p, card)
    config = kvzap_config(directory, card)
    layers = Shape.from_card(card).global_layers if card is not None and card.shape.get("layers") else None
    size = (f"{kvzap.variant(config)}, {kvzap.parameters(config, layers) / 1e6:,.1f}M parameters"
            if config.get("n_modules") else "size unknown")
    if directory is None and (card is None or not card.kvzap_release):
        return "scorer: KVzap, none at hand for this model: pass --heads DIR (a KVzap release folder)"
    if p.heads or shipped_kvzap_dir(card):
        return f"scorer: KVzap ({size}) from {directory}"
    where = (f"fetched into {directory}" if directory else
             f"not fetched yet: `localchat heads fetch {card.id}` downloads it once (or the first run does)")
    return f"scorer: KVzap ({size}), the release {card.kvzap_release}, {where}"


def run_plan(args) -> int:
    spec, plan, device = plan_for(args)
    if args.verify:
        if plan.kind != device.kind or plan.memory_source.startswith("--memory-gb"):
            raise UserError("--verify measures this machine: drop --memory-gb, or use a profile for this device")
        from localchat.planning.load import load_measured  # the engine's code, only when it runs

        engine, baseline = load_measured(spec)
        plan = verify(engine, plan, baseline=baseline if device.kind == "cpu" else None)
    if args.json:
        print(json.dumps({**plan_dict(plan), "spec": spec.to_dict()}, indent=2))
    else:
        print("\n".join(plan.lines()))
    return 0


def plan_dict(plan: Plan) -> dict:
    e = plan.estimate
    return {
        "model": plan.shape.name, "params": plan.shape.total_params(), "memory": plan.memory,
        "memory_source": plan.memory_source, "kind": plan.kind, "budget": plan.budget, "chunk": plan.chunk,
        "local": plan.request.local, "max_new": plan.request.max_new, "weights_dtype": plan.weights,
        "kv_dtype": plan.request.kv_dtype(), "kv": plan.kv, "precision_chosen": list(plan.chosen),
        "precision_why": plan.precision, "bytes": dict(e.rows()), "predicted_used": e.used, "predicted_total": e.total,
        "fits": plan.fits, "measured_peak": plan.measured_peak, "max_document": plan.max_document(),
        "full_cache_tokens": plan.full_attention_tokens(), "notes": plan.notes,
    }


# --- profile list / show / validate ----------------------------------------------------------------------------


def run_profile(args) -> int:
    cmd = args.profile_command
    if cmd == "list":
        return _list()
    if cmd == "show":
        return _show(args)
    if cmd == "validate":
        return _validate()
    return run_tune(args)


def _list() -> int:
    config = profiles.read_config()
    default = config.get("default_profile")
    rows = [("name", "where", "device", "model", "budget", "chunk", "weights")]
    for name, p in profiles.all_profiles(config).items():
        where = "built-in" if p.origin == "built-in" else "config.toml"
        mark = " *" if name == default else ""
        rows.append((name + mark, where, str(p.meta.get("description", p.meta.get("device", ""))),
                     str(p.values.get("model", "")), str(p.values.get("budget", "auto")),
                     str(p.values.get("chunk", "auto")), str(p.values.get("weights", "auto"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print(f"\n* default_profile; your profiles live in {profiles.config_path()} as [profiles.NAME]")
    return 0


def _show(args) -> int:
    if args.name:
        args.profile = args.name
    device = detect()
    spec = resolve_spec(args, device=device, plan=False)
    profile = profiles.find(spec.profile) if spec.profile else None
    print(f"profile      {spec.profile or 'none'} ({spec.sources.get('profile', 'no profile')})")
    print(f"device       {device.describe()}")
    print(f"fingerprint  {device.fingerprint}")
    if profile is not None:
        for key in ("description", "device", "memory_gb", "fingerprint"):
            if key in profile.meta:
                print(f"  {key:<11} {profile.meta[key]}")
    print()
    rows = spec.rows()
    width = max(len(k) for k, _, _ in rows)
    for key, value, source in rows:
        print(f"{key:<{width}}  {str(value):<34} {source}")
    print("\n(`localchat plan` shows the memory plan, which may lower an automatic budget or chunk)")
    measured = profile.meta.get("measured") if profile is not None else None
    if measured:
        print("\nmeasured:")
        for k, v in measured.items():
            print(f"  {k}: {v}")
    return 0


def _validate() -> int:
    bad = profiles.validate()
    if bad:
        for line in bad:
            print(f"localchat: error: {line}", file=sys.stderr)
        return 2
    n = len(profiles.all_profiles())
    print(f"ok: {n} profiles ({profiles.config_path()} {'present' if profiles.config_path().exists() else 'absent'})")
    return 0


# --- tune -------------------------------------------------------------------------------------------------------------


def _slug(text: str) -> str:
    import re

    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:32] or "device"


def measure_speed(engine, tokens: int, chunk: int, baseline: int | None = None) -> tuple[float, int]:
    """(prefill tokens/s, peak bytes) for a `tokens`-long random prompt at `chunk`."""
    import torch

    from localchat.engine.sampling import GenerationSettings
    from localchat.planning import memory

    ids = torch.randint(0, len(engine.tokenizer), (tokens,), generator=torch.Generator().manual_seed(chunk)).tolist()
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    else:
        before = memory.rss_bytes()
        memory.reset_peak_rss()
    engine.configure(chunk=chunk)
    t0 = time.perf_counter()
    for ev in engine.generate(ids, GenerationSettings(max_new_tokens=1, ignore_eos=True)):
        if type(ev).__name__ == "Error":
            raise UserError(f"measuring chunk {chunk} failed: {ev.message}")
    secs = time.perf_counter() - t0
    if cuda:
        peak = int(torch.cuda.max_memory_allocated())
    else:
        peak = memory.peak_rss_bytes()
        peak = peak - baseline if baseline is not None else memory.model_bytes(engine.model) + peak - before
    return tokens / secs, peak


def measure_decode(spec: RunSpec, choices: tuple[str, ...], prompt: int = 256, new: int = 32) -> dict[str, float]:
    """Decode tokens/s after a `prompt`-token random prompt with each weights in `choices` (a load each)."""
    import gc

    import torch

    from localchat.engine.sampling import GenerationSettings
    from localchat.planning.load import load_engine

    speeds = {}
    for weights in choices:
        engine = load_engine(replace(spec, weights=weights))
        ids = torch.randint(0, len(engine.tokenizer), (prompt,), generator=torch.Generator().manual_seed(0)).tolist()
        done = None
        for ev in engine.generate(ids, GenerationSettings(max_new_tokens=new, ignore_eos=True)):
            if type(ev).__name__ == "Error":
                raise UserError(f"measuring {weights} decoding failed: {ev.message}")
            done = ev
        speeds[weights] = round(done.decode_tps, 1)
        print(f"decode {weights:>5}: {done.decode_tps:8.1f} tokens/s", file=sys.stderr)
        del engine
        gc.collect()
    return speeds


def thread_counts(text: str | None, cores: int) -> list[int]:
    """The thread counts `profile tune` measures: `text` (comma-separated), or 1, half the cores and all of them."""
    if not text:
        return sorted({1, max(1, cores // 2), cores})
    try:
        counts = sorted({int(c) for c in text.split(",") if c.strip()})
    except ValueError:
        raise UserError(f"--thread-counts takes whole numbers, e.g. 1,2 (got {text!r})") from None
    if not counts or counts[0] < 1:
        raise UserError(f"--thread-counts needs counts of at least 1 (got {text!r})")
    return counts


def measure_threads(engine, tokens: int, chunk: int, counts: list[int], baseline: int | None) -> dict[int, dict]:
    """Reading speed (a `tokens` prompt at `chunk`) and decoding speed (32 tokens after it) on each thread count."""
    import torch

    from localchat.engine.sampling import GenerationSettings

    out = {}
    for n in counts:
        torch.set_num_threads(n)
        read, _ = measure_speed(engine, tokens, chunk, baseline)
        ids = torch.randint(0, len(engine.tokenizer), (256,), generator=torch.Generator().manual_seed(n)).tolist()
        done = [ev for ev in engine.generate(ids, GenerationSettings(max_new_tokens=32, ignore_eos=True))][-1]
        if type(done).__name__ == "Error":
            raise UserError(f"measuring {n} threads failed: {done.message}")
        out[n] = {"read": round(read, 1), "decode": round(done.decode_tps, 1)}
        print(f"threads {n:>3}: read {read:8.1f} tokens/s, decode {done.decode_tps:6.1f} tokens/s", file=sys.stderr)
    return out


def best_threads(measured: dict[int, dict]) -> int:
    """The count that reads fastest (what a CPU user waits for); of counts within 3 % of it, the one decoding fastest."""
    top = max(m["read"] for m in measured.values())
    return max((n for n, m in measured.items() if m["read"] >= 0.97 * top), key=lambda n: measured[n]["decode"])


def run_tune(args) -> int:
    """Measure this machine: prefill speed per chunk, then the real peak at the plan's budget and precision (planned
    again around any miss); save what fits with the margin as a profile, and show the plan before and after."""
    try:
        chunks = sorted({int(c) for c in args.chunks.split(",") if c.strip()})
    except ValueError:
        raise UserError(f"--chunks takes whole numbers, e.g. 256,512 (got {args.chunks!r})") from None
    if not chunks or min(chunks) < 1:
        raise UserError(f"--chunks needs positive sizes (got {args.chunks!r})")
    if args.tokens < max(chunks):
        raise UserError(f"--tokens ({args.tokens}) must be at least the largest chunk ({max(chunks)})")
    if args.name is not None:
        profiles.profile_toml(args.name, {})  # a bad name fails now, not after the measurements
    import os

    counts = thread_counts(args.thread_counts, os.cpu_count() or 1)
    device = detect()
    args.profile = args.profile or "none"  # measure plain auto-detected settings unless a profile is named
    spec, before, _ = plan_for(args)
    decode = {}
    held = spec.card.held_weights(before.kind) if spec.card is not None else ()
    if (held or before.kind == "cuda") and "weights" not in fixed_fields(spec):  # speed decides (planner's rules)
        decode = measure_decode(spec, decode_choices(before, held))
        target = Target(before.memory, before.memory_source, before.kind)
        spec = plan_spec(replace(spec, plan=None), before.shape, spec.card, target, fixed=fixed_fields(spec),
                         measured={f"decode_tps_{w}": v for w, v in decode.items()})
        before = spec.plan
    from localchat.planning.load import load_measured
    from localchat.planning.memory import dtype_name, model_bytes

    engine, baseline = load_measured(replace(spec, chunk=before.chunk))
    base = baseline if device.kind == "cpu" else None
    window = engine.window if engine.compressing else None
    chunks = [c for c in chunks if not window or before.budget + c < window]
    speeds, peaks = [], []
    for c in chunks:
        tps, peak = measure_speed(engine, args.tokens, c, base)
        speeds.append(round(tps, 1))
        peaks.append(round(peak / MIB, 1))
        print(f"chunk {c:>5}: {tps:8.1f} tokens/s, peak {peak / MIB:8.1f} MiB", file=sys.stderr)
    measured_speed = {"chunks": chunks, "tokens_per_s": speeds}
    act = dtype_name(engine.model.get_input_embeddings().weight.dtype)
    req = plan_request(spec, engine.card, before.kind, fixed=fixed_fields(spec) | {"weights"}, measured=measured_speed,
                       weights_exact=model_bytes(engine.model), act=act)
    req = replace(req, kv=None if "kv" in before.chosen else req.kv)
    check = make_plan(before.shape, before.memory, req, kind=before.kind, memory_source=before.memory_source)
    check.chosen = tuple(sorted(set(check.chosen) | set(before.chosen)))
    print(f"checking budget {check.budget:,}, chunk {check.chunk:,}, {check.weights} weights, {check.kv} cache "
          f"on a full cache ...", file=sys.stderr)
    after = verify(engine, check, baseline=base)
    import torch

    by_threads = {}
    if device.kind == "cpu" and spec.threads is None:  # else the threads the user named
        by_threads = measure_threads(engine, args.tokens, after.chunk, counts, base)
        torch.set_num_threads(best_threads(by_threads))

    from localchat import __version__

    speed = dict(zip(chunks, speeds)).get(after.chunk)
    measured = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "model": engine.name, "prompt_tokens": args.tokens,
        "chunks": chunks, "tokens_per_s": speeds, "peak_mib": peaks, **{f"decode_tps_{w}": v for w, v in decode.items()},
        **_summary("before", before), **_summary("after", after),
        "torch": torch.__version__, "localchat": __version__, "threads": torch.get_num_threads(),
        **({"thread_counts": list(by_threads), "read_tokens_per_s_by_threads": [m["read"] for m in by_threads.values()],
            "decode_tokens_per_s_by_threads": [m["decode"] for m in by_threads.values()]} if by_threads else {}),
    }
    table = {"description": f"tuned on {device.name}", "device": "cpu" if device.kind == "cpu" else device.name,
             "memory_gb": round((before.memory if args.memory_gb else device.total) / GIB, 1),
             "fingerprint": device.fingerprint}
    if spec.model:
        table["model"] = spec.model
    table.update({"policy": engine.policy.name, "positions": engine.positions, "budget": after.budget,
                  "chunk": after.chunk, "local": engine.policy.local, "weights": after.weights,
                  "kv": after.kv, "margin_mib": after.estimate.margin // MIB})
    if by_threads:
        table["threads"] = best_threads(by_threads)
    params = settled_params(spec, after.budget)
    table.update({k: v for k, v in params.items() if k in profiles.SETTINGS})  # LOCRET's n_s
    table["measured"] = measured
    name = args.name or f"tuned-{_slug(device.name if device.kind == 'cuda' else 'cpu')}"
    path = profiles.save_profile(name, table, make_default=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"profile": name, "config": str(path), **table}, indent=2) + "\n")
    print("\n".join(_before_after(before, after, speed)))
    print(f"saved profile {name} to {path}")
    print(profiles.profile_toml(name, table), end="")
    return 0


def _summary(when: str, plan: Plan) -> dict:
    """The plan's choices as flat `when_*` keys (a profile's [measured] table holds no nested tables)."""
    facts = {"weights": plan.weights, "kv": plan.kv, "budget": plan.budget, "chunk": plan.chunk,
             "predicted_peak_mib": round(plan.estimate.used / MIB, 1), "precision": plan.precision}
    if plan.measured_peak is not None:
        facts["measured_peak_mib"] = round(plan.measured_peak / MIB, 1)
    return {f"{when}_{k}": v for k, v in facts.items()}


def _before_after(before: Plan, after: Plan, speed: float | None) -> list[str]:
    """The plan from arithmetic next to the measured one."""
    rows = [("weights", before.weights, after.weights), ("KV cache", before.kv, after.kv),
            ("budget", f"{before.budget:,}", f"{after.budget:,}"), ("chunk", f"{before.chunk:,}", f"{after.chunk:,}"),
            ("peak", f"{before.estimate.used / GIB:.2f} GiB predicted",
             f"{after.measured_peak / GIB:.2f} GiB measured" if after.measured_peak is not None else "-"),
            ("reading", "-", f"{speed:,.0f} tokens/s" if speed else "-")]
    lines = [f"{'':<10} {'before (plan)':<24} after (measured)"]
    lines += [f"{label:<10} {b:<24} {a}" for label, b, a in rows]
    return lines + [f"note       {n}" for n in after.notes if "does not fit" in n]
