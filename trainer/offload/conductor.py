"""The offload conductor: replays a `plan.Plan` on the GPU with two streams, events and per-block hooks.

How the pieces fit. `attach` packs every block (allocators.BlockPacking), asks plan.py where each block
lives in the ring and when each copy may start, copies the streamed blocks into one pinned host arena and the
initially resident ones into the ring, and replaces each block's `forward` with a wrapper. The wrapper keeps
a cursor into the plan's execution sequence (forward F0..F(n-1), then backward B(n-1)..B0 in training):

- on entry (forward, or the recompute of a checkpointed block inside backward, told apart by autograd's
  current graph task) it moves the cursor, makes the compute stream wait for the block's load event, and
  points the block's parameters at their ring views;
- a block's *release point* is after its forward in forward and sampling, and after its **backward** in
  training: an identity autograd function on the block's grad-carrying inputs (trainer/offload/_checkpointed.py,
  with the per-block checkpoint) fires once the gradients of those inputs exist, i.e. after every backward
  kernel that reads the block's weights has been enqueued. Releasing after the recompute instead is the
  OneTrainer race (issue #1306); `race_detector=True` fills a released region with NaN on the compute stream
  at once, so any kernel still reading it poisons the loss;
- at a release point the compute stream records one event; every load the plan issues there makes the
  transfer stream wait for that event, copies one packed block (one `copy_`, non_blocking, from pinned
  memory), and records the block's load event.

So compute waits on loads, and loads wait on the last use of what they overwrite; nothing else synchronises.
The only host-device syncs are in `close`, `set_mode`, `stats` and the activation throttle.

Trainable streamed weights (full fine-tune with a fused back pass): the optimizer steps each parameter in
its post-accumulate-grad hook while the block is resident; the block is marked dirty at its backward release,
and before its region is reused the whole packed region (weights and the optimizer state packed beside them,
see `state_of`) is copied back to the host arena on a third stream; the overwriting load waits for that copy.
Optimizer state therefore never stays on the GPU longer than its block.

Out-of-plan calls (a no-grad forward during training, a step whose backward never came) are absorbed: the
cursor skips ahead, releasing what it skips, so the ring always returns to a state the plan knows.

Left out: torch.compile of the wrapper (it is called eagerly; compiling inside blocks still works), several
GPUs per process, and blocks that appear twice in one pass.
"""

from __future__ import annotations

import functools
import time

import torch
from torch import nn

from ._checkpointed import checkpointed_forward
from .activations import ActivationOffloader
from .allocators import BlockPacking, HostArena, Ring
from .plan import BWD, FWD, Plan, capacity_for, plan_for


