"""Which document tokens LOCRET keeps after reading a document (bench/results/grid-smollm2-cpu-long/kept-*.json).

Layers 0, 10, 20 and 29, every KV head: counts of the kept tokens, of kept units near the needle and of kept
units per tenth of the document, to see what fills the budget (niah_single at 32K against 128K; passkey at
b=1024 against b=2048). Writes kept-LENGTH-EXAMPLE.json (niah_single, b=1024) or
kept-TASK-LENGTH-bBUDGET-EXAMPLE.json into --out. One torch thread.

    python bench/experiments/kept_tokens.py 32768 0          # and 131072 0
    python bench/experiments/kept_tokens.py 131072 0 passkey 2048
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch

from localchat.bench.cell import Cell, load_engine, sample_for, use_policy
from localchat.bench.tasks import prompt_messages
from localchat.engine.events import Done, Error
from localchat.engine.sampling import GenerationSettings


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Which document tokens LOCRET keeps after reading a document.")
    ap.add_argument("length", type=int)
    ap.add_argument("example", type=int)
    ap.add_argument("task", nargs="?", default="niah_single")
    ap.add_argument("budget", type=int, nargs="?", default=1024)
    ap.add_argument("n", type=int, nargs="?", default=20, help="examples in the cell (sets the depths)")
    ap.add_argument("--out", default="bench/results/grid-smollm2-cpu-long", help="folder for the JSON file")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cell = Cell(task=a.task, length=a.length, policy="locret", budget=a.budget, n=a.n, seed=0, model_spec=None,
                heads=None, chunk=512, positions="compact", max_new_tokens=24)
    engine = load_engine(cell)
    use_policy(engine, cell)
    sample = sample_for(cell, engine.tokenizer, a.example)
    ids = engine.encode(engine.render(prompt_messages(sample)))
    cache = engine.new_cache(len(ids), 24)
    answer = None
    for ev in engine.continue_on(cache, ids, 0, GenerationSettings(max_new_tokens=24)):
        if isinstance(ev, Done):
            answer = ev.text
            print("answer:", repr(ev.text), "expected", sample.answers)
        elif isinstance(ev, Error):
            print("error", ev.message)
    tok = engine.tokenizer
    out = {"task": a.task, "budget": a.budget, "length": a.length, "example": a.example, "n": len(ids),
           "needle_token": sample.needle_token, "answer": answer, "expected": list(sample.answers), "layers": {}}
    for li in (0, 10, 20, 29):
        pos = cache.layers[li].positions  # [H, n]
        layer = {}
        for h in range(pos.shape[0]):
            p = pos[h][pos[h] < len(ids) - 200].tolist()  # the document part (not the question tail)
            counts = collections.Counter(tok.decode([ids[i]]) for i in p)
            layer[h] = {"kept_doc": len(p), "top_tokens": counts.most_common(15),
                        "near_needle": sum(1 for i in p if abs(i - sample.needle_token - 40) < 60),
                        "tenths": [sum(1 for i in p if i * 10 // len(ids) == t) for t in range(10)]}
        out["layers"][li] = layer
    name = (f"kept-{a.length}-{a.example}.json" if (a.task, a.budget) == ("niah_single", 1024)
            else f"kept-{a.task}-{a.length}-b{a.budget}-{a.example}.json")
    with open(Path(a.out) / name, "w") as f:
        json.dump(out, f, indent=1)
    for li, layer in out["layers"].items():
        print(li, [(h, v["kept_doc"], v["near_needle"], v["top_tokens"][:6], v["tenths"]) for h, v in layer.items()])


if __name__ == "__main__":
    main()
