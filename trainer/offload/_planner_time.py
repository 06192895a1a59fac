"""Step-time model of the planner: compute from FLOPs (reference figures or a short GPU measurement), transfer
from bytes over the PCIe rate, step = max(compute, transfer).

Compute. Forward FLOPs of the blocks are counted exactly on the meta device (trace). A training step costs a
multiple of them: with gradient checkpointing the forward runs twice (forward, recompute), and backward costs
one forward for the input gradients of every matmul, one more for weight gradients when the weights train (full
fine-tuning; LoRA's weight gradients are negligible), and two forwards for attention (its backward recomputes
the scores). The rate that turns FLOPs into seconds is calibrated once on the DESIGN.md reference: Flux.1-dev
LoRA rank 16 at 1024x1024, batch 1, gradient checkpointing, 0.775 s a step on an H200 (torch 2.11,
diffusers 0.42.1). An H100 has the same compute (both GH100); other GPUs are scaled by nothing, so measure:
with a GPU present, `dittrain plan` times one block at each bucket's shapes (trainer/offload/_planner_measure.py)
and uses that rate per bucket, which also catches small buckets running below the large-bucket efficiency.

Transfer. Host-to-device bytes per step come from the offload plan (trainer/offload/plan.py, the same code the
conductor replays), plus the checkpoint inputs coming back in backward under activation offloading;
device-to-host bytes are the write-back of trained streamed blocks and the checkpoint inputs leaving in forward.
Rates: the DESIGN.md figures (pinned H2D 55.4 GB/s, D2H 55.3 GB/s, both at once 100.7 GB/s) or a measured
pinned 1 GB copy.

Left out: the time the first block of a pass waits for its copy when nothing is resident, Python overhead per
block, and the optimizer step itself (LoRA: milliseconds; full fine-tuning on the GPU: bandwidth-bound, about
16 bytes per parameter at HBM speed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# Reference: DESIGN.md, measured on an H200.
REF_STEP_S = 0.775  # Flux.1-dev LoRA r16, 1024x1024, batch 1, checkpointing
REF_FORWARD_S = 0.198  # Flux.1-dev resident forward (one sampling step), 1024x1024, batch 1
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

    def rate(self, res: int) -> float:
        """FLOP rate for a bucket: measured at that size when it was, else the general one."""
        return self.by_res.get(res, self.flops_per_s)


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
        "DESIGN.md reference figures (H200, PCIe Gen5 x16): Flux-12B LoRA step 0.775 s at 1024 px; "
        "H2D 55.4 GB/s, D2H 55.3 GB/s, both 100.7 GB/s",
    )


def transfer_seconds(h2d_bytes: float, d2h_bytes: float, rates: Rates) -> float:
    """Both directions overlap up to the shared limit."""
    if h2d_bytes <= 0 and d2h_bytes <= 0:
        return 0.0
    return max(h2d_bytes / rates.h2d, d2h_bytes / rates.d2h, (h2d_bytes + d2h_bytes) / rates.bidir)


def measure_rates(blocks: dict | None = None) -> Rates:  # pragma: no cover - needs a GPU
    """Short measurement on the current GPU: a pinned 1 GB copy each way (and both at once) and, per bucket
    side in `blocks` ({res: (fn, flops)}), one block's training pass `fn()` (warmed up) of `flops` FLOPs."""
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
    by_res = {res: flops / timed(fn, reps=5) for res, (fn, flops) in (blocks or {}).items() if flops > 0}
    name = torch.cuda.get_device_name()
    if by_res:
        rate = by_res[max(by_res)]
        source = f"measured on {name}: pinned copies and one block's training pass per bucket"
    else:
        rate = reference_rates().flops_per_s
        source = f"measured copies on {name}; compute from the H200 reference"
    return Rates(rate, h2d, d2h, bidir, source, by_res)
