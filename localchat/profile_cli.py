"""`localchat plan`, `localchat profile list|show|validate|tune`, and applying a profile to the flags."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from localchat import profiles
from localchat.engine.memory import GIB, MIB, Device, Shape, detect, dtype_name, quantized, read_config
from localchat.engine.policies import policy_class
from localchat.engine.policy_setup import check_offload
from localchat.errors import UserError
from localchat.planner import CHUNKS, DEFAULT_MARGIN, Plan, Request, make_plan, verify

# profile setting -> argparse attribute
ARG_NAMES = {"model": "model", "policy": "policy", "positions": "positions", "budget": "budget", "chunk": "chunk",
             "stabilizers": "stabilizers", "local": "local", "weights": "weights", "kv": "kv",
             "margin_mib": "margin_mib"}


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
    tune.add_argument("--out", type=Path, help="also write the measured figures as JSON here")
    _plan_flags(tune)
    model_flags(tune, sub=True)


def _plan_flags(p) -> None:
    p.add_argument("--weights", choices=profiles.WEIGHT_DTYPES, default=None, help="weight dtype to plan for")
    p.add_argument("--kv", choices=profiles.KV_DTYPES, default=None, help="KV-cache dtype to plan for")
    p.add_argument("--margin-mib", type=int, default=None, help="memory left free (default 1024 on CUDA, 512 on CPU)")
    p.add_argument("--memory-gb", type=float, default=None, help="plan for this much memory instead of what is free")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="with --memory-gb: plan for a GPU (bf16, 1 GiB margin) or a CPU (fp32)")


# --- applying a profile -------------------------------------------------------------------------------------


def apply_profile(args, device: Device | None = None, quiet: bool = False) -> profiles.Resolved:
    """Fill flags the user left unset from LOCALCHAT_* and the profile (once per args); warn about a
    profile made for another device."""
    done = getattr(args, "_resolved", None)
    if done is not None:
        return done
    cli = {key: getattr(args, attr, None) for key, attr in ARG_NAMES.items()}
    r = profiles.resolve(cli, getattr(args, "profile", None), device=device or detect())
    for key, value in r.values.items():
        setattr(args, ARG_NAMES[key], value)
    if not quiet:
        for w in r.warnings:
            print(f"localchat: warning: {w}", file=sys.stderr)
    args._resolved = r
    return r


# --- the model's shape without loading it ------------------------------------------------------------------


def _heads_d_r(directory: Path) -> int:
    try:
        return int(json.loads((directory / "heads.json").read_text(encoding="utf-8"))["d_r"])
    except (OSError, KeyError, ValueError):
        return 0


def model_facts(spec: str | None) -> tuple[Shape, object, int]:
    """(shape, model card or None, d_R of the shipped heads or 0) without loading any weights.
    `spec` may also be a config.json file or a directory holding only config.json."""
    from importlib import resources

    from localchat.engine.cards import find_card

    path = Path(spec).expanduser() if spec else None
    if path is not None and (path.suffix == ".json" or (path.is_dir() and (path / "config.json").exists())):
        try:
            cfg = read_config(path)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        card = find_card(spec)
        name = path.stem if path.suffix == ".json" else path.name
    else:
        from localchat.engine import loading

        source, card = loading.resolve(spec)
        if Path(source).is_dir():
            cfg = read_config(source)
        else:
            try:
                from transformers import AutoConfig

                cfg = AutoConfig.from_pretrained(source).to_dict()
            except Exception as exc:  # noqa: BLE001 - offline, gated, or not a model id
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise UserError(f"cannot read the config of {spec}: {first}; pass --model DIR (a directory "
                                f"with config.json) to plan without downloading") from None
        name = card.name if card else spec
    try:
        shape = Shape.from_config(cfg, name=name)
    except (TypeError, ValueError) as exc:
        raise UserError(f"{spec}: not a decoder config this planner knows ({exc})") from None
    d_r = 0
    if card is not None:
        d_r = _heads_d_r(Path(str(resources.files("localchat.models") / card.id)))
    return shape, card, d_r


# --- building a plan ------------------------------------------------------------------------------------------


def _target_device(args, r: profiles.Resolved, device: Device) -> tuple[int, str, str]:
    """(memory bytes, where the figure comes from, device kind) the plan is for."""
    p = r.profile
    if getattr(args, "memory_gb", None):
        kind = getattr(args, "device", None) or device.kind
        if not getattr(args, "device", None) and p is not None and p.meta.get("device"):
            kind = "cpu" if str(p.meta["device"]).lower() == "cpu" else "cuda"
        return int(args.memory_gb * GIB), f"--memory-gb {args.memory_gb:g}", kind
    if p is not None and "memory_gb" in p.meta and profiles.device_mismatch(p, device):
        return int(p.meta["memory_gb"] * GIB), f"{p.meta.get('description', p.name)}, from {p.label}", "cuda"
    return device.free, f"free on {device.describe()}", device.kind


def build_request(args, r: profiles.Resolved, card, d_r: int, kind: str, measured: dict | None = None) -> Request:
    act = "bf16" if kind == "cuda" else "fp32"
    weights = args.weights or act
    policy = args.policy or ("locret" if d_r or getattr(args, "heads", None) else None)
    cls = policy_class(policy) if policy else None
    offload = bool(getattr(args, "offload", False))
    if offload:
        check_offload(policy, kind, "plan it for a GPU with --device cuda --memory-gb N")
    bounded = cls is None or cls.bounded()
    positions = args.positions or (cls.default_positions if cls else "compact")
    locret = (card.locret if card else {}) or {}
    if policy == "locret" and not d_r:
        d_r = 1024  # the paper's d_R: heads trained for this model would be this size
    throughput = {}
    if measured:
        throughput = {int(c): float(t) for c, t in zip(measured.get("chunks", []), measured.get("tokens_per_s", []))}
    return Request(
        budget=args.budget, chunk=args.chunk,
        local=args.local if args.local is not None else int(locret.get("local", 96)),
        max_new=getattr(args, "max_new_tokens", 512), weights=weights,
        kv=args.kv if args.kv not in (None, "none") else act, act=act,
        d_r=d_r if policy in ("locret", None) else 0,
        margin=args.margin_mib * MIB if args.margin_mib is not None else None,
        target=locret.get("budget"), card_chunk=locret.get("chunk"),
        compact=positions == "compact" and bounded, holds_prompt=None if bounded else policy,
        policy=(cls(offload=True) if offload else cls()) if cls is not None else None,
        throughput=throughput,
        host_memory=detect("cpu").free - DEFAULT_MARGIN["cpu"] if offload else None,
    )


def _plan(args, quiet: bool = False) -> tuple[Plan, profiles.Resolved, Device]:
    device = detect()
    r = apply_profile(args, device, quiet=quiet)
    shape, card, d_r = model_facts(args.model)
    memory, source, kind = _target_device(args, r, device)
    measured = r.profile.meta.get("measured") if r.profile is not None else None
    req = build_request(args, r, card, d_r, kind, measured)
    plan = make_plan(shape, memory, req, kind=kind, memory_source=source)
    if quantized(req.weights):
        plan.notes.append(f"weights {req.weights}: linear layers only (embeddings, lm_head and norms at 16 bits); "
                          f"`--weights {req.weights}` loads them so")
    if quantized(req.kv):
        plan.notes.append(f"KV cache {req.kv}: retained units packed with a fp16 scale and zero per 64 values; "
                          f"the newest chunk stays full precision until the next eviction")
    if r.profile is not None:
        plan.notes.insert(0, f"{r.profile.label} ({r.profile_source})")
    return plan, r, device


def load_measured(args) -> tuple[object, int]:
    """The engine as load_engine builds it, and the process RSS just before its weights load (after the
    libraries, their CPU kernels and the tokenizer: those are the margin's job, not the memory model's)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from localchat.engine import loading
    from localchat.engine.engine import Engine
    from localchat.engine.memory import rss_bytes
    from localchat.engine.policy_setup import policy_for

    from localchat.engine import quantize

    source, card = loading.resolve(args.model)
    local = Path(source).is_dir()
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local)
    device = loading.best_device()
    weights = getattr(args, "weights", None)  # measured as planned: --weights and --kv load as the chat would
    quantize.check(weights, device)
    dtype = quantize.load_dtype(weights, loading.best_dtype(device), device)
    bnb = quantize.bnb_config(weights, device)
    extra = {"quantization_config": bnb, "device_map": {"": device.index or 0}} if bnb is not None else {}
    kv = getattr(args, "kv", None)
    x = torch.randn(1, 4, 64, 32, dtype=dtype, device=device)  # page in the kernels a forward uses
    mask = torch.ones(64, 64, dtype=torch.bool, device=device).tril()
    torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask)
    torch.nn.functional.silu(x @ x.transpose(-1, -2)).topk(8, dim=-1)
    baseline = rss_bytes()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa", local_files_only=local,
                                                 **extra)
    if bnb is None:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    quantize.quantize_after_load(model, weights, device)
    engine = Engine(model, tokenizer, name=card.name if card else args.model or source, card=card, chunk=args.chunk,
                    positions=args.positions, kv=kv if kv in ("int8", "int4", "int2") else None)
    engine.weights = weights
    engine.set_policy(policy_for(engine, args.policy, budget=args.budget, stabilizers=args.stabilizers,
                                 local=args.local, heads=getattr(args, "heads", None),
                                 decode_window=getattr(args, "decode_window", None),
                                 offload=getattr(args, "offload", False),
                                 sparse_prefill=getattr(args, "sparse_prefill", None)), args.positions)
    return engine, baseline


