"""The Triton kernels behind qattn.decode_attention (imported only when Triton runs; see qattn.py).

`qattn_split_kernel`, grid (query heads, splits + 1): program (hq, s < splits) attends to its split of the
quantized units, the last program of each head to the full-precision tail; each writes a partial output and
its log-sum-exp. `qattn_group_kernel`, grid (KV heads, splits + 1): the same for all query heads of a KV head
at once (GQA: each unit read once). `merge_kernel`, grid (query heads,): the softmax-weighted sum of the partials.
Lengths are not specialised on (`do_not_specialize`): a decode step adds a unit, and a new compile per
length would cost far more than the step. With `LENS` the two lengths are read from device memory
(`lens_ptr`: quantized units, tail units) and the grid is sized for the cache's capacity: a captured decode
step (engine/graph_step.py) replays it at every length, and a split past the units held reads nothing.
`BITS = 0` reads the split's units as plain keys and values (`kc_ptr`, `vc_ptr`: the unquantized cache).
"""

import triton
import triton.language as tl


@triton.jit
def _dequant(c_ptr, s_ptr, z_ptr, c_row, s_row, z_row, cols, live, umask, BITS: tl.constexpr, G: tl.constexpr,
             D: tl.constexpr):
    """Values `[BLOCK, len(cols)]` fp32 of the rows at c_row / s_row / z_row (pointer offsets). A unit's scales
    and zeros are loaded once per group, as `[BLOCK]` vectors, and spread over the group's columns: loaded per
    column, they were two scalar loads for each value the codes give (at the 8B's shape with an int8 cache, the
    dot way's 64-unit kernel had 360 global loads in its machine code, now 120: tools/gpu/compile_check.py)."""
    PER_BYTE: tl.constexpr = 8 // BITS
    NG: tl.constexpr = D // G
    packed = tl.load(c_ptr + c_row[:, None] + (cols // PER_BYTE)[None, :], mask=umask, other=0).to(tl.int32)
    codes = ((packed >> ((cols % PER_BYTE) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
    if NG == 1:
        scale = tl.load(s_ptr + s_row, mask=live, other=0.0).to(tl.float32)[:, None]
        zero = tl.load(z_ptr + z_row, mask=live, other=0.0).to(tl.float32)[:, None]
        return codes * scale + zero
    group = (cols // G)[None, :]
    scale = tl.zeros_like(codes)
    zero = tl.zeros_like(codes)
    for g in tl.static_range(NG):
        scale = tl.where(group == g, tl.load(s_ptr + s_row + g, mask=live, other=0.0).to(tl.float32)[:, None], scale)
        zero = tl.where(group == g, tl.load(z_ptr + z_row + g, mask=live, other=0.0).to(tl.float32)[:, None], zero)
    return codes * scale + zero


@triton.jit
def _rows(c_ptr, s_ptr, z_ptr, c_row, s_row, z_row, cols, live, umask, BITS: tl.constexpr, G: tl.constexpr,
          D: tl.constexpr):
    """Keys or values `[BLOCK, len(cols)]` fp32: dequantized, or read as they are (BITS = 0)."""
    if BITS == 0:
        x = tl.load(c_ptr + c_row[:, None] + cols[None, :], mask=umask, other=0.0).to(tl.float32)
    else:
        x = _dequant(c_ptr, s_ptr, z_ptr, c_row, s_row, z_row, cols, live, umask, BITS, G, D)
    return x


@triton.jit
def _rope_offsets(inv_ptr, cols, cmask, D: tl.constexpr, BLOCK: tl.constexpr):
    """For the in-kernel RoPE: each column's partner (rotate_half) and sign, its frequency, and cos/sin of j·inv
    for a block's offsets j `[BLOCK, D_PAD]` (computed once per program; see _block_angles)."""
    HALF: tl.constexpr = D // 2
    partner = tl.where(cols < HALF, cols + HALF, cols - HALF)
    sign = tl.where(cols < HALF, -1.0, 1.0)
    inv = tl.load(inv_ptr + (cols % HALF), mask=cmask, other=0.0)
    step = tl.arange(0, BLOCK).to(tl.float32)[:, None] * inv[None, :]
    return partner, sign, inv, tl.cos(step), tl.sin(step)


@triton.jit
def _block_angles(first, cols, inv, cos_j, sin_j):
    """cos and sin of the angles (first + j)·inv `[BLOCK, D_PAD]` by the addition rule: two transcendentals per
    column per block instead of two per element."""
    base = (first + cols * 0).to(tl.float32) * inv
    cos_b, sin_b = tl.cos(base)[None, :], tl.sin(base)[None, :]
    return cos_b * cos_j - sin_b * sin_j, sin_b * cos_j + cos_b * sin_j


@triton.jit
def _ranges(lens_ptr, n, nt, per_split, LENS: tl.constexpr):
    """(split, programs along axis 1, first and end of this split's quantized units, end of the tail): the last
    program of a head reads the tail alone, the others their split of the n quantized units. With LENS the two
    lengths come from device memory (a captured step)."""
    if LENS:
        n = tl.load(lens_ptr).to(tl.int32)
        nt = tl.load(lens_ptr + 1).to(tl.int32)
    split = tl.program_id(1)
    programs = tl.num_programs(1)
    tail = split == programs - 1
    q_start = tl.where(tail, 0, split * per_split)
    return split, programs, q_start, tl.where(tail, 0, tl.minimum(q_start + per_split, n)), tl.where(tail, nt, 0)


@triton.jit(do_not_specialize=["n", "nt", "per_split"])
def qattn_split_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, tk_ptr, tv_ptr, inv_ptr, out_ptr, lse_ptr, lens_ptr,
    n, nt, per_split, scaling, q_h,
    kc_h, kc_u, vc_h, vc_u, ks_h, ks_u, kz_h, kz_u, vs_h, vs_u, vz_h, vz_u, tk_h, tk_u, tv_h, tv_u,
    Q_PER_KV: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
    ROTATE: tl.constexpr, BLOCK: tl.constexpr, LENS: tl.constexpr,
):
    hq = tl.program_id(0)
    h = hq // Q_PER_KV
    cols = tl.arange(0, D_PAD)
    cmask = cols < D
    q = tl.load(q_ptr + hq * q_h + cols, mask=cmask, other=0.0).to(tl.float32) * scaling
    if ROTATE:  # q·R(i)k = (R(-i)q)·k: rotate the query per unit instead of each key (no partner dequantize)
        partner, sign, inv, cos_j, sin_j = _rope_offsets(inv_ptr, cols, cmask, D, BLOCK)
        qp = tl.load(q_ptr + hq * q_h + partner, mask=cmask, other=0.0).to(tl.float32) * scaling

    split, programs, q_start, q_stop, t_stop = _ranges(lens_ptr, n, nt, per_split, LENS)
    m_i = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    acc = tl.zeros([D_PAD], tl.float32)
    for first in range(q_start, q_stop, BLOCK):  # the quantized units of this split
        units = first + tl.arange(0, BLOCK)
        live = units < q_stop
        umask = live[:, None] & cmask[None, :]
        k = _rows(kc_ptr, ks_ptr, kz_ptr, h * kc_h + units * kc_u, h * ks_h + units * ks_u,
                  h * kz_h + units * kz_u, cols, live, umask, BITS, G, D)
        if ROTATE:
            cos_a, sin_a = _block_angles(first, cols, inv, cos_j, sin_j)
            s = tl.sum(k * (q[None, :] * cos_a - sign[None, :] * qp[None, :] * sin_a), axis=1)
        else:
            s = tl.sum(k * q[None, :], axis=1)
        s = tl.where(live, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        v = _rows(vc_ptr, vs_ptr, vz_ptr, h * vc_h + units * vc_u, h * vs_h + units * vs_u,
                  h * vz_h + units * vz_u, cols, live, umask, BITS, G, D)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    for first in range(0, t_stop, BLOCK):  # the full-precision tail (keys already at their RoPE positions)
        units = first + tl.arange(0, BLOCK)
        live = units < t_stop
        umask = live[:, None] & cmask[None, :]
        k = tl.load(tk_ptr + h * tk_h + units[:, None] * tk_u + cols[None, :], mask=umask, other=0.0).to(tl.float32)
        s = tl.where(live, tl.sum(k * q[None, :], axis=1), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(tv_ptr + h * tv_h + units[:, None] * tv_u + cols[None, :], mask=umask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    empty = l_i == 0.0  # a tail program with no tail
    tl.store(out_ptr + (hq * programs + split) * D + cols, acc / tl.where(empty, 1.0, l_i), mask=cmask)
    tl.store(lse_ptr + hq * programs + split, tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i))))


@triton.jit(do_not_specialize=["n", "nt", "per_split"])
def qattn_group_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, tk_ptr, tv_ptr, inv_ptr, out_ptr, lse_ptr, lens_ptr,
    n, nt, per_split, scaling, q_h,
    kc_h, kc_u, vc_h, vc_u, ks_h, ks_u, kz_h, kz_u, vs_h, vs_u, vz_h, vz_u, tk_h, tk_u, tv_h, tv_u,
    Q_PER_KV: tl.constexpr, QP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BITS: tl.constexpr,
    G: tl.constexpr, ROTATE: tl.constexpr, BLOCK: tl.constexpr, LENS: tl.constexpr,
):
    """qattn_split_kernel with one program per (KV head, split) for all its Q_PER_KV query heads (QP: that
    number padded to a power of two): each unit is read, dequantized and rotated once, not once per query head.
    The same outputs, in the same places."""
    h = tl.program_id(0)
    heads = tl.arange(0, QP)
    hmask = heads < Q_PER_KV
    hq = h * Q_PER_KV + heads
    cols = tl.arange(0, D_PAD)
    cmask = cols < D
    qmask = hmask[:, None] & cmask[None, :]
    q = tl.load(q_ptr + hq[:, None] * q_h + cols[None, :], mask=qmask, other=0.0).to(tl.float32) * scaling
    if ROTATE:  # R(i)k = k·cos + sign·k[partner]·sin, rotated once for the group
        partner, sign, inv, cos_j, sin_j = _rope_offsets(inv_ptr, cols, cmask, D, BLOCK)

    split, programs, q_start, q_stop, t_stop = _ranges(lens_ptr, n, nt, per_split, LENS)
    m_i = tl.full([QP], float("-inf"), tl.float32)
    l_i = tl.zeros([QP], tl.float32)
    acc = tl.zeros([QP, D_PAD], tl.float32)
    for first in range(q_start, q_stop, BLOCK):
        units = first + tl.arange(0, BLOCK)
        live = units < q_stop
        umask = live[:, None] & cmask[None, :]
        k_rows, ks_rows, kz_rows = h * kc_h + units * kc_u, h * ks_h + units * ks_u, h * kz_h + units * kz_u
        k = _rows(kc_ptr, ks_ptr, kz_ptr, k_rows, ks_rows, kz_rows, cols, live, umask, BITS, G, D)
        if ROTATE:
            kp = _rows(kc_ptr, ks_ptr, kz_ptr, k_rows, ks_rows, kz_rows, partner, live, umask, BITS, G, D)
            cos_a, sin_a = _block_angles(first, cols, inv, cos_j, sin_j)
            k = k * cos_a + sign[None, :] * kp * sin_a
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [QP, BLOCK]
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        v = _rows(vc_ptr, vs_ptr, vz_ptr, h * vc_h + units * vc_u, h * vs_h + units * vs_u,
                  h * vz_h + units * vz_u, cols, live, umask, BITS, G, D)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    for first in range(0, t_stop, BLOCK):  # the full-precision tail (keys already at their RoPE positions)
        units = first + tl.arange(0, BLOCK)
        live = units < t_stop
        umask = live[:, None] & cmask[None, :]
        k = tl.load(tk_ptr + h * tk_h + units[:, None] * tk_u + cols[None, :], mask=umask, other=0.0).to(tl.float32)
        s = tl.where(live[None, :], tl.sum(q[:, None, :] * k[None, :, :], axis=2), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(tv_ptr + h * tv_h + units[:, None] * tv_u + cols[None, :], mask=umask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    empty = l_i == 0.0
    rows = hq * programs + split
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], acc / tl.where(empty, 1.0, l_i)[:, None], mask=qmask)
    tl.store(lse_ptr + rows, tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i))), mask=hmask)


@triton.jit(do_not_specialize=["parts"])
def merge_kernel(part_ptr, lse_ptr, out_ptr, parts, D: tl.constexpr, D_PAD: tl.constexpr, P_PAD: tl.constexpr,
                 PB: tl.constexpr):
    """One query head: the partials weighted by exp(lse - max), PB of them at a time (a [P_PAD, d] tile of 127
    splits would not fit a program's registers), over the sum of the weights."""
    hq = tl.program_id(0)
    idx = tl.arange(0, P_PAD)
    lse = tl.load(lse_ptr + hq * parts + idx, mask=idx < parts, other=float("-inf"))
    top = tl.max(lse, axis=0)
    total = tl.sum(tl.exp(lse - top), axis=0)
    cols = tl.arange(0, D_PAD)
    cmask = cols < D
    acc = tl.zeros([D_PAD], tl.float32)
    for first in range(0, parts, PB):
        j = first + tl.arange(0, PB)
        jmask = j < parts
        w = tl.exp(tl.load(lse_ptr + hq * parts + j, mask=jmask, other=float("-inf")) - top)
        part = tl.load(part_ptr + (hq * parts + j)[:, None] * D + cols[None, :], mask=jmask[:, None] & cmask[None, :],
                       other=0.0)
        acc += tl.sum(w[:, None] * part, axis=0)
    tl.store(out_ptr + hq * D + cols, (acc / total).to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _dot_block(q1, q2, k1, k2, v1, v2, live, m_i, l_i, acc1, acc2):
    """One block of units for qattn_dot_kernel: scores and the weighted values as tensor-core products (fp16
    operands, fp32 sums) over the two halves of the head, then the online softmax's update."""
    s = tl.dot(q1, tl.trans(k1.to(tl.float16))) + tl.dot(q2, tl.trans(k2.to(tl.float16)))  # [QM, BLOCK]
    s = tl.where(live[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    pf = p.to(tl.float16)
    acc1 = acc1 * alpha[:, None] + tl.dot(pf, v1.to(tl.float16))
    acc2 = acc2 * alpha[:, None] + tl.dot(pf, v2.to(tl.float16))
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc1, acc2


@triton.jit(do_not_specialize=["n", "nt", "per_split"])
def qattn_dot_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, tk_ptr, tv_ptr, inv_ptr, out_ptr, lse_ptr, lens_ptr,
    n, nt, per_split, scaling, q_h,
    kc_h, kc_u, vc_h, vc_u, ks_h, ks_u, kz_h, kz_u, vs_h, vs_u, vz_h, vz_u, tk_h, tk_u, tv_h, tv_u,
    Q_PER_KV: tl.constexpr, QM: tl.constexpr, D: tl.constexpr, HALF_PAD: tl.constexpr, BITS: tl.constexpr,
    G: tl.constexpr, ROTATE: tl.constexpr, BLOCK: tl.constexpr, LENS: tl.constexpr,
):
    """qattn_group_kernel with the products on tensor cores: the query heads of a KV head padded to QM (>= 16)
    rows, each head split in its two RoPE halves (columns lo and hi = lo + d/2, HALF_PAD wide), so the rotation
    is k1·cos - k2·sin, k2·cos + k1·sin with no second read of the key. The same outputs, in the same places."""
    h = tl.program_id(0)
    heads = tl.arange(0, QM)
    hmask = heads < Q_PER_KV
    hq = h * Q_PER_KV + heads
    HALF: tl.constexpr = D // 2
    lo = tl.arange(0, HALF_PAD)
    cmask = lo < HALF
    hi = lo + HALF
    qmask = hmask[:, None] & cmask[None, :]
    q_rows = q_ptr + hq[:, None] * q_h
    q1 = (tl.load(q_rows + lo[None, :], mask=qmask, other=0.0).to(tl.float32) * scaling).to(tl.float16)
    q2 = (tl.load(q_rows + hi[None, :], mask=qmask, other=0.0).to(tl.float32) * scaling).to(tl.float16)
    if ROTATE:  # cos/sin of the block's offsets j·inv, once per program (the addition rule per block)
        _, _, inv, cos_j, sin_j = _rope_offsets(inv_ptr, lo, cmask, D, BLOCK)

    split, programs, q_start, q_stop, t_stop = _ranges(lens_ptr, n, nt, per_split, LENS)
    m_i = tl.full([QM], float("-inf"), tl.float32)
    l_i = tl.zeros([QM], tl.float32)
    acc1 = tl.zeros([QM, HALF_PAD], tl.float32)
    acc2 = tl.zeros([QM, HALF_PAD], tl.float32)
    for first in range(q_start, q_stop, BLOCK):
        units = first + tl.arange(0, BLOCK)
        live = units < q_stop
        umask = live[:, None] & cmask[None, :]
        k_rows, ks_rows, kz_rows = h * kc_h + units * kc_u, h * ks_h + units * ks_u, h * kz_h + units * kz_u
        k1 = _rows(kc_ptr, ks_ptr, kz_ptr, k_rows, ks_rows, kz_rows, lo, live, umask, BITS, G, D)
        k2 = _rows(kc_ptr, ks_ptr, kz_ptr, k_rows, ks_rows, kz_rows, hi, live, umask, BITS, G, D)
        if ROTATE:
            cos_a, sin_a = _block_angles(first, lo, inv, cos_j, sin_j)
            k1, k2 = k1 * cos_a - k2 * sin_a, k2 * cos_a + k1 * sin_a
        v_rows, vs_rows, vz_rows = h * vc_h + units * vc_u, h * vs_h + units * vs_u, h * vz_h + units * vz_u
        v1 = _rows(vc_ptr, vs_ptr, vz_ptr, v_rows, vs_rows, vz_rows, lo, live, umask, BITS, G, D)
        v2 = _rows(vc_ptr, vs_ptr, vz_ptr, v_rows, vs_rows, vz_rows, hi, live, umask, BITS, G, D)
        m_i, l_i, acc1, acc2 = _dot_block(q1, q2, k1, k2, v1, v2, live, m_i, l_i, acc1, acc2)
    for first in range(0, t_stop, BLOCK):  # the full-precision tail (keys already at their RoPE positions)
        units = first + tl.arange(0, BLOCK)
        live = units < t_stop
        umask = live[:, None] & cmask[None, :]
        tk_rows = tk_ptr + h * tk_h + units[:, None] * tk_u
        tv_rows = tv_ptr + h * tv_h + units[:, None] * tv_u
        k1 = tl.load(tk_rows + lo[None, :], mask=umask, other=0.0)
        k2 = tl.load(tk_rows + hi[None, :], mask=umask, other=0.0)
        v1 = tl.load(tv_rows + lo[None, :], mask=umask, other=0.0)
        v2 = tl.load(tv_rows + hi[None, :], mask=umask, other=0.0)
        m_i, l_i, acc1, acc2 = _dot_block(q1, q2, k1, k2, v1, v2, live, m_i, l_i, acc1, acc2)
    empty = l_i == 0.0
    rows = hq * programs + split
    norm = tl.where(empty, 1.0, l_i)[:, None]
    tl.store(out_ptr + rows[:, None] * D + lo[None, :], acc1 / norm, mask=qmask)
    tl.store(out_ptr + rows[:, None] * D + hi[None, :], acc2 / norm, mask=qmask)
    tl.store(lse_ptr + rows, tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i))), mask=hmask)
