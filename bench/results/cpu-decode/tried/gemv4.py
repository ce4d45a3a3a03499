import torch, time
from torch import nn
from torch.utils.cpp_extension import load_inline
torch.set_num_threads(2)
src = r'''
#include <torch/extension.h>
#include <ATen/Parallel.h>
// x [1, K] float; packed [rows, K/2] uint8 in torch's CPU int4 layout (blocks of 64 rows: [rows/64, K, 32] bytes,
// byte j of input k = row j low nibble, row j+32 high nibble); sz [K/G, rows, 2] bf16 (scale, zero): w = (c-8)*s + z
torch::Tensor gemv4(torch::Tensor x, torch::Tensor packed, int64_t group, torch::Tensor sz) {
  const int64_t rows = packed.size(0), K = packed.size(1) * 2, blocks = rows / 64, groups = K / group;
  auto xf = x.to(at::kFloat).contiguous();
  auto szf = sz.to(at::kFloat).contiguous();  // [groups, rows, 2]
  auto y = torch::empty({1, rows}, x.options().dtype(at::kFloat));
  const float* X = xf.data_ptr<float>(); const uint8_t* P = packed.data_ptr<uint8_t>(); const float* SZ = szf.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  std::vector<float> xs(groups);
  for (int64_t g = 0; g < groups; ++g) { float t = 0; for (int64_t k = 0; k < group; ++k) t += X[g * group + k]; xs[g] = t; }
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* B = P + b * K * 32;
      float out[64] = {0};
      for (int64_t g = 0; g < groups; ++g) {
        float acc[64] = {0};
        for (int64_t k = g * group; k < (g + 1) * group; ++k) {
          const uint8_t* bk = B + k * 32; const float xk = X[k];
#pragma omp simd
          for (int j = 0; j < 32; ++j) { acc[j] += (float)(bk[j] & 15) * xk; acc[j + 32] += (float)(bk[j] >> 4) * xk; }
        }
        const float* s = SZ + (g * rows + b * 64) * 2;
#pragma omp simd
        for (int j = 0; j < 64; ++j) out[j] += s[2 * j] * (acc[j] - 8.f * xs[g]) + s[2 * j + 1] * xs[g];
      }
      for (int j = 0; j < 64; ++j) Y[b * 64 + j] = out[j];
    }
  });
  return y;
}
'''
mod = load_inline("lc_gemv4_test", cpp_sources=src, functions=["gemv4"], extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
from localchat.kernels.packed import PackedLinear, GROUP
def bench(f, reps=20):
    f(); t = time.perf_counter()
    for _ in range(reps): f()
    return (time.perf_counter() - t) / reps * 1e6
tt = to = 0
for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536)):
    ps = [PackedLinear(nn.Linear(k, n, bias=False), 4) for _ in range(30)]
    x = torch.randn(1, k)
    ref = torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), ps[0].codes, GROUP, ps[0].scales).float()
    got = mod.gemv4(x, ps[0].codes, GROUP, ps[0].scales)
    err = ((got - ref).norm() / ref.norm()).item()
    xb = x.bfloat16()
    a = bench(lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p.codes, GROUP, p.scales) for p in ps]) / 30
    b = bench(lambda: [mod.gemv4(x, p.codes, GROUP, p.scales) for p in ps]) / 30
    tt += a; to += b
    print(n, k, "err %.4f torch %.1f us ours %.1f us" % (err, a, b))
print("per step torch %.2f ms ours %.2f ms" % (tt * 30 / 1e3, to * 30 / 1e3))
