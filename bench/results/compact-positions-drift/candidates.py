"""Candidate designs for exact compact positions, simulated on plain tensors (3 heads, d=64, theta 1e5, b=256,
chunk 64, 256 evictions, scores fixed at insertion): today (re-rotate the rounded key), A (keys as they arrived
+ insertion slot, rotated once per eviction), res (int8/6/4-bit rounding remainder). Prints error vs fp64
and the one-rotation error. Needs nothing from localchat."""
import torch
torch.manual_seed(0)
H, d, b, c, E = 3, 64, 256, 64, 256
inv = 1.0 / (100000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))

def rot64(k, delta):  # k [H,n,d] float64, delta [H,n]
    a = delta.double()[..., None] * inv
    cos = torch.cat([a.cos(), a.cos()], -1); sin = torch.cat([a.sin(), a.sin()], -1)
    half = d // 2
    return k * cos + torch.cat([-k[..., half:], k[..., :half]], -1) * sin

def rot32(k, delta):
    a = delta.float()[..., None] * inv.float()
    cos = torch.cat([a.cos(), a.cos()], -1); sin = torch.cat([a.sin(), a.sin()], -1)
    k = k.float(); half = d // 2
    return k * cos + torch.cat([-k[..., half:], k[..., :half]], -1) * sin

def step_of(w, dtype):
    fi = torch.finfo(dtype)
    pow2 = (w.float().view(torch.int32) & 0x7F800000).view(torch.float32).clamp_min(fi.smallest_normal)
    return pow2 * (fi.eps / 256)

def run(dtype, mode, bits=8):
    g = torch.Generator().manual_seed(1)
    W = torch.empty(H, 0, d, dtype=dtype)   # working keys at their slots
    R = torch.empty(H, 0, d, dtype=torch.int8)  # residual
    O = torch.empty(H, 0, d, dtype=dtype)   # originals (mode A)
    ins = torch.empty(H, 0, dtype=torch.long)
    S = torch.empty(H, 0)
    ref_src = torch.empty(H, 0, d, dtype=torch.float64)
    lim = 2 ** (bits - 1) - 1
    for e in range(E):
        n = W.shape[1]
        raw = torch.randn(H, c, d, generator=g, dtype=torch.float64) * 2
        slots = torch.arange(n, n + c).expand(H, c)
        arrived = rot64(raw, slots).to(dtype)
        W = torch.cat([W, arrived], 1); O = torch.cat([O, arrived], 1)
        R = torch.cat([R, torch.zeros(H, c, d, dtype=torch.int8)], 1)
        ins = torch.cat([ins, slots], 1); S = torch.cat([S, torch.rand(H, c, generator=g)], 1)
        ref_src = torch.cat([ref_src, arrived.double()], 1)
        idx = S.topk(min(b, S.shape[1]), -1).indices.sort(-1).values
        new = torch.arange(idx.shape[1]).expand_as(idx)
        gi = idx[..., None].expand(-1, -1, d)
        if mode == "today":
            W = rot32(W.gather(1, gi), new - idx).to(dtype)
        elif mode == "A":
            O = O.gather(1, gi); ins = ins.gather(1, idx)
            W = rot32(O, new - ins).to(dtype)
        elif mode == "res":
            w = W.gather(1, gi); r = R.gather(1, gi)
            x = w.float() + r.float() * step_of(w, dtype) * (2 ** (8 - bits))
            x = rot32(x, new - idx)
            W = x.to(dtype)
            st = step_of(W, dtype) * (2 ** (8 - bits))
            R = ((x - W.float()) / st).round().clamp(-lim, lim).to(torch.int8)
        S = S.gather(1, idx); ref_src = ref_src.gather(1, gi)
        if mode != "A": ins = ins.gather(1, idx)
    final = torch.arange(W.shape[1]).expand(H, -1)
    ref = rot64(ref_src, final - ins)
    err = ((W.double() - ref).norm() / ref.norm()).item()
    one = ((rot32(ref_src.to(dtype), final - ins).to(dtype).double() - ref).norm() / ref.norm()).item()
    return err, one

for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for mode, bits in (("today", 8), ("A", 8), ("res", 8), ("res", 6), ("res", 4)):
        err, one = run(dtype, mode, bits)
        print(f"{str(dtype):15s} {mode:5s} bits={bits} err={err:.3e} one-rotation={one:.3e} ratio={err/one:.2f}")
