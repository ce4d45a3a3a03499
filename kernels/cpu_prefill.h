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

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace prefill {

// A chunk's attention over a layer's kept units and its own tokens: softmax(q k^T * scale + mask) v, with q, k and
// v rounded to bf16 and every product summed in fp32 by AVX512-BF16's dot products (`vdpbf16ps`: twice fp32's
// multiply-adds per instruction), as bf16 models attend on GPUs. Blocks of 64 keys, the softmax online per row
// (running maximum and sum), in fp32. The query heads of one KV head are folded into one block of rows, so each
// key and value is packed once per KV head: keys as [key block][d pair][16 keys][2], values as
// [key pair][d / 16][16][2], the layouts `vdpbf16ps` multiplies.
constexpr int64_t KEYS = 64;  // keys per block
constexpr int64_t ROWS = 32;  // query rows per task

inline __m512 exp_ps(__m512 x) {  // e^x for x <= 0, relative error ~1e-7 (2^f by a degree-6 polynomial)
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718f));  // e^f, |f| <= ln2 / 2
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline uint16_t bf16_bits(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Keys [S, D] (row stride ks) as [S / 16 blocks][D / 2 pairs][16 keys][2] bf16 pairs (uint32), zero past S.
inline void pack_keys(const float* k, int64_t ks, int64_t S, int64_t D, uint32_t* out) {
  const int64_t blocks = (S + 15) / 16, pairs = D / 2;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t j = 0; j < 16; ++j) {
      const int64_t s = b * 16 + j;
      uint32_t* o = out + b * pairs * 16 + j;
      if (s >= S) {
        for (int64_t p = 0; p < pairs; ++p) o[p * 16] = 0;
        continue;
      }
      const float* row = k + s * ks;
      for (int64_t p = 0; p < pairs; ++p)
        o[p * 16] = bf16_bits(row[2 * p]) | (static_cast<uint32_t>(bf16_bits(row[2 * p + 1])) << 16);
    }
}

// Values [S, D] (row stride vs) as [S / 2 pairs][D / 16][16][2]: for each pair of keys, each d their two values.
inline void pack_values(const float* v, int64_t vs, int64_t S, int64_t Spad, int64_t D, uint16_t* out) {
  const __m512i idx_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                          39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i idx_hi = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(16));
  for (int64_t s = 0; s < Spad; s += 2)
    for (int64_t d = 0; d < D; d += 32) {
      __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
      if (s < S)
        a = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(v + s * vs + d + 16), _mm512_loadu_ps(v + s * vs + d));
      if (s + 1 < S)
        b = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(v + (s + 1) * vs + d + 16),
                                         _mm512_loadu_ps(v + (s + 1) * vs + d));
      uint16_t* o = out + (s / 2) * D * 2 + d * 2;  // [d / 16][16][2] of this pair: d * 2 values before d
      _mm512_storeu_si512(o, _mm512_permutex2var_epi16(a, idx_lo, b));
      _mm512_storeu_si512(o + 32, _mm512_permutex2var_epi16(a, idx_hi, b));
    }
}

