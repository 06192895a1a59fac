"""Streaming the transformer during training: the offload fraction, the conductor, and the planner's check.

The fraction is resolved once, in setup, into one float: the config's number, or for `offload.transformer: auto`
the planner's choice for this GPU (trainer/planner `resolve_fraction`); 0 where nothing streams (on
the CPU the model stays resident). The same float is what the loop hands to the planner's check after the first
steps and to the out-of-memory message, which can then suggest a higher one.

`place_blocks` is where the transformer's blocks become what the loop runs: checkpointed (recomputed in backward;
per block under `train.gradient_checkpointing: auto`, `checkpoint_policy`) and, when the conductor runs, streamed
between pinned CPU RAM and the GPU. Everything outside the blocks moves to
the device here (the conductor's contract); the training method then decides where the optimizer state of
streamed trainable weights lives (trainer/train/method.py). It needs the optimizer built first: a streamed full
fine-tune packs each weight's optimizer state beside it, in the layout the optimizer reports.

`train.compile` is handed to the same handle: each block class's forward is compiled once (trainer/offload/
compiled.py), inside the StreamedBlock, at every fraction, so the handle runs whenever compile is on. The
sampler of a training run calls the same blocks, so its images use the same compiled code.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from pathlib import Path

import torch

from ..config import Config
from ..models import adapter_class
from ..offload import CompileOptions, attach_offload, move_outside_blocks
from ..offload import plan as offload_plan
from ..offload.allocators import SharedArena
from ..offload.gather import SliceGather
from ..optim.specs import names_where, optimizer_spec
from ..planner import check_line, expected, resolve_fraction
from .monitor import say


def transformer_fraction(cfg: Config, can_stream: bool) -> float:
    """The share of block bytes this run streams from CPU RAM: the config's number, or the planner's choice for
    `auto`; 0 where streaming does not pay (`can_stream` False: on the CPU), said in one line when the config
    asked for more."""
    if not can_stream:
        asked = cfg.offload.transformer
        if asked == "auto" or asked > 0:
            say(f"note: offload.transformer {asked} is ignored on the CPU: the transformer stays in RAM (streaming "
                "blocks saves GPU memory only)")
        return 0.0
    if cfg.offload.transformer == "auto":
        return float(resolve_fraction(cfg))
    return float(cfg.offload.transformer)


def compiles(cfg: Config, device: torch.device) -> bool:
    """train.compile resolved: auto is on for CUDA, off on the CPU (inductor compiles slowly there and gains
    little)."""
    c = cfg.train.compile
    return device.type == "cuda" if c == "auto" else bool(c)


def compile_options(cfg: Config, device: torch.device, shapes: int = 8) -> CompileOptions | None:
    """The handle's `compile` argument: None (eager) or options sized for `shapes` bucket shapes."""
    if not compiles(cfg, device):
        return None
    return CompileOptions(dynamic=cfg.train.compile_dynamic, shapes=max(1, shapes))


def checkpoint_policy(cfg: Config, device: torch.device, fraction: float) -> bool | list[bool]:
    """The handle's `checkpointing`: train.gradient_checkpointing, or for `auto` the planner's per-block choice
    (trainer/planner/checkpointing.py) for the budget: offload.vram_budget_gb, else the GPU's memory, or the
    process's cap on it where one is set (on the CPU there is none to plan for: every block checkpointed). Logged
    once."""
    c = cfg.train.gradient_checkpointing
    if c != "auto":
        return bool(c)
    from ..planner import GB
    from ..planner.checkpointing import CARD_SHARE, choose_checkpointing
    from ..planner.presets import process_fraction

    budget = None
    if cfg.offload.vram_budget_gb is not None:
        budget = cfg.offload.vram_budget_gb * GB
    elif device.type == "cuda":  # the card, or this process's cap where one is set (DITTRAIN_VRAM_CAP_GB)
        total = torch.cuda.get_device_properties(device).total_memory
        budget = CARD_SHARE * total * min(1.0, process_fraction(device))
    if budget is None:
        return True
    try:
        choice = choose_checkpointing(cfg, fraction, budget, log=say)
    except Exception as e:  # noqa: BLE001 - a prediction that cannot be made must never stop training
        say(f"checkpointing: auto could not plan ({type(e).__name__}: {e}); every block recomputed")
        return True
    return choice.checkpointed


