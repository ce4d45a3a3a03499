"""The cache LOCRET holds after a document, before the prompt's tail (the last n_loc tokens) is read.

Made once per document and saved under $SNAPS (default /tmp/qread), then loaded, so that every setting of
`question_read.py` and `focus_sweep.py` reads the same units. A helper of those two, not an experiment.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from localchat.bench.cell import Cell, answer_tokens, load_engine, sample_for, use_policy
from localchat.bench.tasks import prompt_messages
from localchat.engine.prefill import prefill


def setup(task: str, length: int, example: int, budget: int, cap: int, max_new: int):
    """SmolLM2 with LOCRET b=`budget` (cap `cap`) as the bench lane runs it, and the example's prompt: (engine,
    sample, ids, head_end: where the tail begins, where: the answer's prompt token indices)."""
    cell = Cell(task=task, length=length, policy="locret", budget=budget, n=20, seed=0, model_spec=None, heads=None,
                chunk=512, positions="compact", max_new_tokens=max_new, max_copies=cap)
    engine = load_engine(cell)
    use_policy(engine, cell)
    sample = sample_for(cell, engine.tokenizer, example)
    text = engine.render(prompt_messages(sample))
    ids = engine.encode(text)
    where = torch.tensor(answer_tokens(engine.tokenizer, text, ids, sample.answers))
    return engine, sample, ids, len(ids) - engine.policy.local, where


@torch.inference_mode()
def cache_before_tail(engine, ids: list[int], head_end: int, max_new: int, snap_file: str):
    cache = engine.new_cache(len(ids), max_new)
    if os.path.exists(snap_file):
        cache.load_tensors(torch.load(snap_file))
        return cache
    policy = engine.policy
    policy.attach(engine.model, cache)
    held = {}

    def at_chunk(report):
        if report.end == head_end:
            held["cache"] = cache.clone()

    t = time.time()
    for _ in prefill(engine.model, cache, torch.tensor([ids]), chunk=engine.chunk, policy=policy, on_chunk=at_chunk):
        pass
    policy.detach()
    print(json.dumps({"prefill_s": round(time.time() - t)}), file=sys.stderr)
    torch.save({k: v.clone() for k, v in held["cache"].tensors().items()}, snap_file)
    return held["cache"]


def snap_path(task: str, length: int, example: int, budget: int, cap: int) -> str:
    """Where a document's cache is saved: under $SNAPS (default /tmp/qread)."""
    snaps = os.environ.get("SNAPS", "/tmp/qread")
    os.makedirs(snaps, exist_ok=True)
    return f"{snaps}/{task}-{length}-{example}-b{budget}-c{cap}.pt"


def answer_share(cache, where: torch.Tensor) -> float | None:
    """The share of the answer's prompt tokens (`where`) held, over layers and KV heads."""
    if len(where) == 0:
        return None
    held = sum(int(torch.isin(layer.positions, where).sum()) for layer in cache.layers)
    return round(held / (len(cache.layers) * cache.layers[0].positions.shape[0] * len(where)), 4)
