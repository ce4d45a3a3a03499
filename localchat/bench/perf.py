"""`localchat bench perf`: LOCRET vs full attention, side by side in one run, on this machine.

1. One prompt of `length` tokens (a niah_single document at depth 0.5 in the app's layout), chunked
   prefill: `full` (original positions, our in-place cache) vs `locret` (compact positions); prefill
   tokens/s, decode tokens/s over `decode_tokens` greedy tokens (EOS ignored), KV bytes held.
2. An extra, labelled row: `full` through transformers' stock DynamicCache, the HF default path
   (`model(..., past_key_values=DynamicCache(config=model.config))`, `cache=` from transformers 5.24;
   the same chunks, then one token per step, greedy): earlier prototypes compared against it.
3. A floor row: `full` decoding after a 64-token prompt, i.e. almost only the weights are read per
   step. No cache policy can decode faster than this, so floor / full bounds any policy's decode
   speedup at `length` on this machine. Next to it, the bound a byte count predicts for a memory-bound
   step: (weights + full KV) / (weights + kept KV).
With `max_copies` N, a fifth row: LOCRET with `--max-copies N` on the same prompt, after the LOCRET row in
   each run, for the cost of the cap (engine/policies/repeats.py). With `focus` K, a row after it: LOCRET
   with `--focus K` (engine/focus.py), for the cost of reading the tail twice and decoding on the view.
4. LOCRET time per token from `lengths[0]` to `lengths[-1]` (compact positions): a flat line means
   the total cost grows linearly with the length.
With `repeat` R > 1 every row is measured R times (the side-by-side rows interleaved, then the
lengths of the scaling run interleaved) and each number in the tables is the median over the R runs; the single
runs are kept in perf.json under `runs`. This machine's speed drifts while other work shares it.
Speed does not depend on the heads' weights, only on their size: `--heads random` is the default.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from localchat.bench import machine
from localchat.bench.cell import Cell, load_engine, use_policy
from localchat.bench.runner import MAX_LENGTH, MIN_LENGTH, default_chunk
from localchat.bench.tasks import niah_single, prompt_messages
from localchat.engine.events import Done, Error
from localchat.engine.policies import POLICIES
from localchat.engine.prefill import cache_kwarg
from localchat.engine.sampling import GenerationSettings
from localchat.errors import UserError

FLOOR_PROMPT = 64  # tokens before the floor row's decode: a cache that is almost empty


@dataclass
class PerfConfig:
    out: Path | None = None
    model: str | None = None
    chunk: int | None = None
    length: int = 7600
    lengths: list[int] = field(default_factory=lambda: [4096, 8192, 16384, 32768])
    budget: int | None = None  # None: the model card's (else the policy default)
    heads: str = "random"
    decode_tokens: int = 64
    scaling_decode_tokens: int = 16
    seed: int = 0
    repeat: int = 1
    max_copies: int | None = None  # also LOCRET with --max-copies N, beside plain LOCRET
    focus: int | None = None  # also LOCRET with --focus K, beside plain LOCRET
    peer: str | None = None  # "llama.cpp": the same GGUF through llama-cpp-python in the same repeats (bench/peer.py)
    command: str = ""


def doubling(low: int, high: int) -> list[int]:
    """low, 2·low, 4·low, ... up to high (high itself last)."""
    lengths = []
    n = low
    while n < high:
        lengths.append(n)
        n *= 2
    return lengths + [high]


def prompt(engine, n_tokens: int, seed: int) -> list[int]:
    """The token ids of the bench's perf prompt: a niah_single sample of about `n_tokens` tokens (needle at half
    depth), in the chat template."""
    sample = niah_single(engine.tokenizer, n_tokens, seed, depth=0.5)
    return engine.encode_chat(prompt_messages(sample))


def greedy(engine, ids: list[int], new: int) -> Done:
    """`engine` answers `ids` with `new` greedy tokens (EOS ignored); its Done event. An Error raises UserError."""
    for event in engine.generate(ids, GenerationSettings(max_new_tokens=new, ignore_eos=True)):
        if isinstance(event, Error):
            raise UserError(event.message)
        if isinstance(event, Done):
            return event
    raise RuntimeError("the engine ended without a Done event")


def _row(label: str, policy: str, positions: str, length: int, done: Done) -> dict:
    return {
        "row": label, "policy": policy, "positions": positions, "length": length, "prompt_tokens": done.prompt_tokens,
        "prefill_s": round(done.prefill_s, 3), "prefill_tok_s": round(done.prefill_tps, 1),
        "prefill_ms_per_token": round(1000 * done.prefill_s / done.prompt_tokens, 3),
        "new_tokens": done.new_tokens, "decode_tok_s": round(done.decode_tps, 2),
        "total_ms_per_token": round(1000 * (done.prefill_s + done.decode_s)
                                    / (done.prompt_tokens + done.new_tokens), 3),
        "kv_units_per_head": done.kv_tokens, "kv_mib": round(done.kv_bytes / 2**20, 2),
        "kv_full_mib": round(done.kv_full_bytes / 2**20, 2),
    }


def median_row(rows: list[dict]) -> dict:
    """One row whose numbers are the medians over `rows` (the same row measured several times)."""
    out = dict(rows[0])
    for key, value in out.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in rows)
    return out


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def hf_dynamic_cache(model, ids: list[int], chunk: int, new: int) -> Done:
    """Full attention through transformers' DynamicCache: chunked prefill, then greedy steps."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    tokens = torch.tensor([ids], device=device)
    cache = DynamicCache(config=model.config)
    arg = {cache_kwarg(model): cache}
    t0 = time.perf_counter()
    for start in range(0, tokens.shape[-1], chunk):
        out = model(input_ids=tokens[:, start:start + chunk], use_cache=True, logits_to_keep=1, **arg)
    sync(device)
    prefill_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    for i in range(new):
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        if i == new - 1:
            break
        out = model(input_ids=tok, use_cache=True, **arg)
    sync(device)
    decode_s = time.perf_counter() - t1
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return Done(text="", prompt_tokens=len(ids), new_tokens=new, prefill_s=prefill_s, decode_s=decode_s,
                ttft_s=prefill_s, stop_reason="length", kv_tokens=cache.get_seq_length(), kv_bytes=held,
                kv_full_bytes=held)


