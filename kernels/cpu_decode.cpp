// Decode-step kernels for the CPU (kernels/cpu_decode.py builds this file once per machine).
//
// decode_attention: one decoded token's queries against the kept units of one layer. torch's CPU SDPA runs
// this shape (3 KV heads x 3 queries x ~1,100 units for SmolLM2) at a third of memory speed: it splits the work
// by head only, and multiplies 3-row blocks. Here each KV head's units are split into ranges, every range
// scores its units for the head's queries, softmaxes them locally and sums its values; the ranges merge by
// their maxima and sums (the same result, in another summation order).
//
// rms_norm: x * rsqrt(mean(x^2) + eps) * w over the last dim, fp32, in one pass per row (torch's eager CPU
// op is seven).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_pool.h"  // parallel(): the decode loops' thread pool
#include "cpu_prefill.h"  // prefill::: a chunk's int8 products

namespace {

constexpr int64_t kMinUnits = 64;  // units per range at least: smaller ranges cost more to merge than they save
constexpr int64_t AHEAD_UNITS = 32;  // keys and values prefetched this many units ahead of their use

struct Partial {  // one range's softmax state for every query of its head
  std::vector<float> max, sum, out;  // [G], [G], [G * D]
};

void attend_range(const float* q, const float* k, const float* v, int64_t k_stride, int64_t v_stride,
                  int64_t lo, int64_t hi, int64_t G, int64_t D, float scale, Partial& p, std::vector<float>& s) {
  const int64_t len = hi - lo;
  s.resize(G * len);
  for (int64_t j = 0; j < len; ++j) {
    const float* kj = k + (lo + j) * k_stride;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t e = 0; e < D; ++e) acc += qg[e] * kj[e];
      s[g * len + j] = acc * scale;
    }
  }
  p.max.assign(G, -INFINITY);
  p.sum.assign(G, 0.f);
  p.out.assign(G * D, 0.f);
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s.data() + g * len;
    float m = -INFINITY;
    for (int64_t j = 0; j < len; ++j) m = std::max(m, sg[j]);
    float total = 0.f;
    for (int64_t j = 0; j < len; ++j) {
      sg[j] = std::exp(sg[j] - m);
      total += sg[j];
    }
    p.max[g] = m;
    p.sum[g] = total;
  }
  for (int64_t j = 0; j < len; ++j) {
    const float* vj = v + (lo + j) * v_stride;
    for (int64_t g = 0; g < G; ++g) {
      const float w = s[g * len + j];
      float* og = p.out.data() + g * D;
#pragma omp simd
      for (int64_t e = 0; e < D; ++e) og[e] += w * vj[e];
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// e^x for 8 floats: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-7 series (Cephes' expf coefficients),
// 2^n in the exponent bits. Within 2 ulp of std::exp over the softmax's range (x <= 0); below -87.3, 2^-126.
__m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts: r exact
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// attend_range with AVX2 for G <= 8 queries and D a multiple of 8 * W: each unit's key is read once for every
// query (G accumulators), the exponentials 8 at a time, and the values in slices of W vectors, G x W
// accumulators held in registers across the range (G and W are constants, so they stay in registers). The
// generic loops above take 2-3x as long.
template <int G, int W>
void attend_range_avx2(const float* q, const float* k, const float* v, int64_t k_stride, int64_t v_stride,
                       int64_t lo, int64_t hi, int64_t D, float scale, Partial& p, std::vector<float>& s) {
  const int64_t len = hi - lo, padded = (len + 7) / 8 * 8;
  s.assign(G * padded, -INFINITY);
  for (int64_t j = 0; j < len; j += 2) {  // two units at a time: twice the independent multiply-add chains
    const int64_t j2 = std::min(j + 1, len - 1);
    const float* kj = k + (lo + j) * k_stride;
    const float* kj2 = k + (lo + j2) * k_stride;
    if (j + AHEAD_UNITS + 2 <= len)  // the keys AHEAD_UNITS units ahead, their lines
      for (int64_t u = AHEAD_UNITS; u < AHEAD_UNITS + 2; ++u)
        for (int64_t e = 0; e < D; e += 16) _mm_prefetch(reinterpret_cast<const char*>(kj + u * k_stride + e), _MM_HINT_T0);
    __m256 acc[G], acc2[G];
    for (int g = 0; g < G; ++g) acc[g] = acc2[g] = _mm256_setzero_ps();
    for (int64_t e = 0; e < D; e += 8) {
      const __m256 kv = _mm256_loadu_ps(kj + e), kv2 = _mm256_loadu_ps(kj2 + e);
      for (int g = 0; g < G; ++g) {
        const __m256 qg = _mm256_loadu_ps(q + g * D + e);
        acc[g] = _mm256_fmadd_ps(qg, kv, acc[g]);
        acc2[g] = _mm256_fmadd_ps(qg, kv2, acc2[g]);
      }
    }
    for (int g = 0; g < G; ++g) {
      s[g * padded + j] = hsum(acc[g]) * scale;
      s[g * padded + j2] = hsum(acc2[g]) * scale;  // j2 == j on an odd last unit: the same value again
    }
  }
  p.max.assign(G, -INFINITY);
  p.sum.assign(G, 0.f);
  p.out.assign(G * D, 0.f);
  for (int g = 0; g < G; ++g) {
    float* sg = s.data() + g * padded;
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < padded; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(sg + j));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    const float m = *std::max_element(lanes, lanes + 8);
    const __m256 mv = _mm256_set1_ps(m);
    for (int64_t j = 0; j < padded; j += 8) _mm256_storeu_ps(sg + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), mv)));
    float total = 0.f;
    for (int64_t j = 0; j < len; ++j) total += sg[j];
    p.max[g] = m;
    p.sum[g] = total;
  }
  for (int64_t h0 = 0; h0 < D; h0 += 8 * W) {
    __m256 o[G][W];
    for (int g = 0; g < G; ++g)
      for (int w = 0; w < W; ++w) o[g][w] = _mm256_setzero_ps();
    for (int64_t j = 0; j < len; ++j) {
      const float* vj = v + (lo + j) * v_stride + h0;
      if (j + AHEAD_UNITS < len)
        for (int w = 0; w < W; w += 2) _mm_prefetch(reinterpret_cast<const char*>(vj + AHEAD_UNITS * v_stride + 8 * w), _MM_HINT_T0);
      __m256 vv[W];
      for (int w = 0; w < W; ++w) vv[w] = _mm256_loadu_ps(vj + 8 * w);
      for (int g = 0; g < G; ++g) {
        const __m256 wg = _mm256_set1_ps(s[g * padded + j]);
        for (int w = 0; w < W; ++w) o[g][w] = _mm256_fmadd_ps(wg, vv[w], o[g][w]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int w = 0; w < W; ++w) _mm256_storeu_ps(p.out.data() + g * D + h0 + 8 * w, o[g][w]);
  }
}
#endif

// One range of units for a head's G queries: the AVX2 loops where they apply, else the generic ones.
void attend(const float* q, const float* k, const float* v, int64_t k_stride, int64_t v_stride, int64_t lo,
            int64_t hi, int64_t G, int64_t D, float scale, Partial& p, std::vector<float>& s) {
#if defined(__AVX2__) && defined(__FMA__)
  const bool wide = D % 32 == 0, narrow = D % 16 == 0, single = D % 8 == 0;  // D fits slices of W = 4, 2, 1
#define LOCALCHAT_ATTEND(g, w) return attend_range_avx2<g, w>(q, k, v, k_stride, v_stride, lo, hi, D, scale, p, s)
  switch (G) {
    case 1: if (wide) LOCALCHAT_ATTEND(1, 4); break;
    case 2: if (wide) LOCALCHAT_ATTEND(2, 4); break;
    case 3: if (wide) LOCALCHAT_ATTEND(3, 4); break;
    case 4: if (narrow) LOCALCHAT_ATTEND(4, 2); break;
    case 5: if (narrow) LOCALCHAT_ATTEND(5, 2); break;
    case 6: if (narrow) LOCALCHAT_ATTEND(6, 2); break;
    case 7: if (narrow) LOCALCHAT_ATTEND(7, 2); break;
    case 8: if (single) LOCALCHAT_ATTEND(8, 1); break;
  }
#undef LOCALCHAT_ATTEND
#endif
  attend_range(q, k, v, k_stride, v_stride, lo, hi, G, D, scale, p, s);
}

}  // namespace

