"""Nano-batching (seed 004): split token-wise MLPs into chunks, each under its own checkpoint.

Inside a checkpointed block the MLP's wide intermediate (4 x hidden for every token) is what peaks in the
block's backward. A diffusers `FeedForward` acts on each token independently, so splitting the token axis into
n chunks and checkpointing each chunk keeps only one chunk's intermediate alive at a time: that peak falls by
n for one more MLP forward per chunk. Results are the same up to the matmul kernel picked for the smaller
shape (bitwise on the CPU in our tests).

Left out: MLPs written inline in a block's forward (Flux's single blocks) are not split.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _is_token_mlp(m: nn.Module) -> bool:
    return type(m).__name__ == "FeedForward"


def nano_batch(blocks: list[nn.Module], n: int):
    """Wrap every FeedForward inside `blocks`; returns a function that undoes it."""
    if n <= 1:
        return lambda: None
    wrapped = []
    for blk in blocks:
        for m in blk.modules():
            if _is_token_mlp(m):
                orig = m.forward

                def forward(hidden_states, *args, _orig=orig, **kwargs):
                    if hidden_states.dim() < 3 or hidden_states.shape[1] < n:
                        return _orig(hidden_states, *args, **kwargs)
                    chunks = hidden_states.chunk(n, dim=1)
                    if torch.is_grad_enabled():
                        outs = [checkpoint(_orig, c, *args, use_reentrant=False, **kwargs) for c in chunks]
                    else:
                        outs = [_orig(c, *args, **kwargs) for c in chunks]
                    return torch.cat(outs, dim=1)

                m.forward = forward
                wrapped.append(m)

    def undo():
        for m in wrapped:
            m.__dict__.pop("forward", None)

    return undo
