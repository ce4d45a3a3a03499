"""kernels/cpu_decode.cpp: the CPU decode step's C++ kernels against torch's own ops.

They are built here (g++ and ninja, as torch.compile's CPU backend needs); a machine without a compiler gets
torch's ops, which tests/engine/test_decode_step.py runs too."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from localchat.kernels import cpu_decode
from localchat.kernels.fused import rotate as _rotate


@pytest.fixture(scope="module")
def native():
    mod = cpu_decode.kernels()
    assert mod is not None, f"the C++ kernels did not build: {cpu_decode.reason()}"
    return mod


@pytest.mark.parametrize("n", [1, 63, 64, 65, 200, 1500])
def test_attention_matches_sdpa_on_views_of_a_bigger_cache(native, n):
    g = torch.Generator().manual_seed(n)
    keys = torch.randn(1, 3, 1600, 64, generator=g) * 3
    values = torch.randn(1, 3, 1600, 64, generator=g)
    q = (torch.randn(1, 12, 1, 64, generator=g) * 3)[:, :9].reshape(1, 3, 3, 64)  # a slice, as the step has it
    want = F.scaled_dot_product_attention(q, keys[:, :, :n], values[:, :, :n], scale=0.125)
    got = cpu_decode.attention(q, keys[:, :, :n], values[:, :, :n], 0.125)
    k, v = keys[:, :, :n].double(), values[:, :, :n].double()
    exact = torch.softmax(q.double() @ k.transpose(-1, -2) * 0.125, dim=-1) @ v
    # fp32 rounding only, against fp64. torch's SDPA is itself up to 5.3e-6 off on an AVX-512 CPU (2.5e-6 for ours
    # there), so the two fp32 results are compared with room for both.
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=4e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group, d", [(1, 64), (2, 128), (4, 64), (5, 80), (7, 128), (8, 96), (9, 64), (3, 24)])
def test_attention_matches_fp64_for_every_group_size_and_head_dim(native, group, d):
    """The AVX2 loops are specialised by queries per KV head (1-8) and head dim (a multiple of 16 or 32); the
    rest (9 queries, d = 24) take the generic ones. An odd number of units checks the pairwise scoring's tail."""
    g = torch.Generator().manual_seed(group * d)
    n = 333
    keys, values = torch.randn(1, 2, n, d, generator=g) * 2, torch.randn(1, 2, n, d, generator=g)
    q = torch.randn(1, 2, group, d, generator=g) * 2
    got = cpu_decode.attention(q, keys, values, d ** -0.5)
    exact = torch.softmax(q.double() @ keys.double().transpose(-1, -2) * d ** -0.5, dim=-1) @ values.double()
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=4e-6)


def test_attention_declines_what_it_does_not_serve(native):
    q, k = torch.randn(1, 2, 2, 8), torch.randn(1, 2, 5, 8)
    assert cpu_decode.attention(q.bfloat16(), k.bfloat16(), k.bfloat16(), 1.0) is None
    assert cpu_decode.attention(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), k, 1.0) is None  # d not unit stride


def test_rms_norm_matches_torch(native):
    x, w = torch.randn(2, 3, 576) * 4, torch.randn(576)
    torch.testing.assert_close(native.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5), rtol=1e-5, atol=1e-6)


