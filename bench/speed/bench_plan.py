#!/usr/bin/env python3
"""The memory planner against the GPU: predicted vs measured peak VRAM and step time, and the Flux presets' fit.

Full-size Flux.1-dev (11.9 B params, random bf16 weights built on the GPU), LoRA rank 16 on the adapter's
default targets (what `dittrain fit` adapts), batch 1, 512 text tokens, trained a few steps through the offload
conductor (`trainer.offload.attach_offload`) at 512 and 1024 px and fractions 0, 0.5, 0.9 (plus 1.0 with
activation offloading at 1024). For each configuration it prints the planner's prediction
(trainer/planner/prediction.py `predict`) beside the measurement:

- peak `torch.cuda.max_memory_reserved()` and `max_memory_allocated()` over the measured steps, counted from
  the moment the configuration is attached (`empty_cache` after attaching, so memory freed by the attach itself
  does not count), the first optimizer step included (Adam state is part of the steady state);
- the median step time (CUDA events, after warm-up), against the planner's step time from the DESIGN.md
  reference figures and from its own short measurement on this GPU (`trainer.planner.measure`);
- pinned host bytes and the conductor's measured H2D rate.

Then the Flux LoRA presets (configs/flux/lora-{8,16,24}gb.yaml) run at their fraction and resolution under a
VRAM cap of the card size minus 1 GB (`torch.cuda.set_per_process_memory_fraction`, the headroom the presets
assume for the CUDA context); an out-of-memory error is recorded as "does not fit", not raised.

    python -m bench.speed.bench_plan --out /tmp/bench_plan          # the whole run (about 5 minutes on an H100/H200)
    python -m bench.speed.bench_plan --quick --out /tmp/bp          # 1024 px at f=0.5 only, and one preset

Writes plan.json and plan.md (a markdown table for bench/RESULTS.md) under --out. Stops starting new
configurations after --budget-s seconds so the whole run stays under 8 minutes.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common.timing import build_bf16
from bench.speed.bench_offload import inputs  # the same full-size Flux inputs as the offload benchmark
from trainer import planner
from trainer.config import Config, load_config
from trainer.models.flux import FluxAdapter
from trainer.planner import timing as ptime
from trainer.planner import trace as ptrace

ROOT = Path(__file__).resolve().parents[2]

GB = 1e9
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------------------------- the model


def build(dev: str):
    from diffusers import FluxTransformer2DModel

    m = build_bf16(lambda: FluxTransformer2DModel(**FluxAdapter.full_config), dev)
    from peft import LoraConfig

    m.requires_grad_(False)
    m.add_adapter(
        LoraConfig(
            r=16,
            lora_alpha=16,
            target_modules=list(ptrace.default_lora_targets("flux")),
            init_lora_weights="gaussian",
        )
    )
    params = [p for p in m.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()  # the trainer keeps LoRA weights in fp32
    m.train()
    return m, params


def blocks_of(m):
    return ptrace.blocks_of("flux", m)


def attach(blocks, dev, fraction: float, activations: bool):
    """Whatever attach API trainer/offload exposes: attach_offload (keyword names filtered by its signature),
    else the Conductor class."""
    import trainer.offload as off

    fn = getattr(off, "attach_offload", None)
    kw = dict(mode="train", activations=activations, trainable=False)
    if fn is None:
        from trainer.offload.conductor import Conductor as fn  # noqa: N813
    names = set(inspect.signature(fn).parameters)
    return fn(blocks, dev, fraction, **{k: v for k, v in kw.items() if k in names})


def training_step(model, kw, target, opt):
    """One LoRA training step on the bench inputs: forward, MSE loss, backward, optimizer step."""

    def step():
        out = model(**kw)[0]
        F.mse_loss(out.float(), target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def detach(handle, model, params) -> None:
    """After a configuration: close the conductor, put every block back on the CPU (f = 0 leaves them on the GPU,
    and each configuration starts from the CPU), drop gradients, and return the freed memory to the driver."""
    handle.close()
    for b in blocks_of(model):
        b.to("cpu")
    for p in params:
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- one run


def run(model, params, dev, res, fraction, activations, args, cap_gb=None) -> dict:
    row = dict(res=res, fraction=fraction, activations=activations, cap_gb=cap_gb)
    handle = None
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        if cap_gb is not None:
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gb * GB / total))
        t0 = time.perf_counter()
        handle = attach(blocks_of(model), dev, fraction, activations)
        torch.cuda.synchronize()
        row["attach_s"] = time.perf_counter() - t0
        kw, target = inputs(dev, res)
        opt = torch.optim.AdamW(params, lr=1e-5)
        step = training_step(model, kw, target, opt)
        torch.cuda.empty_cache()  # memory the attach freed (GPU originals of packed blocks) is not the run's
        torch.cuda.reset_peak_memory_stats()
        times = []
        for i in range(args.warmup + args.steps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            step()
            e1.record()
            e1.synchronize()
            if i >= args.warmup:
                times.append(e0.elapsed_time(e1) / 1000)
        row.update(
            status="ok",
            step_s=statistics.median(times),
            steps_s=times,
            reserved_gb=torch.cuda.max_memory_reserved() / GB,
            allocated_gb=torch.cuda.max_memory_allocated() / GB,
        )
        st = handle.stats() if hasattr(handle, "stats") else {}
        row.update(
            pinned_gb=(st.get("pinned_bytes", 0) + st.get("activation_pinned_bytes", 0)) / GB,
            ring_gb=st.get("ring_bytes", 0) / GB,
            h2d_gbps=st.get("h2d_gbps"),
        )
    except torch.cuda.OutOfMemoryError as e:
        row.update(status="OOM", error=str(e).splitlines()[0][:200])
    except Exception as e:  # noqa: BLE001 - a failed configuration is a result; the others still run
        row.update(status="error", error=f"{type(e).__name__}: {e}"[:300])
        traceback.print_exc()
    finally:
        opt = kw = target = None  # noqa: F841 - drop Adam state and inputs before the next configuration
        if handle is not None:
            try:
                handle.close()
            except Exception as e:  # noqa: BLE001
                row["close_error"] = f"{type(e).__name__}: {e}"
        for b in blocks_of(model):  # f = 0 leaves blocks on the GPU: every configuration starts from the CPU
            b.to("cpu")
        for p in params:
            p.grad = None
        if cap_gb is not None:
            torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return row


def predicted(facts, res, fraction, activations, rates_ref, rates_gpu) -> dict:
    p = planner.predict(facts, fraction, res, activations, rates_ref)
    out = dict(
        pred_reserved_gb=p.peak_reserved / GB,
        pred_allocated_gb=p.peak_allocated / GB,
        pred_pinned_gb=(p.pinned + p.act_checkpoint_host) / GB,
        pred_step_ref_s=p.step_s,
        pred_static_gb=p.static / GB,
        pred_dynamic_gb=p.dynamic / GB,
    )
    if rates_gpu is not None:
        g = planner.predict(facts, fraction, res, activations, rates_gpu)
        out.update(pred_step_gpu_s=g.step_s, pred_host_s=g.host_s, pred_kernels_s=g.compute_s)
    return out


def lora_cfg(res_list) -> Config:
    return Config.model_validate(
        {
            "model": {"family": "flux", "path": "/nonexistent/FLUX.1-dev"},
            "train": {"method": "lora"},
            "lora": {"rank": 16, "alpha": 16},
            "data": {"sources": [{"path": "unused"}], "resolutions": res_list},
            "output": {"dir": "unused"},
        }
    )


# ------------------------------------------------------------------------------------------------- main


def _pct(pred, meas):
    return None if pred is None or meas in (None, 0) else 100.0 * (pred - meas) / meas


def markdown(meta, rows, presets) -> str:
    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    out = [
        f"### Planner vs measurement ({meta['date']}, {meta['device']}, torch {meta['torch']})",
        "",
        f"H2D pinned {f(meta.get('h2d_gbps'), '{:.1f}')} GB/s measured by the planner; "
        f"command: `{meta['command']}`",
        "",
        "| px | fraction | act | status | reserved GB pred / meas (err %) | allocated GB pred / meas | "
        "step s pred (ref) / pred (GPU) / meas (err % GPU) | host / kernels s pred (GPU) | pinned GB pred / meas "
        "| H2D GB/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        out.append(
            f"| {r['res']} | {r['fraction']:.2f} | {'on' if r['activations'] else 'off'} | {r['status']} "
            f"| {f(r.get('pred_reserved_gb'))} / {f(r.get('reserved_gb'))} ({f(r.get('reserved_err_pct'), '{:+.1f}')}) "
            f"| {f(r.get('pred_allocated_gb'))} / {f(r.get('allocated_gb'))} "
            f"| {f(r.get('pred_step_ref_s'))} / {f(r.get('pred_step_gpu_s'))} / {f(r.get('step_s'))} "
            f"({f(r.get('step_err_pct'), '{:+.1f}')}) "
            f"| {f(r.get('pred_host_s'))} / {f(r.get('pred_kernels_s'))} "
            f"| {f(r.get('pred_pinned_gb'))} / {f(r.get('pinned_gb'))} | {f(r.get('h2d_gbps'), '{:.1f}')} |"
        )
    # Calibration hints: what the allocator model's constant would have to be for each measured row.
    cal = []
    for r in rows:
        if r.get("status") == "ok" and r.get("pred_dynamic_gb"):
            implied = (r["reserved_gb"] - r["pred_static_gb"] - meta["workspace_gb"]) / r["pred_dynamic_gb"]
            alloc_dyn = r["allocated_gb"] - (r["pred_allocated_gb"] - r["pred_dynamic_gb"])
            cal.append(
                f"| {r['res']} | {r['fraction']:.2f} | {'on' if r['activations'] else 'off'} "
                f"| {r['pred_static_gb']:.2f} | {r['pred_dynamic_gb']:.2f} | {alloc_dyn:.2f} | {implied:.2f} |"
            )
    if cal:
        out += [
            "",
            f"Allocator model (planner: reserved = static + {meta['allocator_overhead']:.2f} x dynamic + "
            f"{meta['workspace_gb']:.2f} GB): dynamic measured = allocated peak - predicted static part; "
            "implied factor = (reserved - static - workspace) / predicted dynamic.",
            "",
            "| px | fraction | act | static GB pred | dynamic GB pred | dynamic GB meas | implied factor |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *cal,
        ]
    out += [
        "",
        "### Flux LoRA presets under a VRAM cap (card - 1 GB)",
        "",
        "| preset | fraction | px | act | cap GB | fits | reserved GB pred / meas | step s meas |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in presets:
        out.append(
            f"| {r['preset']} | {r['fraction']:.2f} | {r['res']} | {'on' if r['activations'] else 'off'} "
            f"| {r['cap_gb']:.0f} | {'yes' if r['status'] == 'ok' else 'NO (' + r['status'] + ')'} "
            f"| {f(r.get('pred_reserved_gb'))} / {f(r.get('reserved_gb'))} | {f(r.get('step_s'))} |"
        )
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench_plan_out"))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no new configuration after this")
    ap.add_argument("--quick", action="store_true", help="1024 px at f=0.5 and the 24 GB preset only")
    ap.add_argument("--no-measure", action="store_true", help="skip the planner's own GPU measurement")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("bench_plan.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = "cuda"
    torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN attention fails in backward on that machine (GPU.md)

    log("planner: analysing full-size Flux on the meta device")
    facts = planner.analyze(lora_cfg([512, 1024]))
    rates_ref, rates_gpu = ptime.reference_rates(), None
    if not args.no_measure:
        try:
            from trainer.planner.measure import measure

            rates_gpu = measure(facts)
            log(
                f"planner measurement: H2D {rates_gpu.h2d / GB:.1f} GB/s, D2H {rates_gpu.d2h / GB:.1f}, both "
                f"{rates_gpu.bidir / GB:.1f}; effective TFLOP/s per bucket "
                f"{ {r: round(v / 1e12) for r, v in rates_gpu.by_res.items()} } "
                f"(reference {rates_ref.flops_per_s / 1e12:.0f})"
            )
        except Exception as e:  # noqa: BLE001
            log(f"planner measurement failed: {type(e).__name__}: {e}")
        torch.cuda.empty_cache()

    log("building full-size Flux with random bf16 weights on the GPU")
    model, params = build(dev)
    for b in blocks_of(model):  # blocks start on the CPU, as after loading a checkpoint
        b.to("cpu")
    torch.cuda.empty_cache()
    log(
        f"Flux {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params, LoRA "
        f"{sum(p.numel() for p in params) / 1e6:.1f} M"
    )

    grid = (
        [(1024, 0.5, False)]
        if args.quick
        else [
            (512, 0.0, False),
            (512, 0.5, False),
            (512, 0.9, False),
            (1024, 0.0, False),
            (1024, 0.5, False),
            (1024, 0.9, False),
            (1024, 1.0, True),
        ]
    )
    rows = []
    for res, f, act in grid:
        if time.perf_counter() - T0 > args.budget_s:
            rows.append(dict(res=res, fraction=f, activations=act, status="skipped (time budget)"))
            continue
        r = run(model, params, dev, res, f, act, args)
        r.update(predicted(facts, res, f, act, rates_ref, rates_gpu))
        r["reserved_err_pct"] = _pct(r.get("pred_reserved_gb"), r.get("reserved_gb"))
        r["step_err_pct"] = _pct(r.get("pred_step_gpu_s", r.get("pred_step_ref_s")), r.get("step_s"))
        rows.append(r)
        log(json.dumps({k: v for k, v in r.items() if k != "steps_s"}))

    presets = []
    for gb in [24] if args.quick else [8, 16, 24]:
        path = ROOT / "configs" / "flux" / f"lora-{gb}gb.yaml"
        if time.perf_counter() - T0 > args.budget_s or not path.is_file():
            presets.append(
                dict(
                    preset=path.name,
                    fraction=0.0,
                    res=0,
                    activations=False,
                    cap_gb=gb - 1.0,
                    status="skipped" if path.is_file() else "missing",
                )
            )
            continue
        cfg = load_config(path)
        f, res, act = float(cfg.offload.transformer), max(cfg.data.resolutions), cfg.offload.activations
        r = run(model, params, dev, res, f, act, args, cap_gb=gb - 1.0)
        r.update(predicted(facts, res, f, act, rates_ref, rates_gpu), preset=path.name)
        presets.append(r)
        log(json.dumps({k: v for k, v in r.items() if k != "steps_s"}))

    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        command="python -m bench.speed.bench_plan " + " ".join(sys.argv[1:]),
        h2d_gbps=rates_gpu.h2d / GB if rates_gpu else None,
        gpu_flops=rates_gpu.by_res if rates_gpu else None,
        block_costs={
            res: {cls: dict(vars(c), block=i) for cls, (c, i) in d.items()}
            for res, d in (rates_gpu.blocks if rates_gpu else {}).items()
        },
        ref_flops=rates_ref.flops_per_s,
        allocator_overhead=planner.ALLOCATOR_OVERHEAD,
        workspace_gb=planner.WORKSPACE / GB,
        wall_s=time.perf_counter() - T0,
    )
    (args.out / "plan.json").write_text(json.dumps(dict(meta=meta, rows=rows, presets=presets), indent=1))
    md = markdown(meta, rows, presets)
    (args.out / "plan.md").write_text(md)
    print("\n" + md)
    log(f"wrote {args.out / 'plan.json'} and {args.out / 'plan.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
