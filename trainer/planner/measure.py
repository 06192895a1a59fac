"""A short measurement on the user's GPU for `dittrain plan`: copy rates and each block class's training pass.

One block of every block class (Flux: double and single) is built on the GPU with random weights (a copy of the
meta block, so LoRA layers are included), fed random inputs of each bucket's shapes (recorded by the trace),
and run as training runs it: a checkpointed forward, then the recompute and the backward. The host's launch
time and the GPU's time are taken apart (trainer/planner/timing.py `split_time`) for the forward alone and
the whole pass, and the step is put together from them block by block (trainer/planner/replay.py).
The forward's FLOPs are counted by `torch.utils.flop_counter` and turned into training FLOPs with the whole
model's formula, giving the GPU rate sampling predictions use. A few seconds and about two blocks of VRAM.
"""

from __future__ import annotations

import copy
from collections import Counter

import torch

from . import timing as ptime


def materialize(obj, device):
    """`obj` (meta tensors, possibly nested in tuples, lists and dicts) as random tensors of the same shapes on
    `device`, keeping requires_grad."""
    if isinstance(obj, torch.Tensor):
        t = (
            torch.randn(obj.shape, dtype=obj.dtype, device=device)
            if obj.is_floating_point()
            else torch.zeros(obj.shape, dtype=obj.dtype, device=device)
        )
        return t.requires_grad_(obj.requires_grad)
    if isinstance(obj, tuple):
        return tuple(materialize(o, device) for o in obj)
    if isinstance(obj, list):
        return [materialize(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: materialize(v, device) for k, v in obj.items()}
    return obj


def block_classes(facts) -> list[str]:
    """Block class names, most frequent first."""
    return [c for c, _ in Counter(type(b).__name__ for b in facts.blocks).most_common()]


def block_pass(facts, device: str | torch.device = "cuda", res: int | None = None, cls: str | None = None):
    """(step, block index, forward matmul FLOPs, forward attention FLOPs, forward) for one block of class `cls`
    (default the most frequent) with random weights on `device`, fed the bucket's shapes (`res`, default the
    largest) and run as training runs it by `step()`: through non-reentrant `torch.utils.checkpoint` when the
    config checkpoints (forward, then recompute and backward; the checkpoint's hooks are a good part of the host's
    work at small shapes), else a plain forward and backward. `forward()` runs the forward alone."""
    from torch.utils.checkpoint import checkpoint
    from torch.utils.flop_counter import FlopCounterMode

    dev = torch.device(device)
    tr = facts.trace(res or max(facts.resolutions))
    cls = cls or block_classes(facts)[0]
    idx, args, kwargs = tr.calls[cls]
    block = copy.deepcopy(facts.blocks[idx]).to_empty(device=dev)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    a, kw = materialize(args, dev), materialize(kwargs, dev)

    def outputs(o):
        return [
            t
            for t in (o if isinstance(o, tuple | list) else (o,))
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]

    def run():
        if facts.checkpointing:
            return checkpoint(block, *a, use_reentrant=False, **kw)
        return block(*a, **kw)

    def forward():
        run()  # the graph it builds is dropped at once

    def step():
        outs = outputs(run())
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

    flops = FlopCounterMode(display=False)
    with torch.no_grad(), flops:
        block(*a, **kw)
    per_op = flops.get_flop_counts().get("Global", {})
    attn = sum(v for k, v in per_op.items() if "attention" in str(k))
    return step, idx, sum(per_op.values()) - attn, attn, forward


def measure(facts) -> ptime.Rates:  # pragma: no cover - needs a GPU
    """Copy rates and every block class's training pass at each bucket side (at most the three largest).

    cuDNN attention is off while timing, as the trainer's `train.attention: auto` has it (it fails in backward
    on some drivers, ../shared/GPU.md)."""
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:

        def build(res, cls):
            def make():
                step, idx, lin, attn, forward = block_pass(facts, "cuda", res, cls)
                step()  # warm-up (kernel selection, allocator)
                train = ptime.train_flops(
                    lin, attn, checkpointing=facts.checkpointing, weights_train=facts.method == "full"
                )
                return forward, step, train, idx

            return make

        blocks = [
            (res, cls, build(res, cls))
            for res in sorted(facts.resolutions)[-3:]
            for cls in block_classes(facts)
        ]
        return ptime.measure_rates(blocks)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
