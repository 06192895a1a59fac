#!/usr/bin/env python3
"""Full fine-tune of the WHOLE Flux transformer (19 double + 38 single blocks, 11.9 B parameters, random bf16
weights built on the GPU) with the fused back pass and Adafactor (the full-fine-tune presets' optimizer:
trainer/optim `build_optimizer` -> `Fp32StepOptimizer` over transformers' Adafactor, stochastic rounding),
every block streamed by the offload conductor, its factored Adafactor state packed beside each weight
(`attach_offload(..., trainable=True, optimizer_state=fused.state_layout)` + `bind_fused`). 1024x1024,
batch 1, per-block checkpointing, activation offloading on. Issue 5's target "full fine-tune of Flux-12B
with the fused back pass in <= 24 GB reserved" had only been measured on a 2.56 B cut with AdamW
(bench/speed/bench_offload.py --ft-layers/--ft-singles): AdamW state at full depth does not fit the machine's RAM,
Adafactor's does (weights 23.7 GB bf16 + a few hundred MB of row/column moments).

Configurations, in this order (the first one is the one the target needs):
  full f=1.0 +act      every block streamed (ring = two blocks)
  full f=0.75 +act     if the time budget allows
  full resident        (fraction 0, blocks on the GPU, ~30 GB: an H200/H100 reference for "x resident";
                        impossible on a 24 GB card; --no-resident leaves it out)
`--state packed,ram` adds, per fraction, the wiring `dittrain fit` uses today (trainer/train/method.py: optimizer
built after attaching, the state of streamed weights in pinned RAM through trainer/optim `StateOffload`, copied
to the GPU and back around each parameter's step) beside the packed one.

Reported per configuration: step time (CUDA events, median of --steps after --warmup), ratio to the transfer
floor (bytes the plan moves host->device per step / measured H2D rate, the rate being the larger of a 1 GiB
pinned probe and the median rate of the conductor's own copies, as in bench_offload.py) and to the resident
step when measured, peak max_memory_reserved / max_memory_allocated (reset after attaching), pinned host
bytes (weight+state arena and activation arena), the process's peak RSS, bytes written back device->host per
step, loss finite on every step, every parameter stepped, and whether probe weights (first/last block, a 1-D
block parameter, a non-block parameter) actually changed. OOM and other failures are caught and recorded as
rows. Results are rewritten after every configuration (partial results survive a kill): fullft.json and
fullft.md under --out.

Run on the GPU machine (diffusers and pydantic come from the carried `.whl`, see ../shared/GPU.md), under
240 s on an H200 (build ~1-20 s, attach/pin ~10-20 s and close ~5-10 s per configuration, 1 + 3 steps each):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 \
      && python -m bench.speed.bench_fullft --out $OUT 2>&1 | tee $OUT/fullft.log

(with the `run` tool: carry [".whl"]; `.whl` is made by ../shared/tools/gpu-wheels.sh). `--budget-s` (200)
skips a configuration whose estimated end lies past it; --fractions / --state / --no-resident choose them.

On the CPU (no GPU; tiny Flux, bf16, wall-clock timing, no memory stats) to check the script itself:

    python -m bench.speed.bench_fullft --smoke --out /tmp/fullft-smoke

Loss check: the trainer checks the loss before backward (fused: backward IS the optimizer step); here it is
read after each step's end event instead, so no extra host-device sync sits between forward and backward.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common.timing import build_bf16
from bench.speed.bench_offload import block_list, h2d_rate
from bench.speed.bench_offload import inputs as _flux_inputs
from trainer.config import OptimizerConfig
from trainer.offload import attach_offload, bind_fused
from trainer.optim import FusedBackPass, StateOffload, build_optimizer

T0 = time.perf_counter()


def log(msg: str) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")
    print(f"[{now} +{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def build(args, dev):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    kw = dict(num_layers=args.layers, num_single_layers=args.singles, guidance_embeds=True)
    if args.smoke:  # tiny widths; same block types
        kw.update(
            in_channels=16, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
            pooled_projection_dim=32, axes_dims_rope=(4, 6, 6),
        )  # fmt: skip
    return build_bf16(lambda: FluxTransformer2DModel(**kw), dev)


def inputs(model, dev, res, text):
    """bench_offload.inputs sized from model.config (the smoke model is narrower than Flux)."""
    c = model.config
    return _flux_inputs(dev, res, text, in_channels=c.in_channels, joint_dim=c.joint_attention_dim,
                        pooled_dim=c.pooled_projection_dim, out_channels=c.out_channels)


def probes(model) -> dict[str, torch.nn.Parameter]:
    """A few parameters whose values before/after show that the step wrote the weights."""
    blocks = block_list(model)
    out = {}
    for tag, blk in (("first block", blocks[0]), ("last block", blocks[-1])):
        for name, p in blk.named_parameters():
            if p.dim() == 2:
                out[f"{tag} {name}"] = p
                break
    for name, p in blocks[0].named_parameters():
        if p.dim() == 1:
            out[f"first block {name} (1-D)"] = p
            break
    out["non-block proj_out.weight"] = model.proj_out.weight
    return out


def snapshot(ps: dict) -> dict[str, torch.Tensor]:
    return {k: p.detach().to("cpu", torch.float32, copy=True) for k, p in ps.items()}


def compare(ps: dict, before: dict) -> dict:
    res = {}
    for k, p in ps.items():
        now = p.detach().to("cpu", torch.float32)
        if now.shape != before[k].shape:
            res[k] = dict(error=f"shape {tuple(now.shape)} vs {tuple(before[k].shape)}")
            continue
        d = (now - before[k]).abs()
        res[k] = dict(
            changed_frac=float((d > 0).float().mean()),
            max_abs_diff=float(d.max()),
            finite=bool(torch.isfinite(now).all()),
        )
    return res


class Timer:
    """CUDA events on a GPU (the step's device time), wall clock on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __call__(self, fn):
        if not self.cuda:
            t = time.perf_counter()
            out = fn()
            return time.perf_counter() - t, out
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out = fn()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1) / 1000, out


