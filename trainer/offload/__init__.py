"""Streaming a model's blocks between pinned CPU RAM and the GPU (the offload conductor).

Public interface (everything else in this package is internal):

    handle = attach_offload(
        blocks,                 # list[nn.Module] in execution order (adapter.blocks(transformer))
        device,                 # torch.device or "cuda" / "cpu"
        fraction,               # share of block bytes kept in CPU RAM: 0 = resident (no streaming)
        mode="train",           # "train": forward then backward; "sample": cyclic forward
        activations=False,      # offload checkpoint inputs to pinned RAM (training)
        nano_batches=1,         # split token-wise MLPs (diffusers FeedForward) into this many checkpointed chunks
        nano_mlps=None,         # block -> its token-wise MLPs (the family's `token_wise_of`; None: every FeedForward)
        trainable=False,        # True: block weights are trained (full fine-tune, needs a fused back pass)
        checkpointing=None,     # default: True in "train"; per-block torch.utils.checkpoint(use_reentrant=False);
                                #   a list of bools: per block (a streamed trainable block must be checkpointed;
                                #   a streamed frozen one may keep its activations: conductor `saved_weights`)
        optimizer_state=(),     # full fine-tune: state packed beside each weight: FusedBackPass.state_layout
                                #   (p -> {name: (shape, dtype)}) or names of fp32 weight-shaped tensors
        race_detector=False,    # fill released ring regions with NaN at once (tests)
        activation_min_bytes=1 << 20,  # smaller checkpoint inputs stay on the device
        inputs_on_device=0,     # the last this many recomputed blocks keep their checkpoint inputs on the device
                                #   (plan.py `inputs_on_device`; the trainer: plan.INPUTS_ON_DEVICE, 2)
        compile=False,          # True / CompileOptions(backend, dynamic, shapes): each block class's forward
                                #   compiled once (regional compilation; trainer/offload/compiled.py)
        fill=None,              # blocks hold placeholders: fill(block, entries, views) writes their weights
                                #   into place (trainer/models/stream_load.py TransformerLoader.fill)
        pinned_budget=None,     # bytes the host arena may pin; above it (or if pinning is refused) the arena
                                #   stays pageable and copies go through two pinned one-block buffers
        share=None,             # allocators.SharedArena: the arena once per host for several processes (frozen
                                #   weights only; filled by the owner, mapped by the others)
        gather=None,            # gather.SliceGather: the processes of a host fill their rings together, each
                                #   copying 1/N of every load over PCIe and all-gathering the rest (frozen
                                #   weights only; every process must run the same passes: trainer/offload/gather.py)
        parkable=False,         # park() may give the whole ring back (never-streamed blocks are held in the ring,
                                #   at fraction 0 too): several models that share the GPU in turn (conductor.py)
    )
    handle.pinning_note -> None, or the one line that says the arena is pageable and why
    handle.stats()      -> dict: block_bytes, offloaded_bytes, ring_bytes, pinned_bytes, h2d_gbps, ...
    handle.state_of(p)  -> dict of optimizer-state tensors for a streamed trainable parameter (or None)
    handle.host_state_of(p) -> the host-arena copy of that state (current after the block's write-back)
    handle.set_mode(m)  -> switch between "train" and "sample" (re-plans; synchronises)
    handle.sync()       -> waits; every block parameter then reads current values (to save a full fine-tune)
    handle.close()      -> restores plain modules (their own class) with current weights on the CPU (alias: detach)
    handle.close(keep_weights=False) -> the same, streamed blocks left with meta tensors (the model is discarded)
    handle.park() / handle.unpark() -> (parkable) the ring given back, the blocks on their host bytes / the ring
                           taken again with the plan's initial blocks; one handle runs at a time
    handle.park(disk=True) -> (parkable, frozen, attached with `fill`) the arena freed too: no host bytes; `unpark`
                           reads the blocks from the files again (bitwise the same bytes)
    handle.hold(fraction) -> (sampling, frozen, not parkable) between passes: beyond the ring, the streamed blocks
                           that `fraction` would keep stay on the device, each in its own allocation, until
                           hold(None); False where that allocation failed (nothing changed)
    handle.share_activations(other) -> use `other`'s activation offloader (one pinned buffer for models run in turn)
    handle.release_activations() -> between steps: the activation offloader's pinned buffers given back (the next
                           training forward takes one again)

    bind_fused(handle, fused)  -> trainer.optim FusedBackPass steps streamed weights with their packed state
                                  (from trainer.offload.fused_state; pre/post/synchronize hooks of its protocol,
                                  through the handle's public methods)

Each block becomes a `StreamedBlock` (trainer/offload/block.py): its class is swapped for a subclass whose
forward runs the stages (checkpoint, release after backward, activation offload, streaming, nano split) and
then the block's own forward; module names, state-dict keys and isinstance checks are unchanged, and nothing
assigns `.forward`. `close` restores the blocks' own classes.

Full fine-tune with streaming, in this order:
    fused = FusedBackPass(build_optimizer(params, cfg.optimizer))
    handle = attach_offload(blocks, device, f, trainable=True, optimizer_state=fused.state_layout)
    bind_fused(handle, fused)

Contract with the caller:
- Non-block modules (embedders, final norm, projections) are the caller's: move them to the device yourself
  (`move_outside_blocks(model, blocks, device)`).
- The handle does the per-block gradient checkpointing itself (also at fraction 0: it is how the trainer
  checkpoints blocks); do NOT also call diffusers' `enable_gradient_checkpointing()` on the model (blocks would
  be checkpointed twice). A block can be attached to one handle at a time (a second attach raises).
- Trainable parameters inside blocks (peft LoRA) stay resident on the device and are never packed when
  `trainable=False`; with `trainable=True` every block parameter streams and the optimizer must step inside
  backward (trainer/optim fused back pass), reading its state through `handle.state_of(p)`.
- With `fraction == 0` nothing streams: blocks are moved to the device and run the same StreamedBlock
  (checkpointing, the release identity, activation offloading and nano split still apply when asked).
"""

