"""The conductor's per-block checkpoint in training (trainer/offload/conductor.py): a non-reentrant
`torch.utils.checkpoint` around the block whose recompute tells the conductor it is in backward, and an identity
autograd function on the block's grad-carrying inputs whose backward is the block's release point.

Why an identity function. The block's weights may only be overwritten once every backward kernel that reads them
has been enqueued, which is when the gradients of the block's inputs exist; releasing after the recompute instead
is the OneTrainer race (issue #1306). The identity runs also when nothing streams, so that resident and offloaded
runs build the same graph (it groups each block's gradient contributions to shared inputs such as temb: same
sums, same bits).

Why only non-tensor keyword arguments are kept. The recompute closure lives until backward; checkpoint hands the
tensor arguments back to it (through activation offloading's hooks when on), and a reference to them here would
keep every block's inputs on the GPU, whatever the offloader copied out (bench/RESULTS.md, 02:48 UTC).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .plan import BWD, FWD


class _ReleaseAfterBackward(torch.autograd.Function):
    """Identity on a block's inputs whose backward is the block's release point in training."""

    @staticmethod
    def forward(ctx, callback, *xs):
        ctx.callback = callback
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def checkpointed_forward(c, i: int, fwd, args: tuple, kwargs: dict):
    """Run block `i`'s forward `fwd` under the checkpoint for conductor `c`; see the module docstring."""
    keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    flat = list(args) + [kwargs[k] for k in keys]
    # Also when nothing streams, so that resident and offloaded runs build the same graph (the identity
    # groups each block's gradient contributions to shared inputs such as temb: same sums, same bits).
    if c.mode == "train" and not c._release_at_recompute:
        idx = [j for j, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if idx:
            step = c.step if c.streaming else 0
            pos = c._position(BWD, i) if c.streaming else 0
            outs = _ReleaseAfterBackward.apply(
                lambda: c._release_from_autograd(step, pos), *[flat[j] for j in idx]
            )
            for j, o in zip(idx, outs, strict=True):
                flat[j] = o
    nargs = len(args)
    # The recompute closure must not hold the tensor arguments themselves: checkpoint hands them back as `a`
    # (through activation offloading's hooks when on), and a reference here would keep every block's inputs
    # on the GPU until backward, whatever the offloader copied out.
    static = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    del kwargs

    def inner(*a):
        kw = dict(static)
        kw.update(zip(keys, a[nargs:], strict=True))
        if _in_backward():
            c._enter(BWD, i)
            out = fwd(*a[:nargs], **kw)
            if c._release_at_recompute:
                c._release(c.cursor)
            return out
        c._enter(FWD, i)
        return fwd(*a[:nargs], **kw)

    # early_stop=False only for the deliberate race: the recompute must run to its end to release there
    early = not c._release_at_recompute
    if c.act is not None:
        with c.act.hooks(i):
            out = checkpoint(inner, *flat, use_reentrant=False, early_stop=early)
    else:
        out = checkpoint(inner, *flat, use_reentrant=False, early_stop=early)
    c._leave_forward(i)
    return out