def run_config(name, model, dev, args, fraction, activations, kw, target, opt_cfg, budget_s, state="packed"):
    """state: "packed" (optimizer state packed beside each streamed weight, `bind_fused`) or "ram" (as
    `dittrain fit` wires it: optimizer built after attaching, trainer/optim `StateOffload` for streamed params)."""
    cuda = dev.startswith("cuda")
    row = dict(name=name, fraction=fraction, activations=activations, state=state)
    if cuda:
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
    params = [p for p in model.parameters() if p.requires_grad]
    ps = probes(model)
    before = snapshot(ps)
    handle = fused = None
    d2h = [0]
    try:
        t0 = time.perf_counter()
        log(f"{name}: attaching (fraction {fraction}, activations {activations}, optimizer state {state})")
        blocks = block_list(model)
        if state == "packed":
            fused = FusedBackPass(build_optimizer(params, opt_cfg, seed=0))
            handle = attach_offload(
                blocks, dev, fraction, mode="train", activations=activations,
                trainable=True, optimizer_state=fused.state_layout,
            )  # fmt: skip
            bind_fused(handle, fused)
        else:
            handle = attach_offload(
                blocks, dev, fraction, mode="train", activations=activations, trainable=True
            )
            fused = FusedBackPass(build_optimizer(params, opt_cfg, seed=0))
            plan = handle.plan
            streamed = [
                p for i in (plan.streamed if plan is not None else []) for p in blocks[i].parameters()
            ]
            off = StateOffload(streamed)
            fused.add_step_hooks(pre=off.pre, post=off.post, synchronize=off.synchronize)
        c = handle._c
        if c.streaming:  # count the write-back bytes (weights + packed state, device -> host)
            orig_wb = c._write_back

            def counted(x, compute, _orig=orig_wb, _c=c):
                d2h[0] += _c.plan.sizes[x]
                return _orig(x, compute)

            c._write_back = counted
        for mod in (model.x_embedder, model.context_embedder, model.time_text_embed, model.norm_out,
                    model.proj_out, model.pos_embed):  # fmt: skip
            mod.to(dev)  # non-block modules are the caller's (already there when built on the GPU)
        if cuda:
            torch.cuda.synchronize()
        row["attach_s"] = time.perf_counter() - t0
        st = handle.stats()
        row.update(
            block_bytes=st["block_bytes"], offloaded_bytes=st["offloaded_bytes"], ring_bytes=st["ring_bytes"],
            weights_pinned_bytes=st["pinned_bytes"], h2d_bytes_per_step=st["h2d_bytes_per_step"],
            fraction_in_ram=st.get("fraction_in_ram", 0.0),
            opt_state_bytes=sum(pk_s[3] for pk in c.packs for pk_s in pk.states),
        )  # fmt: skip
        log(
            f"{name}: attached in {row['attach_s']:.1f} s; ring {row['ring_bytes'] / 1e9:.2f} GB, "
            f"arena {row['weights_pinned_bytes'] / 1e9:.2f} GB (packed optimizer state "
            f"{row['opt_state_bytes'] / 1e9:.3f} GB), plan moves {row['h2d_bytes_per_step'] / 1e9:.1f} GB/step"
        )
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

        stepped = []

        def step():
            out = model(**kw)[0]
            loss = F.mse_loss(out.float(), target)
            loss.backward()  # the fused pass steps and frees every gradient in here
            stepped.append(fused.stepped)
            fused.finish_step()
            return loss.detach()

        timer = Timer(cuda)
        losses, ts = [], []
        for i in range(args.warmup):
            t, loss = timer(step)
            losses.append(float(loss))  # host-device sync, after the step's end event
            log(f"{name}: warm-up step {i + 1}: {t:.3f} s, loss {losses[-1]:.5f}")
            if time.perf_counter() - T0 + t * args.steps > budget_s:
                log(f"{name}: timing {args.steps} steps would pass the time budget; timing 1")
                args = argparse.Namespace(**{**vars(args), "steps": 1})
        s0 = torch.cuda.memory_stats() if cuda else None
        d2h[0] = 0
        for i in range(args.steps):
            t, loss = timer(step)
            ts.append(t)
            losses.append(float(loss))
            log(f"{name}: step {i + 1}: {t:.3f} s, loss {losses[-1]:.5f}")
        row["d2h_bytes_per_step"] = d2h[0] / max(1, args.steps)
        row.update(step_s=statistics.median(ts), steps_s=ts, losses=losses)
        row["loss_finite"] = all(v == v and abs(v) != float("inf") for v in losses)
        row["params_stepped"] = stepped[-1] if stepped else 0
        row["params_trainable"] = len(params)
        if cuda:
            s1 = torch.cuda.memory_stats()
            row.update(
                peak_reserved_gb=torch.cuda.max_memory_reserved() / 1e9,
                peak_allocated_gb=torch.cuda.max_memory_allocated() / 1e9,
                cuda_mallocs_timed=s1["segment.all.allocated"] - s0["segment.all.allocated"],
                alloc_retries_timed=s1["num_alloc_retries"] - s0["num_alloc_retries"],
            )
        st = handle.stats()  # synchronises; h2d_gbps of the last step's copies
        row.update(
            pinned_bytes=st["pinned_bytes"] + st["activation_pinned_bytes"],
            activation_pinned_bytes=st["activation_pinned_bytes"],
            h2d_gbps=st.get("h2d_gbps"),
        )
    except Exception as e:  # OOM included: the failure is a result too
        oom = isinstance(e, torch.OutOfMemoryError)
        row["error"] = ("OOM: " if oom else "") + f"{type(e).__name__}: {str(e)[:300]}"
        log(f"{name}: FAILED {row['error']}")
        traceback.print_exc()
        sys.stderr.flush()
        if cuda:
            try:  # after a sticky CUDA error (not OOM) even this raises
                row["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
                row["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
            except Exception:
                row["cuda_broken"] = True
    finally:
        row["host_rss_peak_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
        t1 = time.perf_counter()
        try:
            if handle is not None:
                handle.close()  # streamed blocks come back as CPU tensors with their current values
            row["close_s"] = time.perf_counter() - t1
        except Exception as e:
            row["close_error"] = f"{type(e).__name__}: {e}"
            log(f"{name}: close FAILED {row['close_error']}")
        if fused is not None:
            fused.remove()
        if "close_error" not in row:
            try:
                row["weights"] = compare(ps, before)
                row["weights_changed"] = all(
                    v.get("changed_frac", 0) > 0 and v.get("finite") for v in row["weights"].values()
                )
            except Exception as e:
                row["weights_error"] = f"{type(e).__name__}: {e}"
        fused = handle = None  # drop the optimizer (its state) and the conductor before the next one
        gc.collect()
        if cuda:
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception as e:
                row["cuda_broken"] = True
                log(f"{name}: the CUDA context is unusable after this failure ({type(e).__name__}: {e})")
    slim = {k: v for k, v in row.items() if k not in ("steps_s", "weights")}
    log(f"{name}: {json.dumps(slim)}")
    if "weights" in row:
        for k, v in row["weights"].items():
            log(f"{name}:   weight {k}: {v}")
    return row


def finish(rows, meta, args, B_probe):
    """Floors and ratios; write fullft.json / fullft.md; print the table. Called after every configuration."""
    rates = sorted(r["h2d_gbps"] for r in rows if r.get("h2d_gbps"))
    B = B_probe
    if B is not None and rates:
        B = max(B, rates[len(rates) // 2])
    meta["h2d_gbps"] = B
    meta["h2d_probe_gbps"] = B_probe
    res = next((r for r in rows if r["fraction"] == 0.0 and "step_s" in r), None)
    for r in rows:
        if "step_s" not in r:
            continue
        if B and r.get("h2d_bytes_per_step"):
            r["transfer_floor_s"] = r["h2d_bytes_per_step"] / (B * 1e9)
            r["ratio_transfer_floor"] = r["step_s"] / r["transfer_floor_s"]
        if res is not None:
            r["ratio_resident"] = r["step_s"] / res["step_s"]
            r["floor_s"] = max(res["step_s"], r.get("transfer_floor_s", 0.0))
            r["ratio_floor"] = r["step_s"] / r["floor_s"]
    (args.out / "fullft.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))

    def g(r, k, fmt="{:.3f}", scale=1.0):
        v = r.get(k)
        return "-" if v is None else fmt.format(v / scale)

    bstr = "-" if B is None else f"{B:.1f} GB/s"
    lines = [
        f"{meta['date']} {meta['device']} torch {meta['torch']} diffusers {meta.get('diffusers')} "
        f"transformers {meta.get('transformers')}; H2D {bstr}; Flux {meta['params'] / 1e9:.2f} B params "
        f"({args.layers}+{args.singles} blocks), {args.res}px, batch 1, full fine-tune, fused back pass, "
        f"Adafactor lr {args.lr:g} (bf16 weights, fp32 step, stochastic rounding), per-block checkpointing; "
        f"{args.warmup} warm-up + median of {args.steps} steps",
        "",
        "| config | step s | transfer floor s | x transfer floor | x resident | peak reserved GB | peak alloc GB "
        "| pinned GB | host RSS peak GB | ring GB | opt state GB | H2D GB/step | D2H GB/step | H2D GB/s "
        "| loss finite | params stepped | weights changed | mallocs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
        "| --- |",
    ]
    for r in rows:
        if "step_s" not in r:
            why = r.get("error") or r.get("skipped") or "?"
            lines.append(
                f"| {r['name']} | FAILED/SKIPPED: {why[:120]} | | | | {g(r, 'peak_reserved_gb', '{:.2f}')} "
                f"| {g(r, 'peak_allocated_gb', '{:.2f}')} | | | | | | | | | | | |"
            )
            continue
        lines.append(
            f"| {r['name']} | {g(r, 'step_s')} | {g(r, 'transfer_floor_s')} "
            f"| {g(r, 'ratio_transfer_floor', '{:.2f}')} | {g(r, 'ratio_resident', '{:.2f}')} "
            f"| {g(r, 'peak_reserved_gb', '{:.2f}')} | {g(r, 'peak_allocated_gb', '{:.2f}')} "
            f"| {g(r, 'pinned_bytes', '{:.2f}', 1e9)} | {g(r, 'host_rss_peak_gb', '{:.1f}')} "
            f"| {g(r, 'ring_bytes', '{:.2f}', 1e9)} | {g(r, 'opt_state_bytes', '{:.3f}', 1e9)} "
            f"| {g(r, 'h2d_bytes_per_step', '{:.1f}', 1e9)} | {g(r, 'd2h_bytes_per_step', '{:.1f}', 1e9)} "
            f"| {g(r, 'h2d_gbps', '{:.1f}')} | {r.get('loss_finite')} "
            f"| {r.get('params_stepped')}/{r.get('params_trainable')} | {r.get('weights_changed', '-')} "
            f"| {r.get('cuda_mallocs_timed', '-')} |"
        )
    lines += [
        "",
        "transfer floor = bytes the plan moves host->device per step / H2D rate (the larger of a 1 GiB pinned "
        "probe and the median of the conductor's own copy rates). pinned = weight+state arena + activation "
        "arena. D2H = write-backs of stepped blocks (weights + packed state), on their own stream. "
        "x resident: the resident full fine-tune in the same process (a GPU-memory reference only: ~30 GB).",
    ]
    (args.out / "fullft.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=None, help="double blocks (default 19; smoke 2)")
    ap.add_argument("--singles", type=int, default=None, help="single blocks (default 38; smoke 4)")
    ap.add_argument("--res", type=int, default=None, help="pixels per side (default 1024; smoke 64)")
    ap.add_argument("--text", type=int, default=None, help="text tokens (default 512; smoke 8)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-5, help="Adafactor lr (the presets' 1e-5)")
    ap.add_argument("--fractions", default="1.0,0.75", help="streamed configurations, in order")
    ap.add_argument(
        "--state", default="packed",
        help="optimizer state of streamed weights: packed (beside each weight, bind_fused), ram (trainer/optim "
        "StateOffload, as `dittrain fit` wires it), or both: packed,ram (each fraction runs once per mode)",
    )  # fmt: skip
    ap.add_argument("--no-resident", action="store_true", help="leave out the resident reference")
    ap.add_argument("--no-act", action="store_true", help="activation offloading off in streamed configs")
    ap.add_argument(
        "--budget-s", type=float, default=200.0,
        help="skip a configuration that would end after this many seconds from start (estimated)",
    )  # fmt: skip
    ap.add_argument("--device", default=None, help="default cuda; smoke: cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny Flux on the CPU: checks the script, not speed")
    ap.add_argument("--out", type=Path, default=Path("bench_out_fullft"))
    args = ap.parse_args()
    dflt = dict(layers=2, singles=4, res=64, text=8) if args.smoke else dict(layers=19, singles=38, res=1024,
                                                                             text=512)  # fmt: skip
    for k, v in dflt.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    dev = args.device or ("cpu" if args.smoke else "cuda")
    cuda = dev.startswith("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    log(f"start: {dev}, {args.layers}+{args.singles} blocks, {args.res}px, budget {args.budget_s:.0f} s")

    B_probe = None
    if cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN attention fails in backward there (GPU.md)
        B_probe = h2d_rate(dev)
        log(f"pinned H2D probe {B_probe:.1f} GB/s")

    t = time.perf_counter()
    model = build(args, dev)
    model.requires_grad_(True)
    model.train()
    if cuda:
        torch.cuda.synchronize()
    nparams = sum(p.numel() for p in model.parameters())
    log(f"built Flux {nparams / 1e9:.3f} B params on {dev} in {time.perf_counter() - t:.1f} s")
    kw, target = inputs(model, dev, args.res, args.text)
    opt_cfg = OptimizerConfig(
        name="adafactor", lr=args.lr, fused_back_pass=True, max_grad_norm=None, stochastic_rounding=True
    )

    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name() if cuda else "cpu",
        torch=torch.__version__,
        params=nparams,
        optimizer=opt_cfg.model_dump(),
        args={k: str(v) for k, v in vars(args).items()},
    )
    for mod in ("diffusers", "transformers"):
        try:
            meta[mod] = __import__(mod).__version__
        except Exception:
            pass

    configs = []
    for f in filter(None, (x.strip() for x in args.fractions.split(","))):
        for st in filter(None, (x.strip() for x in args.state.split(","))):
            if st not in ("packed", "ram"):
                raise SystemExit(f"--state: {st!r} is not packed or ram")
            tag = ("" if args.no_act else " +act") + ("" if st == "packed" else " state in RAM")
            configs.append((f"full f={float(f)}{tag}", float(f), not args.no_act, st))
    if not args.no_resident:
        configs.append(("full resident", 0.0, False, "packed"))
    rows = []
    est = None  # (attach + close s, step s) from the last streamed configuration
    for name, f, act, st in configs:
        elapsed = time.perf_counter() - T0
        if est is None:
            need = 0.0 if not rows else 60.0  # the first configuration always runs
        elif f == 0.0:
            need = 15.0 + (args.warmup + args.steps) * est[1] * 1.5  # blocks moved to the GPU, no pinning
        else:
            need = est[0] * 1.3 + (args.warmup + args.steps) * est[1] * 1.5 + 5.0
        if elapsed + need > args.budget_s:
            log(
                f"{name}: skipped (elapsed {elapsed:.0f} s + estimated {need:.0f} s > budget {args.budget_s:.0f} s)"
            )
            rows.append(dict(name=name, fraction=f, activations=act, state=st, skipped="time budget"))
            finish(rows, meta, args, B_probe)
            continue
        try:
            row = run_config(name, model, dev, args, f, act, kw, target, opt_cfg, args.budget_s, st)
        except Exception as e:  # anything run_config's own handlers let through: record it, keep the rest
            traceback.print_exc()
            row = dict(name=name, fraction=f, activations=act, state=st, error=f"{type(e).__name__}: {e}")
        rows.append(row)
        if row.get("cuda_broken"):
            log("stopping: the CUDA context is broken; the remaining configurations would fail the same way")
            finish(rows, meta, args, B_probe)
            break
        if "step_s" in row and f > 0:
            est = (row.get("attach_s", 20.0) + row.get("close_s", 10.0), max(row["steps_s"]))
        finish(rows, meta, args, B_probe)
    log("done")


if __name__ == "__main__":
    main()
