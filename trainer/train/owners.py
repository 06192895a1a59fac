"""A full fine-tune over the sharded stream: each process steps 1/N of the weights and keeps only their state.

Why. Under ddp every process steps every weight, so each keeps the whole optimizer state (AdamW: 8 bytes per
weight in fp32, 96 GB for a 12 B model) and, streaming, its own host copy of the weights: four processes of one
host hold four of each, which no host has room for. The sharded stream (trainer/offload/gather.py) already lets
the processes of a host fill their rings together from one shared arena; here they also share the stepping.

How. Every trainable parameter has one owner, chosen once the same way on every process (greedy by size over
the parameters in order, so each process owns about 1/N of the weights). In the fused back pass
(trainer/optim/fused.py), as each parameter's gradient completes in backward:
- `pre`: the gradient is summed onto its owner (`reduce`), which divides it by N: the mean gradient, as ddp's
  all-reduce gives it, at half the traffic;
- only the owner steps it (`FusedBackPass.owns`), with its optimizer state, which therefore exists only there
  (the optimizer creates state at a parameter's first step); the others free the gradient;
- `post`: the owner broadcasts the new weight, so every GPU's ring holds the same block again before its region
  is written back. That is what makes the shared arena work for trainable weights: the conductor writes back
  only this process's 1/N slice of a block (the slice it will copy in again at the next load, the rest being
  gathered from the others), so no process ever reads host bytes another one wrote during training, and the
  arena is whole after a barrier (checkpoints, the end of the run).
The broadcast is registered before the EMA's post hook (trainer/train/ema.py), so every process's EMA sees the
new weights. The reductions and broadcasts use the default group in the order autograd finishes the
parameters, the same on every process; the ring gathers use the host group, whose order is the plan's.

Checkpoints: each process writes the state it owns (`optimizer.rank-R-of-N.safetensors`, the same encoding as
one process's file), and a resume on any number of processes reads every such file and keeps the entries of the
parameters it owns (`load_state`), so a run saved on 4 processes resumes on 2 or 1.

Exactness: the mean gradient is the one ddp's all-reduce gives (on two processes a + b either way: bitwise), the
step is the same optimizer code on the same values, and stochastic rounding draws from (seed, weight, step), not
from the process: the weights are those of the ddp run (tests/test_distributed.py, tests/test_owners.py).

Left out: optimizers that step the weights together (Prodigy's and schedule-free's global sums; config.py refuses
them with the fused back pass anyway); several hosts are untested (the code uses the default group for the
gradients and each host's group for the gathers).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as tdist

from ..optim.build import torch_optimizer
from ..optim.state import load_optimizer_shards, save_optimizer_state
from .distributed import ShardNorm

SHARD_GLOB = "optimizer.rank-*-of-*.safetensors"


def shard_name(rank: int, world: int) -> str:
    return f"optimizer.rank-{rank:03d}-of-{world:03d}.safetensors"


def assign(params: list[torch.Tensor], world: int) -> dict[int, int]:
    """id(param) -> the rank that steps it: each parameter in order to the least loaded rank (by elements),
    the lowest rank on ties; the same on every process."""
    loads = [0] * world
    owner: dict[int, int] = {}
    for p in params:
        r = min(range(world), key=lambda k: (loads[k], k))
        owner[id(p)] = r
        loads[r] += p.numel()
    return owner


class OwnedSteps:
    """The fused back pass's hooks when each process steps its own parameters (module docstring). Built by
    trainer/train/optimizer.py over the run's trainable parameters; `attach(fused)` registers them."""

    def __init__(self, params: list[torch.Tensor], rank: int, world: int):
        self.rank, self.world = rank, world
        self._owner = assign(params, world)
        self._norm = ShardNorm()  # each owner's squares of the mean gradients, summed over the processes

    @property
    def track(self) -> bool:
        return self._norm.track

    @track.setter
    def track(self, on: bool) -> None:
        self._norm.track = on

    def owns(self, p: torch.Tensor) -> bool:
        return self._owner[id(p)] == self.rank

    def owned(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        return [p for p in params if self.owns(p)]

    def attach(self, fused) -> None:
        fused.owns = self.owns
        fused.add_step_hooks(pre=self.pre, post=self.post)

    def pre(self, p: torch.Tensor, state) -> None:
        """Sum p's gradient onto its owner (NCCL: the step is ordered after it on the GPU; the host goes on)."""
        if p.grad is None:
            return
        tdist.reduce(p.grad, dst=self._owner[id(p)], op=tdist.ReduceOp.SUM)
        if not self.owns(p):
            return
        p.grad.div_(self.world)
        self._norm.pre(p, state)  # the norm of the mean gradient, summed over the owners in `take_norm`

    def post(self, p: torch.Tensor, state) -> None:  # noqa: ARG002
        """Every process gets the owner's new weight (into its ring view of the block, or the resident tensor)."""
        tdist.broadcast(p.data, src=self._owner[id(p)])

    def take_norm(self) -> float | None:
        """The gradient norm of the step (logging steps: every process calls it, as `track` is the same)."""
        return self._norm.take_norm()

    # ------------------------------------------------------------------------------------------ checkpoints
    def save_state(self, fused, folder: Path) -> None:
        """This process's file: the state of the parameters it owns (the others have none here)."""
        folder.mkdir(parents=True, exist_ok=True)
        save_optimizer_state(fused, folder, name=shard_name(self.rank, self.world))

    def load_state(self, fused, files: list[Path]) -> None:
        """The entries of the parameters this process owns, from every process's file of a checkpoint."""
        mine = owned_indices(fused, self.owns)
        load_optimizer_shards(fused, files, mine.__contains__)


def owned_indices(fused, owns) -> set[int]:
    """The indices (in the optimizer's state dict) of the parameters `owns` says are this process's."""
    inner = torch_optimizer(fused.optimizer)
    order = [q for g in inner.param_groups for q in g["params"]]
    by_key = {id(fused.key_of(p)): p for p in fused.params}
    return {i for i, q in enumerate(order) if id(q) in by_key and owns(by_key[id(q)])}
