"""kernels/packed.py: weight-only int8 / int4 linear layers on torch's packed CPU kernels."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from localchat.kernels.packed import GROUP, VECTOR_ROWS, PackedLinear, layout_ok, unpack_int4


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture
def float_chunks():
    """A chunk's products with the dequantized weight (not int8 sums), whatever this CPU's default."""
    from localchat.kernels import packed

    packed.set_chunk_products("float")
    yield
    packed.set_chunk_products(None)


def test_the_int4_layout_read_back_is_torchs_own():
    """unpack_int4 reads torch's packed int4 codes back exactly (else int4 would dequantize wrong weights)."""
    assert layout_ok()
    codes = torch.randint(0, 16, (192, 96), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(unpack_int4(packed).to(torch.int32), codes)


@pytest.mark.parametrize("block", [64, 32])
def test_both_layouts_read_back(block):
    """torch packs int4 rows in blocks of 64 (AVX-512) or 32 (other CPUs): byte j of input k of a block holds row j
    low and row j + block/2 high. Built here by that rule, whichever this CPU uses."""
    rows, k = 2 * block, 8
    codes = torch.randint(0, 16, (rows, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    blocks = codes.reshape(rows // block, block, k).permute(0, 2, 1)  # [blocks, K, block]
    packed = (blocks[..., : block // 2] | (blocks[..., block // 2:] << 4)).reshape(rows, k // 2)
    assert torch.equal(unpack_int4(packed, block), codes)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("out_features,bias", [(192, False), (40, True)])  # 40 rows: int4 pads to a block of 64
def test_both_paths_compute_the_dequantized_weight(bits, out_features, bias, float_chunks):
    torch.manual_seed(0)
    linear = nn.Linear(96, out_features, bias=bias)
    packed = PackedLinear(linear, bits)
    assert packed.bits == bits
    weight = packed.dequantized().float()[:out_features]
    assert _rel(weight, linear.weight) < (0.01 if bits == 8 else 0.08)  # the quantization error itself
    for rows in (1, VECTOR_ROWS[bits] + 1):  # the packed kernel, then the dequantized bf16 matmul
        x = torch.randn(2, rows, 96)
        y = packed(x)
        assert y.shape == (2, rows, out_features) and y.dtype == torch.float32
        assert _rel(y, nn.functional.linear(x, weight, linear.bias)) < 0.01  # bf16 arithmetic only


def test_int4_reproduces_weights_already_on_a_4bit_grid():
    """A weight that is itself 4-bit in groups of 32 (a Q4_1 GGUF's: each group's minimum is code 0 and its maximum
    code 15) comes back to bf16 rounding, not to 4 bits."""
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (128, 64 // GROUP, GROUP), generator=g).float()
    codes[..., 0], codes[..., 1] = 0, 15
    scale, low = torch.rand(128, 64 // GROUP, 1, generator=g) * 0.01, torch.randn(128, 64 // GROUP, 1, generator=g) * 0.05
    linear = nn.Linear(64, 128, bias=False)
    linear.weight.data = (codes * scale + low).reshape(128, 64)
    assert _rel(PackedLinear(linear, 4).dequantized(), linear.weight) < 0.004


def test_int4_needs_whole_groups_else_int8():
    assert PackedLinear(nn.Linear(48, 64), 4).bits == 8  # 48 inputs: not whole groups of 32


@pytest.mark.parametrize("bits", [8, 4])
def test_a_chunk_is_multiplied_in_bf16_only_where_bf16_products_are_native(bits, monkeypatch, float_chunks):
    """More rows than VECTOR_ROWS: one product with the dequantized weight, in bf16 on AVX-512 and in the input's
    dtype elsewhere (torch emulates bf16 there, ~8x slower than fp32)."""
    from localchat.kernels import packed

    layer = PackedLinear(nn.Linear(64, 96, bias=True), bits)
    x = torch.randn(VECTOR_ROWS[bits] + 1, 64, generator=torch.Generator().manual_seed(3))
    w, b = layer.dequantized(), layer.bias
    for native in (True, False):
        monkeypatch.setattr(packed, "bf16_products_fast", lambda native=native: native)
        y = layer(x)
        if not native and bits == 4 and packed.row_kernels() is not None:
            # fp32 with the weight dequantized in fp32 by the C++ kernel (no bf16 rounding of the weight)
            torch.testing.assert_close(y, x @ exact_int4(layer).t()[:, :96] + b, rtol=1e-5, atol=1e-5)
            continue
        want = nn.functional.linear(x.bfloat16(), w).float() if native else nn.functional.linear(x, w.float())
        assert y.dtype == torch.float32 and torch.equal(y, want[:, :96] + b)


def exact_int4(layer: PackedLinear) -> torch.Tensor:
    """(code - 8) * scale + zero in fp32, `[rows, K]`."""
    codes = unpack_int4(layer.codes).float()
    rows, k = codes.shape
    scale, zero = layer.scales[..., 0].t().float(), layer.scales[..., 1].t().float()
    return ((codes.reshape(rows, k // GROUP, GROUP) - 8) * scale[..., None] + zero[..., None]).reshape(rows, k)


@pytest.mark.parametrize("out_features, inputs", [(1536, 576), (40, 64), (96, 1536)])
def test_the_cpp_dequantization_writes_the_transposed_fp32_weight(out_features, inputs):
    from localchat.kernels import cpu_decode

    native = cpu_decode.kernels()
    assert native is not None, cpu_decode.reason()
    torch.manual_seed(out_features)
    layer = PackedLinear(nn.Linear(inputs, out_features), 4)
    wt = torch.full((inputs, layer.codes.shape[0]), float("nan"))
    native.dequant_int4_t(layer.codes, layer.scales, GROUP, layer.block, wt)
    torch.testing.assert_close(wt.t(), exact_int4(layer), rtol=0, atol=1e-6)


def _native():
    from localchat.kernels import cpu_decode

    native = cpu_decode.kernels()
    assert native is not None, cpu_decode.reason()
    return native


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("out_features,bias", [(192, False), (40, True)])
def test_int8_chunk_products_are_integer_sums_of_the_rows_and_weight_as_int8(bits, out_features, bias):
    """A chunk's int8 products: each row as round(x * 127 / max|x|), each output row of the weight as
    round(w * 127 / max|w|) (int4: w its exact (code - 8) * scale + zero), exact integer sums, both scales."""
    from localchat.kernels import packed

    _native()
    torch.manual_seed(1)
    layer = PackedLinear(nn.Linear(96, out_features, bias=bias), bits)
    x = torch.randn(VECTOR_ROWS[bits] + 7, 96)
    x[3] = 0  # a zero row: scale 0, codes 0, output the bias
    packed.set_chunk_products("int8")
    try:
        y = layer(x)
    finally:
        packed.set_chunk_products(None)
    w = (exact_int4(layer) if bits == 4 else layer.codes.float() * layer.scales.float()[:, None])[:out_features]
    sw = w.abs().amax(dim=1) / 127
    wq = torch.round(w / sw[:, None]).clamp(-127, 127)
    sx = x.abs().amax(dim=1) / 127
    xq = torch.round(x / sx.clamp(min=1e-30)[:, None])
    want = (xq.double() @ wq.double().t()) * sx.double()[:, None] * sw.double()[None, :]
    want = want.float() + (layer.bias if bias else 0)
    assert y.shape == (x.shape[0], out_features) and y.dtype == torch.float32
    torch.testing.assert_close(y, want, rtol=2e-3, atol=2e-3 * want.abs().max().item())  # a code may round apart
    assert torch.equal(y[3], layer.bias if bias else torch.zeros(out_features))
    fp32 = nn.functional.linear(x, w, layer.bias)
    assert 1e-4 < _rel(y, fp32) < 0.02  # the rows' and weight's int8 rounding, and no more


def test_int4_to_int8_codes_round_the_exact_weight():
    native = _native()
    torch.manual_seed(2)
    layer = PackedLinear(nn.Linear(576, 1536), 4)
    w = exact_int4(layer)
    scale = w.abs().amax(dim=1) / 127
    out = torch.zeros(576, layer.codes.shape[0], dtype=torch.int8)
    native.int4_to_int8_t(layer.codes, layer.scales, 1 / scale, GROUP, layer.block, out)
    diff = (out.t().float() - torch.round(w / scale[:, None])).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3  # float rounding at a .5 tie at most
    assert out.abs().max() == 127


def test_chunk_products_default_follows_the_cpus_integer_multiply_adds(monkeypatch):
    from localchat.kernels import packed

    for vnni, kind in ((True, "int8"), (False, "float")):
        monkeypatch.setattr(packed, "_cpu_has_vnni", lambda vnni=vnni: vnni)
        assert packed.chunk_products() == kind
    packed.set_chunk_products("float")
    monkeypatch.setattr(packed, "_cpu_has_vnni", lambda: True)
    assert packed.chunk_products() == "float"
    packed.set_chunk_products(None)
    assert packed.chunk_products() == "int8"
    with pytest.raises(ValueError, match="int8, float"):
        packed.set_chunk_products("int4")
