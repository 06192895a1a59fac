"""Several GPUs: data-parallel training through torch.distributed, one process per GPU.

    torchrun --nproc_per_node 2 -m trainer.cli fit cfg.yaml        (or: torchrun --no-python dittrain fit ...)

How. `setup()` reads torchrun's (or `accelerate launch`'s) WORLD_SIZE / RANK / LOCAL_RANK; with more than one
process it initialises the default process group (NCCL on CUDA, gloo on the CPU) and gives each process the
device cuda:LOCAL_RANK. Every process builds the whole trainer for itself: its own model copy, its own offload
conductor streaming its own blocks, its own optimizer. They stay identical because they start identical (LoRA is
initialised from the same seed and broadcast from rank 0 anyway) and apply identical updates:

- unfused path (LoRA, or full fine-tuning without the fused back pass): `BucketedAllReduce` hooks every
  trainable parameter's post-accumulate-grad. Parameters are grouped in ~25 MB buckets in reverse registration
  order (roughly the order backward finishes them); once every parameter of a bucket has received its gradient
  for the last micro-batch of the step, its gradients are copied into the bucket's flat buffer and an *async*
  all-reduce is launched, so on a GPU the reduction of late blocks runs while backward still computes the early
  ones. Gradient accumulation needs no `no_sync`: the hook counts arrivals and launches a bucket only after
  grad_accum of them per parameter. Before clipping, `finish()` waits for every bucket, divides by the world
  size and points each `.grad` at its slice of the buffer (no copy back), so clipping and the step see the mean.
- fused back pass (full fine-tuning): each parameter steps inside backward, before the other gradients exist,
  so its gradient is all-reduced in a pre-step hook (`FusedBackPass.add_step_hooks`) right before its step.
  What is overlapped there: nothing across parameters. The host does not block (NCCL orders the step after the
  reduction on the GPU), but the compute stream waits for each reduction before the next backward kernel. A
  bucketed version would have to defer steps past the point where the conductor writes a streamed block back to
  CPU RAM, which would lose updates; the per-parameter reduction is the correct one.

The trainer's one optimizer object (trainer/train/optimizer.py) picks one of the two when it is built with more
than one process; the loop calls it the same way with one process or several.

Same numbers on any number of GPUs. The global batch of a step is batch_size x world x grad_accum; in round p of
micro-batches rank r trains the data's global batch p * world + r (trainer/data). Each process draws the
timesteps and noise of *every* rank's micro-batch of the round from the objective's one generator (the shapes
are all-gathered) and keeps its own, so the generator walks exactly as in one process with grad_accum x world
micro-batches: with 2 processes at grad_accum 1 the run is the 1-process run at grad_accum 2 (in fp32 on the
CPU, bitwise: dividing by 2 is exact). torch's global generator (LoRA dropout) is reseeded per micro-batch from
(seed, global position) when world > 1, so ranks draw different masks and a resume is exact. The checkpoint
stores the *global* data position; a resume on W processes continues at round position / W (it must divide).

Rank 0 alone writes checkpoints, the final weights, metrics, TensorBoard, tqdm and samples; the others wait at a
barrier while it saves. Ctrl-C and the non-finite-loss check are agreed by all-reduce: the stop flag once a step,
the loss of every micro-batch (an all-gather of one float, which replaces the sync the check needed anyway), so
all ranks stop, save or raise at the same step and nobody is left waiting inside a collective.

Ctrl-C under torchrun: the workers run in their own sessions, so only torchrun sees the terminal's SIGINT; it
forwards one SIGINT to every worker (the first signal: finish the step, save, exit 130) and kills them after
`--shutdown-timeout` seconds (30 by default: raise it for a full fine-tune's checkpoint).

CPU threads. torchrun sets OMP_NUM_THREADS=1 in every worker when the user set none (its warning at start), so
each process's CPU ops ran on one core: the load's safetensors reads and copies into the host arena, the casts,
the caches. Where torchrun chose it, `setup` gives each process the host's cores divided by its processes
(`torchrun_threads`: as many threads in all as one process would use) and says so in one line; a value the user
set, 1 included, is kept. torch's compiler also sizes its pool of compile workers by the host (min(32, cores)
processes each, beside every training process: 128 on a 4-GPU host of 64 cores, each a Python with torch
imported); `compile_workers` gives each training process its share (cores / local processes, at most 32) unless
TORCHINDUCTOR_COMPILE_THREADS says otherwise. Measured on 4 x H200 (bench/history/2026-11-28.md 19:55, the
Flux.1-dev 48 GB LoRA preset): the node's anonymous memory 15.6 GB with 32 workers a process, 12.8 GB with 16 (4.9 GB
of it the workers at their peak), 7.2 GB with one compile thread (no workers).

Sharded weights and optimizer state: train.distributed: fsdp (trainer/train/sharded.py) uses the same process
group, data order and noise; only the model and optimizer differ.

Left out: overlapping the fused back pass's reductions with compute, and bucket views as gradients (the
unfused path keeps one flat copy of the trainable gradients: small for LoRA, a model's worth for an unfused full
fine-tune, which the fused back pass avoids).
"""

