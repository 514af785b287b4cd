"""What the tools' PyTorch baselines (torch_mlp.py, torch_norms.py) time and print alike: JSON lines
in kiln-bench's shape (workload, variant, metric, value, unit, device), the median of timed runs,
and a first call (a cold compile). Imported from the scripts' own folder: run them as
`python3 tools/<script>.py`.
"""
import json
import time

import torch


def emit(workload, variant, metric, value, unit, device):
    r = dict(workload=workload, variant=variant, metric=metric, value=round(value, 4), unit=unit,
             device=device)
    print(json.dumps(r), flush=True)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def median_s(fn, device, warmup=5, runs=15, calls=1):
    """Median seconds per call over `runs` runs of `calls` calls each, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        _sync(device)
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t) / calls)
    times.sort()
    return times[len(times) // 2]


def once_s(fn, device):
    """Seconds one call takes, the device's work included (a first call: a cold compile)."""
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t