def run_plan(args) -> int:
    plan, r, device = _plan(args)
    if args.verify:
        if plan.kind != device.kind or plan.memory_source.startswith("--memory-gb"):
            raise UserError("--verify measures this machine: drop --memory-gb, or use a profile for this device")
        args.budget, args.chunk = plan.budget, plan.chunk
        engine, baseline = load_measured(args)
        plan = verify(engine, plan, baseline=baseline if device.kind == "cpu" else None)
    if args.json:
        print(json.dumps(plan_dict(plan), indent=2))
    else:
        print("\n".join(plan.lines()))
    return 0


def plan_dict(plan: Plan) -> dict:
    e = plan.estimate
    return {
        "model": plan.shape.name, "params": plan.shape.total_params(), "memory": plan.memory,
        "memory_source": plan.memory_source, "kind": plan.kind, "budget": plan.budget, "chunk": plan.chunk,
        "local": plan.request.local, "max_new": plan.request.max_new, "weights_dtype": plan.request.weights,
        "kv_dtype": plan.request.kv, "bytes": dict(e.rows()), "predicted_used": e.used, "predicted_total": e.total,
        "fits": plan.fits, "measured_peak": plan.measured_peak, "max_document": plan.max_document(),
        "full_cache_tokens": plan.full_attention_tokens(), "notes": plan.notes,
    }


