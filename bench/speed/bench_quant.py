#!/usr/bin/env python3
"""8-bit frozen base (trainer/quant.py) on full-size Flux (random bf16 weights built on the GPU), 1024 px, batch 1,
LoRA rank 16, all in one process. Prints one table; writes bench_quant.json under --out.

Rows:
- `ref diffusers+peft bf16 resident`: plain diffusers + peft, eager, no offload, no checkpointing (the
  reference a user would compare against);
- `train f=1.0 bf16` / `train f=1.0 fp8` / `train f=1.0 fp8 scaled_mm`: LoRA step with every block streamed by the
  conductor, bf16 base vs fp8 base (dequantize-then-matmul, then torch._scaled_mm where the GPU has it);
  `train f=1.0 fp8+mod`: fp8 base with the modulation Linears quantized too (`model.quantize_modulation`);
- `sample f=1.0 bf16` / `sample f=1.0 fp8` / `sample f=1.0 fp8+mod`: one no-grad forward, streamed;
- `linear ...`: one Flux MLP Linear (3072 -> 12288, 4096 + 512 tokens): bf16 F.linear, fp8 dequantize + F.linear,
  fp8 `_scaled_mm`, forward only.

    python -m bench.speed.bench_quant --out /tmp/bq             # the GPU run (the coordinator's; a few minutes)
    python -m bench.speed.bench_quant --smoke --out /tmp/bq     # CPU, a 1+1 block Flux of small width, seconds

Timing: CUDA events (perf_counter on the CPU) around each step after --warmup, median of --steps. Memory: peak
max_memory_allocated since the configuration was attached. Prediction to check: a streamed step on the fp8 base
moves half the weight bytes, so where f=1.0 bf16 is bound by H2D it should drop towards half; the dequantize costs
one extra read+write of each weight in bf16 per use (forward, recompute, backward), small beside the matmuls at
4096 tokens.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common.timing import build_bf16, step_seconds
from bench.speed.bench_offload import add_flux_args
from trainer import quant
from trainer.models import adapter_class
from trainer.offload import attach_offload

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out"]


def build(args, dev, mode, modulation=False):
    from diffusers import FluxTransformer2DModel

    m = build_bf16(lambda: FluxTransformer2DModel(num_layers=args.layers, num_single_layers=args.singles,
                                                  guidance_embeds=True, **args.dims), dev)
    m.requires_grad_(False)
    quant.quantize_blocks(blocks_of(m), mode, modulation,  # one block at a time, as the loader does
                          adapter_class("flux").modulation_linears)
    from peft import LoraConfig

    m.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=LORA_TARGETS,
                             init_lora_weights="gaussian"))
    params = [p for p in m.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    return m.train(), params


def blocks_of(m):
    return list(m.transformer_blocks) + list(m.single_transformer_blocks)


def inputs(m, dev, res, text):
    c = m.config
    side = res // 16
    n = side * side
    g = torch.Generator().manual_seed(1)

    def r(*s):
        return torch.randn(*s, generator=g).to(dev, torch.bfloat16)

    ids = torch.zeros(n, 3)
    ids[:, 1], ids[:, 2] = torch.arange(n) // side, torch.arange(n) % side
    kw = dict(hidden_states=r(1, n, c.in_channels), encoder_hidden_states=r(1, text, c.joint_attention_dim),
              pooled_projections=r(1, c.pooled_projection_dim), timestep=torch.tensor([0.5], device=dev, dtype=torch.bfloat16),
              guidance=torch.tensor([3.5], device=dev, dtype=torch.bfloat16), img_ids=ids.to(dev),
              txt_ids=torch.zeros(text, 3, device=dev), return_dict=False)
    return kw, r(1, n, c.out_channels or c.in_channels).float()


def timed(fn, dev, warmup, steps):
    cuda = dev != "cpu"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    ts = step_seconds(fn, steps, cuda)
    peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else None
    return statistics.median(ts), peak


def model_row(name, args, dev, mode, kind, fraction, scaled_mm=False, modulation=False):
    quant.set_scaled_mm(scaled_mm)
    m, params = build(args, dev, mode, modulation)
    kw, target = inputs(m, dev, args.res, args.text)
    opt = torch.optim.AdamW(params, lr=1e-5)
    handle = attach_offload(blocks_of(m), dev, fraction, mode=kind) if fraction > 0 else None

    def train_step():
        F.mse_loss(m(**kw)[0].float(), target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sample_step():
        with torch.no_grad():
            m(**kw)

    try:
        step_s, peak = timed(train_step if kind == "train" else sample_step, dev, args.warmup, args.steps)
        row = dict(name=name, step_s=step_s, peak_allocated_gb=peak)
        if handle is not None:
            st = handle.stats()
            row.update(block_bytes=st["block_bytes"], h2d_bytes_per_step=st["h2d_bytes_per_step"])
    except Exception as e:  # the failure is a result too; keep the other rows
        row = dict(name=name, error=f"{type(e).__name__}: {e}")
    finally:
        quant.set_scaled_mm(False)
        if handle is not None:
            handle.close()
    print(json.dumps(row), flush=True)
    return row


def free(dev) -> None:
    """Drop the previous configuration's model before building the next (each is a full-size Flux)."""
    gc.collect()
    if dev != "cpu":
        torch.cuda.empty_cache()


