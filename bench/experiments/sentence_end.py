"""Why --max-copies 16 loses niah_single at 4K (bench/results/max-copies-smollm2-cpu/sentence_end.jsonl).

For LOCRET b=1024 with the shipped heads and each cap (0: the paper's rule), per layer: the share of (KV head,
digit) pairs that keep the needle's number, the share of KV heads that keep the token right after it (the
sentence's "."), and the kept copies of "." per KV head. One torch thread; one JSON line per cap.

    python bench/experiments/sentence_end.py 4096 0 0,16,64     # and examples 1, 5, 12
"""

from __future__ import annotations

import argparse
import json

import torch

from localchat.bench.cell import Cell, load_engine, sample_for, use_policy
from localchat.bench.tasks import prompt_messages
from localchat.engine.events import Done
from localchat.engine.sampling import GenerationSettings


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Which caps keep the needle's number and its full stop.")
    ap.add_argument("length", type=int)
    ap.add_argument("example", type=int)
    ap.add_argument("caps", help="comma-separated --max-copies values (0: the paper's rule)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    engine = None
    for cap in [int(c) for c in a.caps.split(",")]:
        cell = Cell(task="niah_single", length=a.length, policy="locret", budget=1024, n=20, seed=0, model_spec=None,
                    heads=None, chunk=512, positions="compact", max_new_tokens=24, max_copies=cap or None)
        engine = engine or load_engine(cell)
        use_policy(engine, cell)
        sample = sample_for(cell, engine.tokenizer, a.example)
        text = engine.render(prompt_messages(sample))
        number = sample.answers[0]
        at = text.index(number)
        enc = engine.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        assert ids == engine.encode(text), "offsets tokenization differs from the engine's"
        digits = [i for i, (s, e) in enumerate(enc["offset_mapping"]) if s < at + len(number) and e > at]
        after = digits[-1] + 1
        cache = engine.new_cache(len(ids), 24)
        answer = None
        for ev in engine.continue_on(cache, ids, 0, GenerationSettings(max_new_tokens=24)):
            if isinstance(ev, Done):
                answer = ev.text
        dot = engine.tokenizer.convert_tokens_to_ids(".")
        layers = []
        for li, layer in enumerate(cache.layers):
            kept = [set(p) for p in layer.positions.tolist()]  # [H][n]
            layers.append({"layer": li,
                           "digits_kept": round(sum(d in k for k in kept for d in digits) / (len(kept) * len(digits)), 3),
                           "end_kept": round(sum(after in k for k in kept) / len(kept), 3),
                           "dots_per_head": [sum(1 for p in k if p < len(ids) and ids[p] == dot) for k in kept]})
        print(json.dumps({"cap": cap, "length": a.length, "example": a.example, "expected": number, "answer": answer,
                          "after_token": engine.tokenizer.decode([ids[after]]),
                          "digits_kept": round(sum(r["digits_kept"] for r in layers) / len(layers), 3),
                          "end_kept": round(sum(r["end_kept"] for r in layers) / len(layers), 3),
                          "layers": layers}), flush=True)


if __name__ == "__main__":
    main()
