# Which document tokens LOCRET keeps after reading a document (layers 0, 10, 20, 29, every KV head): counts of the
# kept tokens, of kept units near the needle and of kept units per tenth of the document, to see what fills the
# budget (niah_single at 32K vs 128K, session 6; passkey at b=1024 vs b=2048, session 8).
# usage: python bench/results/grid-smollm2-cpu-long/kept_tokens.py LENGTH EXAMPLE [TASK [BUDGET [N]]]  (one torch
# thread; defaults niah_single, 1024, 20; writes kept-LENGTH-EXAMPLE.json for those, else kept-TASK-LENGTH-bBUDGET-EXAMPLE.json)
import sys, json, collections, torch
torch.set_num_threads(1)
from localchat.bench.cell import Cell, sample_for, load_engine, use_policy
from localchat.bench.tasks import prompt_messages
from localchat.engine.sampling import GenerationSettings
from localchat.engine.events import Done
length, example = int(sys.argv[1]), int(sys.argv[2])
task = sys.argv[3] if len(sys.argv) > 3 else "niah_single"
budget = int(sys.argv[4]) if len(sys.argv) > 4 else 1024
n_examples = int(sys.argv[5]) if len(sys.argv) > 5 else 20
cell = Cell(task=task, length=length, policy="locret", budget=budget, n=n_examples, seed=0, model_spec=None, heads=None,
            chunk=512, positions="compact", max_new_tokens=24)
engine = load_engine(cell)
use_policy(engine, cell)
sample = sample_for(cell, engine.tokenizer, example)
text = engine.render(prompt_messages(sample)); ids = engine.encode(text)
cache = engine.new_cache(len(ids), 24)
answer = None
for ev in engine.continue_on(cache, ids, 0, GenerationSettings(max_new_tokens=24)):
    if isinstance(ev, Done):
        answer = ev.text
        print("answer:", repr(ev.text), "expected", sample.answers)
    elif type(ev).__name__ == "Error": print("error", ev.message)
tok = engine.tokenizer
out = {"task": task, "budget": budget, "length": length, "example": example, "n": len(ids),
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
from pathlib import Path
name = f"kept-{length}-{example}.json" if (task, budget) == ("niah_single", 1024) else \
    f"kept-{task}-{length}-b{budget}-{example}.json"
json.dump(out, open(Path(__file__).with_name(name), "w"), indent=1)
for li, layer in out["layers"].items():
    print(li, [(h, v["kept_doc"], v["near_needle"], v["top_tokens"][:6], v["tenths"]) for h, v in layer.items()])
