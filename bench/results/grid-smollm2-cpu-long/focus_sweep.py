# Focus settings on saved caches (session 14): LOCRET b=BUDGET (cap CAP) reads the document as the bench lane does
# and the cache before the prompt's tail is saved under $SNAPS (question_read.py's files, the same names). For
# every window x spread x K (--focus-window, --focus-spread, --focus) the engine's own focus code (localchat/engine/focus.py: Probe, view) runs on a copy:
# the tail is read with the probe installed, the view is built, the tail is read again over it and the answer is
# decoded greedily on it, as Engine._generate does. One JSON line per setting on stdout, with the share of the
# answer's prompt tokens held in the cache and in the view (over layers and KV heads).
# usage: python focus_sweep.py TASK LENGTH EXAMPLE BUDGET CAP WINDOWS SPREADS KS   (lists comma-separated)
import json, os, sys, time
import torch
torch.set_num_threads(int(os.environ.get("THREADS", "1")))
from localchat.bench.tasks import ANSWER_TOKENS, score
from localchat.engine import focus
from localchat.engine.prefill import forward
from saved_cache import answer_share, cache_before_tail, setup, snap_path

task, length, example, budget, cap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
windows, spreads, ks = ([int(x) for x in a.split(",")] for a in sys.argv[6:9])
MAX_NEW = ANSWER_TOKENS[task]  # as the bench answers
engine, sample, ids, head_end, where = setup(task, length, example, budget, cap, MAX_NEW)
model, p = engine.model, engine.policy
n = len(ids)
snap_file = snap_path(task, length, example, budget, cap)


@torch.inference_mode()
def run(doc, window: int, spread: int, k: int) -> dict:
    cache = doc.clone()
    held = cache.get_seq_length()
    tail = torch.tensor([ids[head_end:]])
    probe = focus.Probe(model, held, window)
    try:
        forward(model, cache, tail, head_end)
    finally:
        probe.close()
    view = focus.view(cache, probe.votes, held, k, reserve=k + tail.shape[-1] + MAX_NEW, after=spread)
    logits = forward(model, view, tail, head_end)
    out, pos = [], n
    for _ in range(MAX_NEW):
        tok = int(logits.argmax())
        if tok in engine.stop_ids:
            break
        out.append(tok)
        logits = forward(model, view, torch.tensor([[tok]]), pos)
        pos += 1
    said = engine.tokenizer.decode(out)
    return {"window": window, "spread": spread, "k": k, "answer": said, "correct": bool(score(sample, said)),
            "in_cache": answer_share(doc, where), "in_view": answer_share(view, where)}


doc = cache_before_tail(engine, ids, head_end, MAX_NEW, snap_file)
for w in windows:
    for s in spreads:
        for k in ks:
            t = time.time()
            row = run(doc, w, s, k)
            print(json.dumps({"task": task, "length": length, "example": example, "budget": budget, "max_copies": cap,
                              "depth": sample.depth, "expected": sample.answers[0], **row,
                              "seconds": round(time.time() - t, 1)}), flush=True)
