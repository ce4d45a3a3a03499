# Can SmolLM2 (full attention, 4K) answer "first parameter of F" from docstring sections? Prototype, 1 thread.
import re, random, sys, torch
torch.set_num_threads(1)
from localchat.bench import tasks
from localchat.bench.tasks import reference, _place, _sample, _enough, _norm
from localchat.bench.cell import Cell, load_engine, use_policy
from localchat.bench.tasks import prompt_messages
from localchat.engine.sampling import GenerationSettings
from localchat.engine.events import Done
ref = reference(); every = "\n".join(ref.normed)
facts = []
for i, s in enumerate(ref.sections):
    if s.kind == "module" or len(s.text) > tasks.MAX_ASKED: continue
    m = re.match(r"## (?:class )?[\w.]+\((?:(?:self|cls), )?(\w+)", s.text)
    if m and len(m.group(1)) >= 4 and every.count(f" {m.group(1).lower()} ") <= 3:
        facts.append((i, s.name, m.group(1)))
print(len(facts))
cell = Cell(task="docs_qa", length=4096, policy="full", budget=None, n=10, seed=0, model_spec=None, heads=None,
            chunk=512, positions="original", max_new_tokens=24)
engine = load_engine(cell); use_policy(engine, cell)
tok = engine.tokenizer
rng = random.Random(0)
Q = sys.argv[1] if len(sys.argv) > 1 else "In the provided text, what is the first parameter of {name}? Answer with the parameter name only."
right = 0
for k, (i, name, p) in enumerate(rng.sample(facts, 10)):
    asked = ref.sections[i].text
    budget = 4096 - tasks._count(tok, "\n\n" + asked)
    filler = ["\n\n" + s.text for j, (s, t) in enumerate(zip(ref.sections, ref.normed)) if j != i and f" {p.lower()} " not in t]
    random.Random(k).shuffle(filler)
    depth = k / 9
    doc, offsets = _place(tok, 4096, _enough(tok, filler, budget), budget, [(depth, asked)], sep="\n\n")
    sample = _sample("docs_qa", tok, doc, Q.format(name=name), [p], offsets, depth)
    ids = engine.encode(engine.render(prompt_messages(sample)))
    cache = engine.new_cache(len(ids), 24)
    out = ""
    for ev in engine.continue_on(cache, ids, 0, GenerationSettings(max_new_tokens=24)):
        if isinstance(ev, Done): out = ev.text
    ok = re.search(rf"(?<!\w){re.escape(p)}(?!\w)", out, re.I) is not None
    right += ok
    print(k, round(depth, 2), name, p, ok, repr(out[:60]), flush=True)
print("right", right, "/ 10")