# --- the engine fits itself to the memory (load_engine) ---------------------------------------------------


def fit_engine(engine, args) -> Plan | None:
    """After loading: shrink an automatic budget (and chunk) that do not fit the free memory; a budget or chunk
    the user fixed that cannot fit is an error saying what would. Returns the plan (None: not evicting, or a
    policy whose prefill holds the whole cache, SAGE-KV: the budget does not bound its memory, the document does)."""
    import torch

    from localchat.engine.memory import model_bytes

    p = engine.policy
    if not p.bounded():
        return None
    device = detect("cuda" if engine.device.type == "cuda" else "cpu")
    weights = model_bytes(engine.model)
    memory = device.free + (weights if device.kind == "cpu" else torch.cuda.memory_allocated())
    heads = getattr(p, "heads", None)
    dtype = next(engine.model.parameters()).dtype
    act = dtype_name(dtype)
    req = Request(budget=args.budget, chunk=args.chunk, local=p.local, max_new=getattr(args, "max_new_tokens", 512),
                  weights=act, kv=engine.kv if getattr(engine, "kv", "none") != "none" else act, act=act, d_r=getattr(heads, "d_r", 0) if heads is not None else 0,
                  margin=args.margin_mib * MIB if getattr(args, "margin_mib", None) is not None else None,
                  target=p.budget, card_chunk=engine.chunk, compact=engine.positions == "compact",
                  weights_exact=weights, policy=p)
    shape = Shape.from_config(engine.model.config, name=engine.name)
    plan = make_plan(shape, memory, req, kind=device.kind, memory_source=f"free on {device.describe()}")
    if plan.budget < p.budget or plan.chunk < engine.chunk:
        print(f"localchat: plan: budget {plan.budget:,} (asked {p.budget:,}), chunk {plan.chunk:,} "
              f"(asked {engine.chunk:,}) to fit {memory / GIB:.1f} GiB", file=sys.stderr)
        p.budget = plan.budget
        if getattr(p, "stabilizers", 0) >= p.budget:
            p.stabilizers = p.budget // 4
        engine.chunk = plan.chunk
    engine.plan = plan
    return plan


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
    r = apply_profile(args, device)
    print(f"profile      {r.profile.name if r.profile else 'none'} ({r.profile_source})")
    print(f"device       {device.describe()}")
    print(f"fingerprint  {device.fingerprint}")
    if r.profile is not None:
        for key in ("description", "device", "memory_gb", "fingerprint"):
            if key in r.profile.meta:
                print(f"  {key:<11} {r.profile.meta[key]}")
    print()
    width = max(map(len, profiles.SETTINGS))
    for key in profiles.SETTINGS:
        if key in r.values:
            print(f"{key:<{width}}  {str(r.values[key]):<34} {r.sources[key]}")
        else:
            print(f"{key:<{width}}  {'auto':<34} auto-detected (model card / planner; see `localchat plan`)")
    measured = r.profile.meta.get("measured") if r.profile is not None else None
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

    from localchat.engine import memory
    from localchat.engine.sampling import GenerationSettings

    ids = torch.randint(0, len(engine.tokenizer), (tokens,), generator=torch.Generator().manual_seed(chunk)).tolist()
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    else:
        before = memory.rss_bytes()
        memory.reset_peak_rss()
    engine.chunk = chunk
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