def check(config: PerfConfig) -> None:
    for n in [config.length, *config.lengths]:
        if not MIN_LENGTH <= n <= MAX_LENGTH:
            raise UserError(f"length {n} is out of range; use {MIN_LENGTH} to {MAX_LENGTH} tokens")
    for value, what in ((config.decode_tokens, "--decode-tokens"), (config.chunk, "--chunk"),
                        (config.budget, "--budget"), (config.repeat, "--repeat"), (config.max_copies, "--max-copies"),
                        (config.focus, "--focus")):
        if value is not None and value < 1:
            raise UserError(f"{what} must be at least 1 (got {value})")


def measure(config: PerfConfig, say=lambda s: None) -> dict:
    from localchat.bench.peer import check_peer, load_peer, peer_rows, peer_summary

    check(config)
    check_peer(config.peer, config.model)

    def cell(policy: str, budget: int | None, positions: str, max_copies: int | None = None,
             focus: int | None = None) -> Cell:
        return Cell(task="niah_single", length=config.length, policy=policy, budget=budget, n=1, seed=config.seed,
                    model_spec=config.model, heads=config.heads if "heads" in POLICIES[policy].fields() else None,
                    chunk=config.chunk or default_chunk(config.model), positions=positions,
                    max_new_tokens=config.decode_tokens, max_copies=max_copies, focus=focus)

    engine = load_engine(cell("full", None, "original"))
    if engine.window and config.length >= engine.window:
        raise UserError(f"--length {config.length} must be below {engine.name}'s window ({engine.window}) "
                        f"for full attention at original positions")
    ids = prompt(engine, config.length, config.seed)
    budget = config.budget or (engine.card.locret.get("budget") if engine.card else None) or 1024
    def tag(rep: int) -> str:
        return f" (run {rep + 1}/{config.repeat})" if config.repeat > 1 else ""

    runs: dict[str, list[list[dict]]] = {"side_by_side": [], "locret_scaling": [[] for _ in config.lengths],
                                         "peer": []}
    peer = load_peer(config.peer, config.model, len(ids) + config.decode_tokens + 16, torch.get_num_threads())
    for rep in range(config.repeat):
        use_policy(engine, cell("full", None, "original"))
        say(f"perf: full, {len(ids)} tokens{tag(rep)}")
        full = _row("full (ours: in-place KVCache)", "full", "original", config.length,
                    greedy(engine, ids, config.decode_tokens))
        say(f"perf: full through transformers DynamicCache{tag(rep)}")
        hf = _row("full (transformers DynamicCache, HF default path)", "full", "original", config.length,
                  hf_dynamic_cache(engine.model, ids, engine.chunk, config.decode_tokens))
        say(f"perf: floor, full after a {FLOOR_PROMPT}-token prompt{tag(rep)}")
        floor = _row(f"floor: full after a {FLOOR_PROMPT}-token prompt (weights only)", "full", "original",
                     FLOOR_PROMPT, greedy(engine, ids[-FLOOR_PROMPT:], config.decode_tokens))
        use_policy(engine, cell("locret", budget, "compact"))
        say(f"perf: locret b={budget}{tag(rep)}")
        locret = _row("locret", "locret", "compact", config.length, greedy(engine, ids, config.decode_tokens))
        extra = []  # the optional LOCRET rows: with the cap, with focus
        if config.max_copies:
            use_policy(engine, cell("locret", budget, "compact", config.max_copies))
            say(f"perf: locret b={budget} max-copies={config.max_copies}{tag(rep)}")
            extra.append(_row(f"locret max-copies={config.max_copies}", "locret", "compact", config.length,
                              greedy(engine, ids, config.decode_tokens)))
        if config.focus:
            use_policy(engine, cell("locret", budget, "compact", focus=config.focus))
            say(f"perf: locret b={budget} focus={config.focus}{tag(rep)}")
            extra.append(_row(f"locret focus={config.focus}", "locret", "compact", config.length,
                              greedy(engine, ids, config.decode_tokens)))
        runs["side_by_side"].append([full, locret, hf, floor, *extra])
        if peer is not None:
            say(f"perf: {config.peer}{tag(rep)}")
            runs["peer"].append(peer_rows(peer, config.peer, ids, locret["kv_units_per_head"], config.decode_tokens))
    prompts = [prompt(engine, n, config.seed) for n in config.lengths]
    use_policy(engine, cell("locret", budget, "compact"))  # the scaling run is plain LOCRET
    for rep in range(config.repeat):  # lengths interleaved: a drift of the machine's speed hits them all
        for n, ids_n, reps in zip(config.lengths, prompts, runs["locret_scaling"]):
            say(f"perf: locret scaling, {n} tokens{tag(rep)}")
            reps.append(_row("locret", "locret", "compact", n, greedy(engine, ids_n, config.scaling_decode_tokens)))
    side = [median_row([r[i] for r in runs["side_by_side"]]) for i in range(len(runs["side_by_side"][0]))]
    full, locret, hf, floor = side[:4]
    scaling = [median_row(reps) for reps in runs["locret_scaling"]]
    per_token = [r["total_ms_per_token"] for r in scaling]
    policy = engine.policy
    from localchat.engine.quantize import weight_bytes

    weights_mib = weight_bytes(engine.model) / 2**20
    if hasattr(peer, "close"):
        peer.close()
    peer_out, measured = peer_summary(runs["peer"], config.peer, median_row)
    return {
        "command": config.command, "peer": config.peer, "peer_rows": peer_out, "ratios_vs_peer": _vs_peer(
            {"full (ours)": full, "locret": locret}, peer_out if measured else None),
        "setup": {
            "model": engine.name, "model_spec": config.model, "device": engine.device.type, "chunk": engine.chunk,
            "length": config.length, "scaling_lengths": config.lengths, "decode_tokens": config.decode_tokens,
            "scaling_decode_tokens": config.scaling_decode_tokens, "seed": config.seed, "heads": config.heads,
            "repeat": config.repeat,
            "locret": {"budget": policy.budget, "stabilizers": getattr(policy, "stabilizers", None),
                       "local": policy.local},
            "max_copies": config.max_copies, "focus": config.focus,
            "prompt": "niah_single document at depth 0.5 in the app's layout (render.user_turn)",
            "date": time.strftime("%Y-%m-%d"), "peak_rss_bytes": machine.max_rss_bytes(),
        },
        "hardware": machine.hardware(), "versions": machine.versions(),
        "side_by_side": side,
        "weights_mib": round(weights_mib, 1),
        "locret_scaling": scaling,
        "runs": runs,
        "ratios": {
            "prefill_locret_vs_full": round(locret["prefill_tok_s"] / full["prefill_tok_s"], 2),
            "decode_locret_vs_full": round(locret["decode_tok_s"] / full["decode_tok_s"], 2),
            "decode_locret_vs_hf_dynamic_cache": round(locret["decode_tok_s"] / hf["decode_tok_s"], 2),
            "decode_full_vs_hf_dynamic_cache": round(full["decode_tok_s"] / hf["decode_tok_s"], 2),
            "kv_smaller_than_full": round(full["kv_mib"] / locret["kv_mib"], 2) if locret["kv_mib"] else None,
            "decode_floor_vs_full": round(floor["decode_tok_s"] / full["decode_tok_s"], 2),
            "decode_bound_from_bytes": round((weights_mib + full["kv_mib"]) / (weights_mib + locret["kv_mib"]), 2),
            "decode_locret_vs_full_per_run": [round(r[1]["decode_tok_s"] / r[0]["decode_tok_s"], 2)
                                              for r in runs["side_by_side"]],
            "total_ms_per_token_spread": round(max(per_token) / min(per_token) - 1, 3) if per_token else None,
            **(_extra_ratios("capped", side, runs["side_by_side"], 4, "prefill") if config.max_copies else {}),
            **(_extra_ratios("focus", side, runs["side_by_side"], -1, "decode") if config.focus else {}),
        },
    }