// q [H, G, D] (the G query heads of each of H KV heads); k, v [H, N, D] with unit stride in D (views of a
// bigger cache are fine); all float32 on the CPU. Returns [H, G, D].
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "decode_attention: q, k, v must be 3-d");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "decode_attention: float32 only");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "decode_attention: k and v need unit stride in the last dim");
  q = q.contiguous();
  const int64_t H = q.size(0), G = q.size(1), D = q.size(2), N = k.size(1);
  TORCH_CHECK(k.size(0) == H && v.size(0) == H && k.size(2) == D && v.size(1) == N, "decode_attention: shapes");
  TORCH_CHECK(N > 0, "decode_attention: no units");
  const int64_t threads = at::get_num_threads();
  const int64_t ranges = std::max<int64_t>(1, std::min<int64_t>((2 * threads + H - 1) / H, N / kMinUnits));
  std::vector<Partial> parts(H * ranges);
  const float* Q = q.data_ptr<float>();
  const float* K = k.data_ptr<float>();
  const float* V = v.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  parallel(0, H * ranges, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t / ranges, r = t % ranges;
      attend(Q + h * G * D, K + h * k.stride(0), V + h * v.stride(0), k.stride(1), v.stride(1),
                   N * r / ranges, N * (r + 1) / ranges, G, D, sc, parts[t], s);
    }
  });
  auto out = torch::empty({H, G, D}, q.options());
  float* O = out.data_ptr<float>();
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t g = 0; g < G; ++g) {
      float m = -INFINITY;
      for (int64_t r = 0; r < ranges; ++r) m = std::max(m, parts[h * ranges + r].max[g]);
      float total = 0.f;
      float* og = O + (h * G + g) * D;
      std::fill(og, og + D, 0.f);
      for (int64_t r = 0; r < ranges; ++r) {
        const Partial& p = parts[h * ranges + r];
        const float w = std::exp(p.max[g] - m);
        total += w * p.sum[g];
        const float* po = p.out.data() + g * D;
        for (int64_t e = 0; e < D; ++e) og[e] += w * po[e];
      }
      for (int64_t e = 0; e < D; ++e) og[e] /= total;
    }
  }
  return out;
}

