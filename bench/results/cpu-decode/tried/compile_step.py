import time, sys, os, torch, statistics
torch.set_num_threads(2)
from torch.nn import functional as F
from localchat.engine.engine import Engine
from localchat.bench.cell import Cell, use_policy
from localchat.engine.prefill import prefill
from localchat.engine.decode_step import DecodeStep, _rotate
from localchat.kernels.packed import PackedLinear, GROUP
w = sys.argv[1]; mode = sys.argv[2]
c = Cell(task="niah_single", length=2048, policy="locret", budget=1024, n=1, seed=0, model_spec=None, heads="random",
         chunk=512, positions="compact", max_new_tokens=64)
eng = Engine.load(None, weights=None if w == "fp32" else w, chunk=512); use_policy(eng, c)
m = eng.model; p = eng.policy
ids = torch.randint(100, 40000, (1, 2000))
cache = eng.new_cache(2000, 200); p.attach(m, cache)
with torch.inference_mode():
    g = prefill(m, cache, ids, chunk=512, policy=p)
    try:
        while True: next(g)
    except StopIteration: pass
n0 = cache.get_seq_length(); print("units", n0, "cap", cache.layers[0]._k.shape)
inner = m.model; cfg = m.config
d = inner.layers[0].self_attn.head_dim; HQ = cfg.num_attention_heads; HK = cfg.num_key_value_heads; G = HQ // HK
def lin(mod, x):
    if isinstance(mod, PackedLinear):
        xb = x.reshape(1, -1).to(torch.bfloat16)
        if mod.bits == 8: y = torch.ops.aten._weight_int8pack_mm(xb, mod.codes, mod.scales)
        else: y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, mod.codes, GROUP, mod.scales)
        return y[:, :mod.out_features].float()
    return F.linear(x.reshape(1, -1), mod.weight)
Ks = [l._k for l in cache.layers]; Vs = [l._v for l in cache.layers]
cap = Ks[0].shape[2]
def step(h, cos, sin, slot, mask):
    for i, layer in enumerate(inner.layers):
        a = layer.self_attn
        x = F.rms_norm(h, (h.shape[-1],), layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
        q = lin(a.q_proj, x).view(1, HQ, 1, d); k = lin(a.k_proj, x).view(1, HK, 1, d); v = lin(a.v_proj, x).view(1, HK, 1, d)
        qk = _rotate(torch.cat((q, k), 1), cos, sin); q, k = qk[:, :HQ], qk[:, HQ:]
        Ks[i].index_copy_(2, slot, k); Vs[i].index_copy_(2, slot, v)
        out = F.scaled_dot_product_attention(q.reshape(1, HK, G, d), Ks[i], Vs[i], attn_mask=mask, scale=a.scaling)
        h = h + lin(a.o_proj, out.reshape(1, -1)).view(1, 1, -1)
        x = F.rms_norm(h, (h.shape[-1],), layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
        mlp = layer.mlp
        h = h + lin(mlp.down_proj, F.silu(lin(mlp.gate_proj, x)) * lin(mlp.up_proj, x)).view(1, 1, -1)
    h = F.rms_norm(h, (h.shape[-1],), inner.norm.weight, inner.norm.variance_epsilon)
    return lin(m.lm_head, h)
if mode != "eager":
    import torch._inductor.config as ic
    if mode == "cppwrap": ic.cpp_wrapper = True
    step = torch.compile(step, fullgraph=True, dynamic=False)
lean = DecodeStep(m, cache)
def run_static(steps):
    n = n0
    t = time.perf_counter()
    for s in range(steps):
        pos = torch.tensor([[n]]); h = inner.embed_tokens(torch.tensor([[123]]))
        cos, sin = inner.rotary_emb(h, pos); cos, sin = cos[:, None], sin[:, None]
        mask = (torch.arange(cap) <= n).view(1, 1, 1, cap)
        step(h, cos, sin, torch.tensor([n]), mask)
        n += 1
    return steps / (time.perf_counter() - t)
def run_lean(steps):
    t = time.perf_counter()
    for s in range(steps):
        lean.step(torch.tensor([[123]]), 2000 + s)
        for l in cache.layers: l.n -= 1; l._publish()  # keep the length fixed
    return steps / (time.perf_counter() - t)
with torch.inference_mode():
    t = time.perf_counter(); run_static(3); print("warm", round(time.perf_counter() - t, 1), "s")
    run_lean(5)
    a, b = [], []
    for _ in range(5):
        a.append(run_static(40)); b.append(run_lean(40))
print(w, mode, "static %.1f %s | lean %.1f %s" % (statistics.median(a), [round(x,1) for x in a], statistics.median(b), [round(x,1) for x in b]))
