"""Question-aware read of LOCRET's cache, the experiment before `--focus`
(bench/results/grid-smollm2-cpu-long/question_read.jsonl).

LOCRET b=BUDGET reads the document as the lane does; then the prompt's tail (the last n_loc tokens: the
document's end, the question, the template) is read once over the kept units, its last W queries' attention
picks the top K units per KV head (summed over the window rows and each KV head's query group, as SnapKV
scores), and the tail is read again over those K units only before answering. The kept cache itself is not
changed (a chat's next question starts from it again). The cache after the document's last eviction is saved
under $SNAPS (`saved_cache.py`), so other K and W reuse it. One JSON line per K; K=0 is plain LOCRET (the tail
read over every kept unit). $SLOTS=keep leaves the picked units at their slots (default: compact, moved to
slots 0..K-1); $THREADS torch threads (default 1).

    SNAPS=/tmp/qread python bench/experiments/question_read.py niah_single 65536 EXAMPLE 1024 0 64,128,256 32 16
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

from localchat.bench.tasks import score  # noqa: E402
from localchat.engine.cache import KVCache  # noqa: E402
from localchat.engine.policies.attention_stats import Collector, StatsHook, group_sum  # noqa: E402
from localchat.engine.prefill import cache_kwarg, forward  # noqa: E402

MAX_NEW = 24


def spread(votes: torch.Tensor, positions: torch.Tensor, after: int) -> torch.Tensor:
    """Each unit's vote raised to the largest vote of the units at most `after` tokens before it (the same head)."""
    if after <= 0:
        return votes.clone()
    gap = positions[:, :, None] - positions[:, None, :]  # [H, n, n]: this unit's position minus the other's
    near = (gap >= 0) & (gap <= after)
    return torch.where(near, votes[:, None, :], torch.zeros((), dtype=votes.dtype)).amax(dim=-1)


class Reader:
    """The example's tail read over a cache, and the answer decoded greedily."""

    def __init__(self, engine, ids: list[int], head_end: int, window: int, after: int, slots: str):
        self.engine, self.model, self.ids, self.head_end = engine, engine.model, ids, head_end
        self.tail = torch.tensor([ids[head_end:]])
        self.window, self.after, self.slots = window, after, slots

    def step(self, cache, piece: torch.Tensor, true_first: int, slot: int | None) -> torch.Tensor:
        """forward(), with the RoPE slot of the first token given (`slot`) instead of the cache's length."""
        if slot is None:
            return forward(self.model, cache, piece, true_first)
        t = piece.shape[-1]
        cache.set_pending_positions(torch.arange(true_first, true_first + t))
        out = self.model(input_ids=piece, position_ids=torch.arange(slot, slot + t).unsqueeze(0), use_cache=True,
                         logits_to_keep=1, **{cache_kwarg(self.model): cache})
        return out.logits[0, -1]

    @torch.inference_mode()
    def answer(self, cache, slot: int | None = None) -> str:
        logits = self.step(cache, self.tail, self.head_end, slot)
        pos, out = len(self.ids), []
        for j in range(MAX_NEW):
            tok = int(logits.argmax())
            if tok in self.engine.stop_ids:
                break
            out.append(tok)
            logits = self.step(cache, torch.tensor([[tok]]), pos, None if slot is None else slot + self.tail.shape[-1] + j)
            pos += 1
        return self.engine.tokenizer.decode(out)

    @torch.inference_mode()
    def narrowed(self, doc: KVCache, k: int) -> KVCache:
        """The document's units the tail's last `window` queries attend to most: top-k per KV head (+ the first 4)."""
        probe = doc.clone()
        n = doc.get_seq_length()
        votes = {}
        hook = StatsHook(self.model, Collector(self.window, lambda i, probs: votes.__setitem__(
            i, group_sum(probs[:, :, :n], self.model.config.num_key_value_heads))))
        try:
            forward(self.model, probe, self.tail, self.head_end)
        finally:
            hook.close()
        out = doc.clone()
        for i, layer in enumerate(out.layers):
            s = spread(votes[i], layer.positions, self.after)
            s[layer.positions < 4] = float("inf")
            idx = s.topk(min(k, n), dim=-1).indices.sort(dim=-1).values
            if self.slots == "keep":  # no move: keys keep the rotation of their slot in the document's cache
                out.layers[i].keep(idx)
            else:
                out.keep(i, idx)
        return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Question-aware read of LOCRET's cache.")
    ap.add_argument("task")
    ap.add_argument("length", type=int)
    ap.add_argument("example", type=int)
    ap.add_argument("budget", type=int)
    ap.add_argument("cap", type=int, help="--max-copies (0: the paper's rule)")
    ap.add_argument("ks", help="comma-separated K (0: plain LOCRET)")
    ap.add_argument("window", type=int, nargs="?", default=32, help="W: the tail's last queries that vote")
    ap.add_argument("after", type=int, nargs="?", default=0,
                    help="a unit also takes the vote of units up to AFTER tokens before it")
    a = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    slots = os.environ.get("SLOTS", "compact")
    engine, sample, ids, head_end, where = setup(a.task, a.length, a.example, a.budget, a.cap, MAX_NEW)
    reader = Reader(engine, ids, head_end, a.window, a.after, slots)
    doc = cache_before_tail(engine, ids, head_end, MAX_NEW, snap_path(a.task, a.length, a.example, a.budget, a.cap))
    for k in [int(k) for k in a.ks.split(",")]:
        t = time.time()
        cache = doc.clone() if k == 0 else reader.narrowed(doc, k)
        share = answer_share(cache, where)
        said = reader.answer(cache, doc.get_seq_length() if slots == "keep" and k else None)
        print(json.dumps({"task": a.task, "length": a.length, "example": a.example, "budget": a.budget,
                          "max_copies": a.cap, "k": k, "window": a.window, "after": a.after, "slots": slots,
                          "depth": sample.depth, "expected": sample.answers[0], "answer": said,
                          "correct": bool(score(sample, said)), "answer_kept": share,
                          "seconds": round(time.time() - t, 1)}), flush=True)


if __name__ == "__main__":
    main()