// One layer's attention step for a decoded token, from its projections on: rotate q and k (RoPE, rotate-half
// layout: cos/sin [D] for the token's position), write k and v into the cache buffers at `slot`, and attend
// over units 0..slot. qkv [1, (Hq + 2 Hkv) D]; k_cache, v_cache [1, Hkv, capacity, D] (capacity > slot).
// Returns [1, Hq * D] in the query heads' order.
torch::Tensor attend_token(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                           torch::Tensor v_cache, int64_t slot, double scale, int64_t heads_q, int64_t heads_kv) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat, "attend_token: float32 only");
  const int64_t D = k_cache.size(3), half = D / 2, G = heads_q / heads_kv;
  TORCH_CHECK(qkv.numel() == (heads_q + 2 * heads_kv) * D && k_cache.size(1) == heads_kv, "attend_token: shapes");
  TORCH_CHECK(slot >= 0 && slot < k_cache.size(2) && slot < v_cache.size(2), "attend_token: slot outside the cache");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "attend_token: cache needs unit stride");
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  const float* X = qkv.data_ptr<float>();
  const float* C = cos.data_ptr<float>();
  const float* S = sin.data_ptr<float>();
  auto rotate = [&](const float* x, float* y) {
    for (int64_t e = 0; e < half; ++e) {
      y[e] = x[e] * C[e] - x[e + half] * S[e];
      y[e + half] = x[e + half] * C[e + half] + x[e] * S[e + half];
    }
  };
  auto q = torch::empty({heads_kv, G, D}, qkv.options());
  float* Q = q.data_ptr<float>();
  for (int64_t h = 0; h < heads_q; ++h) rotate(X + h * D, Q + h * D);
  float* K = k_cache.data_ptr<float>();
  float* V = v_cache.data_ptr<float>();
  for (int64_t h = 0; h < heads_kv; ++h) {
    rotate(X + (heads_q + h) * D, K + h * k_cache.stride(1) + slot * k_cache.stride(2));
    const float* v = X + (heads_q + heads_kv + h) * D;
    std::copy(v, v + D, V + h * v_cache.stride(1) + slot * v_cache.stride(2));
  }
  auto keys = k_cache[0].narrow(1, 0, slot + 1);
  auto values = v_cache[0].narrow(1, 0, slot + 1);
  return decode_attention(q, keys, values, scale).reshape({1, heads_q * D});
}

// x [..., D] and w [D] float32; returns x * rsqrt(mean(x^2, -1) + eps) * w.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "rms_norm: float32 only");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t D = x.size(-1), rows = x.numel() / D;
  TORCH_CHECK(w.numel() == D, "rms_norm: weight size");
  auto out = torch::empty_like(x);
  const float* X = x.data_ptr<float>();
  const float* W = w.data_ptr<float>();
  float* O = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = X + r * D;
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t e = 0; e < D; ++e) squares += xr[e] * xr[e];
    const float inv = 1.f / std::sqrt(squares / static_cast<float>(D) + static_cast<float>(eps));
    float* orow = O + r * D;
#pragma omp simd
    for (int64_t e = 0; e < D; ++e) orow[e] = xr[e] * inv * W[e];
  }
  return out;
}

