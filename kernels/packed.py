"""Weight-only int8 / int4 linear layers for the CPU, on torch's packed matmul kernels.

A decoded token multiplies one row by every weight, so reading the weights is the cost of a step; at 8 or 4
bits a step reads 4x or 8x fewer bytes than fp32. The weights are kept in the layouts of torch's CPU kernels:

  int8  aten._weight_int8pack_mm            codes [N, K] int8, one bf16 scale per output row (symmetric)
  int4  aten._weight_int4pack_mm_for_cpu    4-bit codes in torch's packed layout, and per group of GROUP inputs
                                            a bf16 scale and zero: w = (code - 8) * scale + zero

One fp32 row (a decoded token) goes through `packed_row` of the C++ decode kernels where they are built
(kernels/cpu_decode.cpp: own int4 code for AVX-512; on AVX2 without it, int4 and int8 products on the row
quantized to int8 per group of 32 inputs (`quantize_row`, as llama.cpp's Q8_0 activations: integer multiply-adds
in place of widening every code to fp32); torch's int8 kernel elsewhere), else through torch's kernels on a bf16
copy of the row. Those are matrix-vector kernels: their time grows with the rows, and at a prefill
chunk of 512 rows they are no faster than fp32. A step of more than VECTOR_ROWS[bits] rows, where the CPU has AVX512-VNNI's
integer multiply-adds, multiplies the rows as int8 by the weight as int8 (`chunk_products`, kernels/cpu_prefill.h:
one int8 x int8 -> int32 product through torch's `_int_mm`, 4.3x fp32's products here). Elsewhere it dequantizes the weight
to bf16 and runs one bf16 matmul instead (where bf16 products are native, AVX-512; elsewhere in the input's
dtype, as torch emulates bf16) (for 512 x 576 x 1536 on one core: fp32 10.2 ms, int8 5.1 ms, int4 7.3 ms, of
which dequantizing 0.3 / 1.4 ms); the thresholds are where the two ways cost the same on a 2-core EPYC with
AVX-512 (bench/results/cpu-decode/). Outputs are cast back to the input's dtype, so the rest of the model keeps
its own (fp32 on a CPU). engine/packed_store.py keeps a model's packed layers on disk between starts.

torch's int4 layout (torch 2.13): rows in blocks of 64 where its kernel uses AVX-512, of 32 on other CPUs; byte j
of input k of a block holds row j in its low nibble and row j + block/2 in its high one. `torch_block` reads the
block off torch's own packing once per process, `unpack_int4` reads codes back with it, and int4 becomes int8
if a torch release changed the layout.
"""

from __future__ import annotations

import functools
import threading

import torch
from torch import nn

GROUP = 32  # int4: inputs per scale and zero
BLOCK = 64  # int4: torch packs rows in blocks of 64
VECTOR_ROWS = {8: 24, 4: 96}  # steps of at most this many rows use the packed kernels; more, a bf16 matmul
_scratch = threading.local()  # the largest dequantized int4 weight of a prefill chunk, per thread


def quantize_row(x: torch.Tensor) -> torch.Tensor:
    """`x` `[..., K]` (K a multiple of 32) as packed_row's AVX2 code multiplies it: per group of 32 inputs,
    round(x * 127 / max |x|) times max |x| / 127, in float32 (the C++ code's twin, for tests)."""
    g = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(g * inv) * (amax / 127.0)).reshape(x.shape)


