"""PyTorch's side of kiln-bench's `mlp` workload: Linear(1024, 4096) -> ReLU -> Linear(4096,
4096) -> ReLU -> Linear(4096, 1024) on a [8192, 1024] f32 batch, forward, eager and torch.compile
(default and max-autotune), then a training step (forward, mean-square loss, backward; eager and
torch.compile default), on the CPU or on CUDA. Same JSON lines and workload name as
kiln-bench, so both go in one table. TF32 off, as kiln's default.

    python3 tools/torch_mlp.py [cpu|cuda]
"""
import sys

import torch

from torch_timing import emit, median_s, once_s

W = "mlp_8192x1024"


def main():
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
        torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
        torch.nn.Linear(4096, 1024),
    ).to(device)
    x = torch.randn(8192, 1024, device=device)
    flops = 2 * 8192 * (1024 * 4096 + 4096 * 4096 + 4096 * 1024)
    with torch.no_grad():
        t = median_s(lambda: model(x), device, warmup=3)
        emit(W, "eager", "call", t * 1e6, "us", device)
        for mode in ["default", "max-autotune-no-cudagraphs"]:
            torch._dynamo.reset()
            g = torch.compile(model, mode=mode)
            emit(W, mode, "cold_compile", once_s(lambda: g(x), device), "s", device)
            t = median_s(lambda: g(x), device, warmup=3)
            emit(W, mode, "call", t * 1e6, "us", device)
            emit(W, mode, "tflops", flops / t / 1e12, "TFLOP/s", device)
    # the training step: forward, mean-square loss, backward (no optimizer)
    w = W + "_train"

    def step(f):
        for p in model.parameters():
            p.grad = None
        y = f(x)
        loss = (y * y).mean()
        loss.backward()
        return loss

    t = median_s(lambda: step(model), device, warmup=3)
    emit(w, "eager", "call", t * 1e6, "us", device)
    torch._dynamo.reset()
    g = torch.compile(model)
    emit(w, "default", "cold_compile", once_s(lambda: step(g), device), "s", device)
    t = median_s(lambda: step(g), device, warmup=3)
    emit(w, "default", "call", t * 1e6, "us", device)


if __name__ == "__main__":
    main()