#if defined(__AVX512F__)
// One row times torch's packed int4 weight (kernels/packed.py: rows in blocks of 64, per block [K, 32] bytes where
// byte j of input k holds row j in its low nibble and row j + 32 in its high one; per group of 32 inputs and per
// row a bf16 (scale, zero): w = (code - 8) * scale + zero). torch's own kernel reads this at 9-10 GB/s on the
// project's EPYC for one row; this one keeps 64 rows in four AVX-512 accumulators per group. x: float32 [K].
at::Tensor int4_row(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t group,
                    int64_t out) {
  const int64_t rows = packed.size(0), K = packed.size(1) * 2, groups = K / group;
  TORCH_CHECK(rows % 64 == 0 && group == 32 && K % group == 0 && packed.is_contiguous() && scales.is_contiguous(),
              "int4_row: torch's packed int4 layout in groups of 32");
  const float* X = x.data_ptr<float>();
  const uint8_t* P = packed.data_ptr<uint8_t>();
  const uint32_t* SZ = reinterpret_cast<const uint32_t*>(scales.data_ptr<at::BFloat16>());  // (scale, zero) pairs
  std::vector<float> sums(groups);
  for (int64_t g = 0; g < groups; ++g) {
    float t = 0.f;
    for (int64_t k = 0; k < group; ++k) t += X[g * group + k];
    sums[g] = t;
  }
  auto y = torch::empty({1, rows}, x.options());
  float* Y = y.data_ptr<float>();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m512i high16 = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  parallel(0, rows / 64, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* B = P + b * K * 32;
      __m512 res[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t g = 0; g < groups; ++g) {
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t k = g * group; k < (g + 1) * group; ++k) {
          const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B + k * 32));
          const __m256i lo = _mm256_and_si256(bytes, low4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
          const __m512 xk = _mm512_set1_ps(X[k]);
          acc[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo))), xk, acc[0]);
          acc[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo, 1))), xk, acc[1]);
          acc[2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi))), xk, acc[2]);
          acc[3] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi, 1))), xk, acc[3]);
        }
        const __m512 xs = _mm512_set1_ps(sums[g]);
        const __m512 xs8 = _mm512_set1_ps(8.f * sums[g]);
        for (int q = 0; q < 4; ++q) {  // rows 16q .. 16q + 15 of the block
          const __m512i pair = _mm512_loadu_si512(SZ + g * rows + b * 64 + 16 * q);
          const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
          const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(pair, high16));
          res[q] = _mm512_fmadd_ps(scale, _mm512_sub_ps(acc[q], xs8), _mm512_fmadd_ps(zero, xs, res[q]));
        }
      }
      for (int q = 0; q < 4; ++q) _mm512_storeu_ps(Y + b * 64 + 16 * q, res[q]);
    }
  });
  return out < rows ? y.narrow(-1, 0, out) : y;
}
#endif

namespace {


// x [K] (K a multiple of 32) as int8 per group of 32: q = round(x * 127 / max |x|), scale max |x| / 127 (0 for a
// group of zeros). Writes the codes as int16 pairs (q[2i] low byte, q[2i+1] high: one input pair per maddubs
// lane), the scales, and per group scale * sum(q) (the quantized row's sum, for the zero points).
void quantize_row(const float* x, int64_t K, int16_t* pairs, float* scales, float* sums) {
  for (int64_t g = 0; g < K / 32; ++g) {
    float amax = 0.f;
    for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(x[g * 32 + k]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t total = 0;
    int8_t q[32];
    for (int k = 0; k < 32; ++k) {
      q[k] = static_cast<int8_t>(std::nearbyint(x[g * 32 + k] * inv));
      total += q[k];
    }
    for (int k = 0; k < 32; k += 2)
      pairs[g * 16 + k / 2] = static_cast<int16_t>(static_cast<uint8_t>(q[k]) | (static_cast<uint16_t>(static_cast<uint8_t>(q[k + 1])) << 8));
    scales[g] = amax / 127.f;
    sums[g] = scales[g] * static_cast<float>(total);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// One row times torch's packed int4 weight with AVX2, for CPUs without AVX-512 (torch's own kernel is 20-40 %
// slower there: bench/results/cpu-defaults-avx2/packed_row.txt). The layout as int4_row's, in blocks of B rows (torch packs 32 here, 64 where it uses
// AVX-512): per input, B/2 bytes, byte j holding row j (low nibble) and row j + B/2 (high). B/8 accumulators of
// 8 rows each per group of 32 inputs, then scale and zero as in int4_row. x: float32 [K]; y: float32 [rows].
template <int B>
void int4_rows_avx2(const float* X, const uint8_t* P, const uint32_t* SZ, int64_t rows, int64_t K,
                    const std::vector<float>& sums, float* Y) {
  constexpr int H = B / 2, A = B / 8;
  const int64_t groups = K / 32;
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256i high16 = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  auto widen = [](__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); };  // 8 low bytes -> floats
  parallel(0, rows / B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* blk = P + b * K * H;
      __m256 res[A];
      for (int a = 0; a < A; ++a) res[a] = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        __m256 acc[A];
        for (int a = 0; a < A; ++a) acc[a] = _mm256_setzero_ps();
        for (int64_t k = g * 32; k < (g + 1) * 32; ++k) {
          const __m256 xk = _mm256_set1_ps(X[k]);
          for (int h = 0; h < H; h += 16) {
            const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + k * H + h));
            const __m128i lo = _mm_and_si128(bytes, low4);
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
            acc[h / 8] = _mm256_fmadd_ps(widen(lo), xk, acc[h / 8]);
            acc[h / 8 + 1] = _mm256_fmadd_ps(widen(_mm_srli_si128(lo, 8)), xk, acc[h / 8 + 1]);
            acc[(H + h) / 8] = _mm256_fmadd_ps(widen(hi), xk, acc[(H + h) / 8]);
            acc[(H + h) / 8 + 1] = _mm256_fmadd_ps(widen(_mm_srli_si128(hi, 8)), xk, acc[(H + h) / 8 + 1]);
          }
        }
        const __m256 xs = _mm256_set1_ps(sums[g]);
        const __m256 xs8 = _mm256_set1_ps(8.f * sums[g]);
        for (int a = 0; a < A; ++a) {  // rows 8a .. 8a + 7 of the block
          const __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(SZ + g * rows + b * B + 8 * a));
          const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
          const __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(pair, high16));
          res[a] = _mm256_fmadd_ps(scale, _mm256_sub_ps(acc[a], xs8), _mm256_fmadd_ps(zero, xs, res[a]));
        }
      }
      for (int a = 0; a < A; ++a) _mm256_storeu_ps(Y + b * B + 8 * a, res[a]);
    }
  });
}


