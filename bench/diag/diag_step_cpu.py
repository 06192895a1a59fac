#!/usr/bin/env python3
# ruff: noqa: B023, F821 - each closure runs inside the loop iteration that defines it
"""Where the host's time goes in a streamed training step at 512 px (issue 7): Flux LoRA r16, full size, random
bf16 weights; at each fraction: wall and host-issue time of 4 steps, then one step under cProfile (top functions
by own time and by cumulative time written to cprofile-<f>.txt).

    python -m bench.diag.diag_step_cpu --out /tmp/diag --res 512 --fractions 0 0.5 0.9
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import torch

from bench.speed.bench_offload import inputs
from bench.speed.bench_plan import attach, blocks_of, build, detach, training_step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("diag_cpu"))
    ap.add_argument("--res", type=int, default=512)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.5, 0.9])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.enable_cudnn_sdp(False)
    model, params = build("cuda")
    for b in blocks_of(model):
        b.to("cpu")
    torch.cuda.empty_cache()
    rows = []
    for f in args.fractions:
        h = attach(blocks_of(model), "cuda", f, False)
        kw, target = inputs("cuda", args.res)
        opt = torch.optim.AdamW(params, lr=1e-5)
        step = training_step(model, kw, target, opt)

        for _ in range(2):
            step()
        torch.cuda.synchronize()
        wall, issue = [], []
        for _ in range(4):
            t0 = time.perf_counter()
            step()
            issue.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            wall.append(time.perf_counter() - t0)
        pr = cProfile.Profile()
        t0 = time.perf_counter()
        pr.enable()
        step()
        torch.cuda.synchronize()
        pr.disable()
        prof_wall = time.perf_counter() - t0
        s = io.StringIO()
        ps = pstats.Stats(pr, stream=s)
        ps.sort_stats("tottime").print_stats(45)
        ps.sort_stats("cumtime").print_stats(60)
        (args.out / f"cprofile-{args.res}-{f}.txt").write_text(s.getvalue())
        row = dict(
            res=args.res,
            fraction=f,
            wall=statistics.median(wall),
            issue=statistics.median(issue),
            walls=wall,
            issues=issue,
            profiled_wall=prof_wall,
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
        opt = kw = target = None
        detach(h, model, params)
    (args.out / "cpu.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
