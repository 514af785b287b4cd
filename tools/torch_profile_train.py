"""Where torch.compile's ResNet-18 training step spends its GPU time (batch 64, 224x224, Adam as in
../shared/bench/torch_baseline.py): the top kernels by CUDA time and a split into convolution
(cuDNN), generated (Triton) and other kernels, to set beside kiln-bench's `KILN_BENCH_PROFILE`
table from the same run.

    python3 tools/torch_profile_train.py [ROWS]
"""
import sys

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile
from torchvision import models

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 30
m = models.resnet18(num_classes=10).cuda().train()
x = torch.randn(64, 3, 224, 224, device="cuda")
y = torch.randint(0, 10, (64,), device="cuda")
loss_fn = nn.CrossEntropyLoss()
cm = torch.compile(m)
opt = torch.optim.Adam(cm.parameters(), lr=1e-4, weight_decay=0.005)


def step():
    opt.zero_grad(set_to_none=True)
    loss_fn(cm(x), y).backward()
    opt.step()


for _ in range(3):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        step()
    torch.cuda.synchronize()

groups = {"conv (cuDNN)": 0.0, "generated (triton)": 0.0, "other": 0.0}
kernels = []
for e in prof.key_averages():
    t = e.self_device_time_total / 5  # us per step
    if t <= 0:
        continue
    n = e.key.lower()
    if n.startswith("triton"):
        g = "generated (triton)"
    elif any(s in n for s in ("conv", "cudnn", "xmma", "implicit", "wgrad", "dgrad", "fprop", "cutlass", "sm90", "sm80")):
        g = "conv (cuDNN)"
    else:
        g = "other"
    groups[g] += t
    kernels.append((t, e.count // 5, e.key[:110]))
kernels.sort(reverse=True)
print(f"torch.compile train_resnet18 bs64: GPU time per step by kind ({torch.cuda.get_device_name()})")
for g, t in groups.items():
    print(f"  {g:20s} {t / 1000:8.3f} ms")
print(f"  {'total':20s} {sum(groups.values()) / 1000:8.3f} ms")
print(f"top {rows} kernels (us per step, calls per step):")
for t, c, k in kernels[:rows]:
    print(f"  {t:9.1f} {c:4d}  {k}")