// The same product with the row quantized to int8 per group of 32 inputs (scale = max |x| / 127, as llama.cpp's
// Q8_0 activations), torch's block of 32 rows: the codes of inputs k and k + 1 are interleaved per row and
// multiplied with the row's two int8 values in one `maddubs` (16 rows x 2 inputs per instruction, exact integer
// sums), where the float path widens every code to fp32 first. y = W x^ exactly, x^ the quantized row
// (kernels/packed.py `quantize_row` is its twin).
// Several weights may share one row and one parallel region (q, k, v; gate, up): their blocks are one range.
struct Int4Part {
  const uint8_t* P;
  const uint32_t* SZ;
  int64_t rows;
  float* Y;
};

void int4_rows_q8_avx2(const int16_t* XP, const float* XS, const float* XSUM, const std::vector<Int4Part>& parts,
                       int64_t K) {
  constexpr int B = 32, H = 16;
  const int64_t groups = K / 32;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i high16 = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  // per 128-bit lane [8 codes of input k, 8 of input k + 1] -> [row r: k, k + 1] for the lane's 8 rows
  const __m256i pairs = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                         0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  std::vector<int64_t> first(parts.size() + 1, 0);  // the first block of each part in the shared range
  for (size_t i = 0; i < parts.size(); ++i) first[i + 1] = first[i] + parts[i].rows / B;
  parallel(0, first.back(), 1, [&](int64_t t0, int64_t t1) {
    size_t i = 0;
    for (int64_t t = t0; t < t1; ++t) {
      while (t >= first[i + 1]) ++i;
      const int64_t b = t - first[i], rows = parts[i].rows;
      const uint32_t* SZ = parts[i].SZ;
      float* Y = parts[i].Y;
      const uint8_t* blk = parts[i].P + b * K * H;
      __m256 res[4];
      for (int a = 0; a < 4; ++a) res[a] = _mm256_setzero_ps();
      const bool fetch = (b + 1) * B < rows;  // the next block's codes and scales, a group's lines at a time
      for (int64_t g = 0; g < groups; ++g) {
        if (fetch) {
          const char* next = reinterpret_cast<const char*>(blk + K * H + g * 32 * H);
          for (int line = 0; line < 32 * H; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(SZ + g * rows + (b + 1) * B), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(SZ + g * rows + (b + 1) * B + 16), _MM_HINT_T0);
        }
        __m256i wide[4];  // int32 sums of rows 8a .. 8a + 7
        for (int a = 0; a < 4; ++a) wide[a] = _mm256_setzero_si256();
        for (int half = 0; half < 2; ++half) {  // 8 input pairs at a time: 16-bit sums stay below 8 x 3,810
          __m256i lo_acc = _mm256_setzero_si256(), hi_acc = _mm256_setzero_si256();
          for (int p = 0; p < 8; ++p) {
            const int64_t k = g * 32 + half * 16 + 2 * p;
            const __m256i x = _mm256_set1_epi16(XP[k / 2]);
            // inputs k (low lane) and k + 1 (high lane), 16 bytes each: byte j = row j | row j + 16 << 4
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + k * H));
            const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            // qwords [k: rows 0-7, k+1: rows 0-7 | k: rows 8-15, k+1: rows 8-15], then bytes paired per row
            const __m256i lo_rows = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(lo, 0xD8), pairs);
            const __m256i hi_rows = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(hi, 0xD8), pairs);
            lo_acc = _mm256_add_epi16(lo_acc, _mm256_maddubs_epi16(lo_rows, x));  // rows 0-15
            hi_acc = _mm256_add_epi16(hi_acc, _mm256_maddubs_epi16(hi_rows, x));  // rows 16-31
          }
          wide[0] = _mm256_add_epi32(wide[0], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(lo_acc)));
          wide[1] = _mm256_add_epi32(wide[1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(lo_acc, 1)));
          wide[2] = _mm256_add_epi32(wide[2], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(hi_acc)));
          wide[3] = _mm256_add_epi32(wide[3], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(hi_acc, 1)));
        }
        const __m256 xs = _mm256_set1_ps(XS[g]);
        const __m256 sum = _mm256_set1_ps(XSUM[g]);
        const __m256 sum8 = _mm256_set1_ps(8.f * XSUM[g]);
        for (int a = 0; a < 4; ++a) {
          const __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(SZ + g * rows + b * B + 8 * a));
          const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
          const __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(pair, high16));
          const __m256 dot = _mm256_mul_ps(_mm256_cvtepi32_ps(wide[a]), xs);
          res[a] = _mm256_fmadd_ps(scale, _mm256_sub_ps(dot, sum8), _mm256_fmadd_ps(zero, sum, res[a]));
        }
      }
      for (int a = 0; a < 4; ++a) _mm256_storeu_ps(Y + b * B + 8 * a, res[a]);
    }
  });
}

