"""A cap on each token id's copies per head, the experiment before `--max-copies`
(bench/results/grid-smollm2-cpu-long/repeat_cap.jsonl).

LOCRET with the shipped heads as the lanes run it, except that in every layer and KV head at most CAP units of
any one token id survive an eviction (the rest of that id rank last). Why: `kept_tokens.py` shows that on a 128K
document each head's budget fills with copies of one or two frequent tokens (passkey b=2048, layer 0: 1,917 of
2,010 kept units are "." in head 0, 1,849 " is" in head 1), since LOCRET scores each unit once from its own Q,
K, V, and a repeated token scores about the same every time. The engine now has this rule as LOCRET's
`--max-copies` (engine/policies/repeats.py, which also exempts protected units); this script is kept as it ran
for repeat_cap.jsonl. One torch thread; one JSON line.

    python bench/experiments/repeat_cap.py TASK LENGTH EXAMPLE BUDGET CAP [N]
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

LOW = -1e30


def capped_priority(plain, token: torch.Tensor, cap: int):
    """The plain priorities, with every unit past the CAP best of its token id (per head) moved to the bottom."""
    last = len(token) - 1

    def capped(layer, layer_idx, last_chunk):
        prio = plain(layer, layer_idx, last_chunk)
        if cap <= 0:
            return prio
        unit_ids = token[layer.positions.clamp(max=last).cpu()].to(prio.device)  # [H, n]
        order = prio.argsort(dim=-1, descending=True, stable=True)
        by_id = unit_ids.gather(-1, order).argsort(dim=-1, stable=True)  # best-first within each id
        ranked = order.gather(-1, by_id)
        same = unit_ids.gather(-1, ranked)
        n = same.shape[-1]
        idx = torch.arange(n, device=prio.device).expand_as(same)
        first = torch.where(torch.cat([torch.ones_like(same[:, :1], dtype=torch.bool), same[:, 1:] != same[:, :-1]], -1),
                            idx, torch.zeros_like(idx)).cummax(-1).values
        over = torch.zeros_like(prio, dtype=torch.bool).scatter(-1, ranked, (idx - first) >= cap)
        return torch.where(over, torch.full_like(prio, LOW), prio)

    return capped


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="LOCRET with a cap on each token id's copies per head.")
    ap.add_argument("task")
    ap.add_argument("length", type=int)
    ap.add_argument("example", type=int)
    ap.add_argument("budget", type=int)
    ap.add_argument("cap", type=int, help="copies of one token id kept per head (0: no cap)")
    ap.add_argument("n", type=int, nargs="?", default=20, help="examples in the cell (sets the depths)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cell = Cell(task=a.task, length=a.length, policy="locret", budget=a.budget, n=a.n, seed=0, model_spec=None,
                heads=None, chunk=512, positions="compact", max_new_tokens=16)
    engine = load_engine(cell)
    use_policy(engine, cell)
    sample = sample_for(cell, engine.tokenizer, a.example)
    ids = engine.encode(engine.render(prompt_messages(sample)))
    token = torch.tensor(ids)
    engine.policy.priority = capped_priority(engine.policy.priority, token, a.cap)
    cache = engine.new_cache(len(ids), 16)
    t = time.time()
    out = ""
    for ev in engine.continue_on(cache, ids, 0, GenerationSettings(max_new_tokens=16)):
        if isinstance(ev, Done):
            out = ev.text
    top = []
    for li in (0, 10, 20, 29):
        pos = cache.layers[li].positions
        doc = [pos[h][pos[h] < len(ids)].cpu() for h in range(pos.shape[0])]  # prompt units (not the answer's)
        top.append(max(int(torch.bincount(token[p]).max()) for p in doc))
    print(json.dumps({"task": a.task, "length": a.length, "example": a.example, "budget": a.budget, "cap": a.cap,
                      "n": a.n, "depth": sample.depth, "answer": out, "expected": list(sample.answers),
                      "correct": bool(score(sample, out) >= 1), "most_copies_of_one_token_layers_0_10_20_29": top,
                      "prompt_tokens": len(ids), "seconds": round(time.time() - t)}))


if __name__ == "__main__":
    main()
