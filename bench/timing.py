"""Per-step timing shared by the benchmarks (GPU.md: CUDA events after warm-up, the median compared in-process).

    ts = step_seconds(fn, steps, cuda)   # seconds of each of `steps` calls of fn

On a GPU each call is bracketed by two CUDA events and waited for (the time is the device's, not the host's
launch time); elsewhere the wall clock.
"""

from __future__ import annotations

import time

import torch


def step_seconds(fn, steps: int, cuda: bool) -> list[float]:
    ts = []
    for _ in range(steps):
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return ts
