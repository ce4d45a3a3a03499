"""Oracle check for niah_single (bench/results/grid-smollm2-cpu-long/oracle.jsonl): LOCRET with the shipped heads,
but the needle sentence's units are kept in every layer and KV head (a priority boost). If SmolLM2 still
answers wrong, selection is not what limits it. AROUND also keeps that many tokens on each side of the needle.
One torch thread; one JSON line.

    python bench/experiments/needle_oracle.py LENGTH EXAMPLE [BUDGET [AROUND]]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from localchat.bench.cell import Cell, load_engine, sample_for, use_policy
from localchat.bench.tasks import prompt_messages, score
from localchat.engine.events import Done
from localchat.engine.sampling import GenerationSettings


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="niah_single with the needle's sentence always kept.")
    ap.add_argument("length", type=int)
    ap.add_argument("example", type=int)
    ap.add_argument("budget", type=int, nargs="?", default=1024)
    ap.add_argument("around", type=int, nargs="?", default=0, help="also keep this many tokens each side")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cell = Cell(task="niah_single", length=a.length, policy="locret", budget=a.budget, n=20, seed=0, model_spec=None,
                heads=None, chunk=512, positions="compact", max_new_tokens=24)
    engine = load_engine(cell)
    use_policy(engine, cell)
    sample = sample_for(cell, engine.tokenizer, a.example)
    text = engine.render(prompt_messages(sample))
    key = sample.question.split("for ")[1].split(" mentioned")[0]
    needle = f"One of the special magic numbers for {key} is: {sample.answers[0]}."
    at = text.index(needle)
    enc = engine.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    assert ids == engine.encode(text), "offsets tokenization differs from the engine's"
    span = [i for i, (s, e) in enumerate(enc["offset_mapping"]) if s < at + len(needle) and e > at]
    lo, hi = span[0] - a.around, span[-1] + 1 + a.around
    plain = engine.policy.priority

    def boosted(layer, layer_idx, last_chunk):
        prio = plain(layer, layer_idx, last_chunk)
        pos = layer.positions
        return torch.where((pos >= lo) & (pos < hi), torch.full_like(prio, 1e30), prio)

    engine.policy.priority = boosted
    cache = engine.new_cache(len(ids), 24)
    t = time.time()
    out = ""
    for ev in engine.continue_on(cache, ids, 0, GenerationSettings(max_new_tokens=24)):
        if isinstance(ev, Done):
            out = ev.text
    kept = [int(((layer.positions >= lo) & (layer.positions < hi)).sum()) for layer in cache.layers]
    print(json.dumps({"length": a.length, "example": a.example, "budget": a.budget, "around": a.around,
                      "depth": sample.depth, "kept_span_tokens": hi - lo,
                      "needle_units_kept_min_per_layer": min(kept) // cache.layers[0].positions.shape[0],
                      "answer": out, "expected": sample.answers[0], "correct": bool(score(sample, out)),
                      "prompt_tokens": len(ids), "seconds": round(time.time() - t)}))


if __name__ == "__main__":
    main()