def test_attend_token_rotates_writes_the_slot_and_attends_over_it(native):
    g = torch.Generator().manual_seed(7)
    hq, hkv, d, slot = 4, 2, 16, 9
    qkv = torch.randn(1, (hq + 2 * hkv) * d, generator=g)
    angles = torch.rand(d // 2, generator=g) * 3
    cos, sin = torch.cat([angles, angles]).cos(), torch.cat([angles, angles]).sin()
    k_cache, v_cache = torch.randn(1, hkv, 32, d, generator=g), torch.randn(1, hkv, 32, d, generator=g)
    before = k_cache.clone()
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = _rotate(q.view(hq, d), cos, sin), _rotate(k.view(hkv, d), cos, sin)
    out = native.attend_token(qkv, cos, sin, k_cache, v_cache, slot, 0.25, hq, hkv)
    torch.testing.assert_close(k_cache[0, :, slot], k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v_cache[0, :, slot], v.view(hkv, d))
    assert torch.equal(k_cache[:, :, :slot], before[:, :, :slot]) and torch.equal(k_cache[:, :, slot + 1:], before[:, :, slot + 1:])
    want = F.scaled_dot_product_attention(q.view(1, hkv, hq // hkv, d), k_cache[:, :, : slot + 1], v_cache[:, :, : slot + 1],
                                          scale=0.25)
    torch.testing.assert_close(out, want.reshape(1, -1), rtol=1e-5, atol=1e-6)


def test_a_build_that_cannot_happen_leaves_torchs_ops_and_says_why(monkeypatch):
    monkeypatch.setattr(cpu_decode, "kernels", cpu_decode.kernels.__wrapped__)  # uncached: build (or load) again
    monkeypatch.setenv("LOCALCHAT_CPU_KERNELS", "0")
    assert cpu_decode.kernels() is None and cpu_decode.reason() == "LOCALCHAT_CPU_KERNELS=0"
    monkeypatch.delenv("LOCALCHAT_CPU_KERNELS")
    monkeypatch.setattr(cpu_decode, "build_dir", lambda: __import__("pathlib").Path("/proc/no-such-dir"))
    assert cpu_decode.kernels() is None and cpu_decode.reason()


def test_loading_a_model_says_it_builds_and_then_that_torchs_ops_stand_in(monkeypatch):
    said = []
    monkeypatch.setattr(cpu_decode, "kernels", cpu_decode.kernels.__wrapped__)
    monkeypatch.setattr(cpu_decode, "build_dir", lambda: __import__("pathlib").Path("/proc/no-such-dir"))
    cpu_decode.prepare(said.append)
    assert len(said) == 2 and said[0].startswith("localchat: building the CPU decode kernels")
    assert said[1].startswith("localchat: CPU decode kernels unavailable (") and "torch's ops" in said[1]


@pytest.mark.parametrize("rows,inputs", [(960, 576), (40, 64), (576, 1536)])  # 40 rows: padded to a block of 64
def test_the_int4_row_product_reads_torchs_packed_layout(native, rows, inputs):
    """kernels/cpu_decode.cpp `int4_row` (AVX-512) against the dequantized weight: the same product as torch's own
    packed kernel, without its bf16 rounding of the input and output."""
    from torch import nn

    from localchat.kernels.packed import GROUP, PackedLinear

    if "avx512f" not in cpu_decode._cpu_flags().split():  # the kernel exists only where it can run
        pytest.skip("this CPU has no AVX-512: int4 goes through packed_row's AVX2 code (tested below)")
    assert hasattr(native, "int4_row"), "an AVX-512 CPU, but the build has no int4_row"
    torch.manual_seed(rows)
    packed = PackedLinear(nn.Linear(inputs, rows, bias=False), 4)
    x = torch.randn(1, inputs)
    want = F.linear(x, packed.dequantized().float()[:rows])
    got = native.int4_row(x, packed.codes, packed.scales, GROUP, rows)
    assert got.shape == (1, rows)
    assert ((got - want).norm() / want.norm()).item() < 4e-3  # the dequantized reference is itself bf16
    theirs = torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed.codes, GROUP, packed.scales).float()
    assert ((got - theirs[:, :rows]).norm() / want.norm()).item() < 8e-3


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows,inputs", [(960, 576), (40, 64), (576, 1536), (192, 576), (36, 96), (38, 64)])
def test_packed_row_is_the_product_with_the_dequantized_weight(native, bits, rows, inputs):
    """`packed_row` on every CPU, and PackedLinear's one-row forward through it, against the exact fp32 weight.
    On AVX2 without AVX-512 the row is quantized to int8 per 32 inputs first: the product is exact for that row
    (`quantize_row`, its twin), within 1 % of the fp32 row's; elsewhere (own AVX-512 int4 code, torch's int8
    kernel) within the bf16 rounding of the row."""
    from torch import nn

    from localchat.kernels.packed import GROUP, PackedLinear, quantize_row

    torch.manual_seed(rows + bits)
    packed = PackedLinear(nn.Linear(inputs, rows), bits)
    if bits == 4:
        wt = torch.empty(inputs, packed.codes.shape[0])
        native.dequant_int4_t(packed.codes, packed.scales, GROUP, packed.block, wt)
        weight = wt.T[:rows]
    else:
        weight = packed.codes.float() * packed.scales.float()[:, None]
    x = torch.randn(1, inputs)
    want = F.linear(x, weight)
    got = native.packed_row(x, packed.codes, packed.scales, bits, rows, GROUP, packed.block)
    assert got.shape == (1, rows) and got.dtype == torch.float32
    flags = cpu_decode._cpu_flags().split()
    q8 = "avx2" in flags and "avx512f" not in flags and (packed.block == 32 if bits == 4 else rows % 4 == 0)
    if q8:
        exact = F.linear(quantize_row(x), weight)
        assert ((got - exact).norm() / exact.norm()).item() < 2e-6
        assert ((got - want).norm() / want.norm()).item() < 1e-2
    else:
        assert ((got - want).norm() / want.norm()).item() < 4e-3
    layer = packed(x[None])  # [1, 1, K]: one row, through packed_row, plus the bias
    assert layer.shape == (1, 1, rows)
    torch.testing.assert_close(layer[0], got + packed.bias, rtol=0, atol=0)
    several = packed(torch.cat([x, x]))  # two rows: torch's kernel (bf16 input)
    assert ((several[0] - layer[0, 0]).norm() / want.norm()).item() < 8e-3


def _inputs():
    from torch import nn

    from localchat.kernels.packed import PackedLinear

    torch.manual_seed(0)
    linears = [PackedLinear(nn.Linear(576, 960, bias=False), bits) for bits in (4, 8)]
    return torch.randn(1, 576), linears, (torch.randn(3, 3, 64), torch.randn(3, 1500, 64), torch.randn(3, 1500, 64))


def _products(native, inputs):
    """An int4 and an int8 row product and an attention: the loops the decode step runs on the pool."""
    from localchat.kernels.packed import GROUP

    x, linears, qkv = inputs
    return [native.packed_row(x, p.codes, p.scales, p.bits, 960, GROUP, p.block) for p in linears] + \
        [native.decode_attention(*qkv, 0.125)]


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("n", [2, 3])
def test_the_pool_gives_openmps_results_bit_for_bit(native, n, threads):
    """kernels/cpu_pool.h's pool (set_pool: spinning, then sleeping workers) splits a loop as at::parallel_for
    does: the same numbers, at any thread count (a new count makes a new pool)."""
    torch.set_num_threads(n)
    try:
        inputs = _inputs()
        native.set_pool(0)
        theirs = _products(native, inputs)
        native.set_pool(200)
        for _ in range(3):
            for a, b in zip(_products(native, inputs), theirs):
                assert torch.equal(a, b)
    finally:
        native.set_pool(200)


def test_the_pool_serves_two_callers_and_a_forked_child(native, threads):
    """Two Python threads at once (the second takes OpenMP while the pool is busy), and a child forked after the
    pool started (its workers are not there: the child makes its own), all give the same numbers."""
    import multiprocessing
    import threading

    torch.set_num_threads(2)
    inputs = _inputs()
    want = _products(native, inputs)
    wrong = []

    def caller():
        for _ in range(20):
            if not all(torch.equal(a, b) for a, b in zip(_products(native, inputs), want)):
                wrong.append(1)

    both = [threading.Thread(target=caller) for _ in range(2)]
    for t in both:
        t.start()
    for t in both:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in both) and not wrong
    child = multiprocessing.get_context("fork").Process(target=_child_check, args=(inputs, want))
    child.start()
    child.join(timeout=120)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0


def _child_check(inputs, want) -> None:
    """The int4 product and the attention, which run on the pool with AVX2 or AVX-512. Not the int8 product: with
    AVX-512 it is torch's own op, an OpenMP region, and GNU OpenMP cannot run one in a child forked after the parent
    ran one (it waits for the parent's threads; the app starts its children with spawn)."""
    from localchat.kernels.packed import GROUP

    x, linears, qkv = inputs
    int4 = next(p for p in linears if p.bits == 4)
    native = cpu_decode.kernels()
    got = [native.packed_row(x, int4.codes, int4.scales, 4, 960, GROUP, int4.block),
           native.decode_attention(*qkv, 0.125)]
    raise SystemExit(0 if torch.equal(got[0], want[0]) and torch.equal(got[1], want[-1]) else 1)
