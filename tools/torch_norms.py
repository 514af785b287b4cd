"""PyTorch's side of kiln-bench's `norms` workload: batch norm (training) + ReLU on
[32, 64, 56, 56] and layer norm on [4096, 768], f32, eager and torch.compile, forward only, on
the CPU or on CUDA. Same JSON lines and workload names as kiln-bench, so both go in one table.

    python3 tools/torch_norms.py [cpu|cuda]
"""
import sys

import torch
import torch.nn.functional as F

from torch_timing import emit, median_s, once_s


def main():
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    # a few calls per timed run on CUDA: each is tens of microseconds
    calls = 20 if device == "cuda" else 1
    torch.manual_seed(0)
    cases = [
        ("batch_norm_relu_32x64x56x56", (32, 64, 56, 56), 64,
         lambda x, w, b: F.relu(F.batch_norm(x, None, None, w, b, training=True, eps=1e-5))),
        ("layer_norm_4096x768", (4096, 768), 768,
         lambda x, w, b: F.layer_norm(x, (768,), w, b, eps=1e-5)),
    ]
    with torch.no_grad():
        for name, shape, p, f in cases:
            w = "norms_" + name
            x = torch.randn(shape, device=device)
            wt, bs = torch.randn(p, device=device), torch.randn(p, device=device)
            nbytes = 2 * x.numel() * 4
            t = median_s(lambda: f(x, wt, bs), device, calls=calls)
            emit(w, "eager", "call", t * 1e6, "us", device)
            emit(w, "eager", "bandwidth", nbytes / t / 1e9, "GB/s", device)
            g = torch.compile(f)
            emit(w, "default", "cold_compile", once_s(lambda: g(x, wt, bs), device), "s", device)
            t = median_s(lambda: g(x, wt, bs), device, calls=calls)
            emit(w, "default", "call", t * 1e6, "us", device)
            emit(w, "default", "bandwidth", nbytes / t / 1e9, "GB/s", device)


if __name__ == "__main__":
    main()
