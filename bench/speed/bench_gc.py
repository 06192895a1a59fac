#!/usr/bin/env python3
"""Where the occasional slow step comes from: Python's garbage collector, measured step by step.

Issue 40 saw steps 2, 4 and 12 of 14 take 1.4-1.8 s against a median of 0.8 s, and bench_sharded.py's runs show one
step in six 0.25-0.7 s slower in every configuration, the resident one included. Hypothesis: a full (generation 2)
collection of the cyclic garbage collector walks every tracked Python object (a full-size Flux with peft LoRA, the
libraries and the data: ~450k objects, 0.22-0.26 s per collection on a 2-core CPU) and it falls inside a step.

What runs: full-size Flux.1-dev (random bf16 weights on the GPU), LoRA r16, 1024 px, batch 1, the trainer's
StreamedBlock at --fraction (0: resident), compiled blocks unless --eager. `gc.callbacks` time every collection
and its generation; --steps steps with the collector as Python leaves it, then `gc.freeze()` (what the trainer now
does after setup: every object alive then moves to a permanent generation no collection walks) and --steps more.
Per step: seconds, and the seconds spent in generation-2 collections inside it. Writes gc.json and gc.md under --out.

    python -m bench.speed.bench_gc --out $OUT/gc
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.speed.bench_offload import add_flux_args, add_lora, block_list, build, inputs
from trainer.offload import attach_offload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_flux_args(ap, rank=False)
    ap.add_argument("--fraction", type=float, default=0.0)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("bench_out/gc"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    torch.backends.cuda.enable_cudnn_sdp(False)
    model = build(args, dev)
    params = add_lora(model, 16)
    model.train()
    attach_offload(block_list(model), dev, args.fraction, mode="train", checkpointing=True, compile=not args.eager)
    kw, target = inputs(dev, args.res, text=args.text)
    opt = torch.optim.AdamW(params, lr=1e-5)

    pauses: list = []  # (generation, seconds) of the collections inside the current step
    started = {}

    def on_gc(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - started.pop("t", time.perf_counter())))

    def step():
        F.mse_loss(model(**kw)[0].float(), target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    gc.callbacks.append(on_gc)
    rows = []
    for mode in ("default", "frozen"):
        if mode == "frozen":
            gc.collect()
            gc.freeze()
        for k in range(args.steps):
            pauses.clear()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            rows.append({"mode": mode, "step": k, "s": dt, "gen2_s": sum(s for g, s in pauses if g == 2),
                         "gen01_s": sum(s for g, s in pauses if g < 2), "collections": len(pauses)})
    gc.callbacks.remove(on_gc)
    objects = len(gc.get_objects()) + gc.get_freeze_count()
    lines = [f"Flux.1-dev LoRA r16, {args.res} px, fraction {args.fraction}, {'eager' if args.eager else 'compiled'}, "
             f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, Python {sys.version.split()[0]}, "
             f"{objects} Python objects", "",
             "| collector | median step s | max step s | steps > 1.15 x median | gen-2 collections | their s (sum) | "
             "the slow steps' gen-2 s |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for mode in ("default", "frozen"):
        rs = [r for r in rows if r["mode"] == mode]
        med = statistics.median(r["s"] for r in rs)
        slow = [r for r in rs if r["s"] > 1.15 * med]
        lines.append(f"| {mode} | {med:.3f} | {max(r['s'] for r in rs):.3f} | {len(slow)} | "
                     f"{sum(1 for r in rs if r['gen2_s'] > 0)} | {sum(r['gen2_s'] for r in rs):.3f} | "
                     f"{', '.join(format(r['gen2_s'], '.3f') for r in slow) or '-'} |")
    (args.out / "gc.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                   "rows": rows}, indent=1))
    (args.out / "gc.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
