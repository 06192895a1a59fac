"""Nano-batching (seed 004; offload.nano_batches): split token-wise sub-layers into token chunks, each under its
own checkpoint.

Inside a checkpointed block the MLP's wide intermediate (4 x hidden for every token) is what peaks in the
block's backward. A diffusers `FeedForward` acts on each token independently, so splitting the token axis into
n chunks and checkpointing each chunk keeps only one chunk's intermediate alive at a time: that peak falls by
n for one more MLP forward per chunk. The same holds for any sub-layer whose output for a token depends on that
token alone and which takes the tokens first, (B, S, D): a cross-attention whose queries are the tokens (Wan's
attn2; its keys and values, the text's, are made again per chunk). The forward is the same up to the matmul
kernel picked for the smaller shape (bitwise on AVX2 CPUs, within 1e-6 on an AVX-512 one); the sub-layers' weight gradients are sums over chunks,
so they differ by fp32 reassociation (tests/test_nano_batches.py).

How. A stage of the block's StreamedBlock install (trainer/offload/block.py): every FeedForward inside the block
becomes a `NanoBatched` subclass of its class (the same class swap, so module names and state-dict keys stay),
whose forward splits and then calls the MLP's own forward per chunk; `block.remove` restores the class.

Which modules: the family's declaration (trainer/models/base.py `token_wise`, handed to `attach_offload` as
`nano_mlps`), else every diffusers `FeedForward` in the block. A family may declare parameterless regions of its
block's own forward: HunyuanVideo 1.5's blocks are two of them around the attention kernel, the video tokens' work
before it (norm, modulation, q / k / v, rotary) and after it (output projection through the feed-forward), so that
all of a block but attention runs in chunks (trainer/models/hunyuan_video15_block.py). Such a region takes per-token
tensors beside the tokens (the rotary tables), which are split with them (its class's `token_args`), and may return
several (q, k, v), joined one by one. The planner counts the saving
(trainer/planner/trace.py `chunk_mlps`): the block's recompute no longer saves the sub-layers' hidden activations
for the whole sequence; backward recomputes one chunk's at a time. In Wan 2.1 14B at 480p x 81
(32,760 tokens, fp8 base) a block's recompute saves 8.5 GB, of which the feed-forward's hidden is 1.8 GB (the
GELU's bf16 input and output, 13,824 wide: the two largest tensors) and the cross-attention's per-token tensors
(q, output, their projections' inputs) 1.0 GB.

Under train.compile the block's compiled forward (trainer/offload/compiled.py) traces the chunks and their
checkpoints as torch.compile's activation-checkpoint regions, and AOTAutograd recomputes each chunk in the compiled
backward: the same numbers as eager (aot_eager on the CPU, tests/test_nano_batches.py). The compiled block saves less
than the eager one with chunks: nothing made inside a chunk (the sub-layers' dequantized weights and the text's keys
and values included) and none of the inputs the sub-layers can make again cheaply (the norms' outputs); counted on
meta for the 14B block at 480p x 81, its saved bytes fall from 7.16 to 3.26 GB with the split (with 2 chunks or 16
alike), where the eager count drops 2.65 GB. On an H200 (bench/history/2026-11-27.md, 12:05) 16 chunks took the
step from 14.96 to 10.88 GB allocated; the planner counts it so (trainer/planner/compiled_saves.py `chunk_saving`).

Left out: MLPs written inline in a block's forward (Flux's single blocks) are not split.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .block import restore_class, swap_class


def _is_token_mlp(m: nn.Module) -> bool:
    return type(m).__name__ == "FeedForward"


class NanoBatched:
    """Mixin of a token-wise sub-layer's split class; `_nano_batches` is set by `split_mlps`. The tokens' axis is
    dim 1 of the first argument, and of the first `token_args` positional arguments where the sub-layer's class
    sets that (a region that takes per-token rotary tables beside its tokens, trainer/models/hunyuan_video15_block.py);
    a tuple of outputs is joined item by item."""

    _nano_batches: int

    def forward(self, hidden_states, *args, **kwargs):
        n, run = self._nano_batches, super().forward
        if hidden_states.dim() < 3 or hidden_states.shape[1] < n:
            return run(hidden_states, *args, **kwargs)
        k = getattr(self, "token_args", 1) - 1
        per_token = zip(*(t.chunk(n, dim=1) for t in (hidden_states, *args[:k])), strict=True)
        rest = args[k:]
        if torch.is_grad_enabled():
            outs = [checkpoint(run, *c, *rest, use_reentrant=False, **kwargs) for c in per_token]
        else:
            outs = [run(*c, *rest, **kwargs) for c in per_token]
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(o, dim=1) for o in zip(*outs, strict=True))
        return torch.cat(outs, dim=1)


def split_mlps(block: nn.Module, n: int, mlps: list[nn.Module] | None = None) -> None:
    """Make the token-wise MLPs `mlps` of `block` (None: every diffusers FeedForward inside it; a family declares
    its own, trainer/models/base.py `token_wise`) run in `n` token chunks (n <= 1: nothing)."""
    if n <= 1:
        return
    for m in (mlps if mlps is not None else [m for m in block.modules() if _is_token_mlp(m)]):
        swap_class(m, NanoBatched, "NanoBatched")
        m._nano_batches = n


def join_mlps(mlps) -> None:
    """Undo `split_mlps` on the split ones of `mlps`: their plain classes again, whole-width."""
    for m in mlps:
        if isinstance(m, NanoBatched):
            restore_class(m)
            del m._nano_batches
