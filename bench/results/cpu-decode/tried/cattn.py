import torch, time, os
from torch.utils.cpp_extension import load_inline
torch.set_num_threads(2)
src = r'''
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>
#include <algorithm>
// q [H, G, d] contiguous fp32; k, v [H, n, d] with unit stride d (any head stride); out [H, G, d]
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale, int64_t splits) {
  const int64_t H = q.size(0), G = q.size(1), D = q.size(2), N = k.size(1);
  const int64_t ksh = k.stride(0), vsh = v.stride(0), ksn = k.stride(1), vsn = v.stride(1);
  const float* Q = q.data_ptr<float>(); const float* K = k.data_ptr<float>(); const float* V = v.data_ptr<float>();
  const int64_t S = std::max<int64_t>(1, std::min<int64_t>(splits, N));
  std::vector<float> part_m(H * S * G), part_l(H * S * G), part_o(H * S * G * D);
  at::parallel_for(0, H * S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sc;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t / S, s = t % S;
      const int64_t lo = N * s / S, hi = N * (s + 1) / S, len = hi - lo;
      sc.assign(G * len, 0.f);
      const float* qh = Q + h * G * D;
      for (int64_t j = 0; j < len; ++j) {
        const float* kj = K + h * ksh + (lo + j) * ksn;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qh + g * D; float acc = 0.f;
          for (int64_t e = 0; e < D; ++e) acc += qg[e] * kj[e];
          sc[g * len + j] = acc * (float)scale;
        }
      }
      float* o = part_o.data() + t * G * D;
      std::fill(o, o + G * D, 0.f);
      for (int64_t g = 0; g < G; ++g) {
        float m = -INFINITY; for (int64_t j = 0; j < len; ++j) m = std::max(m, sc[g * len + j]);
        float l = 0.f; for (int64_t j = 0; j < len; ++j) { float p = std::exp(sc[g * len + j] - m); sc[g * len + j] = p; l += p; }
        part_m[t * G + g] = m; part_l[t * G + g] = l;
      }
      for (int64_t j = 0; j < len; ++j) {
        const float* vj = V + h * vsh + (lo + j) * vsn;
        for (int64_t g = 0; g < G; ++g) {
          const float p = sc[g * len + j]; float* og = o + g * D;
          for (int64_t e = 0; e < D; ++e) og[e] += p * vj[e];
        }
      }
    }
  });
  auto out = torch::empty({H, G, D}, q.options());
  float* O = out.data_ptr<float>();
  for (int64_t h = 0; h < H; ++h) for (int64_t g = 0; g < G; ++g) {
    float m = -INFINITY; for (int64_t s = 0; s < S; ++s) m = std::max(m, part_m[(h * S + s) * G + g]);
    float l = 0.f; float* og = O + (h * G + g) * D; std::fill(og, og + D, 0.f);
    for (int64_t s = 0; s < S; ++s) {
      const float w = std::exp(part_m[(h * S + s) * G + g] - m); l += w * part_l[(h * S + s) * G + g];
      const float* po = part_o.data() + ((h * S + s) * G + g) * D;
      for (int64_t e = 0; e < D; ++e) og[e] += w * po[e];
    }
    for (int64_t e = 0; e < D; ++e) og[e] /= l;
  }
  return out;
}
'''
t = time.perf_counter()
mod = load_inline("lc_decode_attn", cpp_sources=src, functions=["decode_attention"], extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"], extra_ldflags=["-fopenmp"], build_directory=None, verbose=False)
print("build %.1f s" % (time.perf_counter() - t))
from torch.nn import functional as F
H, G, d, n, cap, L = 3, 3, 64, 1120, 1832, 30
Ks = [torch.randn(1, H, cap, d) for _ in range(L)]; Vs = [torch.randn(1, H, cap, d) for _ in range(L)]
q = torch.randn(1, H, G, d)
ref = F.scaled_dot_product_attention(q, Ks[0][:, :, :n], Vs[0][:, :, :n], scale=0.125)
got = mod.decode_attention(q[0], Ks[0][0, :, :n], Vs[0][0, :, :n], 0.125, 2)
print("err", (got - ref[0]).abs().max().item())
def bench(f, reps=30):
    f(); t = time.perf_counter()
    for _ in range(reps): f()
    return (time.perf_counter() - t) / reps * 1e3
def plain():
    for K, V in zip(Ks, Vs): F.scaled_dot_product_attention(q, K[:, :, :n], V[:, :, :n], scale=0.125)
def ours(S):
    def f():
        for K, V in zip(Ks, Vs): mod.decode_attention(q[0], K[0, :, :n], V[0, :, :n], 0.125, S)
    return f
with torch.inference_mode():
    for _ in range(3):
        print("sdpa %.2f ms/step" % bench(plain), " ".join("ours S=%d %.2f" % (S, bench(ours(S))) for S in (1, 2, 4, 8)))
