"""The Triton kernel behind evict.gather_rotate and evict.gather_rotate_rest (imported only when Triton runs)."""

import triton
import triton.language as tl


@triton.jit
def _step(w, small, unit):
    """One remainder step of each half-precision value `w` (fp32), as keyrest.step."""
    bits = w.to(tl.float32).to(tl.int32, bitcast=True) & 0x7F800000
    return tl.maximum(bits.to(tl.float32, bitcast=True), small) * unit


@triton.jit(do_not_specialize=["keep"])
def gather_rotate_kernel(
    k_ptr, v_ptr, r_ptr, idx_ptr, inv_ptr, ok_ptr, ov_ptr, or_ptr, keep,
    k_h, k_u, v_h, v_u, r_h, r_u, idx_h, ok_h, ok_u, ov_h, ov_u, or_h, or_u, small, unit,
    D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, ROTATE: tl.constexpr,
    REST: tl.constexpr, BF16: tl.constexpr, LIMIT: tl.constexpr, BLOCK: tl.constexpr,
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
        other = tl.load(row + partner[None, :], mask=m, other=0.0)
        x = key.to(tl.float32)
        y = other.to(tl.float32)
        if REST:  # the exact values: key + remainder * step (kernels/keyrest.py)
            rrow = r_ptr + h * r_h + src[:, None] * r_u
            x += tl.load(rrow + cols[None, :], mask=m, other=0).to(tl.float32) * _step(key, small, unit)
            y += tl.load(rrow + partner[None, :], mask=m, other=0).to(tl.float32) * _step(other, small, unit)
        sign = tl.where(cols < HALF, -1.0, 1.0)
        inv = tl.load(inv_ptr + (cols % HALF), mask=cols < D, other=0.0)
        angle = (slots - src).to(tl.float32)[:, None] * inv[None, :]
        exact = x * tl.cos(angle) + sign[None, :] * y * tl.sin(angle)
        if REST and BF16:  # round to nearest even on the bits (the interpreter's bf16 cast truncates)
            bits = exact.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            key = bits.to(tl.float32, bitcast=True).to(key.dtype)  # exact: the low half is zero
        else:
            key = exact.to(key.dtype)
        if REST:  # what rounding to the key's dtype dropped, in steps
            rest = tl.floor((exact - key.to(tl.float32)) / _step(key, small, unit) + 0.5)
            rest = tl.minimum(tl.maximum(rest, -LIMIT), LIMIT)
            tl.store(or_ptr + h * or_h + slots[:, None] * or_u + cols[None, :], rest.to(tl.int8), mask=m)
    tl.store(ok_ptr + h * ok_h + slots[:, None] * ok_u + cols[None, :], key, mask=m)
    vcols = tl.arange(0, DV_PAD)
    vm = live[:, None] & (vcols < DV)[None, :]
    value = tl.load(v_ptr + h * v_h + src[:, None] * v_u + vcols[None, :], mask=vm, other=0.0)
    tl.store(ov_ptr + h * ov_h + slots[:, None] * ov_u + vcols[None, :], value, mask=vm)
