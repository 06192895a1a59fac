#!/usr/bin/env python3
"""Flux.1 Kontext LoRA step at 1024 px on the GPU, with the planner's prediction beside it.

Full-size Kontext (Flux.1-dev's architecture, 11.9 B params, random bf16 weights built on the GPU), LoRA rank 16
on the adapter's default targets, batch 1, 512 text tokens, and a 1024 px reference image: the transformer sees
4096 target + 4096 reference tokens, built by `FluxKontextAdapter.predict` itself (reference ids offset to 1,
prediction sliced to the target). Trained a few steps through the offload conductor at each `--fractions`
value; for each it prints the planner's prediction (`planner.analyze` of a flux-kontext config, which traces the
adapter's `dummy_inputs` with the doubled sequence) beside the measured peak reserved VRAM and median step time.

    python -m bench.speed.bench_kontext --out /tmp/bench_kontext                # GPU: fractions 0.5 and 0.9 (~3 min)
    python -m bench.speed.bench_kontext --smoke                                 # CPU: tiny model at 64 px, no timing

Writes kontext.json and kontext.md (a markdown table for bench/RESULTS.md) under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common.timing import build_bf16
from trainer import planner
from trainer.config import Config
from trainer.models.flux_kontext import FluxKontextAdapter
from trainer.planner import timing as ptime

ROOT = Path(__file__).resolve().parents[2]

GB = 1e9
TINY = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
            axes_dims_rope=(4, 4, 8))


def build(dev: str, config: dict):
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    m = build_bf16(lambda: FluxTransformer2DModel(**config), dev)
    m.requires_grad_(False)
    m.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=list(FluxKontextAdapter.default_lora_targets),
                             init_lora_weights="gaussian"))
    params = [p for p in m.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()  # the trainer keeps LoRA weights in fp32
    return m.train(), params


def batch(dev: str, res: int, m, text: int = 512) -> tuple:
    """Latents of a target and of a reference (both res px), text of `text` tokens, one timestep."""
    c, g = m.config, torch.Generator().manual_seed(1)
    lat = c.in_channels // 4

    def r(*s):
        return torch.randn(*s, generator=g).to(dev, torch.bfloat16)

    side = res // 8
    cond = {"prompt_embeds": r(1, text, c.joint_attention_dim), "pooled_prompt_embeds": r(1, c.pooled_projection_dim),
            "control_latents": r(1, lat, side, side)}
    return r(1, lat, side, side), cond, torch.tensor([0.5], device=dev), r(1, lat, side, side).float()


def kontext_cfg(res: int) -> Config:
    return Config.model_validate({
        "model": {"family": "flux-kontext", "path": "/nonexistent/FLUX.1-Kontext-dev"},
        "train": {"method": "lora"},
        "lora": {"rank": 16, "alpha": 16},
        "data": {"sources": [{"path": "unused"}], "resolutions": [res]},
        "output": {"dir": "unused"},
    })


def measure_step(m, params, dev, res, fraction, steps, warmup) -> dict:
    return timed_steps(FluxKontextAdapter(), m, params, dev, fraction, lambda: batch(dev, res, m), 3.5, steps, warmup,
                       dict(res=res, fraction=fraction))


def timed_steps(adapter, m, params, dev, fraction, make_batch, guidance, steps, warmup, row) -> dict:
    """LoRA steps of `m` with its blocks through the offload handle at `fraction`: `row` plus the median step time
    after `warmup` steps and, on CUDA, the peak reserved / allocated VRAM (or status OOM). `make_batch()` gives
    (x, cond, t, target) once the handle is attached. Shared with bench_flux2_pairs.py."""
    from trainer.offload import attach_offload

    blocks = adapter.blocks(m)
    handle = None
    try:
        handle = attach_offload(blocks, dev, fraction, mode="train", activations=False, trainable=False)
        x, cond, t, target = make_batch()
        opt = torch.optim.AdamW(params, lr=1e-5)
        cuda = dev == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            pred = adapter.predict(m, x, t, cond, guidance=guidance)
            F.mse_loss(pred.float(), target).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        row.update(status="ok", step_s=statistics.median(times))
        if cuda:
            row.update(reserved_gb=torch.cuda.max_memory_reserved() / GB,
                       allocated_gb=torch.cuda.max_memory_allocated() / GB)
    except torch.OutOfMemoryError as e:
        row.update(status="OOM", error=str(e).splitlines()[0][:200])
    finally:
        if handle is not None:
            handle.close()
        for b in blocks:
            b.to("cpu")
        for p in params:
            p.grad = None
        if dev == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench_kontext_out"))
    ap.add_argument("--res", type=int, default=1024)
    ap.add_argument("--fractions", type=float, nargs="*", default=[0.5, 0.9])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny Kontext at 64 px, one step, no timing claims")
    args = ap.parse_args()
    if args.smoke:
        dev, config, res, args.warmup, args.steps = "cpu", TINY, 64, 0, 1
    elif not torch.cuda.is_available():
        print("bench_kontext.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    else:
        dev, config, res = "cuda", FluxKontextAdapter.full_config, args.res
        torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN attention fails in backward on that machine (GPU.md)
    facts = planner.analyze(kontext_cfg(args.res))  # always the full-size prediction
    rates = ptime.reference_rates()
    m, params = build(dev, config)
    for b in FluxKontextAdapter().blocks(m):
        b.to("cpu")
    rows = []
    for f in args.fractions:
        p = planner.predict(facts, f, args.res, False, rates)
        row = measure_step(m, params, dev, res, f, args.steps, args.warmup)
        row.update(pred_reserved_gb=p.peak_reserved / GB, pred_step_ref_s=p.step_s)
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
                smoke=args.smoke, res=args.res)
    (args.out / "kontext.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"Flux.1 Kontext LoRA r16 step, {args.res} px target + {args.res} px reference "
             f"({2 * (args.res // 16) ** 2} image tokens + 512 text), {meta['device']}, {meta['date']}"
             + (" (SMOKE: tiny model on the CPU, measurements meaningless)" if args.smoke else ""), "",
             "| fraction | measured reserved GB | predicted reserved GB | measured step s | predicted step s (H200 ref) |",
             "|---|---|---|---|---|"]
    for r in rows:
        meas = f"{r['reserved_gb']:.1f}" if "reserved_gb" in r else r.get("status", "-")
        step = f"{r['step_s']:.2f}" if "step_s" in r else "-"
        lines.append(f"| {r['fraction']} | {meas} | {r['pred_reserved_gb']:.1f} | {step} | {r['pred_step_ref_s']:.2f} |")
    (args.out / "kontext.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
