"""The Triton kernel behind qattn.decode_attention (imported only when Triton runs; see qattn.py)."""

import triton
import triton.language as tl


@triton.jit
def _dequant(c_ptr, s_ptr, z_ptr, c_row, s_row, z_row, cols, umask, BITS: tl.constexpr, G: tl.constexpr):
    """Values `[BLOCK, D_PAD]` fp32 of columns `cols` of the rows at c_row / s_row / z_row (pointer offsets)."""
    PER_BYTE: tl.constexpr = 8 // BITS
    byte = cols // PER_BYTE
    shift = (cols % PER_BYTE) * BITS
    packed = tl.load(c_ptr + c_row[:, None] + byte[None, :], mask=umask, other=0).to(tl.int32)
    codes = (packed >> shift[None, :]) & ((1 << BITS) - 1)
    scale = tl.load(s_ptr + s_row[:, None] + (cols // G)[None, :], mask=umask, other=0.0).to(tl.float32)
    zero = tl.load(z_ptr + z_row[:, None] + (cols // G)[None, :], mask=umask, other=0.0).to(tl.float32)
    return codes.to(tl.float32) * scale + zero


@triton.jit
def qattn_split_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, inv_ptr, out_ptr, lse_ptr,
    n, per_split, scaling,
    kc_h, kc_u, vc_h, vc_u, ks_h, ks_u, kz_h, kz_u, vs_h, vs_u, vz_h, vz_u,
    Q_PER_KV: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
    ROTATE: tl.constexpr, BLOCK: tl.constexpr,
):
    hq = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    h = hq // Q_PER_KV
    cols = tl.arange(0, D_PAD)
    cmask = cols < D
    HALF: tl.constexpr = D // 2
    partner = tl.where(cols < HALF, cols + HALF, cols - HALF)
    partner = tl.where(cmask, partner, 0)
    sign = tl.where(cols < HALF, -1.0, 1.0)
    q = tl.load(q_ptr + hq * D + cols, mask=cmask, other=0.0)
    if ROTATE:
        inv = tl.load(inv_ptr + (cols % HALF), mask=cmask, other=0.0)

    start = split * per_split
    stop = tl.minimum(start + per_split, n)
    m_i = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    acc = tl.zeros([D_PAD], tl.float32)
    for first in range(start, stop, BLOCK):
        units = first + tl.arange(0, BLOCK)
        live = units < stop
        umask = live[:, None] & cmask[None, :]
        k = _dequant(kc_ptr, ks_ptr, kz_ptr, h * kc_h + units * kc_u, h * ks_h + units * ks_u,
                     h * kz_h + units * kz_u, cols, umask, BITS, G)
        if ROTATE:  # stored at RoPE position 0; unit i sits at slot i: rotate-half by angle i * inv_freq
            kp = _dequant(kc_ptr, ks_ptr, kz_ptr, h * kc_h + units * kc_u, h * ks_h + units * ks_u,
                          h * kz_h + units * kz_u, partner, umask, BITS, G)
            angle = units.to(tl.float32)[:, None] * inv[None, :]
            k = k * tl.cos(angle) + sign[None, :] * kp * tl.sin(angle)
        s = tl.sum(k * q[None, :], axis=1) * scaling
        s = tl.where(live, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        v = _dequant(vc_ptr, vs_ptr, vz_ptr, h * vc_h + units * vc_u, h * vs_h + units * vs_u,
                     h * vz_h + units * vz_u, cols, umask, BITS, G)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    tl.store(out_ptr + (hq * splits + split) * D + cols, acc / l_i, mask=cmask)
    tl.store(lse_ptr + hq * splits + split, m_i + tl.log(l_i))
