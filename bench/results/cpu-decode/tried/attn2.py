import torch, time
from torch.nn import functional as F
torch.set_num_threads(2)
H, G, d, n, cap, L = 3, 3, 64, 1120, 1832, 30
Ks = [torch.randn(1, H, cap, d) for _ in range(L)]; Vs = [torch.randn(1, H, cap, d) for _ in range(L)]
q = torch.randn(1, H, G, d)
fa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
def plain():
    for K, V in zip(Ks, Vs): F.scaled_dot_product_attention(q, K[:, :, :n], V[:, :, :n], scale=0.125)
def split(parts=2):
    def one(K, V):
        m = n // parts * parts
        k = K[:, :, :m].reshape(H, parts, m // parts, d).transpose(0, 1)  # [parts, H, m/parts, d] view
        v = V[:, :, :m].reshape(H, parts, m // parts, d).transpose(0, 1)
        out, lse = fa(q.expand(parts, H, G, d), k, v, scale=0.125)[:2]
        if m < n:
            o2, l2 = fa(q, K[:, :, m:n], V[:, :, m:n], scale=0.125)[:2]
            out, lse = torch.cat([out, o2]), torch.cat([lse, l2])
        w = torch.softmax(lse, 0).unsqueeze(-1)  # [parts, H, G, 1]
        return (out * w).sum(0, keepdim=True)
    return one
def run(f):
    for K, V in zip(Ks, Vs): f(K, V)
def bench(f, reps=30):
    f()
    t = time.perf_counter()
    for _ in range(reps): f()
    return (time.perf_counter() - t) / reps * 1e3
ref = F.scaled_dot_product_attention(q, Ks[0][:, :, :n], Vs[0][:, :, :n], scale=0.125)
for parts in (2, 4, 8):
    print(parts, "err", (split(parts)(Ks[0], Vs[0]) - ref).abs().max().item())
with torch.inference_mode():
    for _ in range(2):
        print("plain %.2f ms/step" % bench(plain), " ".join("split%d %.2f" % (p, bench(lambda: run(split(p)))) for p in (2, 4, 8)))
Kb = [k.bfloat16() for k in Ks]; Vb = [v.bfloat16() for v in Vs]; qb = q.bfloat16()
def plainb():
    for K, V in zip(Kb, Vb): F.scaled_dot_product_attention(qb, K[:, :, :n], V[:, :, :n], scale=0.125)
def mathf():
    for K, V in zip(Ks, Vs):
        s = torch.matmul(q, K[:, :, :n].transpose(-1, -2)); torch.matmul(torch.softmax(s, -1), V[:, :, :n])
def mathb():
    for K, V in zip(Kb, Vb):
        s = torch.matmul(qb, K[:, :, :n].transpose(-1, -2)); torch.matmul(torch.softmax(s.float(), -1).bfloat16(), V[:, :, :n])
big = torch.randn(50_000_000)
with torch.inference_mode():
    for _ in range(2):
        print("bf16 sdpa %.2f, fp32 math %.2f, bf16 math %.2f ms/step" % (bench(plainb), bench(mathf), bench(mathb)), "sum 200MB %.1f ms" % bench(lambda: big.sum(), 10))
