"""Focus settings on saved caches (bench/results/grid-smollm2-cpu-long/focus_sweep.jsonl).

LOCRET b=BUDGET (cap CAP) reads the document as the bench lane does, and the cache before the prompt's tail is
saved under $SNAPS (`saved_cache.py`; `question_read.py` shares the files). For every window x spread x K
(--focus-window, --focus-spread, --focus) the engine's own focus code (engine/focus.py: Probe, view) runs on a
copy: the tail is read with the probe installed, the view is built, the tail is read again over it and the
answer is decoded greedily on it, as the engine does when it answers. One JSON line per setting, with the share of the
answer's prompt tokens held in the cache and in the view (over layers and KV heads). $THREADS torch threads
(default 1).

    SNAPS=/tmp/snaps python bench/experiments/focus_sweep.py niah_single 131072 EXAMPLE 1024 64 16,32,64 16,32,64 256
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # saved_cache, beside this file

from saved_cache import answer_share, cache_before_tail, setup, snap_path  # noqa: E402

from localchat.bench.tasks import ANSWER_TOKENS, score  # noqa: E402
from localchat.engine import focus  # noqa: E402
from localchat.engine.prefill import forward  # noqa: E402


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


@torch.inference_mode()
def run(engine, sample, ids, head_end, where, doc, max_new: int, window: int, spread: int, k: int) -> dict:
    model = engine.model
    cache = doc.clone()
    held = cache.get_seq_length()
    tail = torch.tensor([ids[head_end:]])
    probe = focus.Probe(model, held, window)
    try:
        forward(model, cache, tail, head_end)
    finally:
        probe.close()
    view = focus.view(cache, probe.votes, held, k, reserve=k + tail.shape[-1] + max_new, after=spread)
    logits = forward(model, view, tail, head_end)
    out, pos = [], len(ids)
    for _ in range(max_new):
        tok = int(logits.argmax())
        if tok in engine.stop_ids:
            break
        out.append(tok)
        logits = forward(model, view, torch.tensor([[tok]]), pos)
        pos += 1
    said = engine.tokenizer.decode(out)
    return {"window": window, "spread": spread, "k": k, "answer": said, "correct": bool(score(sample, said)),
            "in_cache": answer_share(doc, where), "in_view": answer_share(view, where)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Focus settings on saved LOCRET caches.")
    ap.add_argument("task")
    ap.add_argument("length", type=int)
    ap.add_argument("example", type=int)
    ap.add_argument("budget", type=int)
    ap.add_argument("cap", type=int, help="--max-copies (0: the paper's rule)")
    ap.add_argument("windows", type=ints, help="comma-separated --focus-window values")
    ap.add_argument("spreads", type=ints, help="comma-separated --focus-spread values")
    ap.add_argument("ks", type=ints, help="comma-separated --focus values")
    a = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    max_new = ANSWER_TOKENS[a.task]  # as the bench answers
    engine, sample, ids, head_end, where = setup(a.task, a.length, a.example, a.budget, a.cap, max_new)
    doc = cache_before_tail(engine, ids, head_end, max_new, snap_path(a.task, a.length, a.example, a.budget, a.cap))
    for w in a.windows:
        for s in a.spreads:
            for k in a.ks:
                t = time.time()
                row = run(engine, sample, ids, head_end, where, doc, max_new, w, s, k)
                print(json.dumps({"task": a.task, "length": a.length, "example": a.example, "budget": a.budget,
                                  "max_copies": a.cap, "depth": sample.depth, "expected": sample.answers[0], **row,
                                  "seconds": round(time.time() - t, 1)}), flush=True)


if __name__ == "__main__":
    main()