def run_tune(args) -> int:
    chunks = sorted({int(c) for c in args.chunks.split(",") if c.strip()})
    if not chunks or min(chunks) < 1:
        raise UserError(f"--chunks needs positive sizes (got {args.chunks!r})")
    if args.tokens < max(chunks):
        raise UserError(f"--tokens ({args.tokens}) must be at least the largest chunk ({max(chunks)})")
    device = detect()
    args.profile = args.profile or "none"  # measure plain auto-detected settings unless a profile is named
    plan, r, _ = _plan(args)
    args.budget = plan.budget
    args.chunk = plan.chunk
    engine, baseline = load_measured(args)
    window = engine.window if engine.compressing else None
    chunks = [c for c in chunks if not window or plan.budget + c < window]
    speeds, peaks = [], []
    for c in chunks:
        tps, peak = measure_speed(engine, args.tokens, c, baseline if device.kind == "cpu" else None)
        speeds.append(round(tps, 1))
        peaks.append(round(peak / MIB, 1))
        print(f"chunk {c:>5}: {tps:8.1f} tokens/s, peak {peak / MIB:8.1f} MiB", file=sys.stderr)
    fastest = chunks[max(range(len(chunks)), key=lambda i: speeds[i])]
    check = make_plan(plan.shape, plan.memory, build_request(args, r, engine.card, plan.request.d_r, device.kind,
                                                            {"chunks": chunks, "tokens_per_s": speeds}),
                      kind=device.kind, memory_source=plan.memory_source)
    predicted = check.estimate.used
    import torch

    from localchat import __version__

    measured = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "model": engine.name, "prompt_tokens": args.tokens,
        "chunks": chunks, "tokens_per_s": speeds, "peak_mib": peaks, "budget": plan.budget,
        "chosen_chunk": check.chunk, "predicted_peak_mib": round(predicted / MIB, 1),
        "measured_peak_mib": peaks[chunks.index(check.chunk)] if check.chunk in chunks else None,
        "torch": torch.__version__, "localchat": __version__, "threads": torch.get_num_threads(),
    }
    table = {"description": f"tuned on {device.name}", "device": "cpu" if device.kind == "cpu" else device.name,
             "memory_gb": round(device.total / GIB, 1), "fingerprint": device.fingerprint}
    if args.model:
        table["model"] = args.model
    table.update({"policy": engine.policy.name, "positions": engine.positions, "budget": plan.budget,
                  "chunk": check.chunk, "local": engine.policy.local, "weights": plan.request.weights,
                  "kv": plan.request.kv, "margin_mib": plan.estimate.margin // MIB})
    if hasattr(engine.policy, "stabilizers"):
        table["stabilizers"] = engine.policy.stabilizers
    table["measured"] = measured
    name = args.name or f"tuned-{_slug(device.name if device.kind == 'cuda' else 'cpu')}"
    path = profiles.save_profile(name, table, make_default=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"profile": name, "config": str(path), **table}, indent=2) + "\n")
    print(f"saved profile {name} to {path}: budget {plan.budget:,}, chunk {check.chunk:,} "
          f"(fastest, {speeds[chunks.index(check.chunk)] if check.chunk in chunks else 0:,.0f} tokens/s)")
    print(profiles.profile_toml(name, table), end="")
    return 0
