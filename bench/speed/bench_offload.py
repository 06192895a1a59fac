#!/usr/bin/env python3
"""Full-size Flux (11.9 B params, random bf16 weights built on the GPU) at 1024x1024, batch 1, LoRA rank 16:
training and sampling steps resident vs streamed by the offload conductor, and diffusers' group offloading,
all in one process. Prints one table; writes bench.json and bench.md under --out.

    python -m bench.speed.bench_offload --out /tmp/bench            # the full run (a few minutes)
    python -m bench.speed.bench_offload --layers 2 --singles 4      # a quick smoke run

Timing: CUDA events around each step after warm-up, median of --steps. Memory: peak max_memory_reserved /
max_memory_allocated from the moment the configuration is attached (empty_cache first, so earlier
configurations do not count). Floors (DESIGN.md): training max(resident step, bytes moved per step / B_h2d),
sampling max(resident forward, bytes per forward / B_h2d), with B_h2d measured here on one pinned 1 GiB copy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common.timing import build_bf16, step_seconds
from trainer.config import OptimizerConfig
from trainer.models.flux import FluxAdapter
from trainer.offload import attach_offload
from trainer.offload.fused_state import bind_fused
from trainer.optim import FusedBackPass, build_optimizer

LORA_TARGETS = [
    "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out",
]  # fmt: skip


def h2d_rate(dev, nbytes=1 << 30, reps=6) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src, non_blocking=True)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    del src, dst
    return nbytes / (statistics.median(ts[1:]) * 1e6)


def add_flux_args(ap, text: bool = True, rank: bool = True) -> None:
    """The full-size Flux.1-dev step's arguments the Flux benches share (`build`, `inputs`, `add_lora` read them)."""
    ap.add_argument("--layers", type=int, default=19, help="double blocks")
    ap.add_argument("--singles", type=int, default=38, help="single blocks")
    ap.add_argument("--res", type=int, default=1024, help="image side, px")
    if text:
        ap.add_argument("--text", type=int, default=512, help="text tokens")
    if rank:
        ap.add_argument("--rank", type=int, default=16, help="LoRA rank")


def build(args, dev):
    from diffusers import FluxTransformer2DModel

    return build_bf16(
        lambda: FluxTransformer2DModel(num_layers=args.layers, num_single_layers=args.singles, guidance_embeds=True), dev)


