"""Nano-batching (seed 004): split token-wise MLPs into chunks, each under its own checkpoint.

Inside a checkpointed block the MLP's wide intermediate (4 x hidden for every token) is what peaks in the
block's backward. A diffusers `FeedForward` acts on each token independently, so splitting the token axis into
n chunks and checkpointing each chunk keeps only one chunk's intermediate alive at a time: that peak falls by
n for one more MLP forward per chunk. Results are the same up to the matmul kernel picked for the smaller
shape (bitwise on the CPU in our tests).

How. A stage of the block's StreamedBlock install (trainer/offload/block.py): every FeedForward inside the block
becomes a `NanoBatched` subclass of its class (the same class swap, so module names and state-dict keys stay),
whose forward splits and then calls the MLP's own forward per chunk; `block.remove` restores the class.

Left out: MLPs written inline in a block's forward (Flux's single blocks) are not split.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .block import swap_class


def _is_token_mlp(m: nn.Module) -> bool:
    return type(m).__name__ == "FeedForward"


class NanoBatched:
    """Mixin of a token-wise MLP's split class; `_nano_batches` is set by `split_mlps`."""

    _nano_batches: int

    def forward(self, hidden_states, *args, **kwargs):
        n, run = self._nano_batches, super().forward
        if hidden_states.dim() < 3 or hidden_states.shape[1] < n:
            return run(hidden_states, *args, **kwargs)
        chunks = hidden_states.chunk(n, dim=1)
        if torch.is_grad_enabled():
            outs = [checkpoint(run, c, *args, use_reentrant=False, **kwargs) for c in chunks]
        else:
            outs = [run(c, *args, **kwargs) for c in chunks]
        return torch.cat(outs, dim=1)


def split_mlps(block: nn.Module, n: int) -> None:
    """Make every FeedForward inside `block` run in `n` token chunks (n <= 1: nothing)."""
    if n <= 1:
        return
    for m in list(block.modules()):
        if _is_token_mlp(m):
            swap_class(m, NanoBatched, "NanoBatched")
            m._nano_batches = n
