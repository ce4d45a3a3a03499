"""The Triton kernel behind evict.gather_rotate (imported only when Triton runs; see evict.py)."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["keep"])
def gather_rotate_kernel(
    k_ptr, v_ptr, idx_ptr, inv_ptr, ok_ptr, ov_ptr, keep,
    k_h, k_u, v_h, v_u, idx_h, ok_h, ok_u, ov_h, ov_u,
    D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, ROTATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    h = tl.program_id(0)
    slots = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = slots < keep
    src = tl.load(idx_ptr + h * idx_h + slots, mask=live, other=0)
    cols = tl.arange(0, D_PAD)
    m = live[:, None] & (cols < D)[None, :]
    row = k_ptr + h * k_h + src[:, None] * k_u
    key = tl.load(row + cols[None, :], mask=m, other=0.0)
    if ROTATE:  # from slot src to slot `slots`: rotate-half RoPE by (slot - src) positions
        HALF: tl.constexpr = D // 2
        partner = tl.where(cols < HALF, cols + HALF, cols - HALF)
        partner = tl.where(cols < D, partner, 0)
        other = tl.load(row + partner[None, :], mask=m, other=0.0).to(tl.float32)
        sign = tl.where(cols < HALF, -1.0, 1.0)
        inv = tl.load(inv_ptr + (cols % HALF), mask=cols < D, other=0.0)
        angle = (slots - src).to(tl.float32)[:, None] * inv[None, :]
        key = (key.to(tl.float32) * tl.cos(angle) + sign[None, :] * other * tl.sin(angle)).to(key.dtype)
    tl.store(ok_ptr + h * ok_h + slots[:, None] * ok_u + cols[None, :], key, mask=m)
    vcols = tl.arange(0, DV_PAD)
    vm = live[:, None] & (vcols < DV)[None, :]
    value = tl.load(v_ptr + h * v_h + src[:, None] * v_u + vcols[None, :], mask=vm, other=0.0)
    tl.store(ov_ptr + h * ov_h + slots[:, None] * ov_u + vcols[None, :], value, mask=vm)
