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
def fuse(mods):
    a = mods[0]
    if isinstance(a, PackedLinear):
        if a.bits == 8: return (8, torch.cat([x.codes for x in mods]), torch.cat([x.scales for x in mods]))
        return (4, torch.cat([x.codes for x in mods]), torch.cat([x.scales for x in mods], 1))
    return (32, torch.cat([x.weight for x in mods]), None)
def lin(wt, x):
    bits, codes, scales = wt
    if bits == 8: return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), codes, scales).float()
    if bits == 4: return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), codes, GROUP, scales).float()
    return F.linear(x, codes)
W = []
for layer in inner.layers:
    a, mlp = layer.self_attn, layer.mlp
    W.append((layer.input_layernorm.weight, fuse([a.q_proj, a.k_proj, a.v_proj]), fuse([a.o_proj]),
              layer.post_attention_layernorm.weight, fuse([mlp.gate_proj, mlp.up_proj]), fuse([mlp.down_proj])))
head = fuse([m.lm_head]); fnorm = inner.norm.weight; eps = inner.norm.variance_epsilon
I = cfg.intermediate_size; scaling = inner.layers[0].self_attn.scaling
Ks = [l._k for l in cache.layers]; Vs = [l._v for l in cache.layers]
def step(h, cos, sin, n, W, Ks, Vs):
    hid = h.shape[-1]; qkvs = []
    for i in range(len(W)):
        n1, wqkv, wo, n2, wgu, wd = W[i]
        x = F.rms_norm(h, (hid,), n1, eps)
        qkv = lin(wqkv, x); qkvs.append(qkv)
        q = qkv[:, : HQ * d].view(1, HQ, 1, d); k = qkv[:, HQ * d: (HQ + HK) * d].view(1, HK, 1, d); v = qkv[:, (HQ + HK) * d:].view(1, HK, 1, d)
        qk = _rotate(torch.cat((q, k), 1), cos, sin); q, k = qk[:, :HQ], qk[:, HQ:]
        Ks[i][:, :, n:n+1] = k; Vs[i][:, :, n:n+1] = v
        out = F.scaled_dot_product_attention(q.reshape(1, HK, G, d), Ks[i][:, :, :n+1], Vs[i][:, :, :n+1], scale=scaling)
        h = h + lin(wo, out.reshape(1, -1))
        x = F.rms_norm(h, (hid,), n2, eps)
        gu = lin(wgu, x)
        h = h + lin(wd, F.silu(gu[:, :I]) * gu[:, I:])
    h = F.rms_norm(h, (hid,), fnorm, eps)
    return lin(head, h), torch.stack(qkvs)
if mode != "eager":
    import torch._inductor.config as ic
    if mode == "cppwrap": ic.cpp_wrapper = True
    step = torch.compile(step, fullgraph=True, dynamic=None)
lean = DecodeStep(m, cache)
def run_static(steps):
    n = n0
    t = time.perf_counter()
    for s in range(steps):
        pos = torch.tensor([[n]]); h = inner.embed_tokens(torch.tensor([123])).view(1, -1)
        cos, sin = inner.rotary_emb(h, pos); cos, sin = cos[:, None], sin[:, None]
        step(h, cos, sin, n, W, Ks, Vs)
        n += 1
    return steps / (time.perf_counter() - t)
def run_lean(steps):
    t = time.perf_counter()
    for s in range(steps):
        lean.step(torch.tensor([[123]]), 2000 + s)
        for l in cache.layers: l.n -= 1; l._publish()  # keep the length fixed
    return steps / (time.perf_counter() - t)
with torch.inference_mode():
    h = inner.embed_tokens(torch.tensor([123])).view(1, -1)
    pos = torch.tensor([[n0]]); cos, sin = inner.rotary_emb(h, pos); cos, sin = cos[:, None], sin[:, None]
    ref = lean.step(torch.tensor([[123]]), 2000)
    for l in cache.layers: l.n -= 1; l._publish()
    got = step(h, cos, sin, n0, W, Ks, Vs)[0][0]
    print("max logit diff", (got - ref).abs().max().item())
    t = time.perf_counter(); run_static(3); print("warm", round(time.perf_counter() - t, 1), "s")
    run_lean(5)
    a, b = [], []
    for _ in range(5):
        a.append(run_static(40)); b.append(run_lean(40))
print(w, mode, "static %.1f %s | lean %.1f %s" % (statistics.median(a), [round(x,1) for x in a], statistics.median(b), [round(x,1) for x in b]))
if len(sys.argv) > 3:
    from torch.profiler import profile
    with torch.inference_mode(), profile() as prof:
        run_static(20)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