def linear_rows(args, dev):
    """One Linear, forward only: bf16, fp8 dequantize + F.linear, fp8 `_scaled_mm`."""
    d_in = args.dims.get("attention_head_dim", 128) * args.dims.get("num_attention_heads", 24)
    d_out = 4 * d_in
    tokens = (args.res // 16) ** 2 + args.text
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(d_in, d_out, dtype=torch.bfloat16)
    lin.weight.data = (torch.randn(d_out, d_in, generator=g) * 0.02).bfloat16()
    lin = lin.to(dev).requires_grad_(False)
    x = torch.randn(tokens, d_in, generator=g).to(dev, torch.bfloat16)
    ref = lin(x)
    rows = [dict(name="linear bf16", step_s=timed(lambda: lin(x), dev, args.warmup, args.steps * 4)[0])]
    quant.quantize_linear(lin, "fp8")
    for name, on in (("linear fp8 dequant", False), ("linear fp8 scaled_mm", True)):
        if on and not (dev != "cpu" and torch.cuda.get_device_capability() >= (8, 9)):
            rows.append(dict(name=name, error="needs a CUDA GPU with fp8 (sm89+)"))
            continue
        quant.set_scaled_mm(on)
        try:
            y = lin(x)
            rel = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            rows.append(dict(name=name, step_s=timed(lambda: lin(x), dev, args.warmup, args.steps * 4)[0],
                             max_rel_err=rel))
        except Exception as e:
            rows.append(dict(name=name, error=f"{type(e).__name__}: {e}"))
        finally:
            quant.set_scaled_mm(False)
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def reference_row(args, dev):
    """Plain diffusers + peft, bf16, eager, resident: no conductor, no checkpointing."""
    return model_row("ref diffusers+peft bf16 resident", args, dev, "none", "train", 0.0)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny widths: checks the script, measures nothing")
    add_flux_args(ap)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    args = ap.parse_args(argv)
    args.dims = {}
    dev = "cuda"
    if args.smoke:
        dev = "cpu"
        args.layers, args.singles, args.res, args.text, args.warmup, args.steps = 1, 1, 64, 8, 0, 1
        args.dims = dict(attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                         pooled_projection_dim=32, axes_dims_rope=(4, 4, 8), in_channels=16)
    else:
        torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN attention fails in backward there (GPU.md)
    fp8_mm = dev != "cpu" and torch.cuda.get_device_capability() >= (8, 9)
    # (name, model.quantize, kind, scaled_mm, model.quantize_modulation)
    configs = [("train f=1.0 bf16", "none", "train", False, False), ("train f=1.0 fp8", "fp8", "train", False, False),
               ("train f=1.0 fp8+mod", "fp8", "train", False, True)]
    if fp8_mm:
        configs.append(("train f=1.0 fp8 scaled_mm", "fp8", "train", True, False))
    configs += [("sample f=1.0 bf16", "none", "sample", False, False),
                ("sample f=1.0 fp8", "fp8", "sample", False, False),
                ("sample f=1.0 fp8+mod", "fp8", "sample", False, True)]
    rows = [reference_row(args, dev)]
    for name, mode, kind, mm, modulation in configs:
        free(dev)
        rows.append(model_row(name, args, dev, mode, kind, 1.0, scaled_mm=mm, modulation=modulation))
    free(dev)
    rows += linear_rows(args, dev)

    device = "cpu (smoke)" if dev == "cpu" else torch.cuda.get_device_name()
    print(f"\n{device}  {datetime.date.today()}  Flux {args.layers}+{args.singles} blocks, {args.res} px, "
          f"rank {args.rank}")
    print(f"{'configuration':40s} {'step s':>9s} {'peak GB':>8s} {'block MB':>9s} {'H2D GB/step':>12s}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:40s} {r['error']}")
            continue
        peak = f"{r['peak_allocated_gb']:.2f}" if r.get("peak_allocated_gb") is not None else "-"
        blk = f"{r['block_bytes'] / 1e6:.0f}" if "block_bytes" in r else "-"
        h2d = f"{r['h2d_bytes_per_step'] / 1e9:.2f}" if "h2d_bytes_per_step" in r else "-"
        extra = f"  max rel err {r['max_rel_err']:.3g}" if "max_rel_err" in r else ""
        print(f"{r['name']:40s} {r['step_s']:9.4f} {peak:>8s} {blk:>9s} {h2d:>12s}{extra}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_quant.json").write_text(json.dumps(dict(device=device, rows=rows), indent=1))
    return rows


if __name__ == "__main__":
    main()