def conducts(cfg: Config, fraction: float, can_stream: bool, device: torch.device | None = None) -> bool:
    """Whether the offload handle runs: it streams at fraction > 0, and at 0 still runs to checkpoint the blocks
    (offload/block.py StreamedBlock owns each block's forward), to compile them, and for activation offloading or
    nano-batching."""
    return (cfg.train.gradient_checkpointing is not False or fraction > 0
            or (device is not None and compiles(cfg, device))
            or (can_stream and (cfg.offload.activations or cfg.offload.nano_batches > 1)))


def place_blocks(transformer, blocks, cfg: Config, device: torch.device, fraction: float, conduct: bool, method,
                 optim, shapes: int = 8, fill=None, share=None, gather: SliceGather | None = None,
                 parkable: bool = False):
    """With `conduct`, hand the blocks to the offload handle, which checkpoints them (at fraction 0 too), streams
    them at fraction > 0 and compiles them under train.compile (`shapes`: bucket shapes the data has); returns
    the handle or None. Activation offloading only on a GPU (on the CPU there is no second memory to move to).
    `fill`: the blocks hold placeholders, and the conductor reads their weights from the model's files into the
    arena and ring (trainer/models/stream_load.py). `share`: the arena is one /dev/shm file per host
    (`shared_arena`); `gather`: the host's processes fill their rings together (`slice_gather`); `parkable`: the
    handle may give its ring back while another model runs (trainer/train/experts.py)."""
    if not conduct:
        if fill is not None:
            raise RuntimeError("place_blocks: blocks without weights need the offload handle (plan bug)")
        return None
    handle = attach_offload(
        blocks, device, fraction, mode="train", activations=cfg.offload.activations and device.type == "cuda",
        inputs_on_device=offload_plan.INPUTS_ON_DEVICE,  # read at the call: tests turn it off
        nano_batches=cfg.offload.nano_batches, nano_mlps=adapter_class(cfg.model.family).token_wise_of,
        trainable=method.streams_trainable,
        checkpointing=checkpoint_policy(cfg, device, fraction), optimizer_state=method.optimizer_state_layout(optim),
        compile=compile_options(cfg, device, shapes) or False,
        fill=fill, pinned_budget=_gb(cfg.offload.pinned_budget_gb), share=share, gather=gather, parkable=parkable,
    )
    if handle.pinning_note:
        say(handle.pinning_note)
    if (fraction > 0 or parkable) and device.type == "cuda":
        say(memory_line(handle.stats()))
    move_outside_blocks(transformer, blocks, device)
    method.place_optimizer_state(handle, blocks, optim)
    return handle


def memory_line(stats: dict) -> str:
    """Where the streamed blocks sit, as measured on the handle: page-locked host bytes and the GPU ring."""
    pinned = stats["pinned_bytes"] + stats["staging_pinned_bytes"]
    line = (f"offload: {stats['offloaded_bytes'] / 1e9:.2f} GB of blocks in CPU RAM ({pinned / 1e9:.2f} GB "
            f"page-locked), GPU ring {stats['ring_bytes'] / 1e9:.2f} GB")
    if stats["activation_pinned_bytes"]:
        line += f", activation buffers {stats['activation_pinned_bytes'] / 1e9:.2f} GB page-locked"
    return line


def owned_steps(cfg: Config, method) -> bool:
    """Whether a full fine-tune's streamed blocks may go through the sharded stream: each process steps its own
    weights (trainer/train/owners.py), so the rings stay alike and each process writes back its slice."""
    return method.streams_trainable and optimizer_spec(cfg.optimizer.name).owned_steps


