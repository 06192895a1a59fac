"""Costs behind the planner's step time: GPU seconds from FLOPs (reference figures or a short GPU measurement),
host seconds per block, copy rates. trainer/planner/replay.py turns them into a step.

Compute. Forward FLOPs of the blocks are counted exactly on the meta device (trace). A training step costs a
multiple of them: with gradient checkpointing the forward runs twice (forward, recompute), and backward costs
one forward for the input gradients of every matmul, one more for weight gradients when the weights train (full
fine-tuning; LoRA's weight gradients are negligible), and two forwards for attention (its backward recomputes
the scores). The rate that turns FLOPs into seconds is calibrated once on this code's own H200 measurement:
Flux.1-dev LoRA rank 16 at 1024x1024, batch 1, gradient checkpointing, 0.92 s of kernels a step (torch 2.11,
diffusers 0.42.1), a step the GPU's kernels fill. An H100 has the same compute (both GH100); other GPUs are
scaled by nothing, so measure: with a GPU present, `dittrain plan` runs one block of every class at each
bucket's shapes (trainer/planner/measure.py) and times the host's launches and the GPU's work apart
(`split_time`), which is what decides small buckets: there the host, not the GPU, sets the pace.

Transfer. Host-to-device bytes per step come from the offload plan (trainer/offload/plan.py, the same code the
conductor replays), plus the checkpoint inputs coming back in backward under activation offloading;
device-to-host bytes are the write-back of trained streamed blocks and the checkpoint inputs leaving in forward.
Rates: the H200 figures (pinned H2D 55.4 GB/s, D2H 55.3 GB/s, both at once 100.7 GB/s; DESIGN.md, and measured
again there at 55.0-55.4 GB/s) or a measured pinned 1 GB copy.

A full fine-tune's optimizer steps run inside backward, one parameter at a time (fused back pass): they are
charged per parameter at the rate measured for Flux-12B with Adafactor (`REF_FULL_STEP_S_PER_PARAM`), to the
backward of the block that owns the parameter. Left out: LoRA's optimizer step (milliseconds) and the host's
launches for the layers outside the blocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from .replay import REF_HOST_S_PER_OP, BlockCost, reference_costs

# Reference GPU time, measured with this project's code on the H200 machine (torch 2.11, diffusers 0.42.1, peft
# 0.21; bench/RESULTS.md). DESIGN.md's figures for the same GPU (0.775 s and 0.198 s) come from another software
# stack and are 16-34 % faster than what this code's kernels take, so predictions from them ran low.
REF_STEP_S = 0.92  # Flux.1-dev LoRA r16, 1024x1024, batch 1, checkpointing: kernels busy (profiler, 02:10 UTC)
REF_FORWARD_S = 0.298  # Flux.1-dev resident forward (one sampling step), 1024x1024, batch 1 (run 5, 01:35 UTC)
# A full fine-tune's optimizer steps (fused back pass, Adafactor with fp32 math and stochastic rounding to bf16, one
# parameter at a time inside backward): the resident Flux-12B full fine-tune at 1024 px took 1.339 s on the H200
# (bench/history/2026-11-22.md, 02:39 UTC) where its kernels for forward and backward alone take the 1.146 s the FLOP model
# gives: 0.193 s for 11.90 B parameters.
REF_FULL_STEP_S_PER_PARAM = 0.193 / 11.90e9
REF_H2D = 55.4e9
REF_D2H = 55.3e9
REF_BIDIR = 100.7e9
# Forward FLOPs of that reference (trace of the built-in Flux.1-dev config with adapter-default LoRA r16 at
# 1024x1024, 512 text tokens; tests/test_planner.py re-derives them): matmuls and attention.
REF_LINEAR_FLOPS = 59_856_523_886_592
REF_ATTN_FLOPS = 14_872_398_004_224


def train_flops(linear: float, attn: float, *, checkpointing: bool, weights_train: bool) -> float:
    """FLOPs of one training step from forward FLOPs (see the module essay)."""
    fwd_passes = 2 if checkpointing else 1
    lin = linear * (fwd_passes + 1 + (1 if weights_train else 0))
    att = attn * (fwd_passes + 2)
    return lin + att


REF_TRAIN_FLOPS = train_flops(REF_LINEAR_FLOPS, REF_ATTN_FLOPS, checkpointing=True, weights_train=False)


@dataclass
class Rates:
    flops_per_s: float  #: effective training FLOP rate (calibrated or measured)
    h2d: float  #: bytes/s, pinned host to device
    d2h: float
    bidir: float  #: both directions at once, total
    source: str  #: where the numbers come from, for the printed assumptions
    by_res: dict = field(default_factory=dict)  #: measured training FLOP rate per bucket side (px)
    #: measured per bucket side: {block class name: (BlockCost, index of the block measured)}
    blocks: dict = field(default_factory=dict)

    def rate(self, res: int) -> float:
        """FLOP rate for a bucket: measured at that size when it was, else the general one."""
        return self.by_res.get(res, self.flops_per_s)


def block_train_flops(tr, n: int, checkpointing: bool, weights_train: bool) -> list[float]:
    """Per block: the FLOPs of its training pass (every block attends over the same tokens: an equal share of
    the traced attention FLOPs)."""
    attn = tr.attn_flops / max(1, n)
    return [
        train_flops(lin, attn, checkpointing=checkpointing, weights_train=weights_train)
        for lin in tr.block_linear_flops
    ]


def block_costs(
    blocks, tr, rates: Rates, res: int, weights_train: bool, checkpointing: bool, syncs: bool = False
) -> list[BlockCost]:
    """Per block: host and GPU seconds of its forward and of its recompute + backward at bucket `res`.

    Measured classes (`rates.blocks[res]`) use the measurement, the GPU part scaled by the block's matmul FLOPs
    against the measured block's (blocks of one class differ only at the ends, e.g. SD3's last); otherwise GPU
    time is FLOPs over the rate and host time comes from the traced operation count
    (trainer/planner/replay.py; without `checkpointing` less a recompute's launches, as a block that keeps its
    activations under auto: `BlockCost.without_recompute`); `syncs`: the blocks wait on the GPU inside (the family's `blocks_sync_host`), so
    their launches and kernels add up (`BlockCost.syncs`). A measured block's time is its wall time where it syncs
    (`split_time` falls back to it), which the replay's overlap then takes as it is."""
    attn = tr.attn_flops / max(1, len(blocks))
    fwd = [lin + attn for lin in tr.block_linear_flops]
    train = block_train_flops(tr, len(blocks), checkpointing, weights_train)
    rate = rates.rate(res)
    costs = reference_costs(
        tr.block_ops, [f / rate for f in fwd], [(t - f) / rate for t, f in zip(train, fwd, strict=True)], syncs
    )
    if not checkpointing:  # the host's per-operation cost is for a checkpointed pass: no recompute to launch here
        costs = [replace(c, host_bwd=max(0.0, c.host_bwd - c.host_fwd)) for c in costs]
    measured = rates.blocks.get(res, {})
    for b, blk in enumerate(blocks):
        got = measured.get(type(blk).__name__)
        if got is not None:
            cost, idx = got
            ref = tr.block_linear_flops[idx] or 1
            costs[b] = cost.scaled(gpu=(tr.block_linear_flops[b] or ref) / ref)
    return costs


def forward_rate(rates: Rates, res: int) -> float:
    """FLOP rate of a no-grad forward (sampling): the training rate scaled by the reference's ratio of the two
    (a forward runs bigger kernels back to back; the reference forward is 1.2x as efficient)."""
    ref_train = REF_TRAIN_FLOPS / REF_STEP_S
    ref_fwd = (REF_LINEAR_FLOPS + REF_ATTN_FLOPS) / REF_FORWARD_S
    return rates.rate(res) * ref_fwd / ref_train


def reference_rates() -> Rates:
    return Rates(
        REF_TRAIN_FLOPS / REF_STEP_S,
        REF_H2D,
        REF_D2H,
        REF_BIDIR,
        "H200 reference (PCIe Gen5 x16, this code measured there): Flux-12B LoRA step 0.92 s of kernels at "
        "1024 px; H2D 55.4 GB/s, D2H 55.3 GB/s, both 100.7 GB/s; host "
        f"{REF_HOST_S_PER_OP * 1e6:.0f} us per traced block operation per training pass (that machine's host)",
    )


# Several processes of one host streaming at once, measured on 4 x H200 with NV18 NVLink between every pair
# (bench/history/2026-11-27.md, 2026-11-27): pinned host-to-device copies ran 55 GB/s for one GPU alone, 48-53 GB/s each with
# two copying and 42.5-45.3 GB/s each with four, about 175 GB/s for the host in all; NCCL all-gathers ran at 254-266
# GB/s of bus bandwidth on 2 GPUs and 284-326 on 4.
HOST_H2D_TOTAL = 175e9
GATHER_BUS_2, GATHER_BUS_MORE = 260e9, 300e9


def for_processes(rates: Rates, n: int, sharded: bool) -> Rates:
    """The rates one of `n` processes of a host sees while every one of them streams: its blocks arrive at
    `h2d`. Whole copies share the host (`HOST_H2D_TOTAL` / n each, at most one link's rate); the sharded stream
    (trainer/offload/gather.py) copies 1/n of each block at that rate and all-gathers the rest over the GPUs'
    links, a byte of the (n - 1)/n taking 1 / bus bandwidth. Left out: activation offloading's copies, which
    share the host too but are charged at the block rate here."""
    if n <= 1:
        return rates
    each = min(rates.h2d, HOST_H2D_TOTAL / n)
    if not sharded:
        return replace(rates, h2d=each, source=f"{rates.source}; {n} processes copying whole blocks at once: "
                       f"{each / 1e9:.1f} GB/s each")
    bus = GATHER_BUS_2 if n == 2 else GATHER_BUS_MORE
    rate = 1.0 / (1.0 / (n * each) + (n - 1) / (n * bus))
    return replace(rates, h2d=rate, source=f"{rates.source}; {n} processes, sharded stream: 1/{n} of each block "
                   f"copied at {each / 1e9:.1f} GB/s, the rest all-gathered at {bus / 1e9:.0f} GB/s: blocks "
                   f"arrive at {rate / 1e9:.0f} GB/s")


def transfer_seconds(h2d_bytes: float, d2h_bytes: float, rates: Rates) -> float:
    """Both directions overlap up to the shared limit."""
    if h2d_bytes <= 0 and d2h_bytes <= 0:
        return 0.0
    return max(h2d_bytes / rates.h2d, d2h_bytes / rates.d2h, (h2d_bytes + d2h_bytes) / rates.bidir)


def split_time(fn, reps: int = 5) -> tuple[float, float]:  # pragma: no cover - needs a GPU
    """(host seconds, GPU seconds) of `fn()`, medians over `reps`, apart: a sleep kernel queued first keeps the
    GPU busy while the host launches `fn`, so the host's time is its own and CUDA events around `fn` time the
    GPU's work alone. Falls back to the synchronised wall time for both when the sleep is too short (the host
    filled the launch queue) or torch has no sleep kernel."""
    import statistics

    import torch

    def wall():
        torch.cuda.synchronize()  # host-device sync: timing
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    fn()
    w = statistics.median(wall() for _ in range(reps))
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return w, w
    cycles = _cycles_per_s()
    host, gpu = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        hold = 2 * w + 0.01
        sleep(int(hold * cycles))
        e0.record()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        e1.record()
        e1.synchronize()  # host-device sync: timing
        gpu.append(e0.elapsed_time(e1) / 1000)
        if host[-1] > 0.8 * hold:
            return w, w
    return statistics.median(host), statistics.median(gpu)


def _cycles_per_s() -> float:  # pragma: no cover - needs a GPU
    import torch

    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    e0.record()
    torch.cuda._sleep(50_000_000)
    e1.record()
    e1.synchronize()  # host-device sync: timing
    return 50_000_000 / (e0.elapsed_time(e1) / 1000)


def measure_rates(blocks=()) -> Rates:  # pragma: no cover - needs a GPU
    """Short measurement on the current GPU: a pinned 1 GB copy each way (and both at once) and, for each
    `(res, class, build)` in `blocks`, the host and GPU time of the block's checkpointed forward and of a whole
    training pass (forward, recompute, backward); `build()` returns (forward_fn, pass_fn, train FLOPs, block
    index) and is called one block at a time, so only one block is on the GPU at once."""
    import torch

    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)  # allocation: 1 GB pinned, once
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()

    def timed(fn, reps=3):
        fn()
        torch.cuda.synchronize()  # host-device sync: timing
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps

    h2d = n / timed(lambda: dev.copy_(host, non_blocking=True))
    d2h = n / timed(lambda: host.copy_(dev, non_blocking=True))
    half = n // 2

    def both():
        dev[:half].copy_(host[:half], non_blocking=True)
        with torch.cuda.stream(side):
            host[half:].copy_(dev[half:], non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    bidir = n / timed(both)
    host = dev = None  # free the 1 GB buffers before the blocks
    by_res, costs = {}, {}
    for res, cls, build in blocks:
        fwd_fn, pass_fn, flops, idx = build()
        hf, gf = split_time(fwd_fn)
        hp, gp = split_time(pass_fn)
        costs.setdefault(res, {})[cls] = (BlockCost(hf, max(0.0, hp - hf), gf, max(0.0, gp - gf)), idx)
        by_res.setdefault(res, flops / max(gp, 1e-9))  # the first (most frequent) class sets the rate
        del fwd_fn, pass_fn
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name()
    if by_res:
        rate = by_res[max(by_res)]
        source = f"measured on {name}: pinned copies; host and GPU time of each block class per bucket"
    else:
        rate = reference_rates().flops_per_s
        source = f"measured copies on {name}; compute from the H200 reference"
    return Rates(rate, h2d, d2h, bidir, source, by_res, costs)