def _extra_ratios(name: str, side: list[dict], runs: list[list[dict]], at: int, per_run: str) -> dict:
    """An optional LOCRET row (`name`: capped, focus; column `at`) against plain LOCRET (column 1): the medians'
    ratios, and the `per_run` speed's (prefill, decode) ratio in every run."""
    out = {f"{what}_{name}_vs_locret": round(side[at][f"{what}_tok_s"] / side[1][f"{what}_tok_s"], 3)
           for what in ("prefill", "decode")}
    out[f"{per_run}_{name}_vs_locret_per_run"] = [round(r[at][f"{per_run}_tok_s"] / r[1][f"{per_run}_tok_s"], 3)
                                                  for r in runs]
    return out


def _vs_peer(rows: dict[str, dict], peer: list[dict] | None) -> dict:
    """Each row's decode against the peer's at the row's own cache size and after the whole document, and its
    prefill against the peer's."""
    if not peer:
        return {}
    whole, short = peer
    return {name: {"decode_vs_peer_at_locret_depth": round(r["decode_tok_s"] / short["decode_tok_s"], 2),
                   "decode_vs_peer_full": round(r["decode_tok_s"] / whole["decode_tok_s"], 2),
                   "prefill_vs_peer": round(r["prefill_tok_s"] / whole["prefill_tok_s"], 2)} for name, r in rows.items()}


