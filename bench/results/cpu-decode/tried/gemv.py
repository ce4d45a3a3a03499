import torch, time
from torch.utils.cpp_extension import load_inline
torch.set_num_threads(2)
src = r'''
#include <torch/extension.h>
#include <ATen/Parallel.h>
torch::Tensor gemv8(torch::Tensor x, torch::Tensor codes, torch::Tensor scales) {
  const int64_t N = codes.size(0), K = codes.size(1);
  auto xs = x.contiguous(); auto sc = scales.to(at::kFloat).contiguous();
  auto y = torch::empty({1, N}, x.options());
  const float* X = xs.data_ptr<float>(); const int8_t* C = codes.data_ptr<int8_t>(); const float* S = sc.data_ptr<float>(); float* Y = y.data_ptr<float>();
  at::parallel_for(0, N, 256, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int8_t* c = C + r * K; float acc = 0.f;
#pragma omp simd reduction(+:acc)
      for (int64_t k = 0; k < K; ++k) acc += (float)c[k] * X[k];
      Y[r] = acc * S[r];
    }
  });
  return y;
}
'''
mod = load_inline("lc_gemv_test", cpp_sources=src, functions=["gemv8"], extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
from localchat.kernels.packed import quantize_int8
N, K = 49152, 576
w = torch.randn(N, K) * 0.05
codes, scales = quantize_int8(w)
x = torch.randn(1, K)
ref = torch.ops.aten._weight_int8pack_mm(x.bfloat16(), codes, scales).float()
got = mod.gemv8(x, codes, scales)
print("rel err vs torch", ((got - ref).norm() / ref.norm()).item())
def bench(f, reps=50):
    f(); t = time.perf_counter()
    for _ in range(reps): f()
    return (time.perf_counter() - t) / reps * 1e3
for _ in range(3):
    print("torch int8pack %.2f ms, ours %.2f ms" % (bench(lambda: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), codes, scales)), bench(lambda: mod.gemv8(x, codes, scales))))
