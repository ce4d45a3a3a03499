"""LOCRET b=1024 with the shipped heads, each unit's score max-pooled with its neighbours in cache order (window
POOL) before the cap, so that a kept number's full stop shares the number's score
(bench/results/max-copies-smollm2-cpu/pool.jsonl; not an engine option). One torch thread; one JSON line per
example.

    python bench/experiments/score_pool.py niah_single 4096 3 16 0,1,2,3,4,5,10,12
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from localchat.bench.cell import Cell, load_engine, run_example, sample_for, use_policy


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="LOCRET with each unit's score max-pooled with its neighbours.")
    ap.add_argument("task")
    ap.add_argument("length", type=int)
    ap.add_argument("pool", type=int, help="the pooling window (1: none)")
    ap.add_argument("cap", type=int, help="--max-copies (0: the paper's rule)")
    ap.add_argument("examples", help="comma-separated example indices of the N=20 cell")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cell = Cell(task=a.task, length=a.length, policy="locret", budget=1024, n=20, seed=0, model_spec=None, heads=None,
                chunk=512, positions="compact", max_new_tokens=24, max_copies=a.cap or None)
    engine = load_engine(cell)
    use_policy(engine, cell)
    policy = engine.policy
    plain = type(policy).score
    pool = a.pool

    def pooled(self, layer, layer_idx):
        s = plain(self, layer, layer_idx)
        return F.max_pool1d(s.unsqueeze(0), pool, stride=1, padding=pool // 2).squeeze(0) if pool > 1 else s

    policy.score = pooled.__get__(policy)
    for ex in (int(e) for e in a.examples.split(",")):
        r = run_example(engine, sample_for(cell, engine.tokenizer, ex), cell.max_new_tokens)
        print(json.dumps({"task": a.task, "length": a.length, "pool": pool, "cap": a.cap, "example": ex,
                          "correct": r["correct"], "answer_kept": r["answer_kept"], "output": r["output"][:80]}),
              flush=True)


if __name__ == "__main__":
    main()
