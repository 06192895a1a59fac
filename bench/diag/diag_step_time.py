#!/usr/bin/env python3
# ruff: noqa: B023, F821 - each closure runs inside the loop iteration that defines it
"""Where a training step's time goes at small token counts (issue 7: the planner's 512 px step time).

For full-size Flux LoRA r16 (random bf16 weights on the GPU) it measures, per configuration:

- per block class (double / single), at 512 and 1024 px: one block's training pass (no-grad forward, recompute,
  backward) raw and through the conductor (`attach_offload([block], f=0)`): wall time (synchronised), CPU issue
  time (the host's time to launch the pass while the GPU is busy with a sleep kernel queued before it, so the
  host never waits) and GPU time (CUDA events around the pass, all of it already queued);
- the whole step at 512 / 1024 px and several fractions: wall time, CPU issue time and GPU time the same way,
  and from one profiled step the busy time of compute kernels and of host-to-device copies.

    python -m bench.diag.diag_step_time --out /tmp/diag
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.speed.bench_offload import inputs
from bench.speed.bench_plan import attach, blocks_of, build, detach, lora_cfg, training_step
from trainer import planner
from trainer.planner.measure import materialize

ROOT = Path(__file__).resolve().parents[2]

T0 = time.perf_counter()
CYCLES_PER_S = None


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def calibrate_sleep():
    global CYCLES_PER_S
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    e0.record()
    torch.cuda._sleep(200_000_000)
    e1.record()
    e1.synchronize()
    CYCLES_PER_S = 200_000_000 / (e0.elapsed_time(e1) / 1000)


def timings(fn, reps, sleep_s):
    """(wall s, CPU issue s, GPU s) medians over reps."""
    wall, cpu, gpu = [], [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        wall.append(time.perf_counter() - t0)
    for _ in range(reps):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(sleep_s * CYCLES_PER_S))
        e0.record()
        t0 = time.perf_counter()
        fn()
        cpu.append(time.perf_counter() - t0)
        e1.record()
        e1.synchronize()
        gpu.append(e0.elapsed_time(e1) / 1000)
    m = statistics.median
    return dict(wall=m(wall), cpu=m(cpu), gpu=m(gpu), cpu_max=max(cpu), sleep_s=sleep_s)


def profiled(fn):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kern, copy = [], []
    n = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        iv = (e.time_range.start, e.time_range.end)
        (copy if "Memcpy" in e.name else kern).append(iv)
        n += 1

    def union(ivs):
        tot, end = 0.0, -1e30
        for s, t in sorted(ivs):
            if t <= end:
                continue
            tot += t - max(s, end)
            end = t
        return tot / 1e6

    span = (max(t for _, t in kern + copy) - min(s for s, _ in kern + copy)) / 1e6 if kern else 0
    return dict(kernels_busy=union(kern), copy_busy=union(copy), n_kernels=len(kern), gpu_span=span)


def block_part(facts, out):
    import copy as cp

    rows = []
    for res in (512, 1024):
        tr = facts.trace(res)
        for cls, (idx, args, kwargs) in tr.calls.items():
            block = cp.deepcopy(facts.blocks[idx]).to_empty(device="cuda")
            with torch.no_grad():
                for p in block.parameters():
                    p.normal_(0, 0.02)
                for p in block.parameters():
                    if p.requires_grad:
                        p.data = p.data.float()
            a, kw = materialize(args, "cuda"), materialize(kwargs, "cuda")

            def outs(o):
                return [
                    t
                    for t in (o if isinstance(o, tuple | list) else (o,))
                    if isinstance(t, torch.Tensor) and t.requires_grad
                ]

            def raw():
                with torch.no_grad():
                    block(*a, **kw)
                o = outs(block(*a, **kw))
                torch.autograd.backward(o, [torch.ones_like(t) for t in o])

            def fwd_only():
                with torch.no_grad():
                    block(*a, **kw)

            raw()
            row = dict(res=res, cls=cls, raw=timings(raw, 5, 0.2), fwd=timings(fwd_only, 5, 0.1))
            h = attach([block], "cuda", 0.0, False)
            a2 = [
                x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
                for x in a
            ]

            def cond():
                o = outs(block(*a2, **kw))
                torch.autograd.backward(o, [torch.ones_like(t) for t in o])

            cond()
            row["conductor"] = timings(cond, 5, 0.2)
            h.close()
            rows.append(row)
            log(json.dumps(row))
            del block, a, kw, a2
            torch.cuda.empty_cache()
    (out / "blocks.json").write_text(json.dumps(rows, indent=1))
    return rows


def model_part(model, params, grid, out):
    rows = []
    for res, f in grid:
        h = attach(blocks_of(model), "cuda", f, False)
        kw, target = inputs("cuda", res)
        opt = torch.optim.AdamW(params, lr=1e-5)
        step = training_step(model, kw, target, opt)

        def fwd_bwd():
            o = model(**kw)[0]
            F.mse_loss(o.float(), target).backward()
            for p in params:
                p.grad = None

        for _ in range(2):
            step()
        row = dict(res=res, fraction=f, step=timings(step, 3, 3.0), fwd_bwd=timings(fwd_bwd, 3, 3.0))
        try:
            row["profile"] = profiled(step)
        except Exception as e:  # noqa: BLE001
            row["profile_error"] = repr(e)[:300]
        st = h.stats() if hasattr(h, "stats") else {}
        row["h2d_gbps"] = st.get("h2d_gbps")
        rows.append(row)
        log(json.dumps(row))
        opt = kw = target = None
        detach(h, model, params)
        (out / "model.json").write_text(json.dumps(rows, indent=1))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("diag_out"))
    ap.add_argument("--skip-blocks", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.enable_cudnn_sdp(False)
    calibrate_sleep()
    log(f"sleep kernel: {CYCLES_PER_S / 1e9:.3f} G cycles/s")
    facts = planner.analyze(lora_cfg([512, 1024]))
    if not args.skip_blocks:
        block_part(facts, args.out)
    model, params = build("cuda")
    for b in blocks_of(model):
        b.to("cpu")
    torch.cuda.empty_cache()
    grid = [(512, 0.0), (512, 0.5), (512, 0.9), (1024, 0.0), (1024, 0.5), (512, 1.0)]
    model_part(model, params, grid, args.out)
    log("done")


if __name__ == "__main__":
    main()