def shared_arena(cfg: Config, dist, method, streamed: bool, gather: SliceGather | None = None):
    """The SharedArena for this process when several processes train: LoRA (nothing trainable in the
    arena), or a full fine-tune over the sharded stream (`gather`: each process writes back its own slice), with
    blocks streamed and offload.shared_arena on; the name is rank 0's, the owner each host's local rank 0, and each
    of the host's processes fills its part of the blocks. None otherwise."""
    frozen = not method.streams_trainable or gather is not None
    if not (dist.active and streamed and cfg.offload.shared_arena and frozen):
        return None
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return None
    name = dist.broadcast_text(f"{ARENA_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
    if dist.local_rank == 0:
        remove_stale_arenas(shm)
    return SharedArena(shm / name, owner=dist.local_rank == 0, barrier=dist.barrier,
                       part=(dist.local_rank, dist.local_world))


ARENA_PREFIX = "dittrain-arena-"


def remove_stale_arenas(shm: Path) -> int:
    """Remove the arena files of runs whose first process is gone; returns the bytes freed. An arena's name is
    removed once every process has mapped it, so a file is left only by a run killed while its owner filled it
    (SIGKILL, or torchrun's SIGTERM during the load): tmpfs keeps its pages, the host's RAM, until someone removes
    it. The name holds rank 0's pid (a pid of another PID namespace looks gone too: removing the name of a live
    run's arena leaves its processes' mappings intact)."""
    freed = 0
    for f in shm.glob(ARENA_PREFIX + "*"):
        try:
            pid = int(f.name[len(ARENA_PREFIX):].split("-")[0])
            os.kill(pid, 0)
            continue  # its run is alive
        except ProcessLookupError:
            pass
        except (ValueError, PermissionError):
            continue  # not ours, or another user's live process
        try:
            size = f.stat().st_blocks * 512
            f.unlink()
        except OSError:
            continue
        freed += size
        say(f"offload: removed {f} ({size / 1e9:.1f} GB of RAM), the arena of a run that was killed while loading")
    return freed


def slice_gather(cfg: Config, dist, method, streamed: bool, device: torch.device) -> SliceGather | None:
    """Collective. The sharded stream for this process (trainer/offload/gather.py) when several processes of one
    host stream blocks (LoRA's frozen ones, or a full fine-tune's whose optimizer steps each weight alone:
    `owned_steps`) and offload.sharded_stream allows it: `auto` where every pair of the host's GPUs has peer
    access (rank 0 decides for all: every process must take the same path); None otherwise. Logged in one line
    either way when it could have run."""
    mode = cfg.offload.sharded_stream
    if not (dist.active and dist.local_world > 1 and streamed and mode is not False):
        return None
    if method.streams_trainable and not owned_steps(cfg, method):
        if dist.is_main:
            say(f"offload: every process copies whole blocks: optimizer.name {cfg.optimizer.name} steps the weights "
                f"together; the sharded stream of a full fine-tune needs one of {', '.join(names_where('owned_steps'))}")
        return None
    n = dist.local_world
    if mode == "auto":
        why = None
        if device.type != "cuda":
            why = "on the CPU"
        elif not all(torch.cuda.can_device_access_peer(i, j) for i in range(n) for j in range(n) if i != j):
            why = "the host's GPUs have no peer access to each other (no NVLink or PCIe peer-to-peer)"
        why = dist.broadcast_text(why or "", nbytes=200) or None
        if why is not None:
            if dist.is_main:
                say(f"offload: every process copies whole blocks: {why} (offload.sharded_stream)")
            return None
    group = dist.host_group()
    if dist.is_main:
        say(f"offload: sharded stream: each of the host's {n} processes copies 1/{n} of every streamed block over "
            "its PCIe link and all-gathers the rest from the other GPUs (offload.sharded_stream)"
            + (f"; each steps 1/{dist.world} of the weights and keeps only their optimizer state"
               if method.streams_trainable else ""))
    return SliceGather(group, torch.distributed.get_rank(group), n)


def _gb(x: float | None) -> int | None:
    return None if x is None else int(x * 2**30)


class SteadySteps:
    """Step times to check the planner's prediction against: steady-state steps only. The first step of a run
    warms up (allocator, cuBLAS handles) and a step that compiled a new bucket shape (train.compile) costs its
    compile, tens of seconds: averaging them in made the log say "step predicted 1.05 s, measured 14.87 s".
    `add` returns the median once `need` such steps have been seen (once per run), else None."""

    def __init__(self, need: int = 4):
        self.need, self.seen, self.times, self.done = need, 0, [], False

    def add(self, seconds: float, compiled: bool) -> float | None:
        self.seen += 1
        if self.seen > 1 and not compiled:
            self.times.append(seconds)
        if self.done or len(self.times) < self.need:
            return None
        self.done = True
        return statistics.median(self.times)


def over_cap_warning(predicted: float, cap: float, video: bool = False) -> str | None:
    """The line to say at the end of loading when the planner's training-step peak (bytes) is over this process's
    VRAM `cap` (bytes), else None. A warning, not a refusal: the prediction errs both ways by a few per cent (and
    more where a step is compiled), and a run that does fit must not be stopped by it. Without it a run over its
    card found out from an out-of-memory error after loading and a first step (a Wan 2.1 I2V 14B at 81 frames on
    its 16 GB preset, predicted 17.96 GB against 15: bench/history/2026-11-28.md)."""
    if predicted <= cap:
        return None
    fixes = "a larger offload.transformer, offload.activations: true, offload.nano_batches, " + (
        "fewer data.clip_frames or a smaller data.resolutions" if video else "a smaller data.resolutions")
    return (f"warning: the planner predicts {predicted / 1e9:.2f} GB of VRAM for a training step, more than the "
            f"{cap / 1e9:.2f} GB this process may use, so it will likely run out of GPU memory in its first steps; "
            f"`dittrain plan CONFIG --vram GB` shows what fits ({fixes})")


def check_plan(cfg: Config, fraction: float, device: torch.device, step_s: float, handle=None,
               steps: int | None = None, processes: int = 1, facts=None) -> None:
    """Log the planner's predicted peak VRAM and step time beside what the real steps measured: `step_s` is the
    median of `steps` steady-state steps (none of which compiled), each of train.grad_accum micro-batches.
    `handle`: its per-block checkpointing, and whether it runs the sharded stream, are what the prediction
    assumes; `processes`: this host's processes streaming at once; `facts`: the planner's `analyze(cfg)` where the
    caller has it (the trainer's phase lines made it; 1.3-1.7 s on an H200 host to make again). The line says how long the check took: it runs
    between two steps and is not in the status line's s/step (monitor.py)."""
    kept = offload_plan.kept_blocks(handle.checkpointed) if handle is not None else frozenset()
    t0 = time.perf_counter()
    try:
        sharded = handle is not None and handle.stats()["gathered_by"] > 1
        pred = expected(cfg, fraction, facts=facts, kept=kept, processes=processes if fraction > 0 else 1,
                        sharded=sharded)
    except Exception as e:  # a prediction that cannot be made must never stop training
        say(f"offload: no planner prediction to compare with ({type(e).__name__}: {e})")
        return
    line = check_line(pred, torch.cuda.max_memory_reserved(device), step_s, micro_batches=cfg.train.grad_accum)
    line += f" [this check: {time.perf_counter() - t0:.1f} s between two steps]"
    if steps is not None:
        line += f" [measured: median of {steps} steady-state steps, compile steps excluded]"
    if sharded and cfg.train.method == "full":  # owned steps: planner/prediction.py `with_owned_steps`
        line += " [owned steps: their gradient reduces and weight broadcasts are not in the predicted step time]"
    say(line)