// int8 weights [rows, K] (one scale per row) times the row quantized as above: per row and group of 32 inputs one
// `maddubs` of |x| and the weights carrying x's sign (llama.cpp's trick: both operands of maddubs in range), one
// `madd` into 8 int32 sums, scaled by the group's activation scale; 4 rows share each load of x. The rows AHEAD
// groups of 4 further on are prefetched meanwhile (the hardware's prefetcher does not follow four rows at once).
constexpr int64_t AHEAD = 4;
void int8_rows_q8_avx2(const int8_t* XQ, const float* XS, const int8_t* W, const at::BFloat16* S, int64_t rows,
                       int64_t K, float* Y) {
  const int64_t groups = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  auto hsum = [](__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  };
  parallel(0, rows / 4, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = 4 * r0; r < 4 * r1; r += 4) {
      __m256 acc[4];
      for (int i = 0; i < 4; ++i) acc[i] = _mm256_setzero_ps();
      const int8_t* ahead = W + (r + 4 * AHEAD) * K;  // 4 rows are 4 K bytes: two lines a group ahead
      const bool fetch = r + 4 * AHEAD < rows;
      for (int64_t g = 0; g < groups; ++g) {
        if (fetch) {
          _mm_prefetch(reinterpret_cast<const char*>(ahead + g * 128), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(ahead + g * 128 + 64), _MM_HINT_T0);
        }
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(XQ + g * 32));
        const __m256i ax = _mm256_sign_epi8(xq, xq);
        const __m256 xs = _mm256_set1_ps(XS[g]);
        for (int i = 0; i < 4; ++i) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(W + (r + i) * K + g * 32));
          const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w, xq)), ones);
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), xs, acc[i]);
        }
      }
      for (int i = 0; i < 4; ++i) Y[r + i] = hsum(acc[i]) * static_cast<float>(S[r + i]);
    }
  });
}

#endif

}  // namespace

// y = x W^T for one float32 row x [1, K] and packed weights (kernels/packed.py): int8 codes [N, K] with bf16
// scales [N], or int4 in torch's packed layout (`block` rows per block, groups of `group` inputs, rows padded
// to whole blocks). int4 through int4_row on AVX-512 and int4_rows_avx2 on CPUs without it (30-40 % faster than
// torch's kernel, bench/experiments/packed_row.py); int8 through torch's kernel. Returns float32 [1, out].
at::Tensor packed_row(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& scales, int64_t bits,
                      int64_t out, int64_t group, int64_t block) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.numel() == x_in.size(-1), "packed_row: one float32 row");
  const auto x = x_in.reshape({1, -1}).contiguous();
#if defined(__AVX512F__)
  if (bits == 4 && group == 32 && block == 64) return int4_row(x, w, scales, group, out);
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  const int64_t K = x.size(1);
  if (bits == 4 && group == 32 && block == 32 && K % 32 == 0 && w.size(1) * 2 == K && w.size(0) % block == 0
      && w.is_contiguous() && scales.is_contiguous()) {
    const int64_t rows = w.size(0);
    std::vector<int16_t> xp(K / 2);
    std::vector<float> xs(K / 32), xsum(K / 32);
    quantize_row(x.data_ptr<float>(), K, xp.data(), xs.data(), xsum.data());
    auto y = torch::empty({1, rows}, x.options());
    int4_rows_q8_avx2(xp.data(), xs.data(), xsum.data(), {{w.data_ptr<uint8_t>(),
                      reinterpret_cast<const uint32_t*>(scales.data_ptr<at::BFloat16>()), rows, y.data_ptr<float>()}}, K);
    return out < rows ? y.narrow(-1, 0, out) : y;
  }
  if (bits == 8 && K % 32 == 0 && w.size(0) % 4 == 0 && w.size(1) == K && w.is_contiguous() && scales.is_contiguous()) {
    const int64_t rows = w.size(0);
    std::vector<int16_t> xp(K / 2);
    std::vector<float> xs(K / 32), xsum(K / 32);
    quantize_row(x.data_ptr<float>(), K, xp.data(), xs.data(), xsum.data());
    auto y = torch::empty({1, rows}, x.options());
    int8_rows_q8_avx2(reinterpret_cast<const int8_t*>(xp.data()), xs.data(), w.data_ptr<int8_t>(),
                      scales.data_ptr<at::BFloat16>(), rows, K, y.data_ptr<float>());
    return out < rows ? y.narrow(-1, 0, out) : y;
  }
  if (bits == 4 && group == 32 && (block == 32 || block == 64) && K % 32 == 0 && w.size(1) * 2 == K
      && w.size(0) % block == 0 && w.is_contiguous() && scales.is_contiguous()) {
    const int64_t rows = w.size(0);
    const float* X = x.data_ptr<float>();
    std::vector<float> sums(K / 32, 0.f);
    for (int64_t k = 0; k < K; ++k) sums[k / 32] += X[k];
    auto y = torch::empty({1, rows}, x.options());
    const auto* SZ = reinterpret_cast<const uint32_t*>(scales.data_ptr<at::BFloat16>());
    if (block == 32)
      int4_rows_avx2<32>(X, w.data_ptr<uint8_t>(), SZ, rows, K, sums, y.data_ptr<float>());
    else
      int4_rows_avx2<64>(X, w.data_ptr<uint8_t>(), SZ, rows, K, sums, y.data_ptr<float>());
    return out < rows ? y.narrow(-1, 0, out) : y;
  }
