# niah_multikey: how many wrong answers give the number of another needle of the same document (session 12).
# usage: python bench/results/grid-smollm2-cpu-long/other_needle.py LENGTH BUDGET  (LOCRET with the paper's rule, fp32 rows of this folder and the GPU's)
import json,re,sys
from localchat.bench.cell import Cell, load_engine, sample_for
length, budget = int(sys.argv[1]), int(sys.argv[2])
rs=[json.loads(l) for f in ("bench/results/grid-smollm2-cpu-long/results.jsonl", "bench/results/grid-smollm2-gpu-long/results.jsonl") for l in open(f)]
cell = Cell(task="niah_multikey", length=length, policy="locret", budget=budget, n=20, seed=0, model_spec=None, heads=None, chunk=512, positions="compact", max_new_tokens=24)
eng = load_engine(cell)
sel=[r for r in rs if r['task']=='niah_multikey' and r['length']==length and r['budget']==budget and r['policy']=='locret' and r.get('max_copies') is None and r.get('weights') in (None,'fp32')]
other=[]
for r in sel:
    if r['correct']: continue
    s = sample_for(cell, eng.tokenizer, r['example'])
    nums = re.findall(r"special magic numbers? for [\w-]+ is:? (\d+)", s.document)
    if any(g in nums for g in re.findall(r"\d{5,}", r['output'])): other.append(r['example'])
print(length, budget, "rows", len(sel), "right", sum(r['correct'] for r in sel), "another needle's number", len(other), sorted(other))
