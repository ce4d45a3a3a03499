# Why --max-copies 16 loses niah_single at 4K (session 12): for LOCRET b=1024 with the shipped heads and each cap
# (0: the paper's rule), per layer, the share of (KV head, digit) pairs that keep the needle's number, the share of
# KV heads that keep the token right after it (the sentence's "."), and the kept copies of "." per KV head.
# usage: python sentence_end.py LENGTH EXAMPLE CAPS  (CAPS like 0,16,64; one torch thread; one JSON line per cap)
import sys, json, torch
torch.set_num_threads(1)
from localchat.bench.cell import Cell, sample_for, load_engine, use_policy
from localchat.bench.tasks import prompt_messages
from localchat.engine.sampling import GenerationSettings
from localchat.engine.events import Done

length, example = int(sys.argv[1]), int(sys.argv[2])
engine = None
for cap in [int(c) for c in sys.argv[3].split(",")]:
    cell = Cell(task="niah_single", length=length, policy="locret", budget=1024, n=20, seed=0, model_spec=None,
                heads=None, chunk=512, positions="compact", max_new_tokens=24, max_copies=cap or None)
    engine = engine or load_engine(cell)
    use_policy(engine, cell)
    sample = sample_for(cell, engine.tokenizer, example)
    text = engine.render(prompt_messages(sample))
    number = sample.answers[0]
    at = text.index(number)
    enc = engine.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    assert ids == engine.encode(text), "offsets tokenization differs from the engine's"
    digits = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < at + len(number) and b > at]
    after = digits[-1] + 1
    cache = engine.new_cache(len(ids), 24)
    answer = None
    for ev in engine.continue_on(cache, ids, 0, GenerationSettings(max_new_tokens=24)):
        if isinstance(ev, Done):
            answer = ev.text
    dot = engine.tokenizer.convert_tokens_to_ids(".")
    layers = []
    for li, layer in enumerate(cache.layers):
        pos = layer.positions.tolist()  # [H][n]
        kept = [set(p) for p in pos]
        layers.append({"layer": li,
                       "digits_kept": round(sum(d in k for k in kept for d in digits) / (len(kept) * len(digits)), 3),
                       "end_kept": round(sum(after in k for k in kept) / len(kept), 3),
                       "dots_per_head": [sum(1 for p in k if p < len(ids) and ids[p] == dot) for k in kept]})
    print(json.dumps({"cap": cap, "length": length, "example": example, "expected": number, "answer": answer,
                      "after_token": engine.tokenizer.decode([ids[after]]),
                      "digits_kept": round(sum(r["digits_kept"] for r in layers) / len(layers), 3),
                      "end_kept": round(sum(r["end_kept"] for r in layers) / len(layers), 3),
                      "layers": layers}), flush=True)
