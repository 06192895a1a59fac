#!/usr/bin/env python3
"""Flux.2 LoRA step with 0, 1 or 2 reference images at 1024 px on the GPU, with the planner's prediction beside it.

Full-size Flux.2-klein-4B by default (`--family flux2` for the 32 B dev: needs the streamed fractions), random bf16
weights built on the GPU, LoRA rank 16 on the adapter's default targets, batch 1, 512 text tokens. The references
are joined by the adapter's own `predict` (tokens after the target's, time ids 10, 20; prediction sliced to the
target), so each adds the target's 4096 tokens at 1024 px. For each (references, fraction) it prints the
planner's prediction (`planner.analyze` of a config whose data folder has `control/` (and `control2/`) folders,
so `Facts.references` counts them through `reference_inputs`) beside the measured peak reserved VRAM and median
step time. The 0-reference rows are the plain text-to-image baseline on the same model.

    python bench/bench_flux2_pairs.py --out /tmp/bench_flux2_pairs          # GPU: klein, refs 0 1 2, fraction 0 (~3 min)
    python bench/bench_flux2_pairs.py --smoke                              # CPU: tiny model at 64 px, no timing

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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer import planner  # noqa: E402
from trainer.config import CONTROL_DIR, Config  # noqa: E402
from trainer.models import adapter_class  # noqa: E402
from trainer.planner import timing as ptime  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from bench_kontext import timed_steps  # noqa: E402

GB = 1e9
TINY = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4))


def build(cls, dev: str, config: dict):
    from peft import LoraConfig

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            m = cls.transformer_cls.from_config(config)
    finally:
        torch.set_default_dtype(torch.float32)
    m.requires_grad_(False)
    m.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=list(cls.default_lora_targets),
                             init_lora_weights="gaussian"))
    params = [p for p in m.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()  # the trainer keeps LoRA weights in fp32
    return m.train(), params


def batch(dev: str, res: int, m, refs: int, text: int = 512) -> tuple:
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


def measure_step(cls, m, params, dev, res, refs, fraction, steps, warmup) -> dict:
    return timed_steps(cls(), m, params, dev, fraction, lambda: batch(dev, res, m, refs), 4.0, steps, warmup,
                       dict(res=res, references=refs, fraction=fraction))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench_flux2_pairs_out"))
    ap.add_argument("--family", default="flux2-klein", choices=["flux2-klein", "flux2"])
    ap.add_argument("--res", type=int, default=1024)
    ap.add_argument("--references", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--fractions", type=float, nargs="*", default=[0.0])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny Flux.2 at 64 px, one step, no timing claims")
    args = ap.parse_args()
    cls = adapter_class(args.family)
    if args.smoke:
        dev, config, res, args.warmup, args.steps = "cpu", dict(TINY, guidance_embeds=cls.full_config["guidance_embeds"]), 64, 0, 1
    elif not torch.cuda.is_available():
        print("bench_flux2_pairs.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    else:
        dev, config, res = "cuda", cls.full_config, args.res
        torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN attention fails in backward on that machine (GPU.md)
    rates = ptime.reference_rates()
    m, params = build(cls, dev, config)
    for b in cls().blocks(m):
        b.to("cpu")
    rows = []
    for refs in args.references:
        with tempfile.TemporaryDirectory() as data:  # a data folder whose layout says `refs` references
            for k in range(refs):
                (Path(data) / (CONTROL_DIR if k == 0 else f"{CONTROL_DIR}{k + 1}")).mkdir()
            facts = planner.analyze(pairs_cfg(args.family, args.res, Path(data)))  # always the full-size prediction
        assert facts.references == refs, (facts.references, refs)
        for f in args.fractions:
            p = planner.predict(facts, f, args.res, False, rates)
            row = measure_step(cls, m, params, dev, res, refs, f, args.steps, args.warmup)
            row.update(pred_reserved_gb=p.peak_reserved / GB, pred_step_ref_s=p.step_s)
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
                smoke=args.smoke, res=args.res, family=args.family)
    (args.out / "flux2_pairs.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    n = (args.res // 16) ** 2
    lines = [f"{cls.full_name} LoRA r16 step, {args.res} px target + N references of the same size ({n} image tokens "
             f"each + 512 text), {meta['device']}, {meta['date']}"
             + (" (SMOKE: tiny model on the CPU, measurements meaningless)" if args.smoke else ""), "",
             "| references | fraction | measured reserved GB | predicted reserved GB | measured step s | "
             "predicted step s (H200 ref) |", "|---|---|---|---|---|---|"]
    for r in rows:
        meas = f"{r['reserved_gb']:.1f}" if "reserved_gb" in r else r.get("status", "-")
        step = f"{r['step_s']:.2f}" if "step_s" in r else "-"
        lines.append(f"| {r['references']} | {r['fraction']} | {meas} | {r['pred_reserved_gb']:.1f} | {step} | "
                     f"{r['pred_step_ref_s']:.2f} |")
    (args.out / "flux2_pairs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