from __future__ import annotations

import torch
from torch import nn

from . import block, compiled
from .compiled import CompileOptions
from .conductor import Conductor
from .fused_state import bind_fused

__all__ = ["CompileOptions", "OffloadHandle", "attach_offload", "bind_fused", "move_outside_blocks"]


class OffloadHandle:
    def __init__(self, conductor: Conductor, blocks: list[nn.Module], kwargs: dict):
        self._c = conductor
        self._blocks = blocks
        self._kwargs = kwargs

    def stats(self) -> dict:
        return self._c.stats()

    @property
    def pinning_note(self) -> str | None:
        return self._c.pinning_note

    def state_of(self, p: torch.Tensor):
        return self._c.state_of(p)

    def host_state_of(self, p: torch.Tensor):
        return self._c.host_state_of(p)

    @property
    def plan(self):
        return self._c.plan

    @property
    def checkpointed(self) -> list[bool]:
        """Per block: recomputed in backward (the `checkpointing` it was attached with)."""
        return list(self._c.checkpointed)

    def set_mode(self, mode: str) -> None:
        """Re-plan for "train" or "sample". Slow (restores the blocks' tensors and packs them again); a no-grad
        forward under the training plan also works, it just loads the backward's blocks it does not need."""
        if mode == self._c.mode:
            return
        c = self._c
        c.close()
        self._kwargs["mode"] = mode
        self._c = Conductor(c.blocks, c.device, c.fraction, **self._kwargs)
        for i, b in enumerate(self._blocks):
            b.bind(self._c, i)

    def sync(self) -> None:
        """Wait for the device; point every block parameter at current values (ring or host copy)."""
        self._c.expose_current_weights()

    def park(self, disk: bool = False) -> None:
        """A parkable handle gives its ring back; its blocks read their host bytes until `unpark` (a sync), or with
        `disk` (frozen blocks attached with `fill`) hold no host bytes and are read from the files at `unpark`."""
        self._c.park(disk)

    def unpark(self) -> None:
        """The ring taken again, the plan's initial blocks copied in; the next pass starts a step."""
        self._c.unpark()

    def hold(self, fraction: float | None) -> bool:
        """Between passes of a sampling plan: keep on the device what `fraction` would, beyond the ring (each
        held block in its own allocation, copied once), or (None) give those blocks back; False where an
        allocation failed and nothing changed (conductor `hold`)."""
        return self._c.hold(fraction)

    @property
    def parked(self) -> bool:
        return self._c.parked

    def release_activations(self) -> None:
        """Between steps: the activation offloader's pinned buffers given back (ActivationOffloader.release);
        nothing without activation offloading."""
        if self._c.activations is not None:
            self._c.activations.release()

    def activations_retaken(self) -> tuple[int, float, bool] | None:
        """(bytes, seconds, after `release_activations`) of the one activation buffer a pass took since this was
        last asked (after the first steps' growth, or after a release), else None."""
        a = self._c.activations
        if a is None or a.arena.retaken is None:
            return None
        out, a.arena.retaken = a.arena.retaken, None
        return out

    def share_activations(self, other: OffloadHandle) -> None:
        """Offload checkpoint inputs into `other`'s buffers (models that run in turn need one pinned region)."""
        if self._c.activations is not None and other._c.activations is not None:
            self._c.activations = other._c.activations
            self._c.shared_activations = True

    def close(self, keep_weights: bool = True) -> None:
        """Undo the attach; `keep_weights=False`: streamed blocks are left with meta tensors (no RAM copy)."""
        self._c.close(keep_weights)
        block.remove(self._blocks)

    detach = close


