"""PyTorch on the CPU for kiln-bench's `resnet18` workload (batch 16, 3x224x224, eval, float32):
eager and, with --compile, torch.compile. Prints JSON lines like torch_baseline.py.

    python3 tools/torch_cpu_resnet18.py [--compile] [--iters N]
"""
import json, sys, time

import torch
import torchvision


def bench(fn, iters):
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return 1000 * times[len(times) // 2]


def main():
    iters = int(sys.argv[sys.argv.index("--iters") + 1]) if "--iters" in sys.argv else 5
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = torch.randn(16, 3, 224, 224)
    emit = lambda variant, metric, value, unit: print(json.dumps(dict(
        workload="resnet18_cpu", variant=variant, metric=metric, value=round(value, 4), unit=unit,
        device="cpu", threads=torch.get_num_threads())), flush=True)
    with torch.no_grad():
        emit("torch_eager", "call", bench(lambda: model(x), iters), "ms")
        if "--compile" in sys.argv:
            compiled = torch.compile(model)
            t = time.perf_counter()
            compiled(x)
            emit("torch_compile", "cold_compile", time.perf_counter() - t, "s")
            emit("torch_compile", "call", bench(lambda: compiled(x), iters), "ms")


if __name__ == "__main__":
    main()