#endif
  const auto xb = x.to(at::kBFloat16);
  auto y = bits == 8 ? at::_weight_int8pack_mm(xb, w, scales) : at::_weight_int4pack_mm_for_cpu(xb, w, group, scales);
  if (y.size(-1) != out) y = y.narrow(-1, 0, out);
  return y.to(at::kFloat);
}

// torch's packed int4 weight (packed_row's layout) dequantized into `wt`, float32 [K, rows] (the transpose: each
// input's codes of a block are that block's rows side by side), for a chunk's x @ wt. Without AVX-512 the bf16
// products a chunk would use are emulated, so a chunk multiplies in fp32; this writes the weight once into a
// buffer the caller reuses, where torch's ops took several temporaries and bf16 arithmetic.
void dequant_int4_t(const at::Tensor& packed, const at::Tensor& scales, int64_t group, int64_t block, at::Tensor wt) {
  const int64_t rows = packed.size(0), K = packed.size(1) * 2, H = block / 2;
  TORCH_CHECK(group == 32 && (block == 32 || block == 64) && rows % block == 0 && packed.is_contiguous() &&
              scales.is_contiguous() && wt.is_contiguous() && wt.scalar_type() == at::kFloat &&
              wt.size(0) == K && wt.size(1) == rows, "dequant_int4_t: torch's packed int4 layout, wt [K, rows]");
  const uint8_t* P = packed.data_ptr<uint8_t>();
  const uint32_t* SZ = reinterpret_cast<const uint32_t*>(scales.data_ptr<at::BFloat16>());
  float* W = wt.data_ptr<float>();
  at::parallel_for(0, rows / block, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> scale(block), base(block);  // base: the value of code 0 (zero - 8 scale)
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* blk = P + b * K * H;
      for (int64_t k = 0; k < K; ++k) {
        if (k % group == 0) {
          for (int64_t r = 0; r < block; ++r) {
            const uint32_t pair = SZ[(k / group) * rows + b * block + r];
            float sc, zero;
            const uint32_t lo = pair << 16, hi = pair & 0xFFFF0000u;
            std::memcpy(&sc, &lo, 4);
            std::memcpy(&zero, &hi, 4);
            scale[r] = sc;
            base[r] = zero - 8.f * sc;
          }
        }
        const uint8_t* bytes = blk + k * H;
        float* out = W + k * rows + b * block;
#pragma omp simd
        for (int64_t j = 0; j < H; ++j) {
          out[j] = static_cast<float>(bytes[j] & 15) * scale[j] + base[j];
          out[j + H] = static_cast<float>(bytes[j] >> 4) * scale[j + H] + base[j + H];
        }
      }
    }
  });
}

namespace {

// y = x W^T (+ b) for a [1, K] float32 row: float32 weights (bits 32) or packed ones (packed_row).
at::Tensor linear_row(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& bias,
                      int64_t bits, int64_t out, int64_t group, int64_t block) {
  at::Tensor y = bits == 32 ? at::linear(x, w) : packed_row(x, w, scales, bits, out, group, block);
  if (bias.numel()) y = y + bias.to(at::kFloat);
  return y;
}

// Linears `idx` of a layer (layer_step's weights / meta) times one row, their int4 products in one parallel region
// on the row quantized once (AVX2 without AVX-512); empty when one of them is not such a product.
std::vector<at::Tensor> rows_together(const at::Tensor& x, const std::vector<torch::Tensor>& weights,
                                      const std::vector<int64_t>& meta, std::initializer_list<int> idx) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  const int64_t K = x.size(-1);
  if (K % 32 != 0 || !x.is_contiguous()) return {};
  for (int i : idx) {
    const auto& w = weights[3 * i];
    if (meta[4 * i] != 4 || meta[4 * i + 2] != 32 || meta[4 * i + 3] != 32 || w.size(1) * 2 != K ||
        !w.is_contiguous() || !weights[3 * i + 1].is_contiguous())
      return {};
  }
  std::vector<int16_t> xp(K / 2);
  std::vector<float> xs(K / 32), xsum(K / 32);
  quantize_row(x.data_ptr<float>(), K, xp.data(), xs.data(), xsum.data());
  std::vector<at::Tensor> out;
  std::vector<Int4Part> parts;
  for (int i : idx) {
    const auto& w = weights[3 * i];
    out.push_back(torch::empty({1, w.size(0)}, x.options()));
    parts.push_back({w.data_ptr<uint8_t>(), reinterpret_cast<const uint32_t*>(weights[3 * i + 1].data_ptr<at::BFloat16>()),
                     w.size(0), out.back().data_ptr<float>()});
  }
  int4_rows_q8_avx2(xp.data(), xs.data(), xsum.data(), parts, K);
  size_t j = 0;
  for (int i : idx) {
    auto& y = out[j++];
    if (meta[4 * i + 1] < y.size(1)) y = y.narrow(-1, 0, meta[4 * i + 1]);
    if (weights[3 * i + 2].numel()) y = y + weights[3 * i + 2].to(at::kFloat);
  }
  return out;
#else
  return {};
#endif
}

}  // namespace

