"""The offload conductor: replays a `plan.Plan` on the GPU with two streams, events and per-block hooks.

How the pieces fit. The constructor packs every block (allocators.BlockPacking), asks plan.py where each block
lives in the ring and when each copy may start, and copies the streamed blocks into one pinned host arena and the
initially resident ones into the ring. It does not touch the blocks' code: each block is a `StreamedBlock`
(trainer/offload/block.py, installed by `attach_offload`) whose forward calls the public methods below. The
conductor keeps a cursor into the plan's execution sequence (forward F0..F(n-1), then backward B(n-1)..B0 in
training):

- `enter(phase, i)` runs when block i starts (its forward, or its recompute inside backward; for a streamed block
  that keeps its activations, the backward of an identity on its outputs, before any of its backward kernels): it
  moves the cursor, makes the compute stream wait for the block's load event, and points the block's parameters
  at their ring views (`_point`). Such a kept block's weights, saved by autograd in forward, would be views of a
  region refilled since: `saved_weights` saves them as places in the block's region instead and unpacks them from
  wherever the block is in backward (DESIGN.md's version-counter pitfall, decided this way; frozen blocks only: a
  trainable streamed block is stepped and written back in its backward and stays recomputed);
- a block's *release point* is after its forward in forward and sampling (`leave_forward(i)`), and after its
  **backward** in training: the block's identity autograd function on its grad-carrying inputs calls
  `release_callback(i)`'s function once the gradients of those inputs exist, i.e. after every backward kernel
  that reads the block's weights has been enqueued. Releasing after the recompute instead (`leave_recompute`,
  only with the `release_at_recompute` test switch) is the OneTrainer race (issue #1306); `race_detector=True`
  fills a released region with NaN on the compute stream at once, so any kernel still reading it poisons the
  loss;
- at a release point (`_release`) the compute stream records one event; every load the plan issues there makes
  the transfer stream wait for that event, copies one packed block (one `copy_`, non_blocking, from pinned
  memory), and records the block's load event.

So compute waits on loads, and loads wait on the last use of what they overwrite; nothing else synchronises.
The only host-device syncs are in `close`, `expose_current_weights`, `stats` and the activation throttle.

Trainable streamed weights (full fine-tune with a fused back pass): the optimizer steps each parameter in
its post-accumulate-grad hook while the block is resident; `enter(BWD, i)` marks the block dirty, and before
its region is reused `_write_back` copies the whole packed region (weights and the optimizer state packed beside
them, see `state_of`) back to the host arena on a third stream; the overwriting load waits for that copy.
Optimizer state therefore never stays on the GPU longer than its block.

Out-of-plan calls (a no-grad forward during training, a step whose backward never came) are absorbed: `enter`
skips the cursor ahead, releasing what it skips (`_finish_step` at a new step), so the ring always returns to a
state the plan knows.

With fraction 0 nothing streams (`streaming` is False): `enter` only starts the activation offloader's step,
and the release methods do nothing; the blocks run the same `StreamedBlock` code.

Loading without a RAM copy: with `fill` the blocks hold placeholders (trainer/models/stream_load.py), and the
constructor lays out arena and ring from their shapes, then `fill` writes each block's tensors from the model's
files straight into its arena region, its ring region, or (fraction 0) fresh device tensors. Where the arena
cannot be pinned (cudaHostRegister refused, or larger than `pinned_budget`) it stays pageable and every load goes
through two pinned one-block buffers (allocators.Staging); `pinning_note` is the one line that says so.

Several processes of one host may fill their rings together (`gather`, trainer/offload/gather.py): every load
then copies this process's 1/N slice of the block and all-gathers the rest from the other GPUs, on the same
transfer stream and under the same events, so the rest of this text holds unchanged. Trainable blocks too, when
every process ends a block's backward with the same stepped weights (trainer/train/owners.py broadcasts each
owner's step) and no optimizer state is packed: the write-back then copies only this process's slice, the one
its next load copies in again, so the processes never read each other's host bytes during training, and the
arena is whole after a barrier (`expose_current_weights`, `close`).

Parking (several models sharing one GPU in turn: the two experts of Wan 2.2 A14B trained in one run,
trainer/train/experts.py). A conductor built with `parkable` keeps even its never-streamed blocks in the ring (at
fraction 0 too), so that `park()` can give the whole ring back: after a host-device sync, the blocks that have no
arena copy are copied once into a pinned parking buffer (frozen weights never change; trainable ones are copied at
every park), every block's parameters point at their host bytes, and the ring is freed. `unpark()` allocates the
ring again (the caching allocator hands back the bytes the other model's park just freed: the models have the same
blocks), copies in the plan's initial blocks, and starts a fresh step of the plan, as a new conductor would. So only
the running model's blocks are on the GPU, and a switch moves one ring's bytes.

Parking on disk (`park(disk=True)`, frozen blocks built with `fill` only). The parked model then holds no host bytes
at all: after the same sync its arena is unregistered and freed (`HostArena.close`), no parking buffer is made, and
every block tensor becomes a *hollow* one (its shape and dtype over one shared NaN scalar: nothing to free, NaN if
anything reads it). `unpark` reads the blocks again from the model's files with the same `fill` that built them:
the streamed ones into a fresh arena (allocated, filled, then pinned, as at construction), the never-streamed ones
of the plan's start straight into their ring regions. `fill` is deterministic (the same file bytes, the same casts
and quantization), so the refilled bytes are bitwise the first ones and a run parked on disk is bitwise one parked
in RAM. A switch then costs reading one model's blocks (the page cache, or the disk) and pinning its arena, instead
of one ring's copy; the host holds one model's blocks instead of all of them.

Left out: torch.compile of the block wrapper (it is called eagerly; compiling inside blocks still works),
several GPUs per process, and blocks that appear twice in one pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from .activations import ActivationOffloader
from .allocators import BlockPacking, HostArena, Ring, Staging
from .plan import BWD, FWD, Plan, capacity_for, held_plan, plan_for
from .plan import inputs_on_device as plan_inputs_on_device


def _nothing() -> None:
    pass


_HELD = -1  # `params_at` of a block whose parameters point at its held copy (`Conductor.hold`)


class _RingView(NamedTuple):
    """A saved tensor that lay in block `block`'s ring region: its byte offset in the region, shape, strides and
    dtype (conductor `saved_weights`)."""

    block: int
    offset: int
    shape: tuple
    stride: tuple
    dtype: torch.dtype


_NAN: dict[torch.dtype, torch.Tensor] = {}


def _hollow(shape, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of `shape` and `dtype` over one shared scalar (NaN where the dtype has one): a parked-on-disk
    block's tensor costs no memory, and anything that reads it gets NaN, never plausible numbers. Made with `set_`
    (not `expand`) so that each one has its own autograd version counter."""
    ref = _NAN.get(dtype)
    if ref is None:
        ref = _NAN[dtype] = (torch.full((), float("nan")).to(dtype) if dtype.is_floating_point
                             else torch.zeros((), dtype=dtype))
    return torch.empty(0, dtype=dtype).set_(ref.untyped_storage(), 0, tuple(shape), (0,) * len(shape))


