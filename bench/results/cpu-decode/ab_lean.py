import time, sys, torch, statistics
torch.set_num_threads(2)
from localchat.engine.engine import Engine
from localchat.bench.cell import Cell, use_policy
from localchat.engine.prefill import prefill, forward, evict_while_decoding
from localchat.engine.decode_step import DecodeStep
w = sys.argv[1]
c = Cell(task="niah_single", length=2048, policy="locret", budget=1024, n=1, seed=0, model_spec=None, heads="random",
         chunk=512, positions="compact", max_new_tokens=64)
eng = Engine.load(None, weights=None if w == "fp32" else w, chunk=512); use_policy(eng, c)
m = eng.model; p = eng.policy
ids = torch.randint(100, 40000, (1, 2000))
cache = eng.new_cache(2000, 64); p.attach(m, cache)
with torch.inference_mode():
    g = prefill(m, cache, ids, chunk=512, policy=p)
    try:
        while True: next(g)
    except StopIteration: pass
    lean = DecodeStep(m, cache, on_qkv=p.qkv_sink()); tok = torch.tensor([[123]]); pos = [2000]
    def run(use, n=48):
        t = time.perf_counter()
        for _ in range(n):
            (lean.step(tok, pos[0]) if use else forward(m, cache, tok, pos[0])); p.observe(cache, 1, tok); evict_while_decoding(cache, p); pos[0] += 1
        return n / (time.perf_counter() - t)
    run(True, 8); run(False, 8)
    res = {True: [], False: []}
    for _ in range(6):
        for use in (True, False): res[use].append(run(use))
    print(w, "lean tok/s median %.1f %s | transformers forward %.1f %s | units %d" % (statistics.median(res[True]), [round(x,1) for x in res[True]], statistics.median(res[False]), [round(x,1) for x in res[False]], cache.get_seq_length()))
