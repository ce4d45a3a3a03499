// Integer products for a prefill chunk on the CPU (included by cpu_decode.cpp; kernels/packed.py calls them).
//
// A chunk of rows times a linear's weight, as llama.cpp multiplies: the rows quantized to int8 (one scale per
// row, symmetric), the weight as int8 (one scale per output row), and one int8 x int8 -> int32 product through
// torch's `_int_mm` (oneDNN; VNNI's 4-way integer multiply-adds). Then each sum times its row's and column's
// scales. An int4 weight becomes int8 for the chunk in `int4_to_int8_t`, into a buffer the caller reuses: the
// int4 copy stays the only one kept, and its values (code - 8) * scale + zero are rounded once more, to a step
// of the row's largest |w| / 127 (under a tenth of an int4 step).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace prefill {

inline float bf16_float(uint32_t bits16) {
  const uint32_t u = bits16 << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// torch's packed int4 weight (rows in blocks of `block`; byte j of input k of a block holds row j in its low
// nibble and row j + block/2 in its high one; scales [K / group, rows, 2] bf16 scale and zero) as int8 codes
// round(w * inv_scale[row]) in `out`, int8 [K, rows] (a chunk's x @ out).
inline void int4_to_int8_t(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& inv_scale,
                           int64_t group, int64_t block, at::Tensor out) {
  const int64_t rows = packed.size(0), K = packed.size(1) * 2, H = block / 2;
  TORCH_CHECK(group == 32 && (block == 32 || block == 64) && rows % block == 0 && packed.is_contiguous() &&
              scales.is_contiguous() && out.is_contiguous() && out.scalar_type() == at::kChar &&
              out.size(0) == K && out.size(1) == rows && inv_scale.scalar_type() == at::kFloat &&
              inv_scale.numel() == rows, "int4_to_int8_t: torch's packed int4 layout, out int8 [K, rows]");
  const uint8_t* P = packed.data_ptr<uint8_t>();
  const uint32_t* SZ = reinterpret_cast<const uint32_t*>(scales.data_ptr<at::BFloat16>());
  const float* INV = inv_scale.data_ptr<float>();
  int8_t* O = out.data_ptr<int8_t>();
  at::parallel_for(0, rows / block, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> scale(block), base(block);  // both times the row's inverse scale
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* blk = P + b * K * H;
      const float* inv = INV + b * block;
      for (int64_t k = 0; k < K; ++k) {
        if (k % group == 0) {
          for (int64_t r = 0; r < block; ++r) {
            const uint32_t pair = SZ[(k / group) * rows + b * block + r];
            const float sc = bf16_float(pair & 0xFFFFu), zero = bf16_float(pair >> 16);
            scale[r] = sc * inv[r];
            base[r] = (zero - 8.f * sc) * inv[r];
          }
        }
        const uint8_t* bytes = blk + k * H;
        int8_t* o = O + k * rows + b * block;
#pragma omp simd
        for (int64_t j = 0; j < H; ++j) {
          const float lo = std::nearbyint(static_cast<float>(bytes[j] & 15) * scale[j] + base[j]);
          const float hi = std::nearbyint(static_cast<float>(bytes[j] >> 4) * scale[j + H] + base[j + H]);
          o[j] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, lo)));
          o[j + H] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, hi)));
        }
      }
    }
  });
}

// Each row of `x` (float32 [M, K]) as int8 codes round(x * 127 / max |x|) and its scale max |x| / 127.
inline std::vector<at::Tensor> quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "quantize_rows: float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), ld = x.stride(0);
  auto q = torch::empty({M, K}, x.options().dtype(at::kChar));
  auto s = torch::empty({M}, x.options());
  const float* X = x.data_ptr<float>();
  int8_t* Q = q.data_ptr<int8_t>();
  float* S = s.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = X + m * ld;
      float amax = 0.f;
#pragma omp simd reduction(max : amax)
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      S[m] = amax / 127.f;
      int8_t* out = Q + m * K;
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) out[k] = static_cast<int8_t>(std::nearbyint(row[k] * inv));
    }
  });
  return {q, s};
}

// float32 [M, n] = acc[:, :n] * row_scale[:, None] * col_scale[None, :n] (+ bias), from `_int_mm`'s int32 sums.
inline at::Tensor scale_sums(const at::Tensor& acc, const at::Tensor& row_scale, const at::Tensor& col_scale,
                             const at::Tensor& bias, int64_t n) {
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == at::kInt && acc.is_contiguous() && n <= acc.size(1) &&
              row_scale.numel() == acc.size(0) && col_scale.numel() >= n && col_scale.scalar_type() == at::kFloat &&
              (bias.numel() == 0 || (bias.numel() == n && bias.scalar_type() == at::kFloat)),
              "scale_sums: int32 [M, N] sums, float32 scales");
  const int64_t M = acc.size(0), N = acc.size(1);
  auto y = torch::empty({M, n}, row_scale.options());
  const int32_t* A = acc.data_ptr<int32_t>();
  const float* R = row_scale.data_ptr<float>();
  const float* C = col_scale.data_ptr<float>();
  const float* B = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int32_t* a = A + m * N;
      float* out = Y + m * n;
      const float r = R[m];
      if (B) {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) out[j] = static_cast<float>(a[j]) * r * C[j] + B[j];
      } else {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) out[j] = static_cast<float>(a[j]) * r * C[j];
      }
    }
  });
  return y;
}

}  // namespace prefill