def move_outside_blocks(module: nn.Module, blocks: list[nn.Module], device: torch.device | str) -> None:
    """The caller's side of the contract: move every parameter and buffer of `module` that is not inside one of
    `blocks` to `device`. Parameter objects are kept (`p.data` is replaced), so an optimizer holding them stays
    valid. One allocation per tensor, once per run (not in the hot path)."""
    skip = {id(b) for b in blocks}
    device = torch.device(device)

    def move(m: nn.Module) -> None:
        if id(m) in skip:
            return
        for child in m.children():
            move(child)
        for p in m.parameters(recurse=False):
            if p.device != device:
                p.data = p.data.to(device)
        for name, b in m.named_buffers(recurse=False):
            if b is not None and b.device != device:
                m._buffers[name] = b.to(device)

    move(module)


def attach_offload(
    blocks: list[nn.Module],
    device: torch.device | str,
    fraction: float,
    mode: str = "train",
    activations: bool = False,
    nano_batches: int = 1,
    nano_mlps=None,
    trainable: bool = False,
    checkpointing: bool | None | list[bool] = None,
    optimizer_state=(),
    race_detector: bool = False,
    activation_min_bytes: int = 1 << 20,
    inputs_on_device: int = 0,
    training: bool | None = None,
    compile: bool | CompileOptions = False,
    _release_at_recompute: bool = False,
    fill=None,
    pinned_budget: int | None = None,
    share=None,
    min_ring_blocks: int = 2,
    gather=None,
    parkable: bool = False,
) -> OffloadHandle:
    """Install streaming on `blocks`; see the module docstring. `training` is an alias of `mode`;
    `_release_at_recompute` reproduces the OneTrainer race (tests prove the race detector catches it);
    `min_ring_blocks`: the ring holds at least this many of the largest block (2: one computing, one arriving;
    more loads further ahead and keeps more blocks across the turn, at that many blocks' VRAM); `nano_mlps`: a
    function of a block giving its token-wise MLPs to split into `nano_batches` (None: every FeedForward);
    `inputs_on_device`: with `activations`, the last this many recomputed blocks keep their checkpoint inputs on the
    device (plan.py `inputs_on_device`: the trainer passes INPUTS_ON_DEVICE)."""
    if training is not None:
        mode = "train" if training else "sample"
    blocks = list(blocks)
    kwargs = dict(
        mode=mode,
        activations=activations,
        trainable=trainable,
        checkpointing=checkpointing,
        optimizer_state=optimizer_state,
        race_detector=race_detector,
        activation_min_bytes=activation_min_bytes,
        inputs_on_device=inputs_on_device,
        release_at_recompute=_release_at_recompute,
        pinned_budget=pinned_budget,
        min_ring_blocks=min_ring_blocks,
        parkable=parkable,
    )
    if any(isinstance(b, block.StreamedBlock) for b in blocks):
        raise ValueError("offload: these blocks are already attached; close their handle first")
    # `fill`, `share` and `gather` once: a later re-plan (set_mode, one process) copies the real tensors into a
    # private arena and loads whole blocks
    c = Conductor(blocks, device, fraction, fill=fill, share=share, gather=gather, **kwargs)
    block.install(blocks, c, nano_batches, compiled.options(compile), nano_mlps)
    return OffloadHandle(c, blocks, kwargs)
