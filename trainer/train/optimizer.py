"""The loop's one optimizer object: optimizer, schedule, fused back pass and gradient averaging over ranks.

    optim = optimizer_for(cfg, params, dist)
    optim.before_backward(track_norm=log_now)    # per step, before the first micro-batch's backward
    loss.backward()                              # fused back pass: every parameter steps in here
    norm = optim.step()                          # finishes the step; the schedule advances once
    optim.save(folder) / optim.load(folder, scheduler_state)

Two ways of stepping, one object. Unfused: backward fills `.grad`; `step()` clips, steps and zeroes. Fused
(trainer/optim/fused.py): each parameter steps inside backward and its gradient is freed; `step()` only closes
the step. Either way the schedule advances once per optimizer step.

Several processes (trainer/train/distributed.py) add one thing, chosen here once: unfused, a
`BucketedAllReduce` averages the gradients in buckets launched from the gradient hooks, and `step()` waits for it
before clipping; fused, a `FusedAllReduce` pre-step hook averages each gradient right before its parameter
steps, and measures the norm of the averaged gradients (the fused pass's own would be this rank's). The loop
calls the same methods with one process or eight. Under train.distributed: fsdp (trainer/train/sharded.py) the
parameters are shards: FSDP2 averages their gradients itself, clipping sees the global norm of the DTensors,
and `save` / `load` go through torch.distributed.checkpoint (every process writes its shards). Fused under fsdp,
FSDP2 calls each shard's post-accumulate-grad hook right after its reduce-scatter (on its post-reduce stream),
so the shard steps there with the averaged gradient; `ShardNorm` sums the norm over the processes. A full
fine-tune over the sharded stream (`owners`, trainer/train/owners.py): each process steps the parameters it owns,
their gradients reduced onto it and their new values broadcast, and keeps only their state; `save_shards` writes
each process's part.

Where the optimizer state of streamed weights lives is the training method's business (trainer/train/method.py):
it calls `keep_state_in_ram` or binds `fused` to the conductor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import Config
from ..errors import UserError
from ..offload.allocators import pinned_exact
from ..optim.build import build_optimizer, build_scheduler
from ..optim.fused import FusedBackPass, StateOffload
from ..optim.state import load_optimizer_shards, load_optimizer_state, save_optimizer_state
from . import sharded
from .distributed import BucketedAllReduce, Dist, FusedAllReduce, ShardNorm
from .monitor import say
from .owners import SHARD_GLOB, OwnedSteps


class Optim:
    """See the module essay. Build it with `optimizer_for`."""

    def __init__(self, cfg: Config, params: list[torch.nn.Parameter], dist: Dist,
                 sharded: torch.nn.Module | None = None, model: torch.nn.Module | None = None, owners: bool = False):
        self.sharded = sharded  # the FSDP2 model whose shards these parameters are (fsdp), else None
        self.model = sharded if model is None else model  # names the parameters of an fsdp checkpoint's state
        self.max_grad_norm = cfg.optimizer.max_grad_norm
        self.params = params
        self.optimizer = build_optimizer(params, cfg.optimizer, seed=cfg.train.seed)
        self.scheduler = build_scheduler(self.optimizer, cfg.optimizer, cfg.train.steps)
        self.fused = FusedBackPass(self.optimizer) if cfg.optimizer.fused_back_pass else None
        self._reducer: BucketedAllReduce | None = None  # several processes, unfused
        self._fused_reduce: FusedAllReduce | ShardNorm | OwnedSteps | None = None  # several processes, fused
        #: each process steps its own parameters (a full fine-tune over the sharded stream), else None
        self.owners = OwnedSteps(params, dist.rank, dist.world) if owners and dist.active else None
        if self.owners is not None:
            if self.fused is None:
                raise RuntimeError("owned steps need the fused back pass (config.py requires it when blocks stream)")
            self._fused_reduce = self.owners
            self.owners.attach(self.fused)
        elif dist.active and self.fused is not None and sharded is not None:
            self._fused_reduce = ShardNorm()  # FSDP2 has averaged each gradient before the hook sees it
            self.fused.add_step_hooks(pre=self._fused_reduce.pre)
        elif dist.active and self.fused is not None:
            self._fused_reduce = FusedAllReduce(dist.world)
            self.fused.add_step_hooks(pre=self._fused_reduce.pre)
        elif dist.active and sharded is None:
            self._reducer = BucketedAllReduce(params, dist.world, cfg.train.grad_accum)

    def keep_state_in_ram(self, params: list[torch.nn.Parameter]) -> None:
        """Full fine-tune with streamed blocks: the optimizer state of these parameters lives in pinned CPU RAM
        between steps and visits the GPU only while its parameter steps (trainer/optim StateOffload)."""
        if self.owners is not None:
            params = self.owners.owned(params)  # the others' state is never made here
        if not params:
            return
        off = StateOffload(params, alloc=pinned_exact if torch.cuda.is_available() else None)
        self.fused.add_step_hooks(pre=off.pre, post=off.post, synchronize=off.synchronize)

    def before_backward(self, track_norm: bool) -> None:
        if self._fused_reduce is not None:
            self._fused_reduce.track = track_norm  # the norm of the mean gradient, not of this rank's
        elif self.fused is not None:
            self.fused.track_grad_norm = track_norm

    def step(self):
        """Finish the optimizer step. Returns the gradient norm (a float, a 0-dim tensor read later on logging
        steps only, or None)."""
        norm = None
        if self.fused is not None:
            norm = self.fused.finish_step()
            if self._fused_reduce is not None:
                norm = self._fused_reduce.take_norm()
        else:
            if self._reducer is not None:
                self._reducer.finish()  # before clipping: clip the mean gradient, as one process would
            if self.max_grad_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return norm

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    @property
    def shards_state(self) -> bool:
        """Whether every process writes its part of the state (`save_shards`) instead of rank 0 (`save`)."""
        return self.sharded is not None or self.owners is not None

    def save(self, folder: Path) -> None:
        """Rank 0's checkpoint file (one process / ddp); fsdp and owned steps write `save_shards` instead."""
        if not self.shards_state:
            save_optimizer_state(self.fused or self.optimizer, folder)

    def save_shards(self, staged: Path) -> None:
        """Collective: every process writes its part of the state into `staged` (fsdp: its shards under
        OPTIMIZER_DIR; owned steps: one file per process), which rank 0 then moves into the checkpoint."""
        if self.owners is not None:
            self.owners.save_state(self.fused, staged)
        else:
            sharded.save_optimizer(self.sharded, self.optimizer, staged / sharded.OPTIMIZER_DIR)

    def load(self, folder: Path, scheduler_state: dict) -> None:
        shards = sorted(folder.glob(SHARD_GLOB))
        if shards and self.sharded is not None:
            raise UserError(f"--resume {folder}: its optimizer state was saved by processes that each stepped their "
                            "own weights (a full fine-tune over the sharded stream); train.distributed: fsdp cannot "
                            "read it: resume with train.distributed: ddp")
        if shards:  # owned steps' files: each process keeps its own parameters' entries (one process: all)
            if self.owners is not None:
                self.owners.load_state(self.fused, shards)
            else:
                load_optimizer_shards(self.fused or self.optimizer, shards, lambda i: True)
        elif self.sharded is not None:
            sharded.load_optimizer(self.sharded, self.optimizer, folder / sharded.OPTIMIZER_DIR)
        elif (folder / sharded.OPTIMIZER_DIR).is_dir():  # an fsdp checkpoint: its shards read back whole
            if self.fused is not None or self.model is None:
                raise UserError(f"--resume {folder}: its optimizer state is sharded (a train.distributed: fsdp run), "
                                "which the fused back pass cannot read: set optimizer.fused_back_pass: false")
            sharded.load_optimizer(self.model, self.optimizer, folder / sharded.OPTIMIZER_DIR)
        else:
            load_optimizer_state(self.fused or self.optimizer, folder)
        if getattr(self.optimizer, "masters_from_weights", 0):
            say(f"--resume {folder}: its optimizer state has no fp32 master weights (saved without "
                "optimizer.master_weights); they start from the checkpoint's weights")
        self.scheduler.load_state_dict(scheduler_state)

    def close(self) -> None:
        if self._reducer is not None:
            self._reducer.remove()
        if self.fused is not None:
            self.fused.remove()


def optimizer_for(cfg: Config, params: list[torch.nn.Parameter], dist: Dist,
                  sharded: torch.nn.Module | None = None, model: torch.nn.Module | None = None,
                  owners: bool = False) -> Optim:
    """The run's optimizer over `params`: fused or not as cfg.optimizer says, averaging over `dist`'s ranks
    (`sharded`: the FSDP2 model, which averages them itself; `model`: the one the parameters belong to;
    `owners`: each process steps its own parameters, trainer/train/owners.py)."""
    return Optim(cfg, params, dist, sharded, model, owners)
