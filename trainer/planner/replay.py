"""Step time of a training step as the GPU runs it: host, compute stream and copy stream, block by block.

Why not max(compute, transfer). At 1024 px a Flux block keeps the GPU busy for longer than the host needs to
launch it, so a step is the sum of kernel time and copies hide behind it unless they outweigh it. At 512 px
it is the other way round: on an H200 (bench/history/2026-11-22.md, 02:10) a resident step held 0.30 s of kernels
and took that took 0.54-0.81 s. The host, launching about 10,000 tensor operations through Python,
autograd, checkpointing and peft, is the bottleneck, and how much of that run-to-run spread one sees depends
on the host, not the GPU. Predicting that needs the host's time beside the GPU's, and predicting how copies
overlap needs the order in which the conductor issues them.

How. Each block at each bucket has four costs (`BlockCost`): the host's time to launch its checkpointed forward
and its recompute + backward, and the GPU's time to run them. `simulate` replays the conductor's training plan
(trainer/offload/plan.py, the schedule the conductor runs) over three timelines:

- the host launches position p after position p-1 (it never waits on the GPU inside a step: the conductor's
  waits are stream events, not host syncs; it does wait at the step's end, where the loss is read), so host
  time is the running sum of launch costs;
- except in a block whose own code waits on the GPU (`BlockCost.syncs`: the family's `blocks_sync_host`, HiDream's
  boolean masks routing tokens to its experts, each mask's size read on the host): there the host first waits for
  every kernel launched before and then, sync after sync, can never be more than a few kernels ahead, so the block
  takes its launch time plus its kernel time, and the next block's launches start when its kernels end. That is
  an upper bound (the kernels launched between two syncs overlap their launches); HiDream-I1 LoRA at 1024 px on
  the H200, compiled, resident (bench/logs/2026-11-28i/s3-hidream-speed.log): 1.83 s a step with every block
  recomputed and 1.31 s with none, predicted 2.06 / 1.39 s by this sum against 1.12 / 0.75 s overlapped (where
  plain diffusers + peft took 1.79 s compiled and 1.86 s eager); the 16 GB preset's streamed step (compiled, fp8
  base; bench/history/2026-11-27.md 21:58) took 2.38 s, predicted 2.33 s by the sum and 1.39 s overlapped;
- the compute stream finishes position p at max(previous position's end, the arrival of every copy position p
  needs) + its GPU time, and never before the host has launched all of it;
- the copy stream starts a load at max(its previous copy's end, the end of the load's release position on the
  compute stream) and takes bytes / H2D rate.

Several steps are simulated and the steady-state step is taken (the plan is periodic).

The costs come from a short measurement on the user's GPU (trainer/planner/measure.py: each block class
at each bucket, host and GPU time apart) or, without one, from stated assumptions: GPU time from FLOPs at the
reference rate (trainer/planner/timing.py), host time from the operations each block dispatches
(counted on the meta device, `Trace.block_ops`) at `REF_HOST_S_PER_OP`.

Left out: the launch queue's depth (the host may run ahead of a stalled GPU by some thousand kernels, not
without limit); the embedders, loss and optimizer step outside the blocks (about 3 % of the step at 1024 px on
the H200); activation offloading's copies and a full fine-tune's write-backs, which are added as a floor
(total bytes over the PCIe rates) rather than replayed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..offload.plan import BWD, Load, Plan, sequence_for

# Host time per tensor operation of a block's forward, for one whole training pass of it (checkpointed forward
# + recompute + backward; about one third of it in the forward). Calibrated on the H200 machine's host (a
# 16-core Xeon VM, torch 2.11, diffusers 0.42.1, peft 0.21): full-size Flux LoRA r16 at 512 px, where the step
# is host-bound, took 0.54, 0.66 and 0.81 s resident in three processes (median 0.66 s) for 10,564 traced
# forward operations; one block measured alone took 45-72 us per operation.
REF_HOST_S_PER_OP = 0.66 / 10_564
HOST_FWD_SHARE = 1 / 3


@dataclass(frozen=True)
class BlockCost:
    """Seconds for one block at one bucket shape."""

    host_fwd: float  #: launching its checkpointed forward
    host_bwd: float  #: launching its recompute and backward
    gpu_fwd: float  #: running its forward
    gpu_bwd: float  #: running its recompute and backward
    #: the block's code waits on the GPU (a host sync) in its forward and backward: launches and kernels add up
    syncs: bool = False

    def scaled(self, gpu: float = 1.0, extra_gpu_bwd: float = 0.0) -> BlockCost:
        return replace(self, gpu_fwd=self.gpu_fwd * gpu, gpu_bwd=self.gpu_bwd * gpu + extra_gpu_bwd)

    def without_recompute(self) -> BlockCost:
        """The same block keeping its activations (train.gradient_checkpointing auto / false): its backward
        without the recompute, taken as costing one forward."""
        return replace(self, host_bwd=max(0.0, self.host_bwd - self.host_fwd),
                       gpu_bwd=max(0.0, self.gpu_bwd - self.gpu_fwd))


@dataclass(frozen=True)
class StepTime:
    step_s: float  #: simulated steady-state step
    host_s: float  #: the host's launch time alone
    gpu_s: float  #: the compute stream's busy time alone
    copy_s: float  #: the copy stream's busy time alone


def simulate(costs: list[BlockCost], plan: Plan | None, h2d_rate: float, steps: int = 3) -> StepTime:
    """Steady-state training step for per-block `costs` under the conductor's `plan` (None: nothing streams)."""
    n = len(costs)
    seq = plan.sequence if plan is not None else sequence_for("train", n)
    L = len(seq)
    host = [costs[b].host_bwd if p == BWD else costs[b].host_fwd for p, b in seq]
    gpu = [costs[b].gpu_bwd if p == BWD else costs[b].gpu_fwd for p, b in seq]
    syncs = [costs[b].syncs for _, b in seq]
    if plan is None:
        total = steps = 1
        period_start = 0
    else:
        period = len(plan.steps) - plan.loop
        period_start = plan.loop + 1  # one step past the loop start: the previous step's loads are in flight
        total = period_start + period
        steps = period
    h = g = copy_free = 0.0
    ready: dict[int, float] = {}  # absolute position -> when its copies have arrived
    ends: list[float] = []
    copy_busy = 0.0
    for s in range(total):
        loads: tuple[Load, ...] = plan.step_loads(s) if plan is not None else ()
        h = g = max(h, g)  # the training loop reads the loss every step (logging, NaN guard): a host sync
        by_after: dict[int, list[Load]] = {}
        for ld in loads:
            by_after.setdefault(ld.after, []).append(ld)
        for pos in range(L):
            arrived = ready.pop(s * L + pos, 0.0)
            if syncs[pos]:  # the host waits for the kernels before (and the copies they wait on), then no overlap
                h = g = max(h, g, arrived) + host[pos] + gpu[pos]
            else:
                h += host[pos]
                g = max(max(g, arrived) + gpu[pos], h)
            for ld in by_after.get(pos, ()):
                dt = plan.sizes[ld.block] / h2d_rate
                copy_free = max(copy_free, g) + dt
                if s >= period_start:
                    copy_busy += dt
                u = s * L + ld.use
                ready[u] = max(ready.get(u, 0.0), copy_free)
        ends.append(max(h, g))
    start = ends[period_start - 1] if period_start > 0 else 0.0
    return StepTime(
        step_s=(ends[-1] - start) / steps,
        host_s=sum(host),
        gpu_s=sum(gpu),
        copy_s=copy_busy / steps,
    )


def reference_costs(block_ops: list[int], gpu_fwd: list[float], gpu_bwd: list[float],
                    syncs: bool = False) -> list[BlockCost]:
    """Costs without a measurement: host time from the traced operations, GPU time given (from FLOPs); `syncs`:
    the blocks wait on the GPU inside (`BlockCost.syncs`)."""
    return [
        BlockCost(
            host_fwd=ops * REF_HOST_S_PER_OP * HOST_FWD_SHARE,
            host_bwd=ops * REF_HOST_S_PER_OP * (1 - HOST_FWD_SHARE),
            gpu_fwd=f,
            gpu_bwd=b,
            syncs=syncs,
        )
        for ops, f, b in zip(block_ops, gpu_fwd, gpu_bwd, strict=True)
    ]
