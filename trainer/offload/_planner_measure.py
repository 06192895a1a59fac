"""A short measurement on the user's GPU for `dittrain plan`: copy rates and one block's training pass.

One block of the model's most frequent block class is built on the GPU with random weights (a copy of the meta
block, so LoRA layers are included), fed random inputs of each bucket's shapes (recorded by the trace),
and run as training runs it: a forward without grad (the checkpointed forward), a forward with grad (the
recompute) and a backward. Its FLOPs are counted by `torch.utils.flop_counter` on the forward and turned into
training FLOPs with the same formula as the whole model (trainer/offload/_planner_time.py), so the measured rate
replaces the reference rate directly. A few seconds and about two blocks of VRAM.
"""

from __future__ import annotations

import copy
from collections import Counter

import torch

from . import _planner_time as ptime


def _materialize(obj, device):
    if isinstance(obj, torch.Tensor):
        t = (
            torch.randn(obj.shape, dtype=obj.dtype, device=device)
            if obj.is_floating_point()
            else torch.zeros(obj.shape, dtype=obj.dtype, device=device)
        )
        return t.requires_grad_(obj.requires_grad)
    if isinstance(obj, tuple):
        return tuple(_materialize(o, device) for o in obj)
    if isinstance(obj, list):
        return [_materialize(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _materialize(v, device) for k, v in obj.items()}
    return obj


def block_pass(facts, device: str | torch.device = "cuda", res: int | None = None):
    """(step, block index, forward matmul FLOPs, forward attention FLOPs) for one block of the most frequent
    class with random weights on `device`, fed the bucket's shapes (`res`, default the largest) and run as
    training runs it by `step()`: forward without grad, recompute, backward."""
    from torch.utils.flop_counter import FlopCounterMode

    dev = torch.device(device)
    tr = facts.trace(res or max(facts.resolutions))
    cls = Counter(type(b).__name__ for b in facts.blocks).most_common(1)[0][0]
    idx, args, kwargs = tr.calls[cls]
    block = copy.deepcopy(facts.blocks[idx]).to_empty(device=dev)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    a, kw = _materialize(args, dev), _materialize(kwargs, dev)

    def outputs(o):
        return [
            t
            for t in (o if isinstance(o, tuple | list) else (o,))
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]

    def step():
        with torch.no_grad():
            block(*a, **kw)
        outs = outputs(block(*a, **kw))
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

    flops = FlopCounterMode(display=False)
    with torch.no_grad(), flops:
        block(*a, **kw)
    per_op = flops.get_flop_counts().get("Global", {})
    attn = sum(v for k, v in per_op.items() if "attention" in str(k))
    return step, idx, sum(per_op.values()) - attn, attn


def measure(facts) -> ptime.Rates:  # pragma: no cover - needs a GPU
    """Copy rates and one block's training pass at each bucket side (at most the three largest).

    cuDNN attention is off while timing, as the trainer's `train.attention: auto` has it (it fails in backward
    on some drivers, ../shared/GPU.md)."""
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        blocks = {}
        for res in sorted(facts.resolutions)[-3:]:
            step, _, lin, attn = block_pass(facts, "cuda", res)
            step()  # warm-up (kernel selection, allocator)
            train = ptime.train_flops(lin, attn, checkpointing=True, weights_train=facts.method == "full")
            blocks[res] = (step, train)
        # The blocks and their inputs are freed when this returns; plan does not train afterwards.
        return ptime.measure_rates(blocks)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
