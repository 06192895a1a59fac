"""The fused back pass (trainer/optim) with streamed trainable weights: optimizer state that moves with its block.

How. `attach_offload(..., trainable=True, optimizer_state=fused.state_layout)` packs, beside every trainable
weight of a streamed block, room for the tensors its optimizer keeps (AdamW: exp_avg and exp_avg_sq, fp32).
They cross PCIe with the block (host arena -> ring before its backward, ring -> host arena in the write-back
after it), so no state stays on the GPU longer than its block. `bind_fused(handle, fused)` adds the two hooks
trainer/optim's protocol asks for (FusedBackPass docstring): before a parameter's step its state dict is
pointed at the ring slots the block load filled; after the step it points at the host-arena copies again,
which is what a checkpoint reads (after `handle.sync()`, registered as the protocol's synchronize hook).
The first step is the optimizer's own: it creates its state, and `post` copies it into the slots.

Blocks that never leave the ring (low fractions) have no host copy: their state simply stays in the ring.

Left out: optimizers whose state shapes are not known before the first step (the `packed` flag of their spec in
trainer/optim/specs.py: AdamW and Adafactor are); optimizer state of non-block parameters (embedders) is the optimizer's, on the device.
"""

from __future__ import annotations

from typing import Any

import torch


def bind_fused(handle, fused) -> None:
    """Register the pre/post/synchronize hooks on a trainer.optim `FusedBackPass`."""
    def pre(p: torch.Tensor, state: dict[str, Any]) -> None:
        slots = handle.state_of(p)
        if slots is None or not state:
            return  # not streamed, or first step: the optimizer creates its state
        hosts = handle.host_state_of(p) or {}
        for name, slot in slots.items():
            cur = state.get(name)
            if cur is None or cur is slot:
                continue
            if cur is not hosts.get(name):
                slot.copy_(cur)  # set by load_state_dict: adopt it
            state[name] = slot

    def post(p: torch.Tensor, state: dict[str, Any]) -> None:
        slots = handle.state_of(p)
        if slots is None:
            return
        hosts = handle.host_state_of(p)
        for name, slot in slots.items():
            cur = state.get(name)
            if cur is None:
                continue
            if cur is not slot:
                slot.copy_(cur)  # first step: the optimizer's freshly made state moves into the block
            if hosts is not None:
                state[name] = hosts[name]  # between steps: the host copy (current after the write-back)
            else:
                state[name] = slot  # block never leaves the ring

    fused.add_step_hooks(pre=pre, post=post, synchronize=handle.sync)
