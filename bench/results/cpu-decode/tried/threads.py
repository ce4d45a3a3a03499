import torch, time
from torch import nn
from localchat.kernels.packed import PackedLinear, GROUP
def bench(f, reps=30):
    f(); t = time.perf_counter()
    for _ in range(reps): f()
    return (time.perf_counter() - t) / reps * 1e6
head = PackedLinear(nn.Linear(576, 49152, bias=False), 8)
gu = [PackedLinear(nn.Linear(576, 1536, bias=False), 4) for _ in range(30)]
x = torch.randn(1, 576).bfloat16()
for th in (1, 2):
    torch.set_num_threads(th)
    a = bench(lambda: torch.ops.aten._weight_int8pack_mm(x, head.codes, head.scales))
    b = bench(lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(x, p.codes, GROUP, p.scales) for p in gu]) / 30
    print(th, "threads: int8 head %.0f us, int4 1536x576 %.1f us" % (a, b))