class PackedLinear(nn.Module):
    """A linear layer with int8 or int4 weights; `forward` keeps the input's dtype."""

    def __init__(self, linear: nn.Linear, bits: int, packed: tuple[torch.Tensor, torch.Tensor] | None = None):
        """`packed`: the codes and scales of an earlier packing of the same weight (engine/packed_store.py);
        None quantizes `linear`'s weight now."""
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        if bits == 4 and not fits_int4(self.in_features):
            bits = 8
        self.bits = bits
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        codes, scales = packed if packed is not None else self._quantize(linear.weight.detach().float())
        rows = -(-self.out_features // BLOCK) * BLOCK
        want = ({"codes": ((self.out_features, self.in_features), torch.int8), "scales": ((self.out_features,), torch.bfloat16)}
                if bits == 8 else {"codes": ((rows, self.in_features // 2), torch.uint8),
                                   "scales": ((self.in_features // GROUP, rows, 2), torch.bfloat16)})
        for name, t in (("codes", codes), ("scales", scales)):
            if (tuple(t.shape), t.dtype) != want[name]:
                raise ValueError(f"packed {name} {tuple(t.shape)} {t.dtype}: this layer needs {want[name]}")
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)  # int8: [rows]; int4: [K / GROUP, rows, 2] bf16

    def _quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.bits == 8:
            return quantize_int8(w)
        rows = -(-w.shape[0] // BLOCK) * BLOCK  # padded to whole blocks with zero rows
        w = torch.cat([w, w.new_zeros(rows - w.shape[0], w.shape[1])]) if rows > w.shape[0] else w
        codes, scale_zero = quantize_int4(w)
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), scale_zero

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        native = row_kernels() if x.dtype == torch.float32 else None
        if native is not None and x.numel() == self.in_features:  # one fp32 row: kernels/cpu_decode.cpp
            y = native.packed_row(x, self.codes, self.scales, self.bits, self.out_features, GROUP, self.block)
            if self.bias is not None:
                y = y + self.bias.float()
            return y.reshape(*shape[:-1], self.out_features)
        rows = x.numel() // self.in_features
        if rows > VECTOR_ROWS[self.bits] and native is not None and chunk_products() == "int8":
            return self._int8_product(x.reshape(-1, self.in_features), native).reshape(*shape[:-1], self.out_features)
        if rows <= VECTOR_ROWS[self.bits]:
            flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
            if self.bits == 8:
                y = torch.ops.aten._weight_int8pack_mm(flat, self.codes, self.scales)
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.codes, GROUP, self.scales)
        elif bf16_products_fast():
            y = nn.functional.linear(x.reshape(-1, self.in_features).to(torch.bfloat16), self.dequantized())
        elif self.bits == 4 and native is not None:
            # without AVX-512 bf16 products are emulated: fp32, the weight dequantized once into a reused buffer
            y = torch.mm(x.reshape(-1, self.in_features), self._dequantized_t(native))
        else:  # torch emulates bf16 products without AVX-512: the input's own dtype (fp32) is ~8x faster there
            y = nn.functional.linear(x.reshape(-1, self.in_features), self.dequantized().to(x.dtype))
        if y.shape[-1] != self.out_features:  # int4 rows padded to whole blocks
            y = y[:, : self.out_features]
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def _int8_product(self, x: torch.Tensor, native) -> torch.Tensor:
        """`x` fp32 `[M, K]` times the weight as int8 x int8 -> int32 sums (kernels/cpu_prefill.h), fp32 `[M, out]`."""
        q, row_scale = native.quantize_rows(x.contiguous())
        if self.bits == 8:
            weight, col_scale = self.codes.t(), self._col_scale(native)
        else:
            col_scale = self._col_scale(native)
            weight = _buffer("int8", self.in_features * self.codes.shape[0], torch.int8).view(self.in_features, -1)
            native.int4_to_int8_t(self.codes, self.scales, self._inv_col_scale, GROUP, self.block, weight)
        bias = self.bias.float() if self.bias is not None else _NO_BIAS
        # the int32 sums in this thread's reused buffer: a fresh one per layer, freed between the small tensors that
        # stay, left the heap in holes that RSS kept
        sums = _buffer("sums", q.shape[0] * weight.shape[1], torch.int32).view(q.shape[0], weight.shape[1])
        torch._int_mm(q, weight, out=sums)
        return native.scale_sums(sums, row_scale, col_scale, bias, self.out_features)

    def _col_scale(self, native) -> torch.Tensor:
        """Per output row, the step of its int8 codes (int8: the layer's own scales; int4: max |w| / 127)."""
        scale = getattr(self, "_int8_scale", None)
        if scale is None:
            if self.bits == 8:
                scale = self.scales.float()
            else:
                # in place in the scratch buffer: a freed weight-sized temporary between the layers' small kept
                # tensors left the heap in holes (about 2.4 MB of RSS per layer of SmolLM2)
                scale = self._dequantized_t(native).abs_().amax(dim=0).div_(127)
                self._inv_col_scale = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
            self._int8_scale = scale
        return scale

    def _dequantized_t(self, native) -> torch.Tensor:
        """The int4 weight as fp32 `[K, rows]` in this thread's scratch buffer (valid until the next call)."""
        rows = self.codes.shape[0]
        wt = _buffer("float", self.in_features * rows, torch.float32).view(self.in_features, rows)
        native.dequant_int4_t(self.codes, self.scales, GROUP, self.block, wt)
        return wt

    @property
    def block(self) -> int:
        """Rows per block of the int4 layout (0 for int8)."""
        return (torch_block() or BLOCK) if self.bits == 4 else 0

    def dequantized(self) -> torch.Tensor:
        """The weight as bf16 `[rows, K]` (int4: rows padded to whole blocks)."""
        if self.bits == 8:
            return self.codes.to(torch.bfloat16) * self.scales[:, None]
        codes = unpack_int4(self.codes).to(torch.bfloat16)  # [rows, K]
        rows, k = codes.shape
        scale, zero = self.scales[..., 0].t(), self.scales[..., 1].t()  # [rows, K / GROUP]
        grouped = codes.reshape(rows, k // GROUP, GROUP)
        return ((grouped - 8) * scale[..., None] + zero[..., None]).reshape(rows, k)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"


def _buffer(name: str, size: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's reused scratch buffer `name`, `size` elements of `dtype` (grown as needed)."""
    buffer = getattr(_scratch, name, None)
    if (buffer is None or buffer.numel() < size  # a buffer made under inference_mode cannot be written outside it
            or (buffer.is_inference() and not torch.is_inference_mode_enabled())):
        buffer = torch.empty(size, dtype=dtype)
        setattr(_scratch, name, buffer)
    return buffer[:size]


_NO_BIAS = torch.empty(0)
_CHUNK_PRODUCTS: list[str] = []  # a setting made by set_chunk_products, else the CPU's default


def chunk_products() -> str:
    """How a chunk of more than VECTOR_ROWS rows multiplies packed weights: "int8" (rows and weight as int8,
    integer sums: kernels/cpu_prefill.h) or "float" (the weight dequantized: bf16 on AVX-512, else fp32).
    The default is int8 where the CPU has AVX512-VNNI's integer multiply-adds (bench/results/cpu-prefill/)."""
    if _CHUNK_PRODUCTS:
        return _CHUNK_PRODUCTS[-1]
    return "int8" if _cpu_has_vnni() else "float"


def set_chunk_products(kind: str | None) -> None:
    """Choose chunk_products() ("int8" or "float"); None goes back to the CPU's default."""
    if kind not in (None, *CHUNK_PRODUCTS):
        raise ValueError(f"chunk products are one of {', '.join(CHUNK_PRODUCTS)} (got {kind!r})")
    _CHUNK_PRODUCTS[:] = [kind] if kind else []


CHUNK_PRODUCTS = ("int8", "float")


@functools.cache
def _cpu_has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_vnni" in flags  # measured there (bench/results/cpu-prefill/); AVX-VNNI on AVX2 CPUs is not


def row_kernels():
    """The C++ kernels (`packed_row`: one fp32 row times packed weights, own AVX2 / AVX-512 code where torch's
    kernels are slower), or None where they are not built (kernels/cpu_decode.py)."""
    from localchat.kernels import cpu_decode

    return cpu_decode.kernels()


@functools.cache
def bf16_products_fast() -> bool:
    """Whether a bf16 matrix product is native here (AVX-512), not emulated (bench/results/cpu-defaults-avx2/)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def fits_int4(in_features: int) -> bool:
    return in_features % GROUP == 0 and layout_ok()


def quantize_int8(w: torch.Tensor, rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per output row: codes [N, K] int8 and bf16 scales [N] (computed from the rounded scale), `rows` at
    a time: the fp32 temporaries of an output layer (49,152 x 576 for SmolLM2) stay a few MB."""
    codes = torch.empty(w.shape, dtype=torch.int8)
    scales = torch.empty(w.shape[0], dtype=torch.bfloat16)
    for a in range(0, w.shape[0], rows):
        part = w[a:a + rows].float()
        scale = (part.abs().amax(dim=1) / 127).clamp(min=1e-12).to(torch.bfloat16)
        codes[a:a + rows] = torch.round(part / scale.float()[:, None]).clamp(-127, 127)
        scales[a:a + rows] = scale
    return codes, scales


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric per group of GROUP inputs: codes [N, K] int32 in 0..15, and [K / GROUP, N, 2] bf16 scale and
    zero in the kernel's form (w = (code - 8) * scale + zero). The codes are computed from the rounded values."""
    n, k = w.shape
    g = w.reshape(n, k // GROUP, GROUP)
    low, high = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=1e-12).to(torch.bfloat16)
    zero = (low + 8 * scale.float()).to(torch.bfloat16)
    base = zero.float() - 8 * scale.float()  # the value of code 0
    codes = torch.round((g - base[..., None]) / scale.float()[..., None]).clamp(0, 15).to(torch.int32)
    return codes.reshape(n, k), torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()


def unpack_int4(packed: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """torch's packed int4 `[rows, K / 2]` uint8 back to codes `[rows, K]` uint8 (`block`: rows per block, by
    default this CPU's, `torch_block()`)."""
    block = block or torch_block() or BLOCK
    rows, half = packed.shape
    blocks = packed.reshape(rows // block, 2 * half, block // 2)
    both = torch.cat([blocks & 15, blocks >> 4], dim=-1)  # [blocks, K, block]
    return both.permute(0, 2, 1).reshape(rows, 2 * half)


@functools.cache
def torch_block() -> int | None:
    """Rows per block of torch's packed int4 on this CPU, read off torch's own packing: 64 where its kernel uses
    AVX-512, 32 on other CPUs (AVX2); None when neither reads it back (or torch has no CPU int4 kernels)."""
    try:
        codes = torch.randint(0, 16, (2 * BLOCK, 2 * GROUP), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    except (RuntimeError, AttributeError):
        return None
    if packed.shape != (2 * BLOCK, GROUP):
        return None
    return next((b for b in (64, 32) if torch.equal(unpack_int4(packed, b).to(torch.int32), codes)), None)


def layout_ok() -> bool:
    """Whether this torch packs int4 in a layout `unpack_int4` reads (and has the CPU kernels at all)."""
    return torch_block() is not None