def add_lora(m, rank):
    from peft import LoraConfig

    m.requires_grad_(False)
    m.add_adapter(
        LoraConfig(r=rank, lora_alpha=rank, target_modules=LORA_TARGETS, init_lora_weights="gaussian")
    )
    params = [p for p in m.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()  # as the trainer keeps LoRA weights
    return params


def inputs(dev, res, text=512, in_channels=64, joint_dim=4096, pooled_dim=768, out_channels=None):
    """Flux transformer inputs for one 1024 px image (res // 16 squared image tokens + `text` tokens) and a target;
    the channel sizes default to full-size Flux (other benches pass their model's config)."""
    side = res // 16
    n = side * side
    g = torch.Generator(device="cpu").manual_seed(1)

    def r(*s):
        return torch.randn(*s, generator=g).to(dev, torch.bfloat16)

    ids = torch.zeros(n, 3)
    ids[:, 1] = torch.arange(n) // side
    ids[:, 2] = torch.arange(n) % side
    kw = dict(
        hidden_states=r(1, n, in_channels),
        encoder_hidden_states=r(1, text, joint_dim),
        pooled_projections=r(1, pooled_dim),
        timestep=torch.tensor([0.5], device=dev, dtype=torch.bfloat16),
        guidance=torch.tensor([3.5], device=dev, dtype=torch.bfloat16),
        img_ids=ids.to(dev),
        txt_ids=torch.zeros(text, 3, device=dev),
        return_dict=False,
    )
    return kw, r(1, n, out_channels or in_channels).float()


def timed(fn, warmup, steps):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    s0 = torch.cuda.memory_stats()
    ts = step_seconds(fn, steps, True)
    s1 = torch.cuda.memory_stats()
    mallocs = s1["segment.all.allocated"] - s0["segment.all.allocated"]
    return ts, mallocs, s1["num_alloc_retries"] - s0["num_alloc_retries"]


class FusedAdamW:
    """A full fine-tune step with the trainer's own optimizer: AdamW from trainer.optim (`build_optimizer`; bf16
    weights step in fp32 and round back) inside backward (`FusedBackPass`: each gradient freed at once), bound to
    the offload handle as trainer/train/glue.py binds it (`bind_fused`: the state of streamed weights is the fp32
    pair the conductor packs beside them)."""

    def __init__(self, model, kw, target, lr=1e-6):
        self.model, self.kw, self.target = model, kw, target
        self.cfg = OptimizerConfig(name="adamw", lr=lr, fused_back_pass=True, stochastic_rounding=False)
        self.fused = None

    def bind(self, handle):
        """A fresh optimizer (the previous configuration's state dropped) whose steps follow `handle`'s blocks."""
        if self.fused is not None:
            self.fused.remove()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.fused = FusedBackPass(build_optimizer(params, self.cfg))
        bind_fused(handle, self.fused)

    def __call__(self):
        out = self.model(**self.kw)[0]
        F.mse_loss(out.float(), self.target).backward()
        self.fused.finish_step()


def block_list(m):
    """The blocks the conductor streams, in execution order, as the trainer gets them (the Flux adapter)."""
    return FluxAdapter().blocks(m)


def run3_sampling_plan(sizes, capacity, mode, min_blocks=2):
    """Control: the sampling plan of run 3, resident blocks spread evenly by *bytes* (the rule plan.py used
    before it spread the streamed bytes by position), to compare both rules in one process."""
    from trainer.offload.plan import make_plan, plan_for

    total = sum(sizes)
    budget = capacity - min_blocks * max(sizes)
    if mode != "sample" or capacity >= total or budget <= 0:
        return plan_for(sizes, capacity, mode, min_blocks)
    ratio = budget / total
    fixed, used, acc = set(), 0, 0.0
    for i, s in enumerate(sizes):
        acc += s * ratio
        if acc >= s and used + s <= budget:
            fixed.add(i)
            used += s
            acc -= s
    return make_plan(sizes, capacity, mode, fixed=frozenset(fixed))


def run_config(
    name,
    kind,
    model,
    dev,
    args,
    fraction,
    activations=False,
    group_offload=False,
    step_fn=None,
    nano=1,
    plan_fn=None,
    **attach_kw,
):
    import trainer.offload.conductor as conductor

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    handle = None
    if group_offload:
        from diffusers.hooks import apply_group_offloading

        model.to("cpu")
        apply_group_offloading(
            model, onload_device=torch.device(dev), offload_device=torch.device("cpu"),
            offload_type="block_level", num_blocks_per_group=1, use_stream=True,
        )  # fmt: skip
    else:
        saved = conductor.plan_for
        conductor.plan_for = plan_fn or saved  # the plan the conductor replays (a control row swaps it)
        try:
            handle = attach_offload(
                block_list(model),
                dev,
                fraction,
                mode="sample" if kind == "sample" else "train",
                activations=activations,
                nano_batches=nano,
                **attach_kw,
            )
        finally:
            conductor.plan_for = saved
    if attach_kw.get("trainable"):
        step_fn.bind(handle)  # drops the previous configuration's optimizer state
    torch.cuda.synchronize()
    attach_s = time.perf_counter() - t0
    torch.cuda.empty_cache()  # blocks that were on the GPU before attaching are cached, not in use
    torch.cuda.reset_peak_memory_stats()
    ts, mallocs, retries = timed(step_fn, args.warmup, args.steps)
    row = dict(
        name=name,
        kind=kind,
        fraction=fraction,
        activations=activations,
        step_s=statistics.median(ts),
        steps_s=ts,
        peak_reserved_gb=torch.cuda.max_memory_reserved() / 1e9,
        peak_allocated_gb=torch.cuda.max_memory_allocated() / 1e9,
        cuda_mallocs_timed=mallocs,
        alloc_retries_timed=retries,
        attach_s=attach_s,
    )
    if handle is not None:
        st = handle.stats()
        row.update(
            pinned_bytes=st["pinned_bytes"] + st["activation_pinned_bytes"],
            weights_pinned_bytes=st["pinned_bytes"],
            offloaded_bytes=st["offloaded_bytes"],
            ring_bytes=st["ring_bytes"],
            block_bytes=st["block_bytes"],
            h2d_bytes_per_step=st["h2d_bytes_per_step"],
            h2d_gbps=st.get("h2d_gbps"),
            fraction_in_ram=st.get("fraction_in_ram", 0.0),
        )
        t1 = time.perf_counter()
        handle.close()
        row["close_s"] = time.perf_counter() - t1
    print(json.dumps({k: v for k, v in row.items() if k != "steps_s"}), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    add_flux_args(ap, text=False)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--skip", default="", help="comma-separated config names to leave out")
    ap.add_argument(
        "--only",
        choices=["sample", "train"],
        help="only this kind's rows (sample: resident, f=1.0, f=0.5, f=0.5 with run 3's plan; no full FT)",
    )
    ap.add_argument(
        "--ft-layers", type=int, default=4, help="double blocks of the full fine-tune model (0: none)"
    )
    ap.add_argument("--ft-singles", type=int, default=8, help="single blocks of the full fine-tune model")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    dev = "cuda"
    torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN attention fails in backward there (GPU.md)
    B = h2d_rate(dev)
    print(f"pinned H2D {B:.1f} GB/s", flush=True)

    model = build(args, dev)
    params = add_lora(model, args.rank)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"Flux {nparams / 1e9:.2f} B params, LoRA {sum(p.numel() for p in params) / 1e6:.1f} M", flush=True)
    model.train()
    kw, target = inputs(dev, args.res)
    opt = torch.optim.AdamW(params, lr=1e-5)

    def train_step():
        out = model(**kw)[0]
        loss = F.mse_loss(out.float(), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sample_step():
        with torch.no_grad():
            model(**kw)

    configs = [
        ("sample resident", "sample", 0.0, False, False, sample_step, 1),
        ("train resident", "train", 0.0, False, False, train_step, 1),
        ("train f=0.5", "train", 0.5, False, False, train_step, 1),
        ("train f=0.5 +act", "train", 0.5, True, False, train_step, 1),
        ("train f=0.75", "train", 0.75, False, False, train_step, 1),
        ("train f=1.0", "train", 1.0, False, False, train_step, 1),
        ("train f=1.0 +act", "train", 1.0, True, False, train_step, 1),
        ("train f=1.0 +act +nano2", "train", 1.0, True, False, train_step, 2),
        ("sample f=1.0", "sample", 1.0, False, False, sample_step, 1),
        ("sample f=0.5", "sample", 0.5, False, False, sample_step, 1),
        ("sample diffusers group offload", "sample", 1.0, False, True, sample_step, 1),
    ]
    if args.only:
        configs = [c for c in configs if c[1] == args.only and not c[4]]
        args.ft_layers = 0
    if args.only == "sample":  # the run-3 plan beside the current one, same process, then the current again
        configs.append(("sample f=0.5 run3 plan", "sample", 0.5, False, False, sample_step, 1))
        configs.append(("sample f=0.5 again", "sample", 0.5, False, False, sample_step, 1))
    rows = []

    def attempt(name, kind, f, mdl, act, grp, fn, nano, **kw):
        if name in skip:
            return
        if "run3 plan" in name:
            kw["plan_fn"] = run3_sampling_plan
        try:
            rows.append(run_config(name, kind, mdl, dev, args, f, act, grp, fn, nano, **kw))
        except Exception as e:  # keep the other numbers; the failure is a result too
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
            rows.append(dict(name=name, kind=kind, fraction=f, error=f"{type(e).__name__}: {e}"))
            torch.cuda.synchronize()

    for name, kind, f, act, grp, fn, nano in configs:
        attempt(name, kind, f, model, act, grp, fn, nano)

    if args.ft_layers > 0 and args.ft_singles > 0:
        # Full fine-tune with the fused back pass on a shallower Flux (same block sizes): fp32 AdamW state for
        # every weight does not fit beside the whole model in host RAM here (10 bytes a parameter).
        del model, opt, params
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        a2 = argparse.Namespace(**{**vars(args), "layers": args.ft_layers, "singles": args.ft_singles})
        ft = build(a2, dev)
        ft.requires_grad_(True)
        ft.train()
        step = FusedAdamW(ft, kw, target)
        nft = sum(p.numel() for p in ft.parameters())
        print(f"full fine-tune model: {nft / 1e9:.2f} B params", flush=True)
        tag = f"({args.ft_layers}+{args.ft_singles} blocks)"
        attempt(f"full resident {tag}", "full", 0.0, ft, False, False, step, 1, trainable=True)
        attempt(
            f"full f=1.0 +act {tag}", "full", 1.0, ft, True, False, step, 1,
            trainable=True, optimizer_state=("exp_avg", "exp_avg_sq"),
        )  # fmt: skip

    # B: the larger of the 1 GiB probe and the median rate the conductor measured on its own copies
    rates = sorted(r["h2d_gbps"] for r in rows if r.get("h2d_gbps"))
    if rates:
        B = max(B, rates[len(rates) // 2])
    base = {r["kind"]: r["step_s"] for r in rows if "resident" in r["name"] and "step_s" in r}
    base_reserved = {
        r["kind"]: r["peak_reserved_gb"] for r in rows if "resident" in r["name"] and "step_s" in r
    }
    for r in rows:
        if "step_s" not in r or r["kind"] not in base:
            continue
        r["ratio_resident"] = r["step_s"] / base[r["kind"]]
        moved = r.get("h2d_bytes_per_step")
        if moved is None and "group" in r["name"]:  # diffusers moves every block once a forward
            moved = next(x["block_bytes"] for x in rows if x.get("kind") == "sample" and "block_bytes" in x)
        r["floor_s"] = max(base[r["kind"]], (moved or 0) / (B * 1e9))
        r["ratio_floor"] = r["step_s"] / r["floor_s"]
        r["reserved_vs_resident"] = r["peak_reserved_gb"] / base_reserved[r["kind"]]
        if "block_bytes" in r:  # DESIGN.md's floor: 2 f W / B (training), f W / B (sampling)
            passes = 1 if r["kind"] == "sample" else 2
            r["design_floor_s"] = max(
                base[r["kind"]], passes * r["fraction_in_ram"] * r["block_bytes"] / (B * 1e9)
            )
            r["ratio_design_floor"] = r["step_s"] / r["design_floor_s"]

    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        h2d_gbps=B,
        params=nparams,
        args={k: str(v) for k, v in vars(args).items()},
    )
    try:
        import diffusers

        meta["diffusers"] = diffusers.__version__
    except Exception:
        pass
    (args.out / "bench.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [
        f"{meta['date']} {meta['device']} torch {meta['torch']} diffusers {meta.get('diffusers')} "
        f"H2D {B:.1f} GB/s, {nparams / 1e9:.2f} B params, {args.res}px, LoRA r{args.rank}",
        "",
        "| config | step s | x resident | floor s | x floor | x DESIGN floor | peak reserved GB | peak alloc GB "
        "| pinned GB | ring GB | H2D GB/step | H2D GB/s | mallocs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def g(r, k, fmt="{:.3f}", scale=1.0):
        v = r.get(k)
        return "-" if v is None else fmt.format(v / scale)

    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | FAILED: {r['error'][:80]} |")
            continue
        lines.append(
            f"| {r['name']} | {g(r, 'step_s')} | {g(r, 'ratio_resident', '{:.2f}')} | {g(r, 'floor_s')} "
            f"| {g(r, 'ratio_floor', '{:.2f}')} | {g(r, 'ratio_design_floor', '{:.2f}')} "
            f"| {g(r, 'peak_reserved_gb', '{:.2f}')} "
            f"| {g(r, 'peak_allocated_gb', '{:.2f}')} | {g(r, 'pinned_bytes', '{:.1f}', 1e9)} "
            f"| {g(r, 'ring_bytes', '{:.1f}', 1e9)} | {g(r, 'h2d_bytes_per_step', '{:.1f}', 1e9)} "
            f"| {g(r, 'h2d_gbps', '{:.1f}')} | {r.get('cuda_mallocs_timed', '-')} |"
        )
    (args.out / "bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