from __future__ import annotations

import datetime
import hashlib
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as tdist
from torch.distributed.tensor import DTensor

from ..errors import NonFiniteLossError, UserError
from .monitor import say

BUCKET_BYTES = 25 * 2**20


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        raise UserError(f"environment variable {name}={os.environ[name]!r} is not an integer (set by torchrun)") from None


def _cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def torchrun_threads(env=None, cores: int | None = None, launcher_env: dict | None = None) -> int | None:
    """torch's CPU threads for this process when torchrun, not the user, set OMP_NUM_THREADS=1 (see the module
    essay): this host's cores (`cores`; default: those this process may run on) divided by LOCAL_WORLD_SIZE,
    at least 1; None to leave torch's choice alone. torchrun sets the variable in its own environment after it
    started, so the environment it was started with (`launcher_env`; default: its /proc/PID/environ, torchrun
    being this worker's parent) tells whether the user set it; where that cannot be read, 1 under torchrun is
    taken as torchrun's."""
    env = os.environ if env is None else env
    local_world = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
    if env.get("OMP_NUM_THREADS") != "1" or "TORCHELASTIC_RUN_ID" not in env or local_world <= 1:
        return None
    if launcher_env is None:
        launcher_env = _initial_environ(os.getppid())
    if launcher_env is not None and "OMP_NUM_THREADS" in launcher_env:
        return None  # the user's (or their launcher's) choice
    if cores is None:
        cores = _cores()
    return max(1, cores // local_world)


def compile_workers(env=None, cores: int | None = None) -> int | None:
    """torch inductor's compile workers for this process among LOCAL_WORLD_SIZE training processes of one host:
    min(32, its share of the cores), at least 1 (the module essay); None where there is one process or the user set
    TORCHINDUCTOR_COMPILE_THREADS."""
    env = os.environ if env is None else env
    local_world = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
    if local_world <= 1 or "TORCHINDUCTOR_COMPILE_THREADS" in env:
        return None
    if cores is None:
        cores = _cores()
    return max(1, min(32, cores // local_world))


def _use_compile_workers(local_world: int) -> None:
    n = compile_workers()
    if n is None:
        return
    from torch._inductor import config as inductor

    if inductor.compile_threads is not None and inductor.compile_threads <= n:
        return
    inductor.compile_threads = n  # read when the pool starts (the first compile), after setup
    say(f"compile: each of this host's {local_world} processes compiles with {n} workers (the cores / "
        f"{local_world}; set TORCHINDUCTOR_COMPILE_THREADS to choose)")


def _initial_environ(pid: int) -> dict | None:
    """The environment process `pid` was started with (Linux /proc), or None where it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _use_torchrun_threads(local_world: int) -> None:
    n = torchrun_threads()
    if n is None or n == torch.get_num_threads():
        return
    torch.set_num_threads(n)  # intra-op threads; OMP_NUM_THREADS stays 1 for any child process
    say(f"threads: torchrun set OMP_NUM_THREADS=1; each of this host's {local_world} processes uses {n} CPU "
        f"threads (the cores it may run on / {local_world}; set OMP_NUM_THREADS to choose)")


class Dist:
    """This process's place in the job. `Dist()` is the single-process case (every method a no-op)."""

    def __init__(self, rank: int = 0, world: int = 1, local_rank: int = 0, device: torch.device | None = None,
                 created: bool = False, local_world: int | None = None):
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.local_world = world if local_world is None else local_world  # processes on this host
        self.device = device  # None: one process, the trainer picks the device itself
        self._created = created

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    # ------------------------------------------------------------------------------------ agreement

    def barrier(self) -> None:
        if self.active:
            if self.device is not None and self.device.type == "cuda":
                tdist.barrier(device_ids=[self.device.index])
            else:
                tdist.barrier()

    def main_first(self, fn: Callable[[], object]):
        """Run `fn` on rank 0, then (after a barrier) on the others; e.g. filling a shared cache once."""
        if not self.active:
            return fn()
        if self.is_main:
            out = fn()
            self.barrier()
            return out
        self.barrier()
        return fn()

    def broadcast_text(self, text: str, nbytes: int = 128) -> str:
        """Rank 0's `text` (at most `nbytes` UTF-8 bytes) on every rank: one small tensor broadcast."""
        if not self.active:
            return text
        raw = text.encode()[:nbytes]
        t = torch.zeros(nbytes + 1, dtype=torch.uint8, device=self._comm_device())
        t[0] = len(raw)
        t[1 : 1 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        tdist.broadcast(t, src=0)
        data = t.cpu()
        return bytes(data[1 : 1 + int(data[0])].tolist()).decode()

    def any(self, flag: bool) -> bool:
        """True on every rank if it is True on any (the Ctrl-C flag). One tiny all-reduce (host sync)."""
        if not self.active:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self._comm_device())
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return bool(t.item())  # host-device sync, once a step

    def agree_loss(self, value: float, step: int) -> float:
        """The mean loss of this micro-batch over ranks. If another rank's is non-finite every rank raises here,
        before any backward (and so before any collective inside backward); a rank whose own loss is non-finite
        gets it back unchanged, so the caller's check names its batch files."""
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self._comm_device())
        all_ = [torch.empty_like(t) for _ in range(self.world)]
        tdist.all_gather(all_, t)
        values = torch.cat(all_).tolist()  # one host-device sync; the check needed one anyway
        bad = [r for r, v in enumerate(values) if not math.isfinite(v)]
        if not bad or not math.isfinite(value):
            return value if bad else sum(values) / self.world
        raise NonFiniteLossError(
            f"loss is non-finite on rank {bad[0]} at step {step} (its message names the batch files); no weights "
            "were changed by this step"
        )

    def host_group(self):
        """Collective: a process group of this host's processes, with its own communicator (the default group's
        collectives keep their own order beside it). torchrun numbers each host's ranks contiguously."""
        if self.local_world == self.world:
            return tdist.new_group(list(range(self.world)))
        if self.world % self.local_world:
            raise UserError(f"{self.world} processes do not split into hosts of {self.local_world} "
                            "(LOCAL_WORLD_SIZE); start as many processes on every host")
        return tdist.new_subgroups(group_size=self.local_world)[0]

    def _comm_device(self) -> torch.device:
        return self.device if self.device is not None and self.device.type == "cuda" else torch.device("cpu")

    # ------------------------------------------------------------------------------------ randomness

    def noise(self, objective, latents: torch.Tensor, dtype: torch.dtype, position: int, seed: int, streams=None):
        """`objective.noise(latents, dtype, streams, position)` drawn as one process would draw it for global batch
        `position` (a second modality's noise is the position's own: objective.py)."""
        if not self.active:
            return objective.noise(latents, dtype, streams, position)
        # LoRA dropout draws from torch's global generator: a different stream per global batch.
        digest = hashlib.sha256(f"{seed}/{position}".encode()).digest()
        torch.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        shape = torch.tensor(list(latents.shape), dtype=torch.int64, device=self._comm_device())
        shapes = [torch.empty_like(shape) for _ in range(self.world)]
        tdist.all_gather(shapes, shape)  # ranks may train different buckets this round
        mine = None
        for r, s in enumerate(torch.stack(shapes).tolist()):  # one host-device sync
            if r == self.rank:
                mine = objective.noise(latents, dtype, streams, position)
            else:  # advance the generator past rank r's draws (CPU, small; the result is dropped)
                objective.noise(torch.zeros(s), torch.float32)
        return mine

    # ------------------------------------------------------------------------------------ weights

    def same_start(self, params: list[torch.nn.Parameter]) -> None:
        """Copy rank 0's values of `params` to every rank (the LoRA init; cheap, and robust to any draw that
        differed)."""
        if not self.active:
            return
        with torch.no_grad():
            for p in params:
                if p.device.type != self._comm_device().type:
                    t = p.data.to(self._comm_device())
                    tdist.broadcast(t, 0)
                    p.data.copy_(t)
                else:
                    tdist.broadcast(p.data, 0)

    def close(self) -> None:
        if self._created and tdist.is_initialized():
            tdist.destroy_process_group()
        self._created = False


def setup(device_choice: str, mode: str = "ddp") -> Dist:
    """Read the launcher's environment; with WORLD_SIZE > 1, join the process group and pick cuda:LOCAL_RANK.
    `mode`: train.distributed (ddp here; fsdp: trainer/train/sharded.py), for the log line."""
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return Dist()
    rank, local, local_world = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", world)
    _use_torchrun_threads(local_world)
    _use_compile_workers(local_world)
    cuda = torch.cuda.is_available() and device_choice in ("auto", "cuda")
    if device_choice == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device: cuda, but torch sees no CUDA device (set train.device: cpu or auto)")
    if cuda:
        if local >= torch.cuda.device_count():
            raise UserError(
                f"LOCAL_RANK {local} but this machine has {torch.cuda.device_count()} GPU(s): start at most that many "
                "processes per node (torchrun --nproc_per_node)"
            )
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    created = False
    if not tdist.is_initialized():
        # 30 minutes: the others wait at a barrier while rank 0 writes a full fine-tune or samples images.
        # fsdp with CPU-offloaded shards reduces CPU tensors too (the gradient norm): gloo beside NCCL
        backend = ("cpu:gloo,cuda:nccl" if mode == "fsdp" else "nccl") if cuda else "gloo"
        tdist.init_process_group(backend, rank=rank, world_size=world,
                                 timeout=datetime.timedelta(minutes=30), device_id=device if cuda else None)
        created = True
    how = ("the transformer's weights, gradients and optimizer state sharded (fsdp)" if mode == "fsdp"
           else "gradients averaged before every step")
    say(f"data parallel: {world} processes over {tdist.get_backend()}, one per "
        f"{'GPU' if cuda else 'CPU process'}; {how}")
    return Dist(rank, world, local, device, created, local_world)


# ---------------------------------------------------------------------------------------------- data position


def global_data_state(state: dict, world: int) -> dict:
    """Sampler state with the *global* position (batches handed out over all ranks): what a checkpoint stores."""
    return {**state, "position": int(state["position"]) * world}


def local_data_state(state: dict, world: int) -> dict:
    """A checkpoint's global sampler state as this job's per-rank round count."""
    pos = int(state["position"])
    if pos % world:
        raise UserError(
            f"--resume: the checkpoint is at global batch {pos}, which {world} processes cannot split evenly; "
            f"resume on a number of processes that divides {pos}"
        )
    return {**state, "position": pos // world}


# ---------------------------------------------------------------------------------------------- gradients


class BucketedAllReduce:
    """Average the gradients of `params` over ranks, in flat buckets launched from the gradient hooks (see the
    module essay). `finish()` before clipping; then `.grad` are views into the bucket buffers."""

    def __init__(self, params: list[torch.nn.Parameter], world: int, grad_accum: int, bucket_bytes: int | None = None):
        self.world, self.grad_accum = world, grad_accum
        bucket_bytes = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self.buckets: list[list[torch.nn.Parameter]] = []
        groups: dict[tuple, list] = {}
        for p in reversed(params):  # backward reaches the last blocks first
            if not p.requires_grad:
                continue
            key = (p.dtype, p.device)
            cur = groups.get(key)
            if cur is None or sum(q.numel() for q in cur) * p.element_size() >= bucket_bytes:
                cur = groups[key] = []
                self.buckets.append(cur)
            cur.append(p)
        self._where = {p: i for i, b in enumerate(self.buckets) for p in b}
        self._flat: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._work: list = [None] * len(self.buckets)
        self._arrived = [0] * len(self.buckets)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._where]

    def _on_grad(self, p: torch.Tensor) -> None:
        i = self._where[p]
        self._arrived[i] += 1
        if self._arrived[i] == len(self.buckets[i]) * self.grad_accum:
            self._launch(i)

    def _launch(self, i: int) -> None:
        params = self.buckets[i]
        flat = self._flat[i]
        if flat is None:  # allocated once per bucket, on the first step
            flat = self._flat[i] = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype,
                                               device=params[0].device)
        off = 0
        for p in params:
            n = p.numel()
            if p.grad is None:  # unused this step on this rank (assumed on every rank: it stays None)
                flat[off:off + n].zero_()
            else:
                flat[off:off + n].copy_(p.grad.reshape(-1))  # device copy on the backward stream
            off += n
        self._work[i] = tdist.all_reduce(flat, op=tdist.ReduceOp.SUM, async_op=True)

    def finish(self) -> None:
        for i in range(len(self.buckets)):
            if self._work[i] is None:
                self._launch(i)  # some parameter got no gradient by hook (unused, or no backward this step)
        for i, params in enumerate(self.buckets):
            self._work[i].wait()  # NCCL: the current stream waits; gloo: the host waits
            self._work[i] = None
            self._arrived[i] = 0
            flat = self._flat[i].div_(self.world)
            off = 0
            for p in params:
                n = p.numel()
                if p.grad is not None:
                    p.grad = flat[off:off + n].view_as(p)  # no copy; zero_grad(set_to_none) drops the view
                off += n

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class FusedAllReduce:
    """Pre-step hook for the fused back pass: average each gradient over ranks right before its step. Also
    measures the norm of the averaged gradients (FusedBackPass's own would be this rank's)."""

    def __init__(self, world: int):
        self.world = world
        self.track = False
        self._sq: torch.Tensor | None = None

    def pre(self, p: torch.Tensor, state) -> None:  # noqa: ARG002 - FusedBackPass hook signature
        if p.grad is None:
            return
        tdist.all_reduce(p.grad, op=tdist.ReduceOp.SUM)  # NCCL: orders the step after it, host does not wait
        p.grad.div_(self.world)
        if self.track:  # stays on the device; read on logging steps only
            sq = torch.linalg.vector_norm(p.grad, dtype=torch.float32).square()
            self._sq = sq if self._sq is None else self._sq.add_(sq.to(self._sq.device))

    def take_norm(self) -> float | None:
        if self._sq is None:
            return None
        out = float(self._sq) ** 0.5  # host-device sync (logging steps only)
        self._sq = None
        return out


class ShardNorm:
    """The fused back pass where each process holds part of the mean gradient (fsdp: its shards; owned steps,
    owners.py: the gradients of the weights it steps): each process's pre-step hook adds up the squares of its
    part; `take_norm` sums them over the processes (one all-reduce, logging steps only). Under fsdp the fused pass's
    own norm would be a DTensor reduction, a collective inside FSDP2's reduce-scatter hook, per parameter."""

    def __init__(self):
        self.track = False
        self._sq: torch.Tensor | None = None

    def pre(self, p: torch.Tensor, state) -> None:  # noqa: ARG002 - FusedBackPass hook signature
        if self.track and p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            sq = torch.linalg.vector_norm(g, dtype=torch.float32).square()  # stays where the shard is
            self._sq = sq if self._sq is None else self._sq.add_(sq.to(self._sq.device))

    def take_norm(self) -> float | None:
        if not self.track:
            return None
        on = torch.device("cuda", torch.cuda.current_device()) if tdist.get_backend() == "nccl" else torch.device("cpu")
        sq = (self._sq if self._sq is not None else torch.zeros(())).reshape(1).to(on, torch.float32)
        tdist.all_reduce(sq)  # every process calls it: `track` is the same logging step everywhere
        self._sq = None
        return float(sq) ** 0.5  # host-device sync (logging steps only)
