import time, sys, torch, statistics
torch.set_num_threads(2)
from localchat.engine.engine import Engine
from localchat.bench.cell import Cell, use_policy
from localchat.engine.prefill import prefill, evict_while_decoding
from localchat.engine.decode_step import DecodeStep
w = sys.argv[1]
c = Cell(task="niah_single", length=2048, policy="locret", budget=1024, n=1, seed=0, model_spec=None, heads=None,
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
    print("units", cache.get_seq_length())
    lean = DecodeStep(m, cache, on_qkv=p.qkv_sink()); tok = torch.tensor([[123]])
    def run(n, full=True):
        t = time.perf_counter()
        for s in range(n):
            lean.step(tok, 2000 + s)
            if full: p.observe(cache, 1, tok); evict_while_decoding(cache, p)
            else:
                for l in cache.layers: l.n -= 1; l._publish()
        return n / (time.perf_counter() - t)
    run(5, False)
    print("fixed-length step tok/s", [round(run(40, False), 1) for _ in range(4)])
    from torch.profiler import profile
    with profile() as prof:
        run(20, False)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
