"""The Triton kernels behind fused.py (imported only when Triton runs). Each rounds where the eager ops round
(to the output's dtype after each op), so a fused step gives what the eager step gives."""

import triton
import triton.language as tl


@triton.jit
def add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, n, eps, HAS_R: tl.constexpr, N_PAD: tl.constexpr):
    """One row: s = x + r (rounded to x's dtype, stored), out = w * (s / rms(s)) in out's dtype."""
    cols = tl.arange(0, N_PAD)
    m = cols < n
    x = tl.load(x_ptr + cols, mask=m, other=0.0)
    if HAS_R:
        x = (x.to(tl.float32) + tl.load(r_ptr + cols, mask=m, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + cols, x, mask=m)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, (w * y).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rotate(x_ptr, offs, partner_offs, mask, cos, sin, sign, dt):
    """x·cos + rotate_half(x)·sin of the values at x_ptr + offs (their partners at partner_offs), rounded to dt
    where transformers' ops round."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + partner_offs, mask=mask, other=0.0).to(tl.float32)
    a = (x * cos).to(dt).to(tl.float32)
    b = (sign * xp * sin).to(dt).to(tl.float32)
    return (a + b).to(dt)


@triton.jit
def silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """silu(g) * u, rounded after the silu as the eager pair of ops rounds."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    g = tl.load(g_ptr + idx, mask=m, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    u = tl.load(u_ptr + idx, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + idx, (a * u).to(dt), mask=m)


@triton.jit
def _gemv_add(acc, w_ptr, rows, rmask, k, kmask, n_in, x):
    """acc `[BLOCK_N]` + the rows' weights at columns k times x `[BLOCK_K]` (fp32 sums)."""
    w = tl.load(w_ptr + rows[:, None] * n_in + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
    return acc + tl.sum(w.to(tl.float32) * x[None, :], axis=1)


@triton.jit
def heads_score_kernel(x_ptr, w1_ptr, w2_ptr, part_ptr, n_in, d_r, H: tl.constexpr, H_PAD: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """LOCRET's retaining head for one row, BLOCK_R of its d_R hidden units per program: h = silu(fc1·x), rounded
    where the eager ops round (to the weights' dtype), then h's share of fc2·h into this program's row of the
    partial sums `[programs, H]` fp32 (rope_write_kernel adds them up)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = r < d_r
    dt = w1_ptr.dtype.element_ty
    hid = tl.zeros([BLOCK_R], tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < n_in
        x = tl.load(x_ptr + k, mask=km, other=0.0).to(dt).to(tl.float32)
        hid = _gemv_add(hid, w1_ptr, r, rm, k, km, n_in, x)
    hid = hid.to(dt).to(tl.float32)
    hid = (hid / (1.0 + tl.exp(-hid))).to(dt).to(tl.float32)
    heads = tl.arange(0, H_PAD)
    hm = heads < H
    w2 = tl.load(w2_ptr + heads[:, None] * d_r + r[None, :], mask=hm[:, None] & rm[None, :], other=0.0)
    part = tl.sum(w2.to(tl.float32) * hid[None, :], axis=1)
    tl.store(part_ptr + tl.program_id(0) * H + heads, part, mask=hm)


@triton.jit
def rope_write_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, kv_slot_ptr, slot_ptr, true_ptr, score_ptr,
                      kd_ptr, vd_ptr, sd_ptr, pd_ptr, rd_ptr, q_h, k_h, v_h, kd_h, kd_u, vd_h, vd_u, sd_h, pd_h,
                      rd_h, rd_u, parts, Q_PER_KV: tl.constexpr, QP_PAD: tl.constexpr, D: tl.constexpr,
                      D_PAD: tl.constexpr, HAS_SCORE: tl.constexpr, HAS_REST: tl.constexpr, H: tl.constexpr,
                      P_PAD: tl.constexpr, ROUND: tl.constexpr):
    """One KV head h: its query heads rotated into qo `[Hq, D]`; its key rotated and its value written at the
    K/V slot; its score (0 without one) and true position at the unit slot; its key remainder zeroed (keys come
    in exact). The score is the sum of `parts` rows of `[parts, H]` (one row: the retaining head's output; more:
    heads_score_kernel's partial sums), rounded to bf16 (ROUND 1) or fp16 (2) as the head's own output is."""
    h = tl.program_id(0)
    cols = tl.arange(0, D_PAD)
    m = cols < D
    half = D // 2
    partner = tl.where(cols < half, cols + half, cols - half)
    sign = tl.where(cols < half, -1.0, 1.0)
    cos = tl.load(cos_ptr + cols, mask=m, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + cols, mask=m, other=0.0).to(tl.float32)
    group = tl.arange(0, QP_PAD)
    rows = (h * Q_PER_KV + group)[:, None] * q_h
    qm = (group < Q_PER_KV)[:, None] & m[None, :]
    q = _rotate(q_ptr, rows + cols[None, :], rows + partner[None, :], qm, cos[None, :], sin[None, :],
                sign[None, :], qo_ptr.dtype.element_ty)
    tl.store(qo_ptr + (h * Q_PER_KV + group)[:, None] * D + cols[None, :], q, mask=qm)
    kv_slot = tl.load(kv_slot_ptr)
    slot = tl.load(slot_ptr)
    k = _rotate(k_ptr, h * k_h + cols, h * k_h + partner, m, cos, sin, sign, k_ptr.dtype.element_ty)
    tl.store(kd_ptr + h * kd_h + kv_slot * kd_u + cols, k, mask=m)
    tl.store(vd_ptr + h * vd_h + kv_slot * vd_u + cols, tl.load(v_ptr + h * v_h + cols, mask=m), mask=m)
    score = 0.0
    if HAS_SCORE:
        parts_at = tl.arange(0, P_PAD)
        score = tl.sum(tl.load(score_ptr + parts_at * H + h, mask=parts_at < parts, other=0.0).to(tl.float32), axis=0)
        if ROUND == 1:
            score = score.to(tl.bfloat16).to(tl.float32)
        if ROUND == 2:
            score = score.to(tl.float16).to(tl.float32)
    tl.store(sd_ptr + h * sd_h + slot, score)
    tl.store(pd_ptr + h * pd_h + slot, tl.load(true_ptr))
    if HAS_REST:
        tl.store(rd_ptr + h * rd_h + slot * rd_u + cols, tl.zeros([D_PAD], tl.int8), mask=m)


@triton.jit
def _gemv_store(acc, b_ptr, out_ptr, rows, rmask, HAS_B: tl.constexpr):
    if HAS_B:
        acc += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _summed(x_ptr, r_ptr, k, kmask, dt, HAS_R: tl.constexpr):
    """x (+ r, rounded to dt as torch's add rounds) at columns k."""
    s = tl.load(x_ptr + k, mask=kmask, other=0.0)
    if HAS_R:
        s = (s.to(tl.float32) + tl.load(r_ptr + k, mask=kmask, other=0.0).to(tl.float32)).to(dt)
    return s


@triton.jit
def norm_gemv_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, sum_ptr, n_in, n_out, eps, HAS_R: tl.constexpr,
                     HAS_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """add_rms_norm_kernel's row, then its product with BLOCK_N rows of w (+ b): each program reads the whole row
    twice (its sum of squares, then its normed values) and rounds where the eager ops round; program 0 stores the
    residual sum."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < n_out
    dt = x_ptr.dtype.element_ty
    squares = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < n_in
        s = _summed(x_ptr, r_ptr, k, kmask, dt, HAS_R)
        if HAS_R:
            if tl.program_id(0) == 0:
                tl.store(sum_ptr + k, s, mask=kmask)
        sf = s.to(tl.float32)
        squares += sf * sf
    rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / n_in + eps)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < n_in
        y = (_summed(x_ptr, r_ptr, k, kmask, dt, HAS_R).to(tl.float32) * rstd).to(dt).to(tl.float32)
        xn = (tl.load(nw_ptr + k, mask=kmask, other=0.0).to(tl.float32) * y).to(w_ptr.dtype.element_ty)
        acc = _gemv_add(acc, w_ptr, rows, rmask, k, kmask, n_in, xn.to(tl.float32))
    _gemv_store(acc, b_ptr, out_ptr, rows, rmask, HAS_B)


@triton.jit
def silu_gemv_kernel(g_ptr, u_ptr, w_ptr, b_ptr, out_ptr, n_in, n_out, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """silu_mul_kernel's values, then their product with BLOCK_N rows of w (+ b)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < n_out
    dt = g_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < n_in
        g = tl.load(g_ptr + k, mask=kmask, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        x = (a * tl.load(u_ptr + k, mask=kmask, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        acc = _gemv_add(acc, w_ptr, rows, rmask, k, kmask, n_in, x)
    _gemv_store(acc, b_ptr, out_ptr, rows, rmask, HAS_B)
