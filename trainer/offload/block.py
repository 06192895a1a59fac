"""One owner per block's forward: `StreamedBlock`, the module every block of the adapter's block list becomes
while an offload handle is attached.

How. Like torch FSDP2's `fully_shard`, `install` swaps each block instance's class for a subclass made once per
base class, `type("Streamed" + cls.__name__, (StreamedBlock, cls), {})`: the block keeps its parameters,
submodules, module names, state-dict keys, peft targets and `isinstance` checks (diffusers pipelines and
checkpoints see the same model), and `remove` restores the plain class. Nothing assigns `.forward` on an
instance. `StreamedBlock.forward` runs a block's stages in one place, in this order:

1. checkpoint (training, under grad): a non-reentrant `torch.utils.checkpoint` around the block, wrapped in the
   activation offloader's saved-tensor hooks when `activations` is on (trainer/offload/activations.py). Per
   block (the conductor's `checkpointed`): a block that keeps its activations instead (train.gradient_checkpointing
   auto / false: recompute only what must be) runs stages 2-4 without it. A kept block that streams would have its
   weights refilled under autograd's saved views (DESIGN.md, version counters), so its forward runs under the
   conductor's `saved_weights` hooks (saved weight views become places in its ring region, resolved where the block
   is in backward) and its outputs pass another `_CallInBackward`, whose backward is the block's `enter(BWD, i)`:
   before any of its backward kernels, the block is loaded and its parameters point at it (frozen blocks only);
2. release after backward (training): an identity autograd function on the block's grad-carrying inputs,
   `_CallInBackward`, whose backward calls the conductor's `release_callback(i)`: the gradients of the
   block's inputs exist, so every backward kernel that reads the block's weights has been enqueued and its ring
   region may be refilled. Releasing after the recompute instead is the OneTrainer race (issue #1306);
3. streaming: `conductor.enter(phase, i)` before the block computes (in forward, and in its recompute inside
   backward, told apart by autograd's current graph task) and `conductor.leave_forward(i)` after its forward;
4. the block's own forward, through `_compute`: eager, or the plain class's forward compiled once per block
   class when the handle was attached with `compile` (trainer/offload/compiled.py: regional compilation; every
   stage above stays eager around it).

The nano split (trainer/offload/nano.py) is a stage of the same install: each token-wise MLP inside a block
becomes a `NanoBatched` subclass the same way, so it too is undone by `remove`.

At fraction 0 the same module runs: the conductor's streaming calls do nothing, and the identity of stage 2 still
sits on every block, so that resident and offloaded runs build the same graph (it groups each block's gradient
contributions to shared inputs such as temb: same sums, same bits).

Why only non-tensor keyword arguments are kept by the recompute closure. Checkpoint hands the tensor arguments
back to it (through activation offloading's hooks when on), and a reference to them here would keep every block's
inputs on the GPU, whatever the offloader copied out (bench/history/2026-11-22.md, 02:48 UTC).

Left out: torch.compile of `StreamedBlock.forward` itself (it talks to the conductor eagerly): only `_compute`
is compiled.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from . import compiled
from .plan import BWD, FWD

_SUBCLASSES: dict[tuple[type, type], type] = {}


def swap_class(module: nn.Module, mixin: type, prefix: str) -> None:
    """Make `module` an instance of `(mixin, type(module))`, one subclass per pair (FSDP2's `fully_shard` way)."""
    cls = type(module)
    sub = _SUBCLASSES.get((mixin, cls))
    if sub is None:
        sub = _SUBCLASSES[(mixin, cls)] = type(f"{prefix}{cls.__name__}", (mixin, cls), {"_plain_class": cls})
    module.__class__ = sub


def restore_class(module: nn.Module) -> None:
    module.__class__ = module._plain_class


class _CallInBackward(torch.autograd.Function):
    """Identity on some tensors whose backward calls `callback` before passing their gradients on. On a block's
    grad-carrying inputs it is the block's release point in training (`release_callback(i)`: every backward kernel
    of the block is enqueued once these gradients exist); on a kept streamed block's outputs it is the block's
    `enter(BWD, i)` (it runs before any backward kernel of the block, which all need these outputs' gradients, so
    the block is loaded and its saved weight views resolve to where it is: conductor `saved_weights`)."""

    @staticmethod
    def forward(ctx, callback, *xs):
        ctx.callback = callback
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def _call_in_backward(callback, flat: list) -> list:
    """`flat` with its grad-carrying tensors passed through one `_CallInBackward` of `callback`."""
    idx = [j for j, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
    if idx:
        outs = _CallInBackward.apply(callback, *[flat[j] for j in idx])
        for j, o in zip(idx, outs, strict=True):
            flat[j] = o
    return flat


def _enter_before_backward(c, i: int, out):
    """`out` (a block's output: a tensor or a structure of them) whose backward first enters block `i`."""
    flat, spec = tree_flatten(out)
    return tree_unflatten(_call_in_backward(lambda: c.enter(BWD, i), flat), spec)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class StreamedBlock:
    """Mixin of a block's streamed class; see the module docstring. `_offload_conductor` and `_offload_index`
    are set by `install` (and again by `bind` when the handle re-plans)."""

    _plain_class: type
    _offload_conductor: object
    _offload_index: int
    _offload_compile: compiled.CompileOptions | None = None

    def bind(self, conductor, index: int) -> None:
        self._offload_conductor = conductor
        self._offload_index = index

    def forward(self, *args, **kwargs):
        c, i = self._offload_conductor, self._offload_index
        if i == 0:
            c.begin_pass()  # before any path saves block 0's inputs (conductor `begin_pass`)
        if torch.is_grad_enabled() and c.checkpointed[i]:
            return self._checkpointed(c, i, args, kwargs)
        if torch.is_grad_enabled() and c.mode == "train":
            return self._kept(c, i, args, kwargs)
        c.enter(FWD, i)
        out = self._compute(*args, **kwargs)
        c.leave_forward(i)
        return out

    def _kept(self, c, i: int, args: tuple, kwargs: dict):
        """A training block that keeps its activations for backward (not recomputed): the same release identity
        as a checkpointed block, so that both build the same graph (see the module docstring); the conductor
        refuses this for a block that streams."""
        keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        flat = self._release_identity(c, i, list(args) + [kwargs[k] for k in keys])
        kw = dict(kwargs)
        kw.update(zip(keys, flat[len(args):], strict=True))
        c.enter(FWD, i)
        with c.saved_weights(i):  # a streamed block: saved weight views resolve to its region in backward
            out = self._compute(*flat[:len(args)], **kw)
        if c.refills(i):
            out = _enter_before_backward(c, i, out)
        c.leave_forward(i)
        return out

    @staticmethod
    def _release_identity(c, i: int, flat: list) -> list:
        """Stage 2: the identity on the grad-carrying inputs whose backward releases block `i` (training)."""
        if c.mode == "train" and not c.release_at_recompute:
            return _call_in_backward(c.release_callback(i), flat)
        return flat

    def _compute(self, *args, **kwargs):
        """The block's own forward: eager, or its class's compiled forward (one per class, shared by all blocks)."""
        opts = self._offload_compile
        if opts is None:
            return super().forward(*args, **kwargs)
        return compiled.forward_of(self._plain_class, opts)(self, *args, **kwargs)

    def _checkpointed(self, c, i: int, args: tuple, kwargs: dict):
        keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        flat = self._release_identity(c, i, list(args) + [kwargs[k] for k in keys])
        nargs = len(args)
        static = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}  # see the module docstring
        del kwargs

        def inner(*a):
            kw = dict(static)
            kw.update(zip(keys, a[nargs:], strict=True))
            if _in_backward():
                c.enter(BWD, i)
                out = self._compute(*a[:nargs], **kw)
                if c.release_at_recompute:
                    c.leave_recompute(i)
                return out
            c.enter(FWD, i)
            return self._compute(*a[:nargs], **kw)

        # early_stop=False only for the deliberate race: the recompute must run to its end to release there
        early = not c.release_at_recompute
        hooks = c.activations.hooks(i) if c.activations is not None else contextlib.nullcontext()
        with hooks:
            out = checkpoint(inner, *flat, use_reentrant=False, early_stop=early)
        c.leave_forward(i)
        return out


def install(blocks: list[nn.Module], conductor, nano_batches: int = 1,
            compile: compiled.CompileOptions | None = None, nano_mlps=None) -> None:
    """Make every block a StreamedBlock bound to `conductor` (and split its token-wise MLPs, `nano_mlps(block)`
    or every FeedForward, into `nano_batches`; compile each block class's forward with `compile`)."""
    from .nano import split_mlps

    for i, b in enumerate(blocks):
        split_mlps(b, nano_batches, nano_mlps(b) if nano_mlps is not None else None)
        swap_class(b, StreamedBlock, "Streamed")
        b.bind(conductor, i)
        b._offload_compile = compile


def remove(blocks: list[nn.Module]) -> None:
    """Undo `install`: plain classes, no conductor reference."""
    from .nano import join_mlps

    for b in blocks:
        if not isinstance(b, StreamedBlock):
            continue
        join_mlps(list(b.modules()))
        restore_class(b)
        del b._offload_conductor, b._offload_index, b._offload_compile
