#!/usr/bin/env python3
"""Flux.2 / Flux.3 LoRA step with 0, 1 or 2 reference images at 1024 px on the GPU, with the planner's prediction
beside it.

Full-size Flux.2-klein-4B by default (`--family flux2` for the 32 B dev: needs the streamed fractions; `--family
flux3` for Flux.3's reference mode), random bf16 weights built on the GPU, LoRA rank 16 on the targets of the
adapter bound to the reference count (`lora_targets`: Flux.3 adds its reference-mode blocks with references, and
streams them as blocks), batch 1, the family's planned text tokens. The references are joined by the adapter's own
`predict` (Flux.2: tokens after the target's, time ids 10, 20, prediction sliced to the target; Flux.3: their own
sequence through the reference-mode blocks), so each adds the target's 4096 tokens at 1024 px. For each
(references, fraction) it prints the
planner's prediction (`planner.analyze` of a config whose data folder has `control/` (and `control2/`) folders,
so `Facts.references` counts them through `reference_inputs`) beside the measured peak reserved VRAM and median
step time. The 0-reference rows are the plain text-to-image baseline on the same model.

    python -m bench.speed.bench_flux2_pairs --out /tmp/bench_flux2_pairs          # GPU: klein, refs 0 1 2, fraction 0 (~3 min)
    python -m bench.speed.bench_flux2_pairs --family flux3 --fractions 0 0.5 --out /tmp/bench_flux3_pairs   # Flux.3
    python -m bench.speed.bench_flux2_pairs --smoke [--family flux3]             # CPU: tiny model at 64 px, no timing

Writes flux2_pairs.json and flux2_pairs.md (a markdown table for bench/RESULTS.md) under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

import torch

from bench.common.timing import build_bf16
from bench.speed.bench_kontext import timed_steps
from trainer import planner
from trainer.config import CONTROL_DIR, Config
from trainer.models import adapter_class
from trainer.planner import timing as ptime

ROOT = Path(__file__).resolve().parents[2]

GB = 1e9
TINY = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4))
TINY_FLUX3 = dict(in_channels=16, cond_in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=48, timestep_channels=32, axes_dims_rope=(4, 4, 4, 4))


def build(adapter, dev: str, config: dict):
    cls = type(adapter)
    from peft import LoraConfig

    m = build_bf16(lambda: cls.transformer_cls.from_config(config), dev)
    m.requires_grad_(False)
    m.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=list(adapter.lora_targets()),
                             init_lora_weights="gaussian"))
    params = [p for p in m.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()  # the trainer keeps LoRA weights in fp32
    return m.train(), params


def batch(dev: str, res: int, m, refs: int, text: int) -> tuple:
    """Latents of a target and of `refs` references (all res px, as the pairs layout cuts them), text, a timestep."""
    c, g = m.config, torch.Generator().manual_seed(1)
    lat, side = c.in_channels // 4, res // 8

    def r(*s):
        return torch.randn(*s, generator=g).to(dev, torch.bfloat16)

    cond = {"prompt_embeds": r(1, text, c.joint_attention_dim)}
    if refs:
        cond["control_latents"] = r(1, lat, side, side) if refs == 1 else r(1, refs, lat, side, side)
    return r(1, lat, side, side), cond, torch.tensor([0.5], device=dev), r(1, lat, side, side).float()


def pairs_cfg(family: str, res: int, data: Path) -> Config:
    return Config.model_validate({
        "model": {"family": family, "path": f"/nonexistent/{family}"},
        "train": {"method": "lora"},
        "lora": {"rank": 16, "alpha": 16},
        "data": {"sources": [{"path": str(data)}], "resolutions": [res]},
        "output": {"dir": "unused"},
    })


def measure_step(adapter, m, params, dev, res, refs, fraction, steps, warmup) -> dict:
    text = type(adapter).text_tokens
    return timed_steps(adapter, m, params, dev, fraction, lambda: batch(dev, res, m, refs, text), 4.0, steps, warmup,
                       dict(res=res, references=refs, fraction=fraction))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench_flux2_pairs_out"))
    ap.add_argument("--family", default="flux2-klein", choices=["flux2-klein", "flux2", "flux3"])
    ap.add_argument("--res", type=int, default=1024)
    ap.add_argument("--references", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--fractions", type=float, nargs="*", default=[0.0])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny Flux.2 at 64 px, one step, no timing claims")
    args = ap.parse_args()
    cls = adapter_class(args.family)
    if args.smoke:
        tiny = TINY_FLUX3 if args.family == "flux3" else dict(TINY, guidance_embeds=cls.full_config["guidance_embeds"])
        dev, config, res, args.warmup, args.steps = "cpu", tiny, 64, 0, 1
    elif not torch.cuda.is_available():
        print("bench_flux2_pairs.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    else:
        dev, config, res = "cuda", cls.full_config, args.res
        torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN attention fails in backward on that machine (GPU.md)
    rates = ptime.reference_rates()
    built, rows = None, []
    for refs in args.references:
        adapter = cls(references=refs)  # Flux.3: more blocks and LoRA targets with references
        if built is None or built[0] != adapter.lora_targets():
            built = None  # free the previous model first
            m, params = build(adapter, dev, config)
            built = (adapter.lora_targets(), m)
        for b in adapter.blocks(m):
            b.to("cpu")
        with tempfile.TemporaryDirectory() as data:  # a data folder whose layout says `refs` references
            for k in range(refs):
                (Path(data) / (CONTROL_DIR if k == 0 else f"{CONTROL_DIR}{k + 1}")).mkdir()
            facts = planner.analyze(pairs_cfg(args.family, args.res, Path(data)))  # always the full-size prediction
        assert facts.references == refs, (facts.references, refs)
        for f in args.fractions:
            p = planner.predict(facts, f, args.res, False, rates)
            row = measure_step(adapter, m, params, dev, res, refs, f, args.steps, args.warmup)
            row.update(pred_reserved_gb=p.peak_reserved / GB, pred_step_ref_s=p.step_s)
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
                smoke=args.smoke, res=args.res, family=args.family)
    stem = "flux3_pairs" if args.family == "flux3" else "flux2_pairs"
    (args.out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    n = (args.res // 16) ** 2
    lines = [f"{cls.full_name} LoRA r16 step, {args.res} px target + N references of the same size ({n} image tokens "
             f"each + {cls.text_tokens} text), {meta['device']}, {meta['date']}"
             + (" (SMOKE: tiny model on the CPU, measurements meaningless)" if args.smoke else ""), "",
             "| references | fraction | measured reserved GB | predicted reserved GB | measured step s | "
             "predicted step s (H200 ref) |", "|---|---|---|---|---|---|"]
    for r in rows:
        meas = f"{r['reserved_gb']:.1f}" if "reserved_gb" in r else r.get("status", "-")
        step = f"{r['step_s']:.2f}" if "step_s" in r else "-"
        lines.append(f"| {r['references']} | {r['fraction']} | {meas} | {r['pred_reserved_gb']:.1f} | {step} | "
                     f"{r['pred_step_ref_s']:.2f} |")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
