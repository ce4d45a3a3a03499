# Oracle check for niah_single: LOCRET b=1024 with the shipped heads, but the needle sentence's units are kept in
# every layer and KV head (a priority boost). If SmolLM2 still answers wrong, selection is not what limits it.
# usage: python oracle.py LENGTH EXAMPLE [BUDGET [AROUND]]  (1 torch thread; run with PYTHONPATH=/work/lanes2, the
# lane worktree: engine code of e8d4dbf, as the lane rows). AROUND: also keep that many tokens on each side.
import sys, json, torch, time
torch.set_num_threads(1)
from localchat.bench.cell import Cell, sample_for, load_engine, use_policy
from localchat.bench.tasks import prompt_messages, score
from localchat.engine.sampling import GenerationSettings
from localchat.engine.events import Done
length, example = int(sys.argv[1]), int(sys.argv[2])
budget = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
around = int(sys.argv[4]) if len(sys.argv) > 4 else 0  # also keep this many tokens on each side of the needle
cell = Cell(task="niah_single", length=length, policy="locret", budget=budget, n=20, seed=0, model_spec=None,
            heads=None, chunk=512, positions="compact", max_new_tokens=24)
engine = load_engine(cell)
use_policy(engine, cell)
sample = sample_for(cell, engine.tokenizer, example)
text = engine.render(prompt_messages(sample))
key = sample.question.split("for ")[1].split(" mentioned")[0]
needle = f"One of the special magic numbers for {key} is: {sample.answers[0]}."
at = text.index(needle)
enc = engine.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
ids = enc["input_ids"]
span = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < at + len(needle) and b > at]
lo, hi = span[0] - around, span[-1] + 1 + around
policy = engine.policy
plain = policy.priority
def boosted(layer, layer_idx, last_chunk):
    prio = plain(layer, layer_idx, last_chunk)
    pos = layer.positions
    return torch.where((pos >= lo) & (pos < hi), torch.full_like(prio, 1e30), prio)
policy.priority = boosted
assert ids == engine.encode(text), "offsets tokenization differs from the engine's"
cache = engine.new_cache(len(ids), 24)
t = time.time()
out = ""
for ev in engine.continue_on(cache, ids, 0, GenerationSettings(max_new_tokens=24)):
    if isinstance(ev, Done):
        out = ev.text
kept = [int(((l.positions >= lo) & (l.positions < hi)).sum()) for l in cache.layers]
res = {"length": length, "example": example, "budget": budget, "around": around, "depth": sample.depth, "kept_span_tokens": hi - lo,
       "needle_units_kept_min_per_layer": min(kept) // cache.layers[0].positions.shape[0], "answer": out,
       "expected": sample.answers[0], "correct": bool(score(sample, out)), "prompt_tokens": len(ids),
       "seconds": round(time.time() - t)}
print(json.dumps(res))