// One decoder layer of a Llama-layout model (pre-norm attention and SwiGLU MLP) for one decoded token.
// h [1, hidden] float32. weights: 7 linears (q, k, v, o, gate, up, down) x {weight or codes, scales, bias}
// (empty tensors where absent); meta: 7 x {bits, out_features, group, block} (packed_row's). Writes the token's K and V at `slot` of
// k_cache / v_cache, and its score 0 and original position `position` at `slot` of scores / positions [H, cap].
// Returns {h after the layer, the pre-RoPE qkv [1, (Hq + 2 Hkv) D]}.
std::vector<torch::Tensor> layer_step(torch::Tensor h, torch::Tensor norm_in, torch::Tensor norm_post, double eps,
                                      std::vector<torch::Tensor> weights, std::vector<int64_t> meta,
                                      torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                                      torch::Tensor v_cache, torch::Tensor scores, torch::Tensor positions,
                                      int64_t slot, int64_t position, double scale, int64_t heads_q,
                                      int64_t heads_kv) {
  TORCH_CHECK(weights.size() == 21 && meta.size() == 28, "layer_step: 7 linears of 3 tensors and 4 numbers");
  TORCH_CHECK(scores.scalar_type() == at::kFloat && positions.scalar_type() == at::kLong &&
              slot < scores.size(1) && slot < positions.size(1), "layer_step: scores / positions");
  auto lin = [&](int i, const at::Tensor& x) {
    return linear_row(x, weights[3 * i], weights[3 * i + 1], weights[3 * i + 2], meta[4 * i], meta[4 * i + 1],
                      meta[4 * i + 2], meta[4 * i + 3]);
  };
  for (int64_t k = 0; k < scores.size(0); ++k) {
    scores.data_ptr<float>()[k * scores.stride(0) + slot * scores.stride(1)] = 0.f;
    positions.data_ptr<int64_t>()[k * positions.stride(0) + slot * positions.stride(1)] = position;
  }
  const auto x = rms_norm(h, norm_in, eps);
  auto three = rows_together(x, weights, meta, {0, 1, 2});
  auto qkv = three.empty() ? at::cat({lin(0, x), lin(1, x), lin(2, x)}, -1) : at::cat(three, -1);
  const auto attn = attend_token(qkv, cos, sin, k_cache, v_cache, slot, scale, heads_q, heads_kv);
  h = h + lin(3, attn);
  const auto y = rms_norm(h, norm_post, eps);
  auto two = rows_together(y, weights, meta, {4, 5});
  const auto act = two.empty() ? at::silu(lin(4, y)) * lin(5, y) : at::silu(two[0]) * two[1];
  h = h + lin(6, act);
  return {h, qkv};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("layer_step", &layer_step, "one decoder layer for one decoded token");
#if defined(__AVX512F__)
  m.def("int4_row", &int4_row, "one row times torch's packed int4 weight (AVX-512)");
#endif
  m.def("packed_row", &packed_row, "one float32 row times packed int8 / int4 weights");
  m.def("set_pool", &set_pool, "the decode loops on cpu_pool.h's pool, spinning up to this many us before sleeping (0: OpenMP)");
  m.def("dequant_int4_t", &dequant_int4_t, "packed int4 weight into a float32 [K, rows] buffer");
  m.def("int4_to_int8_t", &prefill::int4_to_int8_t, "packed int4 weight as int8 codes per output row, [K, rows]");
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  m.def("chunk_attention", &prefill::chunk_attention, "a chunk's attention over the kept units, bf16 dot products");
#endif
  m.def("quantize_rows", &prefill::quantize_rows, "float32 rows as int8 codes and one scale per row");
  m.def("scale_sums", &prefill::scale_sums, "int32 sums times row and column scales (+ bias), float32");
  m.def("decode_attention", &decode_attention, "one token's grouped queries against a layer's kept units");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim, float32");
  m.def("attend_token", &attend_token, "RoPE, cache write and attention of one decoded token for one layer");
}