// q [1, H, L, D], k and v [1, Hkv, S, D] fp32 (unit stride in D), mask [.., L, S] bool (true: attend) or empty
// (causal, the queries being the last L keys) -> [1, L, H, D] fp32.
inline at::Tensor chunk_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& mask, double scale) {
  const int64_t H = q.size(1), L = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && k.size(0) == 1 && v.size(0) == 1 && H % Hkv == 0 &&
              D % 64 == 0 && k.size(3) == D && v.size(3) == D && v.size(2) == S && q.scalar_type() == at::kFloat &&
              k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && q.stride(3) == 1 &&
              k.stride(3) == 1 && v.stride(3) == 1, "chunk_attention: fp32 q [1, H, L, D], k, v [1, Hkv, S, D]");
  const bool masked = mask.numel() > 0;
  TORCH_CHECK(!masked || (mask.scalar_type() == at::kBool && mask.size(-2) == L && mask.size(-1) == S &&
                          mask.stride(-1) == 1 && mask.numel() == L * S),
              "chunk_attention: one bool mask [L, S] for every head");
  const int64_t G = H / Hkv, Spad = (S + KEYS - 1) / KEYS * KEYS, pairs = D / 2, rows_all = G * L;
  const int64_t mstride = masked ? mask.stride(-2) : 0;
  std::vector<uint32_t> kp(Hkv * Spad * pairs);
  std::vector<uint16_t> vp(Hkv * Spad * D);
  at::parallel_for(0, Hkv, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      pack_keys(k.data_ptr<float>() + h * k.stride(1), k.stride(2), S, D, kp.data() + h * Spad * pairs);
      pack_values(v.data_ptr<float>() + h * v.stride(1), v.stride(2), S, Spad, D, vp.data() + h * Spad * D);
    }
  });
  auto out = torch::empty({1, L, H, D}, q.options());
  const float* Q = q.data_ptr<float>();
  const bool* M = masked ? mask.data_ptr<bool>() : nullptr;
  float* O = out.data_ptr<float>();
  const int64_t tasks_per_head = (rows_all + ROWS - 1) / ROWS;
  at::parallel_for(0, Hkv * tasks_per_head, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint32_t> qb(ROWS * pairs);                // the rows' queries as bf16 pairs
    std::vector<float> s(ROWS * KEYS), acc(ROWS * D), mx(ROWS), sum(ROWS);
    std::vector<uint32_t> pb(ROWS * KEYS / 2);             // probabilities as bf16 pairs of keys
    std::vector<__mmask64> sees(ROWS);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t h = t / tasks_per_head, r0 = (t % tasks_per_head) * ROWS, nr = std::min(ROWS, rows_all - r0);
      const uint32_t* K = kp.data() + h * Spad * pairs;
      const uint16_t* V = vp.data() + h * Spad * D;
      int64_t last = 0;  // keys past the last row's last visible one are skipped
      for (int64_t r = 0; r < ROWS; ++r) {
        const int64_t row = r0 + std::min(r, nr - 1), g = row / L, l = row % L;
        const float* qr = Q + (h * G + g) * q.stride(1) + l * q.stride(2);
        for (int64_t p = 0; p < pairs; ++p)
          qb[r * pairs + p] = bf16_bits(qr[2 * p]) | (static_cast<uint32_t>(bf16_bits(qr[2 * p + 1])) << 16);
        last = std::max(last, masked ? S : S - L + l + 1);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(mx.begin(), mx.end(), -1e30f);
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t k0 = 0; k0 < last; k0 += KEYS) {
        // the keys each row sees, one bit each: below S, and the mask's (or causal: up to its own position)
        __mmask64 any = 0;
        for (int64_t r = 0; r < ROWS; ++r) {
          const int64_t l = (r0 + std::min(r, nr - 1)) % L;
          const int64_t end = std::min(S, masked ? S : S - L + l + 1) - k0;
          __mmask64 see = end >= KEYS ? ~__mmask64(0) : end <= 0 ? 0 : (__mmask64(1) << end) - 1;
          if (masked) {
            const bool* mrow = M + l * mstride + k0;
            see &= end >= KEYS ? _mm512_test_epi8_mask(_mm512_loadu_si512(mrow), _mm512_set1_epi8(1))
                               : _mm512_test_epi8_mask(_mm512_maskz_loadu_epi8(see, mrow), _mm512_set1_epi8(1));
          }
          sees[r] = see;
          any |= see;
        }
        if (!any) continue;  // a block no row sees (a sliding window's start, the chunk's causal end)
        // scores: 4 rows x 64 keys at a time, summed over the d pairs
        for (int64_t r = 0; r < ROWS; r += 4) {
          __m512 c[4][4];
          for (auto& x : c) for (auto& y : x) y = _mm512_setzero_ps();
          const uint32_t* kb = K + (k0 / 16) * pairs * 16;
          for (int64_t p = 0; p < pairs; ++p) {
            __m512bh kv[4];
            for (int j = 0; j < 4; ++j) kv[j] = (__m512bh)_mm512_loadu_si512(kb + (j * pairs + p) * 16);
            for (int i = 0; i < 4; ++i) {
              const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(qb[(r + i) * pairs + p]));
              for (int j = 0; j < 4; ++j) c[i][j] = _mm512_dpbf16_ps(c[i][j], qv, kv[j]);
            }
          }
          for (int i = 0; i < 4; ++i)
            for (int j = 0; j < 4; ++j) _mm512_storeu_ps(s.data() + (r + i) * KEYS + j * 16, c[i][j]);
        }
        // online softmax per row
        for (int64_t r = 0; r < ROWS; ++r) {
          float* sr = s.data() + r * KEYS;
          const __mmask64 see = sees[r];
          __m512 m4 = _mm512_set1_ps(mx[r]);
          for (int64_t j = 0; j < KEYS; j += 16) {
            const __m512 v = _mm512_mask_mul_ps(_mm512_set1_ps(-1e30f), static_cast<__mmask16>(see >> j),
                                                _mm512_loadu_ps(sr + j), _mm512_set1_ps(static_cast<float>(scale)));
            _mm512_storeu_ps(sr + j, v);
            m4 = _mm512_max_ps(m4, v);
          }
          const float m_new = _mm512_reduce_max_ps(m4);
          const float fix = std::exp(mx[r] - m_new);
          mx[r] = m_new;
          __m512 tot = _mm512_setzero_ps();
          for (int64_t j = 0; j < KEYS; j += 32) {
            const __m512 e0 = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + j), _mm512_set1_ps(m_new)));
            const __m512 e1 = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + j + 16), _mm512_set1_ps(m_new)));
            tot = _mm512_add_ps(tot, _mm512_add_ps(e0, e1));
            // keys j..j+31 as 16 pairs; cvtne2ps puts its second argument in the low half
            _mm512_storeu_si512(pb.data() + r * (KEYS / 2) + j / 2, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
          }
          sum[r] = sum[r] * fix + _mm512_reduce_add_ps(tot);
          if (fix != 1.f) {
            const __m512 f = _mm512_set1_ps(fix);
            for (int64_t d = 0; d < D; d += 16)
              _mm512_storeu_ps(acc.data() + r * D + d, _mm512_mul_ps(f, _mm512_loadu_ps(acc.data() + r * D + d)));
          }
        }
        // acc += p v: 4 rows x 64 d at a time, summed over the block's key pairs
        for (int64_t d0 = 0; d0 < D; d0 += 64)
          for (int64_t r = 0; r < ROWS; r += 4) {
            __m512 c[4][4];
            for (int i = 0; i < 4; ++i)
              for (int j = 0; j < 4; ++j) c[i][j] = _mm512_loadu_ps(acc.data() + (r + i) * D + d0 + j * 16);
            for (int64_t kp2 = 0; kp2 < KEYS / 2; ++kp2) {
              const uint16_t* vb = V + ((k0 / 2 + kp2) * D + d0) * 2;
              __m512bh vv[4];
              for (int j = 0; j < 4; ++j) vv[j] = (__m512bh)_mm512_loadu_si512(vb + j * 32);
              for (int i = 0; i < 4; ++i) {
                const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pb[(r + i) * (KEYS / 2) + kp2]));
                for (int j = 0; j < 4; ++j) c[i][j] = _mm512_dpbf16_ps(c[i][j], pv, vv[j]);
              }
            }
            for (int i = 0; i < 4; ++i)
              for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc.data() + (r + i) * D + d0 + j * 16, c[i][j]);
          }
      }
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t row = r0 + r, g = row / L, l = row % L;
        float* o = O + (l * H + h * G + g) * D;
        const __m512 inv = _mm512_set1_ps(1.f / sum[r]);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(inv, _mm512_loadu_ps(acc.data() + r * D + d)));
      }
    }
  });
  return out;
}

}  // namespace prefill
#endif