def peer_lines(result: dict, what: str) -> list[str]:
    """The peer's rows and each `what` row's ratios to them, as markdown (empty without a peer)."""
    if not result.get("peer_rows"):
        return []
    lines = ["", "| peer row | prompt_tokens | prefill_tok_s | decode_tok_s | kv_units_per_head | note |",
             "|---|---|---|---|---|---|"]
    for row in result["peer_rows"]:
        lines.append("| " + " | ".join(str(row.get(c, "")) for c in ("row", "prompt_tokens", "prefill_tok_s",
                                                                     "decode_tok_s", "kv_units_per_head", "note")) + " |")
    for name, r in result["ratios_vs_peer"].items():
        lines.append(f"\n{what} {name} / {result['peer']}: decode {r['decode_vs_peer_at_locret_depth']}x its decode "
                     f"at LOCRET's cache size, {r['decode_vs_peer_full']}x after the whole document; "
                     f"prefill {r['prefill_vs_peer']}x.")
    return lines


COLUMNS = ["row", "positions", "length", "prompt_tokens", "prefill_tok_s", "prefill_ms_per_token", "decode_tok_s",
           "total_ms_per_token", "kv_units_per_head", "kv_mib", "kv_full_mib"]


def _table(rows: list[dict]) -> list[str]:
    return ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS),
            *("| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows)]


def markdown(result: dict) -> str:
    s, hw, v, r = result["setup"], result["hardware"], result["versions"], result["ratios"]
    gpu = f", GPU {hw['gpu']}" if hw.get("gpu") else ""
    lines = [
        f"# LOCRET vs full attention, {s['model']}, {hw['cpu']} ({hw['cores']} cores{gpu})", "",
        f"Command: `{result['command']}` ({s['date']}, {s['device']}, torch {v['torch']}, transformers "
        f"{v['transformers']}, localchat {v['localchat']}, torch threads: {hw['torch_threads']}, "
        f"seed {s['seed']}).", "",
        f"Setup: chunk {s['chunk']}; LOCRET b={s['locret']['budget']}, n_s={s['locret']['stabilizers']}, "
        f"n_loc={s['locret']['local']}, heads {s['heads']}; decode {s['decode_tokens']} tokens (greedy, EOS "
        f"ignored); prompt: {s['prompt']}."
        + (f" Every number is the median of {s['repeat']} runs (interleaved; single runs in perf.json)."
           if s["repeat"] > 1 else ""), "",
        f"## {s['length']}-token document, side by side", "", *_table(result["side_by_side"]), "",
        f"Ratios: prefill LOCRET / full (ours) {r['prefill_locret_vs_full']}x; decode LOCRET / full (ours) "
        f"{r['decode_locret_vs_full']}x; decode LOCRET / full (transformers DynamicCache) "
        f"{r['decode_locret_vs_hf_dynamic_cache']}x; decode full (ours) / full (DynamicCache) "
        f"{r['decode_full_vs_hf_dynamic_cache']}x; KV {r['kv_smaller_than_full']}x smaller."
        + (f" Decode LOCRET / full (ours) in each run: {', '.join(f'{x}x' for x in r['decode_locret_vs_full_per_run'])}."
           if len(r["decode_locret_vs_full_per_run"]) > 1 else ""), "",
        *([(f"The cap (`--max-copies {s['max_copies']}`): prefill {r['prefill_capped_vs_locret']}x and decode "
            f"{r['decode_capped_vs_locret']}x plain LOCRET's (prefill per run: "
            f"{', '.join(f'{x}x' for x in r['prefill_capped_vs_locret_per_run'])})."), ""]
          if s.get("max_copies") else []),
        *([(f"Focus (`--focus {s['focus']}`): prefill {r['prefill_focus_vs_locret']}x and decode "
            f"{r['decode_focus_vs_locret']}x plain LOCRET's (decode per run: "
            f"{', '.join(f'{x}x' for x in r['decode_focus_vs_locret_per_run'])})."), ""]
          if s.get("focus") else []),
        "The DynamicCache row is the stock transformers path (a cache that concatenates per token), labelled "
        "apart; the `full (ours)` row is this engine's in-place cache.", "",
        f"Decode ceiling: the floor row (an almost empty cache, so each step reads little more than the "
        f"{result['weights_mib']} MiB of weights) decodes {r['decode_floor_vs_full']}x faster than `full (ours)`; "
        f"no cache policy can beat that at this length on this machine. The byte count of a memory-bound step, "
        f"(weights + full KV) / (weights + LOCRET's KV), predicts {r['decode_bound_from_bytes']}x.", "",
        *peer_lines(result, "Row"), "",
        f"## LOCRET time per token vs length (compact positions, decode {s['scaling_decode_tokens']} tokens)", "",
        *_table(result["locret_scaling"]), "",
    ]
    if r["total_ms_per_token_spread"] is not None:
        lines += [f"Spread of total ms/token (max/min - 1): {r['total_ms_per_token_spread']:.1%} "
                  f"(flat = total cost linear in the length).", ""]
    return "\n".join(lines)


def write(result: dict, json_path: Path, md_path: Path, render=None) -> Path:
    """result as JSON and as markdown (`render`, default this module's `markdown`); the markdown's path."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    md_path.write_text((render or markdown)(result), encoding="utf-8")
    return md_path


def run(config: PerfConfig, say=lambda s: None) -> Path:
    """Measure and write OUT/perf.json and OUT/perf.md; returns the markdown path."""
    if config.out is None:
        raise UserError("perf needs --out DIR")
    result = measure(config, say)
    write(result, config.out / "perf.json", config.out / "perf.md")
    return config.out / "perf.md"