def _per_block(checkpointing, default: bool, n: int) -> list[bool]:
    """`checkpointing` as one flag per block: None (the mode's default), one bool for all, or a list."""
    if checkpointing is None or isinstance(checkpointing, bool):
        return [default if checkpointing is None else checkpointing] * n
    flags = [bool(x) for x in checkpointing]
    if len(flags) != n:
        raise ValueError(f"checkpointing: {len(flags)} flags for {n} blocks")
    return flags


class Conductor:
    def __init__(
        self,
        blocks: list[nn.Module],
        device: torch.device | str,
        fraction: float,
        mode: str = "train",
        activations: bool = False,
        trainable: bool = False,
        checkpointing: bool | None | list[bool] = None,
        optimizer_state=(),
        race_detector: bool = False,
        min_ring_blocks: int = 2,
        activation_min_bytes: int = 1 << 20,
        inputs_on_device: int = 0,
        release_at_recompute: bool = False,  # reproduces the known race; tests use it to prove the detector
        fill=None,
        pinned_budget: int | None = None,
        share=None,
        gather=None,
        parkable: bool = False,
    ):
        """`fill(block, entries, views)`: writes block `block`'s tensors into `views` (one per packing entry) when
        the blocks hold placeholders instead of weights (trainer/models/stream_load.py); None: copy the blocks'
        own tensors. `pinned_budget`: bytes the host arena may pin (None: all of it); see allocators.Staging.
        `share` (allocators.SharedArena): the arena is one file under /dev/shm for the processes of a host.
        `gather` (gather.SliceGather): the processes of a host fill their rings together, each copying 1/N of a
        block over PCIe and all-gathering the rest (frozen blocks only; every process runs the same plan).
        `parkable`: `park()` may give the ring back (see the module essay); the ring then holds every block that is
        not streamed, at fraction 0 too. `inputs_on_device`: with `activations`, the checkpoint inputs of this many
        of the last recomputed blocks stay on the GPU (plan.py `inputs_on_device`; the trainer's INPUTS_ON_DEVICE)."""
        self.blocks = list(blocks)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.fraction = float(fraction)
        self.mode = mode
        self.trainable = trainable
        #: per block: recompute it in backward (torch.utils.checkpoint) rather than keep its activations
        self.checkpointed = _per_block(checkpointing, mode == "train", len(self.blocks))
        self.checkpointing = any(self.checkpointed)
        self.race_detector = race_detector
        self.release_at_recompute = release_at_recompute
        #: the plan and ring run (blocks streamed, or a parkable model's resident blocks held in the ring)
        self.streaming = self.fraction > 0.0 or parkable
        self.parkable, self.parked = parkable, False
        self.parked_on_disk = False  # parked with `park(disk=True)`: no host bytes, refilled from the files by `fill`
        self._fill = fill if parkable else None  # kept for a disk park's refill (reads the files again)
        self._pinned_budget = pinned_budget
        self._park_buf: HostArena | None = None  # a parked model's never-streamed blocks (`park`)
        self._park_off: dict[int, int] = {}
        self._step0 = 0  # the step the plan's step 0 is (a new conductor, or the last `unpark`)
        if self.fraction > 0.0 and mode == "train" and trainable and not self.checkpointing:
            # A trainable streamed block is stepped and written back in its backward: only a recomputed one
            # (frozen blocks may keep their activations: `saved_weights`)
            raise ValueError(
                "offloading trainable blocks in training needs per-block checkpointing (checkpointing=True)"
            )
        self.cuda = self.device.type == "cuda"
        #: checkpoint inputs to pinned RAM (None: off); StreamedBlock wraps each checkpoint in its hooks
        self.activations = (
            ActivationOffloader(self.device, min_bytes=activation_min_bytes,
                                on_device=plan_inputs_on_device(self.checkpointed, inputs_on_device))
            if activations else None
        )
        self.shared_activations = False  # the offloader is another conductor's (OffloadHandle.share_activations)
        self._h2d_log: list = []  # (start event, end event, bytes) of the last step's copies
        self._host_state: dict[int, dict[str, torch.Tensor]] = {}  # host_state_of's views, built once

        self.packs = self._pack_blocks(trainable, optimizer_state)
        self.pinning_note: str | None = None  # one line when the arena could not be pinned (or shared)
        self.staging = None
        self.shared = False  # the arena is one /dev/shm file for the processes of this host
        #: gather.SliceGather: each load copies this process's slice and all-gathers the rest (None: whole copies)
        self.gather = gather if self.streaming else None
        if self.gather is not None and any(pk.states for pk in self.packs):
            raise ValueError("offload: the sharded stream packs no optimizer state beside the weights (each "
                             "process keeps its own parameters' state: trainer/train/owners.py)")
        if not self.streaming:
            self._place_resident(fill)
        else:
            self._setup_streaming(min_ring_blocks, fill, pinned_budget, share)

    # ------------------------------------------------------------------------------------------ setup
    def _pack_blocks(self, trainable: bool, optimizer_state) -> list[BlockPacking]:
        """Each block's packing (allocators.BlockPacking: its frozen parameters and buffers laid out in one byte
        range; with `trainable`, its trainable weights too, with `optimizer_state` packed beside them); the
        trainable parameters left out of it (a LoRA's) are moved to the device, where they stay."""
        packs = [
            BlockPacking.of(b, include_trainable=trainable, state_layout=optimizer_state) for b in self.blocks
        ]
        for pk in packs:  # LoRA and other trainable params outside the packed region stay resident
            for p in pk.resident:
                p.data = p.data.to(self.device)
        return packs

    def _place_resident(self, fill) -> None:
        """Nothing streams: every block on the device (with `fill`, its tensors written straight onto the device
        one at a time), and no plan, ring or arena."""
        for i, (b, pk) in enumerate(zip(self.blocks, self.packs, strict=True)):
            if fill is not None:  # straight onto the device, one tensor at a time
                views = [torch.empty(e.shape, dtype=e.dtype, device=self.device) for e in pk.entries]
                fill(i, pk.entries, views)
                pk.point_at(views)
            b.to(self.device)
        self.plan = None
        self.ring = self.arena = None

    def _make_arena(self, total: int, pinned_budget: int | None, buf, defer: bool = False) -> None:
        self.arena = HostArena(total, pin=self.cuda, budget=pinned_budget, pageable=True, buf=buf, defer=defer)
        if not defer:
            self._pin_arena()

    def _pin_arena(self) -> None:
        """Page-lock the arena; where that is refused, copies go through two pinned one-block buffers."""
        self.arena.pin()
        sizes, streamed = [pk.nbytes for pk in self.packs], self.plan.streamed
        if self.arena.refused is not None and self.staging is None:  # copies go through two pinned one-block buffers
            self.staging = Staging(max(sizes[b] for b in streamed), self.device)
            self.pinning_note = (f"offload: {self.arena.refused}; the host arena stays pageable and copies are "
                                 f"staged through two pinned {max(sizes[b] for b in streamed) / 2**20:.0f} MB "
                                 f"buffers (slower; set offload.pinned_budget_gb to choose)")

    def _setup_streaming(self, min_ring_blocks: int, fill, pinned_budget: int | None, share) -> None:
        """The plan, the ring, the host arena and the copy streams. Host RAM order: the blocks that
        are never streamed go to the ring first and their CPU originals are dropped, then the arena is filled and
        pinned, each streamed block's original dropped as soon as it is packed, so a model loaded whole into RAM
        peaks at its streamed bytes twice, not whole + arena."""
        sizes = self._plan_ring(min_ring_blocks)
        total = self._arena_layout(sizes)
        use = self._usable_share(share, total)  # the SharedArena in use, if asked for and possible
        self.shared = use is not None
        self.ring = Ring(self.plan.capacity, self.device)
        #: block -> ring offset its packed bytes are loaded (or being loaded) at; None: not in the ring
        self.ring_offset: dict[int, int | None] = {b: None for b in range(len(self.blocks))}
        self._fill_ring_unstreamed(sizes, fill)
        self._fill_arena(sizes, total, fill, pinned_budget, share, use)
        for b, off in self.plan.initial.items():  # streamed blocks that start in the ring
            if b in self.host_off:
                self.ring.region(off, sizes[b]).copy_(self.arena.region(self.host_off[b], sizes[b]))
                self.ring_offset[b] = off
        #: block -> ring offset its parameters currently point at (None: not at the ring)
        self.params_at: dict[int, int | None] = {b: None for b in range(len(self.blocks))}
        for b in range(len(self.blocks)):  # the CPU originals are gone: host arena and ring hold the truth
            if self.ring_offset[b] is not None:
                self._point(b)
            else:
                self._drop_originals(b)
        self._start_streams()

    def _plan_ring(self, min_ring_blocks: int) -> list[int]:
        """The plan (plan.py `plan_for`) of the blocks' packed sizes at this fraction, refused in training where
        a streamed block is not checkpointed; returns those sizes (under the sharded stream, padded to N equal
        slices per block: the padding is never read as weights)."""
        sizes = [pk.nbytes for pk in self.packs]
        if self.gather is not None:
            sizes = [self.gather.padded(n) for n in sizes]
        cap = capacity_for(sizes, self.fraction, min_blocks=min_ring_blocks)
        self.plan: Plan = plan_for(sizes, cap, self.mode, min_ring_blocks)
        kept = [b for b in self.plan.streamed if not self.checkpointed[b]]
        if self.mode == "train" and self.trainable and kept:  # the same reason as in __init__, block by block
            raise ValueError(f"offloading trainable blocks in training needs per-block checkpointing: blocks "
                             f"{kept} stream at fraction {self.fraction:g} but are not checkpointed")
        return sizes

    def _arena_layout(self, sizes: list[int]) -> int:
        """Each streamed block's offset in the host arena (`host_off`), one after the other in block order;
        returns the arena's bytes."""
        self.host_off: dict[int, int] = {}
        total = 0
        for b in self.plan.streamed:
            self.host_off[b] = total
            total += sizes[b]
        return total

    def _usable_share(self, share, total: int):
        """`share` where this host can hold the arena as one /dev/shm file, else None (`pinning_note` says why);
        every process looks before the owner writes. Refused where the arena would hold optimizer state, or
        trainable weights outside the sharded stream."""
        if share is None:
            return None
        if any(pk.states or (self.gather is None and any(e.tensor().requires_grad for e in pk.entries))
               for pk in self.packs):
            raise ValueError("offload: a shared arena holds frozen weights, or trainable ones under the sharded "
                             "stream (each process writes back its own slice); never optimizer state")
        why = share.fits(total)
        share.barrier()  # every process has looked at /dev/shm before the owner writes to it
        if why is None:
            return share
        self.pinning_note = f"offload: every process keeps its own arena: {why}"
        return None

    def _fill_ring_unstreamed(self, sizes: list[int], fill) -> None:
        """The blocks the plan starts in the ring that never stream, packed into their ring regions (with
        `fill`, tensor by tensor from the files; else from the blocks, whose CPU originals are then dropped)."""
        for b, off in self.plan.initial.items():
            if b in self.host_off:
                continue  # filled from the arena
            dst = self.ring.region(off, sizes[b])
            if fill is not None:
                self.packs[b].write_into(dst, fill, b)  # tensor by tensor from the files into the ring
            else:
                tmp = torch.empty(sizes[b], dtype=torch.uint8)
                self.packs[b].write_into(tmp)
                dst.copy_(tmp)
                self._drop_originals(b)
            self.ring_offset[b] = off

    def _fill_arena(self, sizes: list[int], total: int, fill, pinned_budget: int | None, share, use) -> None:
        """The host copies of the streamed blocks (read from the files straight into the arena with `fill`),
        packed and then pinned. With a shared arena the owner creates the /dev/shm file, every process maps it and
        fills its part of the blocks (`SharedArena.mine`) at the same time, and all pin their mappings after the
        last one has filled; as many barriers on every process whatever it decided."""
        buf = None
        if use is not None:
            buf = use.create(total) if use.owner else None
            use.barrier()  # the file exists: every process maps it
            buf = buf if use.owner else use.map(total)
        elif share is not None:
            share.barrier()
        self._make_arena(total, pinned_budget, buf, defer=True)
        mine = set(self.plan.streamed) if use is None else use.mine(self.plan.streamed, sizes)
        for b in self.plan.streamed:
            if b in mine:
                self.packs[b].write_into(self.arena.region(self.host_off[b], sizes[b]), fill, b)
            self._drop_originals(b)
        if share is not None:
            share.barrier()  # every process has mapped the file and filled its part
            if use is not None and use.owner:
                use.unlink()  # the mappings stay; nothing is left in /dev/shm when the processes end
        self._pin_arena()  # after packing: RAM grows as the originals go; the host's processes pin side by side

    def _start_streams(self) -> None:
        """The copy streams (host to device; device to host for trainable blocks' write-back) after a sync, and
        the first step's tables: the conductor is at the start of step 0."""
        self.loaded_event: dict[int, object] = {}
        self.dirty: set[int] = set()
        self.base_plan = self.plan  # the constructor's plan: `hold` switches to a variant of it and back
        #: block -> its copy on the device outside the ring, while the plan holds it (`hold`)
        self.held: dict[int, torch.Tensor] = {}
        self._held_plans: dict[float | None, Plan] = {}  # `hold`'s plan per fraction
        if self.cuda:
            self.h2d = torch.cuda.Stream(self.device)
            self.d2h = torch.cuda.Stream(self.device) if self.trainable else None
            torch.cuda.synchronize(self.device)
        self.step = 0
        self.cursor = 0
        self._new_step_tables()

    def _new_step_tables(self) -> None:
        L = len(self.plan.sequence)
        self.released = [False] * L
        self.loads_after: dict[int, list] = {}
        for ld in self.plan.step_loads(self.step - self._step0):
            self.loads_after.setdefault(ld.after, []).append(ld)
        self._h2d_log_step: list = []

    # ------------------------------------------------------------------------------------------ block interface
    # What trainer/offload/block.py's StreamedBlock calls, in the order a training step calls it.

    def begin_pass(self) -> None:
        """Block 0's forward is called (StreamedBlock.forward, before any of its paths): the step's activation buffers
        start here, before a checkpoint saves block 0's inputs. Started in `enter(FWD, 0)`, which runs inside that
        checkpoint after the save, the buffers were reset after block 0's inputs went out, and block 1's overwrote
        them: the first block recomputed from another block's inputs in backward wherever they carry a gradient (a
        full fine-tune, whose embedders train: wrong first-block gradients until 2026-11-28, tests/test_families.py)."""
        if self.activations is not None:
            self.activations.new_step()

    def enter(self, phase: str, i: int) -> None:
        """Block `i` starts its forward (`FWD`) or its recompute in backward (`BWD`): move the cursor to its plan
        position, wait for its load, point its parameters at the ring."""
        if not self.streaming:
            return
        if self.parked:
            raise RuntimeError(f"offload: block {i} ran while its model is parked (unpark it first)")
        target = self._position(phase, i) if (self.mode == "train" or phase == FWD) else None
        if target is None or self.plan.sequence[target] != (phase, i):
            raise RuntimeError(
                f"offload: block {i} ran in pass {phase} that the {self.mode} plan has no place for"
            )
        if target < self.cursor or (target == self.cursor and self.released[target]):
            self._finish_step()
        for q in range(self.cursor, target):
            self._release(q)  # skipped positions (out-of-plan flows)
        self.cursor = target
        if phase == BWD and self.trainable:
            self.dirty.add(i)  # its fused optimizer step runs in this backward
        if i in self.held:  # on the device outside the ring for this plan (`hold`): its copy is awaited there
            if self.params_at[i] != _HELD:
                self.packs[i].point_at(self.packs[i].views(self.held[i]))
                self.params_at[i] = _HELD
            return
        off = self.ring_offset[i]
        if off is None:
            raise RuntimeError(f"offload: block {i} is not resident at plan position {target} (plan bug)")
        ev = self.loaded_event.pop(i, None)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
        if self.params_at[i] != off:
            self._point(i)

    def refills(self, i: int) -> bool:
        """Block `i` may be loaded again between its forward and its backward (it streams, in training): a kept
        one then saves its weights through `saved_weights` and enters its backward through its outputs."""
        return self.streaming and self.mode == "train" and i in self.host_off

    def saved_weights(self, i: int):
        """The saved-tensor hooks of a kept (not recomputed) block `i`'s forward when it `refills`: a tensor
        autograd saves that lies in the ring (one of the block's weights, or a view of one) is saved as where it
        lies in the block's region, and unpacked in backward as the same view of the region the block occupies
        then (`enter(BWD, i)` has loaded it: the block's output identity runs before its backward kernels).
        Everything else is saved as is. A null context for any other block."""
        if not self.refills(i):
            return contextlib.nullcontext()
        buf = self.ring.buf
        ptr, base = buf.untyped_storage().data_ptr(), self.params_at[i]

        def pack(t: torch.Tensor):
            if t.device != buf.device or t.untyped_storage().data_ptr() != ptr:
                return t
            return _RingView(i, t.storage_offset() * t.element_size() - base, tuple(t.shape), t.stride(), t.dtype)

        return torch.autograd.graph.saved_tensors_hooks(pack, self._unpack_saved)

    def _unpack_saved(self, x):
        if not isinstance(x, _RingView):
            return x
        off = self.params_at[x.block]
        if off is None or self.parked:
            raise RuntimeError(f"offload: block {x.block}'s backward read its weights before the block was loaded")
        return torch.empty(0, dtype=x.dtype, device=self.ring.buf.device).set_(
            self.ring.buf.untyped_storage(), (off + x.offset) // x.dtype.itemsize, x.shape, x.stride)

    def leave_forward(self, i: int) -> None:
        """Block `i`'s forward is enqueued: its forward position is released (the plan may refill its region)."""
        if self.streaming:
            self._release(self._position(FWD, i))

    def release_callback(self, i: int) -> Callable[[], None]:
        """The function block `i`'s backward identity calls once its input gradients exist: releases its
        backward position of the current step (a no-op when nothing streams, or once the step is over)."""
        if not self.streaming:
            return _nothing
        step, pos = self.step, self._position(BWD, i)

        def release() -> None:
            if step == self.step:
                self._release(pos)

        return release

    def leave_recompute(self, i: int) -> None:
        """The wrong release point (after block `i`'s recompute, before its backward kernels); only with
        `release_at_recompute`, so that tests can show the race detector catches it."""
        if self.streaming:
            self._release(self._position(BWD, i))

    # ------------------------------------------------------------------------------------------ cursor
    def _position(self, phase: str, i: int) -> int:
        L = len(self.plan.sequence)
        return L - 1 - i if phase == BWD else i

    def _finish_step(self) -> None:
        for q in range(self.cursor, len(self.plan.sequence)):
            self._release(q)
        self.step += 1
        self.cursor = 0
        self._new_step_tables()

    def _drop_originals(self, b: int) -> None:
        """Block `b`'s parameters stop holding their CPU originals (the arena or the ring has the bytes now)."""
        for e in self.packs[b].entries:
            if e.is_param:
                e.tensor().data = torch.empty(0, dtype=e.dtype)

    def _point(self, b: int) -> None:
        off = self.ring_offset[b]
        self.packs[b].point_at(self.ring.views(b, off, self.packs[b]))
        self.params_at[b] = off

    # ------------------------------------------------------------------------------------------ release / load
    def _release(self, pos: int) -> None:
        """Plan position `pos` is done with its block: issue the loads the plan starts there (once)."""
        if self.released[pos]:
            return
        self.released[pos] = True
        loads = self.loads_after.get(pos)
        if not loads:
            return
        sizes = self.plan.sizes
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        claims = [x for ld in loads for x in ld.claims]
        wb_events = [self._write_back(x, compute) for x in claims if x in self.dirty]
        if self.race_detector:
            for ev in wb_events:
                if ev is not None:
                    compute.wait_event(ev)
            for x in claims:
                self.ring.region(self.ring_offset[x], sizes[x]).fill_(255)  # NaN in bf16/fp16/fp32
        for x in claims:
            self.ring_offset[x] = None
            self.params_at[x] = None
        if not self.cuda:
            for ld in loads:
                dst = self.ring.region(ld.offset, sizes[ld.block])
                self._load(dst, self.arena.region(self.host_off[ld.block], sizes[ld.block]))
                self.ring_offset[ld.block] = ld.offset
            return
        ev = compute.record_event()
        with torch.cuda.stream(self.h2d):
            self.h2d.wait_event(ev)
            for wb in wb_events:
                self.h2d.wait_event(wb)
            for ld in loads:
                n = sizes[ld.block]
                t0 = torch.cuda.Event(enable_timing=True)
                t0.record(self.h2d)
                copied = self._load(self.ring.region(ld.offset, n), self.arena.region(self.host_off[ld.block], n))
                t1 = torch.cuda.Event(enable_timing=True)
                t1.record(self.h2d)
                self._h2d_log_step.append((t0, t1, copied))
                self.loaded_event[ld.block] = t1
                self.ring_offset[ld.block] = ld.offset
        self._h2d_log = self._h2d_log_step

    def _load(self, dst: torch.Tensor, src: torch.Tensor) -> int:
        """Enqueue one block's load into the ring region `dst` from its host bytes `src` (on the transfer stream
        when on CUDA: the caller's stream context); returns the bytes this process copied over PCIe."""
        if self.gather is not None:  # this process's slice over PCIe, the rest from the other GPUs
            return self.gather.load(dst, src, self._copy, self.cuda)
        self._copy(dst, src)
        return dst.numel()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.staging is not None:  # pageable arena: host memcpy into a pinned buffer, then DMA
            self.staging.copy(dst, src, self.h2d if self.cuda else None)
        else:
            dst.copy_(src, non_blocking=self.cuda)

    def _write_back(self, x: int, compute):
        """Copy a dirty trainable block (weights + packed optimizer state) back to its host region."""
        self.dirty.discard(x)
        n = self.plan.sizes[x]
        src = self.ring.region(self.ring_offset[x], n)
        dst = self.arena.region(self.host_off[x], n)
        if self.gather is not None:  # every ring holds the same stepped block: each process writes its slice
            src, dst = self.gather.slice(src), self.gather.slice(dst)
        if not self.cuda:
            dst.copy_(src)
            return None
        ev = compute.record_event()
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(ev)
            dst.copy_(src, non_blocking=True)
            return self.d2h.record_event()

    def _slices_written(self) -> None:
        """Trainable blocks under the sharded stream: the arena is whole only once every process has written
        its slices back (after its own `wait_for_device`); one barrier of the host's processes."""
        if self.gather is not None and self.trainable:
            self.gather.barrier()

    # ------------------------------------------------------------------------------------------ public
    def state_of(self, p: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The optimizer state packed beside a streamed trainable parameter (valid while its block runs)."""
        if not self.streaming:
            return None
        for b, pk in enumerate(self.packs):
            if self.ring_offset[b] is None:
                continue
            sv = self.ring.state_views(b, self.ring_offset[b], pk)
            if id(p) in sv:
                return sv[id(p)]
        return None

    def host_state_of(self, p: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The host-arena copy of a streamed parameter's packed state (current after its write-back)."""
        if not self.streaming:
            return None
        cache = self._host_state
        if id(p) in cache:
            return cache[id(p)]
        for b, pk in enumerate(self.packs):
            if b not in self.host_off:
                continue
            sv = pk.state_views(self.arena.region(self.host_off[b], self.plan.sizes[b]))
            for pid, views in sv.items():
                cache[pid] = views
        return cache.get(id(p))

    def stats(self) -> dict:
        """Sizes and the measured host-to-device rate of the last step's copies (synchronises). With a sharded
        stream, `h2d_gbps` is this process's copied bytes over the time of its loads, gathers included."""
        out = {
            "blocks": len(self.blocks),
            "block_bytes": sum(pk.nbytes for pk in self.packs),
            "offloaded_bytes": sum(self.plan.sizes[b] for b in self.plan.streamed) if self.streaming else 0,
            "ring_bytes": self.plan.capacity if self.streaming else 0,
            "pinned_bytes": (self.arena.pinned_bytes if self.streaming else 0),
            "staging_pinned_bytes": self.staging.pinned_bytes if self.staging is not None else 0,
            "arena_shared": self.shared,
            "gathered_by": self.gather.world if self.gather is not None else 1,
            "activation_pinned_bytes": self.activations.pinned_bytes if self.activations else 0,
            # over this process's PCIe link (a sharded stream copies 1/N of each load, the rest is gathered)
            "h2d_bytes_per_step": self.plan.bytes_per_step() // (self.gather.world if self.gather else 1)
            if self.streaming else 0,
        }
        if self.streaming:
            out["fraction_in_ram"] = 1.0 - self.plan.capacity / max(1, out["block_bytes"])
            out["held_bytes"] = sum(t.numel() for t in self.held.values())  # outside the ring (`hold`)
            out["parking_pinned_bytes"] = self._park_buf.pinned_bytes if self._park_buf is not None else 0
            # host bytes this conductor's blocks hold (arena + parking buffer), pinned or not: 0 parked on disk
            out["host_bytes"] = (self.arena.buf.numel() if self.arena.nbytes > 0 else 0) + (
                self._park_buf.buf.numel() if self._park_buf is not None else 0)
            out["parked_on"] = ("disk" if self.parked_on_disk else "ram") if self.parked else None
        if self.cuda and self._h2d_log:
            self._h2d_log[-1][1].synchronize()  # host-device sync
            ms = sum(a.elapsed_time(b) for a, b, _ in self._h2d_log)
            nbytes = sum(n for _, _, n in self._h2d_log)
            out["h2d_gbps"] = nbytes / (ms * 1e6) if ms > 0 else 0.0
        return out

    def wait_for_device(self) -> None:
        """Host-device sync: every copy and kernel enqueued so far has run."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def expose_current_weights(self) -> None:
        """Make every block's parameters readable with current values (e.g. to save a full fine-tune):
        resident blocks point at the ring, the others at their host copies, until they run again. Synchronises."""
        if self.streaming:
            compute = torch.cuda.current_stream(self.device) if self.cuda else None
            for b in list(self.dirty):
                if b in self.host_off and self.ring_offset[b] is not None:
                    self._write_back(b, compute)  # host copies (weights and packed state) become current
        self.wait_for_device()
        if not self.streaming or self.parked_on_disk:  # parked on disk: frozen blocks, hollow until `unpark`
            return
        self._slices_written()
        for b, pk in enumerate(self.packs):
            if self.ring_offset[b] is not None:
                self._point(b)
            else:
                pk.point_at(pk.views(self._host_region(b)))
                self.params_at[b] = None

    def _host_region(self, b: int) -> torch.Tensor:
        """Block `b`'s host bytes: its arena region, or (a parked model's never-streamed block) its parking one."""
        if b in self.host_off:
            return self.arena.region(self.host_off[b], self.plan.sizes[b])
        return self._park_buf.region(self._park_off[b], self.plan.sizes[b])

    # ------------------------------------------------------------------------------------------ holding
    def hold(self, fraction: float | None) -> bool:
        """Between two passes of a sampling plan of frozen blocks: keep on the device what `fraction` would keep
        (`capacity_for`) beyond this ring, as streamed blocks each held in its own allocation outside the ring
        (plan.py `held_plan`: the same ring, the fixed blocks where they are), the rest streaming as before; None
        (or a fraction not below the constructor's) gives them back and runs the constructor's plan again. The
        new plan starts at its step 0: the blocks it holds and those its ring starts with that are not there
        yet are copied from their host bytes on the transfer stream once the compute stream is past every
        earlier kernel (as `unpark`: a load of the old plan still in flight lands first), and compute waits for
        them. A captioner holds more layers for the decode steps of `generate` than its prefill's activations
        leave room for (trainer/captioning/vlm.py). Allocations: one per newly held block; where one fails the
        plan stays as it is and False is returned (nothing is half held)."""
        if not self.streaming or self.mode != "sample" or self.trainable or self.parkable or self.gather:
            raise ValueError("offload: hold needs a streamed sampling plan of frozen blocks (not parkable, not "
                             "sharded)")
        plan = self._held_plans.get(fraction)
        if plan is None:  # once per fraction: `held_plan` simulates the ring
            base = self.base_plan
            more = 0 if fraction is None else capacity_for(base.sizes, fraction) - base.capacity
            plan = self._held_plans[fraction] = held_plan(base, more) if more > 0 else base
        if plan.held == self.plan.held:
            return True
        sizes = plan.sizes
        try:  # one allocation per newly held block, on the compute stream (host order: before the copies)
            fresh = {b: torch.empty(sizes[b], dtype=torch.uint8, device=self.device)
                     for b in sorted(plan.held - set(self.held))}
        except torch.OutOfMemoryError:
            return False
        for b in set(self.held) - plan.held:  # frozen: its host bytes are current; the device copy is freed
            self.packs[b].point_at(self.packs[b].views(self._host_region(b)))
            self.params_at[b] = None
            del self.held[b]
        starts = {b: off for b, off in plan.initial.items() if b not in plan.fixed}
        for b in range(len(self.blocks)):  # a streamed block not where the new plan starts it may be overwritten
            if b not in plan.fixed and self.ring_offset[b] is not None and starts.get(b) != self.ring_offset[b]:
                self.ring_offset[b] = self.params_at[b] = None
        copies = [(self.held.setdefault(b, t), b) for b, t in fresh.items()]
        copies += [(self.ring.region(off, sizes[b]), b) for b, off in starts.items() if self.ring_offset[b] != off]
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        if self.cuda:
            ev = compute.record_event()
            with torch.cuda.stream(self.h2d):
                self.h2d.wait_event(ev)
                for dst, b in copies:
                    self._load(dst, self._host_region(b))
                done = self.h2d.record_event()
            compute.wait_event(done)
        else:
            for dst, b in copies:
                self._load(dst, self._host_region(b))
        self.loaded_event.clear()  # compute has waited for every copy issued so far
        for b, off in starts.items():
            self.ring_offset[b] = off
        self.plan = plan
        self.step += 1  # as `unpark`: the new plan's step 0 starts at the next pass
        self._step0 = self.step
        self.cursor = 0
        self._new_step_tables()
        return True

    # ------------------------------------------------------------------------------------------ parking
    def park(self, disk: bool = False) -> None:
        """Give the ring back (see the module essay); the blocks read their host bytes until `unpark`, or with
        `disk` hold none (hollow tensors; the arena freed) and are read from the files again at `unpark`.
        Host-device sync, once per park."""
        if not self.parkable or self.parked:
            return
        if disk and (self._fill is None or self.trainable):
            raise ValueError("offload: parking on disk needs frozen blocks read from the model's files (`fill`)")
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        for b in list(self.dirty):
            if b in self.host_off and self.ring_offset[b] is not None:
                self._write_back(b, compute)  # trainable streamed blocks: their host copies become current
        self.wait_for_device()  # every kernel reading the ring, every load into it, every write-back has run
        if disk:
            self._park_hollow()
        else:
            self._park_in_ram()
        self.loaded_event.clear()
        self._h2d_log = self._h2d_log_step = []
        self.ring = None  # freed to the caching allocator: the next model's `unpark` takes the same bytes
        self.parked, self.parked_on_disk = True, disk

    def _park_in_ram(self) -> None:
        """The never-streamed blocks copied to the parking buffer; every block points at its host bytes."""
        sizes = self.plan.sizes
        kept = [b for b in range(len(self.blocks)) if b not in self.host_off]  # no arena copy: the ring's only
        if self._park_buf is None and kept:
            total = 0
            for b in kept:
                self._park_off[b] = total
                total += sizes[b]
            self._park_buf = HostArena(total, pin=self.cuda)  # allocation once per run: pinned, exact
            fresh = True
        else:
            fresh = False
        for b in kept:
            if fresh or self.trainable:  # device-to-host, synchronous (parks only)
                self._park_buf.region(self._park_off[b], sizes[b]).copy_(self.ring.region(self.ring_offset[b],
                                                                                        sizes[b]))
        self.dirty.clear()
        for b, pk in enumerate(self.packs):
            pk.point_at(pk.views(self._host_region(b)))
            self.ring_offset[b] = self.params_at[b] = None

    def _park_hollow(self) -> None:
        """Every block tensor hollow (no bytes), the arena unregistered and freed: the model holds no host RAM."""
        for pk in self.packs:
            pk.point_at([_hollow(e.shape, e.dtype) for e in pk.entries])
        for b in range(len(self.blocks)):
            self.ring_offset[b] = self.params_at[b] = None
        self._host_state.clear()
        self.arena.close()  # unregistered, its buffer freed (nothing views it any more)

    def unpark(self) -> None:
        """Take a ring again, copy in the plan's initial blocks, and start the plan's step 0 (as at construction);
        parked on disk, the arena and the never-streamed initial blocks are first read again from the files."""
        if not self.parked:
            return
        sizes = self.plan.sizes
        if self.parked_on_disk and self.host_off:  # a fresh arena, filled from the files, then pinned
            self._make_arena(self.arena.nbytes, self._pinned_budget, None, defer=True)
            for b in self.plan.streamed:
                self.packs[b].write_into(self.arena.region(self.host_off[b], sizes[b]), self._fill, b)
            self._pin_arena()
        self.ring = Ring(self.plan.capacity, self.device)
        from_files = [b for b in self.plan.initial if self.parked_on_disk and b not in self.host_off]
        for b in from_files:  # tensor by tensor from the files into the ring (synchronous on the compute stream)
            self.packs[b].write_into(self.ring.region(self.plan.initial[b], sizes[b]), self._fill, b)
        copied = [b for b in self.plan.initial if b not in from_files]
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        if self.cuda:  # on the transfer stream, after the ring's allocation; compute waits for all of it
            ev = compute.record_event()
            with torch.cuda.stream(self.h2d):
                self.h2d.wait_event(ev)
                for b in copied:
                    self._load(self.ring.region(self.plan.initial[b], sizes[b]), self._host_region(b))
                done = self.h2d.record_event()
            compute.wait_event(done)
        else:
            for b in copied:
                self._load(self.ring.region(self.plan.initial[b], sizes[b]), self._host_region(b))
        for b, off in self.plan.initial.items():
            self.ring_offset[b] = off
            self._point(b)
        self.parked = self.parked_on_disk = False
        self.step += 1  # a release callback of an earlier step stays a no-op
        self._step0 = self.step
        self.cursor = 0
        self._new_step_tables()

    def close(self, keep_weights: bool = True) -> None:
        """Restore ordinary tensors: every block's parameters and buffers become plain CPU tensors with current
        values. (The blocks' class is the caller's: `attach_offload`'s handle restores it.) `keep_weights=False`
        (the model is being discarded) makes them meta tensors instead: copying them out would hold a second
        copy of every streamed block in RAM beside the arena, twice the model at the end of a run."""
        self.wait_for_device()
        if self.streaming:
            self._slices_written()
            for b, pk in enumerate(self.packs):
                if self.ring_offset[b] is not None:
                    self._point(b)
                    src_views = self.ring.views(b, self.ring_offset[b], pk)
                elif self.parked_on_disk:  # no host copy: read from the files (only if the weights are kept)
                    tmp = torch.empty(self.plan.sizes[b] if keep_weights else 0, dtype=torch.uint8)
                    if keep_weights:
                        pk.write_into(tmp, self._fill, b)
                    src_views = pk.views(tmp) if keep_weights else [_hollow(e.shape, e.dtype) for e in pk.entries]
                else:
                    src_views = pk.views(self._host_region(b))
                for e, v in zip(pk.entries, src_views, strict=True):
                    if not keep_weights:  # new meta objects (a CPU Parameter cannot take meta data)
                        t = torch.empty(v.shape, dtype=v.dtype, device="meta")
                        slots = e.module._parameters if e.is_param else e.module._buffers
                        slots[e.name] = nn.Parameter(t, requires_grad=False) if e.is_param else t
                        continue
                    t = v.to("cpu", copy=True)
                    if e.is_param:
                        e.tensor().data = t
                    else:
                        e.module._buffers[e.name] = t
            self.held.clear()
            self.arena.close()
            if self._park_buf is not None:
                self._park_buf.close()
            self.ring = None
        if self.activations is not None and not self.shared_activations:  # a shared one: its owner's to close
            self.activations.close()
