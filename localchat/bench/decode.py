"""`localchat bench decode`: decode speed by weight precision, in one interleaved run on this machine.

For each `--weights` (fp32, int8, int4 by default) one engine is loaded, and every repeat runs, weights after
weights: LOCRET (compact positions, `budget`) answering after a `length`-token document (prefill and decode
tokens/s), the same through transformers' forward at every step (`Decoding(lean=False)`: what engine/decode_step.py
saves), and the floor, full attention after a 64-token prompt (a cache that is almost empty: what the weights
alone cost a step). Each number is the median over the repeats; the single runs are kept in decode.json.
Speed does not depend on the heads' weights, only on their size: by default the model's shipped heads (what a user
decodes with; SmolLM2's have d_R=256), `--heads random` gives untrained ones of the paper's d_R=1024.

`--peer llama.cpp` adds llama.cpp on the same GGUF file and prompt tokens, in the same repeats (bench/peer.py):
its read and decode after the whole document (full f16 KV cache), and its decode after only as many prompt
tokens as LOCRET keeps (the cache size LOCRET decodes over); the ratios compare each weights' LOCRET row to it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from localchat.bench import machine
from localchat.bench.cell import Cell, load_engine, use_policy
from localchat.bench.peer import check_peer, load_peer, peer_rows, peer_summary
from localchat.bench.perf import FLOOR_PROMPT, _row, _vs_peer, greedy, median_row, peer_lines, prompt, write
from localchat.bench.runner import default_chunk
from localchat.errors import UserError

WEIGHTS = ("fp32", "int8", "int4")


@dataclass
class DecodeConfig:
    out: Path
    model: str | None = None
    weights: list[str] = field(default_factory=lambda: list(WEIGHTS))
    length: int = 7600
    budget: int | None = None
    chunk: int | None = None
    heads: str | None = None  # None: the model's shipped heads
    decode_tokens: int = 64
    repeat: int = 3
    seed: int = 0
    peer: str | None = None
    command: str = ""


def _cell(config: DecodeConfig, weights: str, policy: str, budget: int | None, positions: str) -> Cell:
    return Cell(task="niah_single", length=config.length, policy=policy, budget=budget, n=1, seed=config.seed,
                model_spec=config.model, heads=config.heads if policy == "locret" else None,
                chunk=config.chunk or default_chunk(config.model), positions=positions,
                max_new_tokens=config.decode_tokens, weights=None if weights == "fp32" else weights)


def measure(config: DecodeConfig, say=lambda s: None) -> dict:
    from localchat.engine.quantize import check, weight_bytes

    if config.repeat < 1 or config.decode_tokens < 2:
        raise UserError("--repeat must be at least 1 and --decode-tokens at least 2")
    for w in config.weights:
        check(w, torch.device("cuda" if torch.cuda.is_available() else "cpu"))  # unknown, or nf4 on a CPU
    check_peer(config.peer, config.model)
    engines, budgets = {}, {}
    for w in config.weights:
        say(f"decode: loading {w}")
        engines[w] = load_engine(_cell(config, w, "full", None, "original"))
    first = engines[config.weights[0]]
    ids = prompt(first, config.length, config.seed)
    for w, engine in engines.items():
        budgets[w] = config.budget or (engine.card.locret.get("budget") if engine.card else None) or 1024
    runs: dict[str, list[list[dict]]] = {w: [] for w in config.weights}
    peer = load_peer(config.peer, config.model, len(ids) + config.decode_tokens + 16, torch.get_num_threads())
    peer_runs: list[list[dict]] = []
    for rep in range(config.repeat):  # weights interleaved: a drift of the machine's speed hits them all
        for w, engine in engines.items():
            say(f"decode: {w}, run {rep + 1}/{config.repeat}")
            use_policy(engine, _cell(config, w, "locret", budgets[w], "compact"))
            locret = _row(f"locret b={budgets[w]}, {w}", "locret", "compact", config.length,
                          greedy(engine, ids, config.decode_tokens))
            lean = engine.decoding
            engine.configure(decoding=dataclasses.replace(lean, lean=False))
            stock = _row(f"locret b={budgets[w]} via transformers' forward, {w}", "locret", "compact",
                         config.length, greedy(engine, ids, config.decode_tokens))
            engine.configure(decoding=lean)
            use_policy(engine, _cell(config, w, "full", None, "original"))
            floor = _row(f"floor: full after {FLOOR_PROMPT} tokens, {w}", "full", "original", FLOOR_PROMPT,
                         greedy(engine, ids[-FLOOR_PROMPT:], config.decode_tokens))
            runs[w].append([locret, stock, floor])
        if peer is not None:
            say(f"decode: {config.peer}, run {rep + 1}/{config.repeat}")
            depth = runs[config.weights[0]][-1][0]["kv_units_per_head"]
            peer_runs.append(peer_rows(peer, config.peer, ids, depth, config.decode_tokens))
    rows = []
    for w in config.weights:
        for i in range(3):
            row = median_row([r[i] for r in runs[w]])
            row["weights"] = w
            row["weights_mib"] = round(weight_bytes(engines[w].model) / 2**20, 1)
            rows.append(row)
    base = {r["row"].split(", ")[0]: r for r in rows if r["weights"] == config.weights[0]}
    for row in rows:
        ref = base[row["row"].split(", ")[0]]
        row["decode_vs_" + config.weights[0]] = round(row["decode_tok_s"] / ref["decode_tok_s"], 2)
    if hasattr(peer, "close"):
        peer.close()
    peer_out, measured = peer_summary(peer_runs, config.peer, median_row)
    ratios = _vs_peer({row["weights"]: row for row in rows
                       if row["row"].startswith("locret") and "transformers" not in row["row"]},
                      peer_out if measured else None)
    return {
        "command": config.command, "peer": config.peer, "peer_rows": peer_out, "peer_runs": peer_runs,
        "ratios_vs_peer": ratios,
        "setup": {"model": first.name, "model_spec": config.model, "device": first.device.type,
                  "chunk": first.chunk, "length": config.length, "decode_tokens": config.decode_tokens,
                  "repeat": config.repeat, "seed": config.seed, "heads": config.heads, "budgets": budgets,
                  "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
                  "prompt": "niah_single document at depth 0.5 in the app's layout (render.user_turn)"},
        "hardware": machine.hardware(), "versions": machine.versions(),
        "rows": rows, "runs": runs,
    }


COLUMNS = ["row", "weights", "weights_mib", "prompt_tokens", "prefill_tok_s", "decode_tok_s", "kv_units_per_head"]


def markdown(result: dict) -> str:
    s = result["setup"]
    ratio = next(k for k in result["rows"][0] if k.startswith("decode_vs_"))
    cols = COLUMNS + [ratio]
    lines = [f"# Decode speed by weight precision: {s['model']} on {s['device']}, {s['threads']} threads", "",
             f"Command: `{result['command']}`", "",
             f"Document {s['length']:,} tokens, chunk {s['chunk']}, {s['decode_tokens']} greedy tokens decoded "
             f"(EOS ignored), medians of {s['repeat']} interleaved runs, heads {s['heads'] or 'shipped'} (speed only), "
             f"{s['date']}.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in result["rows"]:
        lines.append("| " + " | ".join(str(row.get(c, "")) for c in cols) + " |")
    lines += peer_lines(result, "LOCRET")
    hw = result["hardware"]
    lines += ["", f"Hardware: {hw}", f"Versions: {result['versions']}", ""]
    return "\n".join(lines)


def run(config: DecodeConfig, say=lambda s: None) -> Path:
    return write(measure(config, say), config.out / "decode.json", config.out / "decode.md", markdown)
