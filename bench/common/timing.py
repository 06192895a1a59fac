"""Per-step timing shared by the benchmarks (GPU.md: CUDA events after warm-up, the median compared in-process).

    ts = step_seconds(fn, steps, cuda)   # seconds of each of `steps` calls of fn
    m = build_bf16(lambda: FluxTransformer2DModel(**config), "cuda")   # random bf16 weights, seed 0

On a GPU each call is bracketed by two CUDA events and waited for (the time is the device's, not the host's
launch time); elsewhere the wall clock. `build_bf16` builds a full-size random-weight model where it will run, with
bf16 as the default dtype while it is built (GPU.md: a Flux transformer builds on the GPU in under a second).
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


def build_bf16(make, device):
    """`make()` (a model constructor) with seed 0, bf16 as the default dtype and `device` as the default device;
    the default dtype is float32 again afterwards, also on an error."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return make()
    finally:
        torch.set_default_dtype(torch.float32)
