"""Designs for exact compact positions, simulated on plain tensors (bench/results/compact-positions-drift/).

3 heads, d=64, theta 1e5, b=256, chunk 64, 256 evictions, scores fixed at insertion: "today" (re-rotate the
rounded key), "A" (keys as they arrived + insertion slot, rotated once per eviction), "res" (an int8/6/4-bit
rounding remainder). Prints the error against fp64 and the one-rotation error. Needs nothing from localchat.

    python bench/experiments/key_drift_designs.py
"""

from __future__ import annotations

import argparse

import torch

H, D, B, C, E = 3, 64, 256, 64, 256
INV = 1.0 / (100000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))


def rot64(k, delta):  # k [H, n, d] float64, delta [H, n]
    a = delta.double()[..., None] * INV
    cos, sin = torch.cat([a.cos(), a.cos()], -1), torch.cat([a.sin(), a.sin()], -1)
    half = D // 2
    return k * cos + torch.cat([-k[..., half:], k[..., :half]], -1) * sin


def rot32(k, delta):
    a = delta.float()[..., None] * INV.float()
    cos, sin = torch.cat([a.cos(), a.cos()], -1), torch.cat([a.sin(), a.sin()], -1)
    k, half = k.float(), D // 2
    return k * cos + torch.cat([-k[..., half:], k[..., :half]], -1) * sin


def step_of(w, dtype):
    fi = torch.finfo(dtype)
    pow2 = (w.float().view(torch.int32) & 0x7F800000).view(torch.float32).clamp_min(fi.smallest_normal)
    return pow2 * (fi.eps / 256)


def run(dtype, mode: str, bits: int = 8) -> tuple[float, float]:
    g = torch.Generator().manual_seed(1)
    W = torch.empty(H, 0, D, dtype=dtype)  # working keys at their slots
    R = torch.empty(H, 0, D, dtype=torch.int8)  # remainder
    arrived_all = torch.empty(H, 0, D, dtype=dtype)  # keys as they arrived (mode A)
    ins = torch.empty(H, 0, dtype=torch.long)
    S = torch.empty(H, 0)
    ref_src = torch.empty(H, 0, D, dtype=torch.float64)
    lim = 2 ** (bits - 1) - 1
    for _ in range(E):
        n = W.shape[1]
        raw = torch.randn(H, C, D, generator=g, dtype=torch.float64) * 2
        slots = torch.arange(n, n + C).expand(H, C)
        arrived = rot64(raw, slots).to(dtype)
        W, arrived_all = torch.cat([W, arrived], 1), torch.cat([arrived_all, arrived], 1)
        R = torch.cat([R, torch.zeros(H, C, D, dtype=torch.int8)], 1)
        ins, S = torch.cat([ins, slots], 1), torch.cat([S, torch.rand(H, C, generator=g)], 1)
        ref_src = torch.cat([ref_src, arrived.double()], 1)
        idx = S.topk(min(B, S.shape[1]), -1).indices.sort(-1).values
        new = torch.arange(idx.shape[1]).expand_as(idx)
        gi = idx[..., None].expand(-1, -1, D)
        if mode == "today":
            W = rot32(W.gather(1, gi), new - idx).to(dtype)
        elif mode == "A":
            arrived_all, ins = arrived_all.gather(1, gi), ins.gather(1, idx)
            W = rot32(arrived_all, new - ins).to(dtype)
        elif mode == "res":
            w, r = W.gather(1, gi), R.gather(1, gi)
            x = rot32(w.float() + r.float() * step_of(w, dtype) * (2 ** (8 - bits)), new - idx)
            W = x.to(dtype)
            st = step_of(W, dtype) * (2 ** (8 - bits))
            R = ((x - W.float()) / st).round().clamp(-lim, lim).to(torch.int8)
        S, ref_src = S.gather(1, idx), ref_src.gather(1, gi)
        if mode != "A":
            ins = ins.gather(1, idx)
    final = torch.arange(W.shape[1]).expand(H, -1)
    ref = rot64(ref_src, final - ins)
    err = ((W.double() - ref).norm() / ref.norm()).item()
    one = ((rot32(ref_src.to(dtype), final - ins).to(dtype).double() - ref).norm() / ref.norm()).item()
    return err, one


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description="Designs for exact compact positions, on plain tensors.").parse_args(argv)
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for mode, bits in (("today", 8), ("A", 8), ("res", 8), ("res", 6), ("res", 4)):
            err, one = run(dtype, mode, bits)
            print(f"{str(dtype):15s} {mode:5s} bits={bits} err={err:.3e} one-rotation={one:.3e} ratio={err/one:.2f}")


if __name__ == "__main__":
    main()
