"""Where torch.compile's inference calls spend their GPU time (as torch_baseline.py runs them:
ResNet-18 batch 16 and BERT-base batch 32 x 128, reduce-overhead and default): the top kernels by
CUDA time per call, to set beside an ncu listing of kiln's call from the same machine.

    python3 tools/torch_profile_infer.py [ROWS]
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 25


def show(name, fn, calls=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events) / calls
    print(f"== {name}: {total:.1f} us of kernels per call ({torch.cuda.get_device_name()})")
    for e in events[:rows]:
        print(f"  {e.self_device_time_total / calls:9.1f} us {e.count // calls:4d}x  {e.key[:110]}")


with torch.no_grad():
    from torchvision import models
    m = models.resnet18().cuda().eval()
    x = torch.randn(16, 3, 224, 224, device="cuda")
    for mode in ("default", "reduce-overhead"):
        torch.compiler.reset()
        g = torch.compile(m, mode=mode)
        show(f"resnet18 bs16 {mode}", lambda: g(x))
    from transformers import BertConfig, BertModel
    bert = BertModel(BertConfig()).cuda().eval()
    ids = torch.randint(0, 30522, (32, 128), device="cuda")
    torch.compiler.reset()
    gb = torch.compile(bert)
    show("bert-base bs32x128 default", lambda: gb(ids))
