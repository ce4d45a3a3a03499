import time, sys, torch, statistics
torch.set_num_threads(2)
from torch.utils.cpp_extension import load
seq = load(name="lc_seq_variant", sources=["/work/exp/seq.cpp"], build_directory="/work/exp/seqbuild", extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
from localchat.engine.engine import Engine
from localchat.bench.cell import Cell, use_policy
from localchat.engine.prefill import prefill
from localchat.engine.decode_step import DecodeStep
c = Cell(task="niah_single", length=2048, policy="locret", budget=1024, n=1, seed=0, model_spec=None, heads=None, chunk=512, positions="compact", max_new_tokens=64)
eng = Engine.load(None, weights="int4", chunk=512, say=lambda s: None); use_policy(eng, c)
m = eng.model; p = eng.policy
ids = torch.randint(100, 40000, (1, 2000))
cache = eng.new_cache(2000, 64); p.attach(m, cache)
with torch.inference_mode():
    g = prefill(m, cache, ids, chunk=512, policy=p)
    try:
        while True: next(g)
    except StopIteration: pass
    a = DecodeStep(m, cache, on_qkv=p.qkv_sink()); b = DecodeStep(m, cache, on_qkv=p.qkv_sink()); b.kernels = seq
    tok = torch.tensor([[123]])
    def run(st, n=40):
        t = time.perf_counter()
        for s in range(n):
            st.step(tok, 2000 + s)
            for l in cache.layers: l.n -= 1; l._publish()
        p.scorer.queue = [[] for _ in p.scorer.queue]
        return n / (time.perf_counter() - t)
    run(a, 5); run(b, 5)
    ra, rb = [], []
    for _ in range(8): ra.append(run(a)); rb.append(run(b))
print("side-by-side gate/up %.1f %s | sequential %.1f %s" % (statistics.median(ra), [round(x,1) for x in ra], statistics.median(rb), [round(x,1) for x in rb]))
