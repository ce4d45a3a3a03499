# Which document tokens LOCRET keeps after reading a niah_single document (layers 0, 10, 20, 29, every KV head):
# counts of the kept tokens and of kept units near the needle, to see what fills the budget at 32K vs 128K.
# usage: python bench/results/grid-smollm2-cpu-long/kept_tokens.py LENGTH EXAMPLE  (one torch thread)
import sys, json, collections, torch
torch.set_num_threads(1)
from localchat.bench.cell import Cell, sample_for, load_engine, use_policy
from localchat.bench.tasks import prompt_messages
from localchat.engine.sampling import GenerationSettings
from localchat.engine.events import Done
length, example = int(sys.argv[1]), int(sys.argv[2])
cell = Cell(task="niah_single", length=length, policy="locret", budget=1024, n=20, seed=0, model_spec=None, heads=None,
            chunk=512, positions="compact", max_new_tokens=24)
engine = load_engine(cell)
use_policy(engine, cell)
sample = sample_for(cell, engine.tokenizer, example)
text = engine.render(prompt_messages(sample)); ids = engine.encode(text)
cache = engine.new_cache(len(ids), 24)
for ev in engine.continue_on(cache, ids, 0, GenerationSettings(max_new_tokens=24)):
    if isinstance(ev, Done): print("answer:", repr(ev.text), "expected", sample.answers)
    elif type(ev).__name__ == "Error": print("error", ev.message)
tok = engine.tokenizer
out = {"length": length, "example": example, "n": len(ids), "needle_token": sample.needle_token, "layers": {}}
for li in (0, 10, 20, 29):
    pos = cache.layers[li].positions  # [H, n]
    layer = {}
    for h in range(pos.shape[0]):
        p = pos[h][pos[h] < len(ids) - 200].tolist()  # the document part (not the question tail)
        counts = collections.Counter(tok.decode([ids[i]]) for i in p)
        layer[h] = {"kept_doc": len(p), "top_tokens": counts.most_common(15),
                    "near_needle": sum(1 for i in p if abs(i - sample.needle_token - 40) < 60)}
    out["layers"][li] = layer
from pathlib import Path
json.dump(out, open(Path(__file__).with_name(f"kept-{length}-{example}.json"), "w"), indent=1)
for li, layer in out["layers"].items():
    print(li, [(h, v["kept_doc"], v["near_needle"], v["top_tokens"][:6]) for h, v in layer.items()])