class Conductor:
    def __init__(
        self,
        blocks: list[nn.Module],
        device: torch.device | str,
        fraction: float,
        mode: str = "train",
        activations: bool = False,
        trainable: bool = False,
        checkpointing: bool | None = None,
        optimizer_state=(),
        race_detector: bool = False,
        min_ring_blocks: int = 2,
        activation_min_bytes: int = 1 << 20,
        _release_at_recompute: bool = False,  # reproduces the known race; tests use it to prove the detector
    ):
        self.blocks = list(blocks)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.fraction = float(fraction)
        self.mode = mode
        self.trainable = trainable
        self.checkpointing = (mode == "train") if checkpointing is None else checkpointing
        self.race_detector = race_detector
        self._release_at_recompute = _release_at_recompute
        self.streaming = self.fraction > 0.0
        if self.streaming and mode == "train" and not self.checkpointing:
            # Without recompute, backward reads weights autograd saved in forward, long after their ring
            # region was refilled: streaming in training is only correct with per-block checkpointing.
            raise ValueError(
                "offloading blocks in training needs per-block checkpointing (checkpointing=True)"
            )
        self.cuda = self.device.type == "cuda"
        self.act = ActivationOffloader(self.device, min_bytes=activation_min_bytes) if activations else None
        self._orig_forward: list = []
        self._h2d_log: list = []  # (start event, end event, bytes) of the current step's copies
        self.h2d_bytes_total = 0

        n = len(self.blocks)
        self.packs = [
            BlockPacking.of(b, include_trainable=trainable, state_layout=optimizer_state) for b in self.blocks
        ]
        for pk in self.packs:  # LoRA and other trainable params outside the packed region stay resident
            for p in pk.resident:
                p.data = p.data.to(self.device)
        if not self.streaming:
            for b in self.blocks:
                b.to(self.device)
            self.plan = None
            self.ring = self.arena = None
            self._state_cache = None
        else:
            self._setup_streaming(min_ring_blocks)
        for i, b in enumerate(self.blocks):
            cur = b.__dict__.get("forward")
            self._orig_forward.append(cur)
            fwd = b.forward
            if getattr(b, "_dittrain_checkpointed", False) and isinstance(cur, functools.partial):
                fwd = cur.args[1]  # the trainer's own checkpoint wrapper: checkpoint here instead, once
                self.checkpointing = True
            b.forward = self._wrap(i, fwd)
        self.n = n

    # ------------------------------------------------------------------------------------------ setup
    def _setup_streaming(self, min_ring_blocks: int) -> None:
        sizes = [pk.nbytes for pk in self.packs]
        cap = capacity_for(sizes, self.fraction, min_blocks=min_ring_blocks)
        self.plan: Plan = plan_for(sizes, cap, self.mode, min_ring_blocks)
        streamed = self.plan.streamed
        self.host_off: dict[int, int] = {}
        total = 0
        for b in streamed:
            self.host_off[b] = total
            total += sizes[b]
        self.arena = HostArena(total, pin=self.cuda)
        self.ring = Ring(cap, self.device)
        # host copies of streamed blocks; ring copies of the initially resident ones
        for b in streamed:
            self.packs[b].write_into(self.arena.region(self.host_off[b], sizes[b]))
        self.where: dict[int, int | None] = {b: None for b in range(len(self.blocks))}
        for b, off in self.plan.initial.items():
            dst = self.ring.region(off, sizes[b])
            if b in self.host_off:
                dst.copy_(self.arena.region(self.host_off[b], sizes[b]))
            else:
                tmp = torch.empty(sizes[b], dtype=torch.uint8)
                self.packs[b].write_into(tmp)
                dst.copy_(tmp)
            self.where[b] = off
        self._pointing: dict[int, int | None] = {b: None for b in range(len(self.blocks))}
        for b in range(len(self.blocks)):  # the CPU originals are dropped: host arena and ring hold the truth
            if self.where[b] is not None:
                self._point(b)
            else:
                for e in self.packs[b].entries:
                    if e.is_param:
                        e.tensor().data = torch.empty(0, dtype=e.dtype)
        self.loaded_event: dict[int, object] = {}
        self.dirty: set[int] = set()
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
        for ld in self.plan.step_loads(self.step):
            self.loads_after.setdefault(ld.after, []).append(ld)
        self._h2d_log_step: list = []

    # ------------------------------------------------------------------------------------------ the wrapper
    def _wrap(self, i: int, fwd):
        def forward(*args, **kwargs):
            if self.checkpointing and torch.is_grad_enabled():
                return checkpointed_forward(self, i, fwd, args, kwargs)
            self._enter(FWD, i)
            out = fwd(*args, **kwargs)
            self._leave_forward(i)
            return out

        return forward

    # ------------------------------------------------------------------------------------------ cursor
    def _position(self, pas: str, i: int) -> int:
        L = len(self.plan.sequence)
        return L - 1 - i if pas == BWD else i

    def _enter(self, pas: str, i: int) -> None:
        if self.act is not None and pas == FWD and i == 0:
            self.act.new_step()
        if not self.streaming:
            return
        target = self._position(pas, i) if (self.mode == "train" or pas == FWD) else None
        if target is None or self.plan.sequence[target] != (pas, i):
            raise RuntimeError(
                f"offload: block {i} ran in pass {pas} that the {self.mode} plan has no place for"
            )
        if target < self.cursor or (target == self.cursor and self.released[target]):
            self._finish_step()
        for q in range(self.cursor, target):
            self._release(q)  # skipped positions (out-of-plan flows)
        self.cursor = target
        if pas == BWD and self.trainable:
            self.dirty.add(i)  # its fused optimizer step runs in this backward
        where = self.where[i]
        if where is None:
            raise RuntimeError(f"offload: block {i} is not resident at plan position {target} (plan bug)")
        ev = self.loaded_event.pop(i, None)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
        if self._pointing[i] != where:
            self._point(i)

    def _leave_forward(self, i: int) -> None:
        if self.streaming:
            self._release(self._position(FWD, i))

    def _finish_step(self) -> None:
        for q in range(self.cursor, len(self.plan.sequence)):
            self._release(q)
        self.step += 1
        self.cursor = 0
        self._new_step_tables()

    def _release_from_autograd(self, step: int, pos: int) -> None:
        if self.streaming and step == self.step:
            self._release(pos)

    def _point(self, b: int) -> None:
        off = self.where[b]
        self.packs[b].point_at(self.ring.views(b, off, self.packs[b]))
        self._pointing[b] = off

    # ------------------------------------------------------------------------------------------ release / load
    def _release(self, pos: int) -> None:
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
                self.ring.region(self.where[x], sizes[x]).fill_(255)  # NaN in bf16/fp16/fp32
        for x in claims:
            self.where[x] = None
            self._pointing[x] = None
        if not self.cuda:
            for ld in loads:
                self.ring.region(ld.offset, sizes[ld.block]).copy_(
                    self.arena.region(self.host_off[ld.block], sizes[ld.block])
                )
                self.where[ld.block] = ld.offset
                self.h2d_bytes_total += sizes[ld.block]
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
                self.ring.region(ld.offset, n).copy_(
                    self.arena.region(self.host_off[ld.block], n), non_blocking=True
                )
                t1 = torch.cuda.Event(enable_timing=True)
                t1.record(self.h2d)
                self._h2d_log_step.append((t0, t1, n))
                self.loaded_event[ld.block] = t1
                self.where[ld.block] = ld.offset
                self.h2d_bytes_total += n
        self._h2d_log = self._h2d_log_step

    def _write_back(self, x: int, compute):
        """Copy a dirty trainable block (weights + packed optimizer state) back to its host region."""
        self.dirty.discard(x)
        n = self.plan.sizes[x]
        src = self.ring.region(self.where[x], n)
        dst = self.arena.region(self.host_off[x], n)
        if not self.cuda:
            dst.copy_(src)
            return None
        ev = compute.record_event()
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(ev)
            dst.copy_(src, non_blocking=True)
            return self.d2h.record_event()

    # ------------------------------------------------------------------------------------------ public
    def state_of(self, p: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The optimizer state packed beside a streamed trainable parameter (valid while its block runs)."""
        if not self.streaming:
            return None
        for b, pk in enumerate(self.packs):
            if self.where[b] is None:
                continue
            sv = self.ring.state_views(b, self.where[b], pk)
            if id(p) in sv:
                return sv[id(p)]
        return None

    def host_state_of(self, p: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The host-arena copy of a streamed parameter's packed state (current after its write-back)."""
        if not self.streaming:
            return None
        cache = self.__dict__.setdefault("_host_state", {})
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
        """Sizes and the measured host-to-device rate of the last step's copies (synchronises)."""
        out = {
            "blocks": len(self.blocks),
            "block_bytes": sum(pk.nbytes for pk in self.packs),
            "offloaded_bytes": sum(self.plan.sizes[b] for b in self.plan.streamed) if self.streaming else 0,
            "ring_bytes": self.ring.capacity if self.streaming else 0,
            "pinned_bytes": (self.arena.pinned_bytes if self.streaming else 0),
            "activation_pinned_bytes": self.act.pinned_bytes if self.act else 0,
            "h2d_bytes_per_step": self.plan.bytes_per_step() if self.streaming else 0,
        }
        if self.streaming:
            out["fraction_in_ram"] = 1.0 - self.ring.capacity / max(1, out["block_bytes"])
        if self.cuda and self._h2d_log:
            self._h2d_log[-1][1].synchronize()  # host-device sync
            ms = sum(a.elapsed_time(b) for a, b, _ in self._h2d_log)
            nbytes = sum(n for _, _, n in self._h2d_log)
            out["h2d_gbps"] = nbytes / (ms * 1e6) if ms > 0 else 0.0
        return out

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def sync(self) -> None:
        """Make every block's parameters readable with current values (e.g. to save a full fine-tune):
        resident blocks point at the ring, the others at their host copies, until they run again."""
        if self.streaming:
            compute = torch.cuda.current_stream(self.device) if self.cuda else None
            for b in list(self.dirty):
                if b in self.host_off and self.where[b] is not None:
                    self._write_back(b, compute)  # host copies (weights and packed state) become current
        self.synchronize()
        if not self.streaming:
            return
        for b, pk in enumerate(self.packs):
            if self.where[b] is not None:
                self._point(b)
            else:
                pk.point_at(pk.views(self.arena.region(self.host_off[b], self.plan.sizes[b])))
                self._pointing[b] = None

    def close(self) -> None:
        """Restore ordinary modules: every block's tensors become plain CPU tensors with current values."""
        self.synchronize()
        t0 = time.perf_counter()
        for i, b in enumerate(self.blocks):
            if self._orig_forward[i] is None:
                b.__dict__.pop("forward", None)
            else:
                b.forward = self._orig_forward[i]
        if self.streaming:
            for b, pk in enumerate(self.packs):
                if self.where[b] is not None:
                    self._point(b)
                    src_views = self.ring.views(b, self.where[b], pk)
                else:
                    src_views = pk.views(self.arena.region(self.host_off[b], self.plan.sizes[b]))
                for e, v in zip(pk.entries, src_views, strict=True):
                    t = v.to("cpu", copy=True)
                    if e.is_param:
                        e.tensor().data = t
                    else:
                        e.module._buffers[e.name] = t
            self.arena.close()
            self.ring = None
        if self.act is not None:
            self.act.close()
        self.close_seconds = time.perf_counter() - t0
