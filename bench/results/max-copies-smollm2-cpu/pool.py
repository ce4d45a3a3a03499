# Throwaway experiment (session 12, run from /work/lanes7 = ab1d27d with PYTHONPATH there): LOCRET b=1024 with the shipped heads, each unit's score max-pooled with its
# neighbours in cache order (window POOL) before the cap, so a kept number's full stop shares the number's score.
# usage: python pool.py TASK LENGTH POOL CAP EXAMPLES  -> one JSON line per example
import sys, json, torch
import torch.nn.functional as F
torch.set_num_threads(1)
from localchat.bench.cell import Cell, sample_for, load_engine, use_policy, run_example
task, length, pool, cap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
examples = [int(e) for e in sys.argv[5].split(",")]
cell = Cell(task=task, length=length, policy="locret", budget=1024, n=20, seed=0, model_spec=None, heads=None,
            chunk=512, positions="compact", max_new_tokens=24, max_copies=cap or None)
engine = load_engine(cell)
use_policy(engine, cell)
p = engine.policy
plain = type(p).score
def pooled(self, layer, layer_idx):
    s = plain(self, layer, layer_idx)
    return F.max_pool1d(s.unsqueeze(0), pool, stride=1, padding=pool // 2).squeeze(0) if pool > 1 else s
p.score = pooled.__get__(p)
for ex in examples:
    sample = sample_for(cell, engine.tokenizer, ex)
    r = run_example(engine, sample, cell.max_new_tokens)
    print(json.dumps({"task": task, "length": length, "pool": pool, "cap": cap, "example": ex, "correct": r["correct"],
                      "answer_kept": r["answer_kept"], "output": r["output"][:80]}), flush=True)
