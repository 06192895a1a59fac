"""`dittrain fit`: one Trainer that reads top to bottom as setup, train_step, save, close.

    Trainer(cfg, resume="latest").fit()

setup     resolves --resume first (a missing checkpoint fails before anything loads); picks the device, dtype and
          attention backend and says so; builds the data caches (the VAE and text encoders are loaded and freed
          there) and only then loads the transformer; resolves the offload fraction once; lets the training
          method (method.py: LoRA or full) pick the trainable parameters; builds the one optimizer object
          (optimizer.py: schedule, fused back pass, averaging over ranks); checkpoints and streams the blocks
          (streaming.py), or under train.distributed: fsdp shards them across the processes instead
          (sharded.py); restores a checkpoint's state.
train_step draws grad_accum micro-batches, checks each loss before its backward, clips, steps.
save      writes a complete, resumable checkpoint atomically (see checkpoint.py) and, at the end, the method's
          final weights in output.dir (the LoRA file or the transformer folder): saving.py, a mixin.
close     restores signal handlers, closes the logs, drops the model, unlocks output.dir.

The loop never asks which method it trains: whatever differs between LoRA and full fine-tuning is a call on
`self.method`.

Exactness. With the same config, a resumed run computes bitwise the losses of the uninterrupted run in fp32 on
the CPU: everything that draws random numbers (noise and timesteps, LoRA dropout, data order) has its generator
state in the checkpoint, and nothing outside the training step (saving, sampling) draws from those generators.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import time
from pathlib import Path

import torch

from ..config import Config
from ..data.cache import CachingInterrupted
from ..data.video import write_video
from ..dtypes import DTYPES
from ..errors import NonFiniteLossError, UserError
from ..models import adapter_classes, get_adapter, stream_load
from ..offload import compiled
from ..offload.plan import kept_blocks
from ..optim.build import eval_weights
from ..phase_log import LOG, Phase, ram_words
from ..sampling.output import image_metadata, save_png, video_fps
from ..sampling.training import TrainingSampler
from . import checkpoint as ck
from . import distributed, experts, faults, sharded, streaming
from . import run as runs
from .ema import EMA
from .faults import StopFlag, TrainingInterrupted, oom_error
from .inputs import prepare_data
from .lock import RunLock
from .monitor import Monitor, say
from .objective import FlowMatching
from .optimizer import optimizer_for
from .saving import Saving
from .sharded_ema import ShardedEMA
from .validation_loss import Validator


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device: cuda, but torch sees no CUDA device (set train.device: cpu or auto)")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


#: `train.attention` values every family takes (SDPA's backends); the others are a family's own (`own_attention`)
SDPA_ATTENTION = ("auto", "flash", "efficient", "math")


def choose_attention(device: torch.device, choice: str) -> str:
    """Set the scaled_dot_product_attention backends for the run, deliberately, and describe the choice.

    cuDNN attention is never enabled on CUDA: it fails in backward for some shapes and drivers."""
    if device.type != "cuda":
        return "cpu (torch's CPU flash / math kernels)"
    b = torch.backends.cuda
    b.enable_cudnn_sdp(False)
    flash, efficient, math_ = {"auto": (True, True, True), "flash": (True, False, False), "efficient": (False, True, False),
                               "math": (False, False, True), "flex": (True, True, True)}[choice]
    b.enable_flash_sdp(flash)
    b.enable_mem_efficient_sdp(efficient)
    b.enable_math_sdp(math_ or choice == "auto")
    names = [n for n, on in (("flash", flash), ("efficient", efficient), ("math", math_)) if on]
    return ("flex attention for the mask, SDPA " if choice == "flex" else "") + "/".join(names) + " (cuDNN attention off)"


def check_attention(adapter, choice: str, device: torch.device) -> None:
    """One line for a `train.attention` the family does not compute (`ModelAdapter.own_attention`; SDPA's
    backends serve every family), or `flex` off CUDA, before anything loads."""
    if choice not in SDPA_ATTENTION and choice not in adapter.own_attention:
        has = ", ".join(c.family for c in adapter_classes() if choice in c.own_attention)
        raise UserError(f"train.attention: {choice} is {has}'s own attention; model.family {adapter.family} takes "
                        "auto, flash, efficient or math")
    if choice == "flex" and device.type != "cuda":
        raise UserError(f"train.attention: flex trains on CUDA only (torch's flex attention has no backward on "
                        f"{device.type}); use auto there")


class Trainer(Saving):
    def __init__(self, cfg: Config, resume: str | None = None, overwrite: bool = False, resume_other_run: bool = False,
                 keep_model: bool = True, relaunch: str = "dittrain fit CONFIG --resume latest"):
        self.cfg = cfg
        self.relaunch = relaunch  # the command that continues this run (the CLI's carries its --set overrides)
        # keep_model=False (the CLI): the transformer is dropped when the run ends, so its streamed blocks are not
        # copied out of the pinned arena (a second copy of the model in RAM at exit)
        self.keep_model = keep_model
        self.resume = resume
        self.overwrite, self.resume_other_run = overwrite, resume_other_run  # see run.py
        self.out = Path(cfg.output.dir)
        self._out_existed = self.out.exists()  # a failed fresh run removes the folder only if it made it
        self.step = 0
        self.stop = StopFlag(say)
        self.monitor: Monitor | None = None
        self.last_checkpoint: Path | None = None
        self.offload = None
        self._activations = None  # fsdp: sharded.shard's activation offloader (the conductor's, else)
        self.ema = None  # train.ema (ema.py), built in setup
        self.method = experts.method_for(cfg)  # LoRA or full (for each expert): what the loop would branch on
        self.fraction: float | None = None  # offload.transformer resolved (auto: the planner's pick), in setup
        self.dist = distributed.Dist()  # one process until setup reads torchrun's environment
        self.sharded = False  # train.distributed: fsdp with several processes (sharded.py), decided in setup
        self.lockstep = False  # the other ranks join rank 0's transformer calls (fsdp, a sharded stream): setup
        self.arena_shared = False  # the streamed blocks' arena is the host's one /dev/shm file: `_place_blocks`
        self._smoothing: dict | None = None  # the checkpoint's smoothed loss (monitor.py), on resume
        self._ready = False
        self._sampling_works = True  # until a sampling pass fails (`_sampling_pass`)
        self._lock: RunLock | None = None  # output.dir's lock (lock.py), from setup to close

    # ------------------------------------------------------------------------------------------------ run

    def fit(self) -> Path:
        """Train to train.steps; returns the final weights' path (lora.safetensors or transformer/)."""
        c = self.cfg.train
        try:
            if not self._ready:
                self.stop.install(at_once=True)  # no step to finish yet: a signal stops loading / caching at once
                with self._phase("load"):  # the caching phases inside it measure and report themselves
                    self.setup()
            self.stop.install()
            steady = streaming.SteadySteps()  # the planner check's step times: no compile, no warm-up
            while self.step < c.steps:
                before = compiled.stats()
                with self._phase("training step", message=self._step_oom):
                    metrics = self.train_step()
                if self.ema is not None:
                    self.ema.after_step(self.step)  # ema.py: unfused, the EMA updates here
                line = compiled.later_compile_line(before, self.step, metrics["step_time"])
                if line is not None and self.dist.is_main:
                    say(line)
                self._say_activations_retaken(metrics["step_time"])
                median = steady.add(metrics["step_time"], compiled=compiled.stats()["graphs"] != before["graphs"])
                if median is not None and self._checks_plan():
                    with self._aside():  # not step 6's time in the status line (monitor.py)
                        streaming.check_plan(self.cfg, self.fraction, self.device, median, handle=self.offload,
                                             steps=steady.need, processes=self.dist.local_world,
                                             facts=self.__dict__.get("_plan_facts"))
                if self.dist.any(self.stop.requested):  # every rank stops at the same step
                    path = self.save()
                    raise TrainingInterrupted(
                        f"stopped by {self.stop.signal_name} at step {self.step}: saved {path}; continue with "
                        f"`{self.relaunch}`", self.stop.signal_name
                    )
                if runs.save_due(self.cfg, self.step):  # train.checkpoint_every, output.save_every
                    self.save()
                s = self.cfg.sample
                if s.every and s.prompts and self.step % s.every == 0 and self._sampling_works \
                        and self._joins(self.sampler):
                    self.release_activations()  # before the phase: its RAM peak starts without them
                    self._sampling_pass()
                if c.validate_every and self.step % c.validate_every == 0 and self._joins(self.validator):
                    with self._phase("validation", "raise offload.transformer, or validate less data (data.validation)",
                                     own_cache=True), self._lockstep():
                        self.validate()
            if self.monitor is not None:
                self.monitor.finish()
            return self.save(final=True)
        except torch.OutOfMemoryError:
            raise oom_error(self.step + 1, self.fraction, self.method.oom_hint) from None
        except KeyboardInterrupt as e:  # a second signal, or the first before step 1
            raise TrainingInterrupted(self._stopped_at_once(e), TrainingInterrupted.signal_of(e)) from None
        finally:
            self.close()
            if self.resume is None and self.step == 0 and getattr(self, "run", None) and self.dist.is_main:
                runs.release(self.out, self.run.id, keep_folder=self._out_existed)  # failed before step 1

    def _stopped_at_once(self, e: KeyboardInterrupt) -> str:
        """The line for a run stopped without saving: what is kept and the command that continues it (`--resume
        latest` only where this run has a checkpoint; a fresh run stopped before one starts again as it was)."""
        name = TrainingInterrupted.signal_of(e)
        newest = self._newest_checkpoint() if getattr(self, "run", None) or self.resume else None
        has = newest is not None and not newest.startswith("none")
        again = self.relaunch if has or self.resume else self.relaunch.removesuffix(" --resume latest")
        if isinstance(e, CachingInterrupted):
            return f"caching stopped by {name} before training: {e.kept_words()}; continue with `{again}`"
        if not self._ready:
            return f"stopped by {name} while loading, before step 1 (nothing trained); continue with `{again}`"
        last = f"the last complete checkpoint is {newest}" if has else "no checkpoint was saved yet"
        return f"stopped by {name} at once at step {self.step} without saving; {last}; continue with `{again}`"

    # ------------------------------------------------------------------------------------------------ setup

    def setup(self) -> None:
        """Everything `fit` needs before step 1, in this order: --resume's checkpoint found and checked,
        output.dir checked and claimed, the process group joined, the device and the family's adapter, the data
        caches (the VAE and text encoders loaded and freed there), the offload fraction, the transformer with its
        trainable parameters, then its blocks sharded (fsdp) or checkpointed and streamed beside the one
        optimizer, and a checkpoint's state restored (`_finish_setup`). A family of experts trained together takes
        over after the fraction (experts.setup)."""
        # What is alive now (the libraries, ~0.5 M objects) lives as long as the run: frozen before the collections
        # setup makes (the cache's, the loaders' release_host_memory: about six a fit), each of which walked them
        # all (0.3-0.6 s a call on a 2-core CPU). `close` unfreezes.
        gc.freeze()
        self._frozen = True
        if self.cfg.data is None:
            raise UserError("the config has no data: section; `dittrain fit` needs data.sources")
        resume_dir = self._checked_resume()
        self._claim_output(resume_dir)
        self._join_processes()
        self._pick_device_and_family()
        self._prepare_data()
        streamed = self._resolve_fraction()
        if experts.trains_both(self.cfg):  # every expert of a family of experts, each loaded and streamed in turn
            return experts.setup(self, resume_dir, streamed)
        blocks = self._build_transformer(resume_dir, streamed)
        if self.sharded:  # train.distributed: fsdp; config.py refused what it does not do (EMA, conductor, ...)
            self._shard(blocks, streamed)
        else:
            self._place_blocks(blocks, streamed)
        self.objective = FlowMatching(self.cfg.train, self.adapter.timestep_shift,
                                      vae_scale=self.adapter.latent_scale, t_range=self.t_range)
        self._finish_setup(resume_dir)

    def _checked_resume(self) -> Path | None:
        """--resume's checkpoint folder (None for a fresh run), checked before anything loads: a checkpoint with
        nothing left to train, or a config that changes the trained weights' shapes (lora.rank 16 -> 8), is one
        line (run.py)."""
        if not self.resume:
            return None
        resume_dir = runs.resolve_resume(self.out, self.resume, self.resume_other_run)
        if resume_dir is not None:
            state = json.loads((resume_dir / "state.json").read_text())
            runs.check_target(state, self.cfg.train.steps, resume_dir, self.out)
            runs.check_shapes(state, self.cfg.model_dump(mode="json"), resume_dir)
        return resume_dir

    def _claim_output(self, resume_dir: Path | None) -> None:
        """Before anything loads, on every process so that all stop together: output.dir and data.cache_dir
        writable, the wandb package present (output.wandb); then output.dir locked for this fit (lock.py,
        rank 0, held to close) and claimed by this run (run.py: another run's outputs are never touched)."""
        cfg = self.cfg
        runs.check_writable(self.out, "output.dir")
        if cfg.data.cache:
            runs.check_writable(cfg.data.cache_dir, "data.cache_dir")
        if cfg.output.wandb is not None and runs.is_main_process():
            from .wandb_log import require_wandb

            require_wandb()  # a missing package is one line now, not after the model has loaded
        if runs.is_main_process():  # one live fit per output.dir (lock.py), held to close(); torchrun: rank 0
            self._lock = RunLock(self.out).acquire(say)
        # The folder belongs to this run from here (or the run stops: another run's outputs are never touched).
        self.run = runs.claim(self.out, resume_dir, self.overwrite, self.resume_other_run, write=runs.is_main_process())

    def _join_processes(self) -> None:
        """Several processes (torchrun): the process group and cuda:LOCAL_RANK; rank 0 then removes what an
        interrupted checkpoint write left in output.dir."""
        self.dist = distributed.setup(self.cfg.train.device, self.cfg.train.distributed)
        if self.dist.is_main:
            ck.remove_partial(ck.checkpoint_root(self.out))

    def _pick_device_and_family(self) -> None:
        """The device, dtype and attention backend (said in one line), and the family's adapter, bound to the
        data's reference images per target (a family may stream and train more blocks with them); a family of
        experts trained together is checked here, before the data."""
        cfg, c = self.cfg, self.cfg.train
        self.device = self.dist.device or pick_device(c.device)
        self.dtype = DTYPES[cfg.model.dtype]
        say(f"device {self.device}; {self.method.storage()}; attention {choose_attention(self.device, c.attention)}")
        self.adapter = get_adapter(cfg.model, references=cfg.data.references() if cfg.data is not None else 0)
        check_attention(self.adapter, c.attention, self.device)
        self.t_range = self.adapter.train_timesteps()  # a family of experts: the chosen one's (refused without one)
        if experts.trains_both(cfg):
            experts.check(cfg, self.dist)

    def _prepare_data(self) -> None:
        """The data caches, before the transformer: building them loads (and frees) the VAE and text encoders,
        so the transformer is not in memory at the same time, and a bad image fails the run before the big load.
        Rank 0 fills the cache, the others read it; rank 0 also holds the held-out set (data.validation) and the
        sample prompts' embeddings (sample.every)."""
        cfg = self.cfg
        self.data = self.dist.main_first(lambda: prepare_data(
            cfg, self.adapter, self.device, self.dtype, rank=self.dist.rank, world_size=self.dist.world))
        self.validator = Validator.build(cfg, self.data, self.adapter, self.device, self.dtype) \
            if self.dist.is_main else None
        self.sampler = None
        if cfg.sample.every and cfg.sample.prompts and self.dist.is_main:
            with self._phase("text caching", "raise offload.text_encoders (the text encoders stream from CPU RAM), "
                             "or set sample.every: 0"):  # the sample prompts, encoded once
                self.sampler = TrainingSampler(cfg, self.adapter, self.device, self.dtype)  # frees the encoders

    def _resolve_fraction(self) -> bool:
        """offload.transformer resolved once (auto: the planner's pick, rank 0's on every process) and whether
        blocks stream; also the compile cache, the sharding mode (fsdp) and the host pages the encoders left.
        Returns whether any block streams from CPU RAM."""
        cfg = self.cfg
        if cfg.train.compile_cache and streaming.compiles(cfg, self.device):  # before anything compiles
            say(f"compile cache: {compiled.use_cache(Path(cfg.data.cache_dir) / 'torch-compile')}")
        self.fraction = streaming.transformer_fraction(cfg, self._can_stream())  # resolved once: auto -> a float
        # Rank 0's choice everywhere: `auto` may time the GPU, and a shared arena needs one layout on every process
        self.fraction = float(self.dist.broadcast_text(repr(self.fraction)))
        stream_load.release_host_memory()  # the VAE and text encoders are gone: give their pages back
        self._loader = None  # reads streamed blocks from the files into the conductor's arena (stream_load.py)
        # train.distributed: fsdp with several processes: FSDP2 units (sharded.py), no conductor
        self.sharded = self.dist.active and cfg.train.distributed == "fsdp"
        self.lockstep = self.sharded
        return self.fraction > 0  # on the CPU, or at 0, the model stays resident

    def _build_transformer(self, resume_dir: Path | None, streamed: bool) -> list:
        """The transformer in training mode with its trainable parameters (the LoRA drawn from train.seed, or a
        checkpoint's weights), the same on every process; returns its blocks. Streamed blocks (and fsdp's) are
        placeholders the loader fills later."""
        cfg, c = self.cfg, self.cfg.train
        if self.sharded and not stream_load.loads_whole(cfg, resume_dir is not None):
            # blocks read one at a time in sharded.shard; the rest to the CPU, sharded from there
            self.transformer, self._loader = stream_load.load(self.adapter, cfg.model, self.dtype, torch.device("cpu"),
                                                              stream_blocks=True)
        else:
            self.transformer, self._loader = self._load_transformer(cfg, self.adapter, streamed or self.sharded,
                                                                    resume_dir is not None)
        self.transformer.train()
        if (form := self.adapter.use_attention(self.transformer, c.attention, self.device)) is not None:
            say(form)  # a family's own form of its attention
        torch.manual_seed(c.seed)  # LoRA init and dropout draw from torch's global generator
        self.params = self.method.trainable_params(self.transformer, self.adapter)
        if resume_dir is not None:
            # Before the optimizer sees the weights and before offloading turns block weights into ring views.
            self._load_weights(resume_dir)
        self.method.same_start(self.dist, self.params)
        blocks = self.adapter.blocks(self.transformer)
        say(f"{self.method.describe(self.params)}, "
            f"{len(blocks)} blocks{_checkpointed(c.gradient_checkpointing)}"
            f"{f', {self.fraction:g} of block bytes streamed from CPU RAM' if streamed else ''}")
        return blocks

    def _shard(self, blocks: list, streamed: bool) -> None:
        """train.distributed: fsdp: the blocks sharded across the processes (sharded.py: FSDP2 units, offloaded
        shards when they stream, checkpointing and compilation per block), then the optimizer and EMA of the
        shards."""
        cfg = self.cfg
        self._activations = sharded.shard(
            self.transformer, blocks, self.device, offload=streamed, loader=self._loader,
            checkpointed=streaming.checkpoint_policy(cfg, self.device, self.fraction),
            compile=streaming.compiles(cfg, self.device), master=self._master_dtype(),
            activations=cfg.offload.activations and self._can_stream(),  # as one process: only on a GPU
            nano_batches=cfg.offload.nano_batches, nano_mlps=self.adapter.token_wise_of)
        self._loader = None
        self.params = sharded.trainable(self.transformer)  # FSDP2's DTensor parameters replaced the originals
        self.optim = optimizer_for(cfg, self.params, self.dist, sharded=self.transformer)
        self.ema = ShardedEMA.build(cfg, self.transformer, self.params)  # train.ema: the EMA of each shard

    def _place_blocks(self, blocks: list, streamed: bool) -> None:
        """Without fsdp: the one optimizer first (a streamed full fine-tune packs each weight's optimizer state
        beside it, in the layout the optimizer reports) and the EMA, then the blocks checkpointed and, where the
        conductor runs (a fraction above 0 on a GPU), streamed (streaming.py); several processes stream through a
        shared arena or the sharded stream."""
        cfg = self.cfg
        conduct = streaming.conducts(cfg, self.fraction, self._can_stream(), self.device)
        gather = streaming.slice_gather(cfg, self.dist, self.method, conduct and streamed, self.device)
        share = streaming.shared_arena(cfg, self.dist, self.method, conduct and streamed, gather)  # several processes
        # gradients averaged over ranks, if several; a full fine-tune over the sharded stream: each process steps
        # its own weights (owners.py)
        self.optim = optimizer_for(cfg, self.params, self.dist, model=self.transformer,
                                   owners=gather is not None and self.method.streams_trainable)
        self.ema = EMA.build(cfg, self.transformer, self.params, self.optim)  # train.ema; before blocks stream
        shapes = len({e.bucket for e in getattr(self.data, "entries", ())}) or 8  # train.compile: one per shape
        self.lockstep = gather is not None  # every load is a collective: rank-0 passes are joined (_joins)
        self.arena_shared = share is not None  # the phase lines then predict one process's RAM without it
        self.offload = streaming.place_blocks(self.transformer, blocks, cfg, self.device, self.fraction, conduct,
                                              self.method, self.optim, shapes,
                                              fill=self._loader and self._loader.fill, share=share, gather=gather)
        if self._loader is not None:
            self._loader.close()
            self._loader = None

    def _load_transformer(self, cfg: Config, adapter, streamed: bool, resuming: bool):
        """(transformer, loader) of `cfg.model` (an expert's, for model.expert: both): streamed blocks as
        placeholders the loader fills into the conductor's arena, or (original-layout single files, and where the
        base weights must exist before blocks stream) whole, in RAM when they stream, else on the device."""
        if not stream_load.loads_whole(cfg, resuming, streamed):
            return stream_load.load(adapter, cfg.model, self.dtype, self.device, streamed)
        if (note := stream_load.whole_file_note(cfg.model)) is not None:
            say(note)
        load_to = torch.device("cpu") if streamed else self.device
        return adapter.load(cfg.model, parts={"transformer"}, dtype=self.dtype, device=load_to).transformer, None

    def _joins(self, runner) -> bool:
        """Whether this rank runs a rank-0 phase (sampling, validation) whose runner it holds or not: rank 0 runs
        it; under fsdp or a sharded stream every other rank joins its transformer calls here (sharded.Lockstep) and
        returns False."""
        if runner is not None:
            return True
        if self.lockstep:
            sharded.Lockstep(self.transformer, self.adapter, self.device, self.dtype).follow()
        return False

    def _lockstep(self):
        """fsdp or a sharded stream, rank 0: announce each transformer call to the other ranks (sharded.Lockstep).
        Otherwise nothing."""
        if not self.lockstep:
            return contextlib.nullcontext()
        return sharded.Lockstep(self.transformer, self.adapter, self.device, self.dtype).lead()

    def _master_dtype(self) -> torch.dtype | None:
        """fsdp: the dtype the method keeps its trainable shards in (sharded.py), else None."""
        return self.method.sharded_master_dtype(self.dtype) if self.sharded else None

    def _finish_setup(self, resume_dir: Path | None) -> None:
        cfg, c = self.cfg, self.cfg.train
        if resume_dir is not None:
            self._restore(resume_dir)
        if self.dist.is_main:
            self.monitor = Monitor(self.out, c.steps, self.step, cfg.output.tensorboard, run_id=self.run.id,
                                   config=cfg, epoch=self._epoch, smoothing=self._smoothing,
                                   wandb=cfg.output.wandb)
        # The collector's full (generation-2) pass walks every tracked Python object: ~0.9 M with a full-size Flux,
        # its LoRA and the libraries, 0.56-0.79 s on the H200 host whenever it fell inside a step (the slow steps of
        # bench/speed/bench_gc.py, bench/history/2026-11-27.md 2026-11-27). What setup built lives as long as the run: frozen, no
        # collection walks it again, and the steps' collections take milliseconds. `close` unfreezes.
        gc.collect()
        gc.freeze()
        self._frozen = True
        self._ready = True

    def _phase(self, name: str, fix: str | None = None, message=None, own_cache: bool = False) -> Phase:
        """A named phase (trainer/phase_log.py): peaks measured, out of memory as one line naming the phase and
        `fix` (or `message(detail)`: the training step keeps faults.oom_error's step-numbered advice); `own_cache`
        for the phases between training steps."""
        return Phase(name, fix, device=getattr(self, "device", None), on_exit=self._phase_done, message=message,
                     own_cache=own_cache)

    def _checks_plan(self) -> bool:
        """Whether this process checks the planner's prediction against the first steady steps: rank 0 on a GPU,
        without fsdp."""
        return self.device.type == "cuda" and self.dist.is_main and not self.sharded

    def _aside(self):
        """While the planner's diagnostics run between steps (its check, the phase lines' predictions): their wall
        time stays out of the status line's s/step (Monitor.aside), which had read as a slow next step."""
        monitor = getattr(self, "monitor", None)  # none yet in setup's caching phases
        return monitor.aside() if monitor is not None else contextlib.nullcontext()

    def _step_oom(self, detail: str) -> str:
        return f"{oom_error(self.step + 1, self.fraction, self.method.oom_hint)} [{detail}]"

    def _phase_done(self, name: str, peak) -> None:
        """On a GPU, log each phase's measured peak beside the planner's prediction, once per phase. With several
        processes both are one process's: its anonymous RSS, the planner's without a shared arena (file pages in
        /dev/shm), which the load line gives once for the host, and with its 1/N of owned optimizer state."""
        logged = self.__dict__.setdefault("_phases_logged", set())
        if name in logged or getattr(self, "device", None) is None or self.device.type != "cuda":
            return
        logged.add(name)
        if name == "load":  # the caching phases ran inside setup (trainer/data/cache.py records them)
            for n in ("text caching", "latent caching"):
                if n in LOG.peaks:
                    self._phase_done(n, LOG.peaks[n])
        line = f"phase {name}: peak reserved VRAM {peak.vram_reserved / 1e9:.2f} GB, {ram_words(peak)}"
        with self._aside():
            words, warning = self._phase_prediction(name)
        say(line + words)
        if warning:
            say(warning)

    def _phase_prediction(self, name: str) -> tuple[str, str | None]:
        """The planner's words for phase `name`'s line (its predicted peaks, or why there are none), and for the
        load phase the warning to say where the training step is predicted over the VRAM cap (else None)."""
        line, warning = "", None
        try:
            from ..planner import analyze
            from ..planner.phases import fallbacks, predicted_map
            from ..planner.prediction import node_arena_words, shared_arena_bytes
            from ..planner.presets import process_fraction

            # Keyed by the fraction and the blocks that keep their activations (train.gradient_checkpointing:
            # auto): text caching logs before setup has resolved offload.transformer (auto) and placed the blocks.
            pred = self.__dict__.setdefault("_phase_pred", {})
            ck = getattr(getattr(self, "offload", None), "checkpointed", None) or []  # none kept without a handle
            n, shared = self.dist.world, self.arena_shared
            key = self.fraction, kept_blocks(ck), n, shared
            if key not in pred:
                # the card's cap: clips whose untiled encode would not fit it were cached tiled (placement.encode_tiles)
                cap = process_fraction(self.device) * torch.cuda.get_device_properties(self.device).total_memory
                facts, first = analyze(self.cfg), not pred
                self._plan_facts = facts  # the config's, whatever the key: the planner check reuses it
                pred[key] = predicted_map(self.cfg, self.fraction or 0.0, facts, budget=cap, kept=key[1],
                                          processes=n, shared=shared)
                pred[key, "node"] = shared_arena_bytes(facts, self.fraction or 0.0, n, shared)
                pred[key, "cap"] = cap
                for note in fallbacks(facts) if first else []:  # said once a run
                    say(note)
            if name in pred[key]:
                v, r = pred[key][name]
                line += f" (planner: {v / 1e9:.2f} GB VRAM, {r / 1e9:.1f} GB RAM{' per process' if n > 1 else ''}"
                if name == "load" and pred[key, "node"]:
                    line += f"; {node_arena_words(pred[key, 'node'], self.dist.local_world)}"
                line += ")"
            if name == "load" and "training step" in pred[key]:  # before step 1, not after its out-of-memory error
                warning = streaming.over_cap_warning(pred[key]["training step"][0], pred[key, "cap"],
                                                     video=getattr(getattr(self, "adapter", None), "video", False))
        except Exception as e:  # noqa: BLE001 - a prediction that cannot be made must never stop training
            line += f" (no planner prediction: {type(e).__name__})"
        return line, warning

    def _epoch(self) -> int:
        """The epoch (from 1) of the batch just trained."""
        d = self.data
        return (d.sampler.position * getattr(d, "world_size", 1) - 1) // d.batches_per_epoch + 1

    def _can_stream(self) -> bool:
        """Streaming pays only between CPU RAM and a GPU; on the CPU the model stays resident. (Tests override
        this to run the conductor's CPU path through the loop.)"""
        return self.device.type == "cuda"

    # ------------------------------------------------------------------------------------------------ step

    def train_step(self) -> dict[str, float]:
        cfg, c = self.cfg, self.cfg.train
        t0 = time.perf_counter()
        losses, images = [], 0
        log_now = (self.step + 1) % c.log_every == 0 or self.step + 1 == c.steps
        self.optim.before_backward(track_norm=log_now)
        self.objective.start_step()  # model.expert: both: the step's first timestep picks the expert it trains
        for _ in range(c.grad_accum):
            batch = self.data.next_batch()
            latents = batch.latents.to(self.device, non_blocking=True)
            # a second modality's clean latents (LTX-2's sound) stay fp32 until noised, as the picture's
            more = {k: v.to(self.device) for k, v in batch.text.items() if k in self.adapter.noised_streams}
            text = {k: _to(v, self.device, self.dtype) for k, v in batch.text.items() if k not in more}
            noised = self.dist.noise(self.objective, latents, self.dtype, batch.position, c.seed, more)
            text |= {k: n.noisy for k, n in noised.streams.items()}
            pred = self.adapter.predict(self.transformer, noised.noisy, noised.t, text, guidance=cfg.model.guidance)
            loss = self.objective.loss(pred, noised, mask=batch.mask)
            # Host-device sync, needed anyway: the check must come before backward, which may step the weights
            # (fused back pass).
            value = self.dist.agree_loss(loss.item(), self.step + 1)  # all ranks raise together
            if not math.isfinite(value):
                raise NonFiniteLossError(
                    f"loss is {value} at step {self.step + 1}; no weights were changed by this step; last "
                    f"checkpoint: {self._newest_checkpoint()}. Likely fixes: {faults.nan_fixes(cfg)}; or a broken "
                    f"image in the batch ({', '.join(map(str, batch.files))})"
                )
            (loss / c.grad_accum if c.grad_accum > 1 else loss).backward()  # fused back pass: steps here
            del pred, loss, noised
            losses.append(value)
            images += latents.shape[0]
        lr = self.optim.lr  # the rate this step used
        grad_norm = self.optim.step()
        self.step += 1
        dt = time.perf_counter() - t0
        line = compiled.report()  # once, after the first step that compiled (its time is logged below)
        if line is not None and self.dist.is_main:
            say(f"{line}; step {self.step} took {dt:.1f} s")
        if self._activations is not None and self.step == 1 and self.dist.is_main:  # fsdp: proof it moved them
            a = self._activations
            say(f"fsdp: activation offloading moved {a.offloaded_bytes / 1e9:.2f} GB of block inputs per micro-batch "
                f"to CPU RAM ({a.pinned_bytes / 1e9:.2f} GB page-locked)")
        metrics = {"loss": sum(losses) / len(losses), "lr": lr, "step_time": dt, "samples_per_s": images * self.dist.world / dt}
        if isinstance(self.transformer, experts.ExpertRouter):
            metrics["expert"] = self.transformer.last  # the expert this step trained
        if log_now:
            metrics["grad_norm"] = None if grad_norm is None else float(grad_norm)  # host sync, logging steps only
            if self.device.type == "cuda":
                metrics["vram_gb"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        if self.monitor is not None:
            self.monitor.log(self.step, metrics, log_now)
        return metrics

    # ------------------------------------------------------------------------------------------------ save

    # ------------------------------------------------------------------------------------------------ sample

    def _say_activations_retaken(self, step_s: float) -> None:
        """A step that page-locked its activation buffer again for a second or more (the step after a sampling pass
        or a checkpoint save, which give it back: `release_activations`) says so, so that its time is explained."""
        got = self.offload.activations_retaken() if getattr(self, "offload", None) is not None else None
        if got is not None and got[1] >= 1.0 and self.dist.is_main:
            why = ("it is given back before sampling and checkpoint saves, so that their host RAM peak is without it"
                   if got[2] else "one buffer of the most bytes a step used, in place of the first steps' chunks")
            say(f"offload: step {self.step} page-locked its {got[0] / 1e9:.1f} GB activation buffer in {got[1]:.1f} s "
                f"of its {step_s:.1f} s ({why})")

    def release_activations(self) -> None:
        """Before a checkpoint save and a sampling pass, outside their phases so that each measured RAM peak starts
        without them: the activation offloader's pinned buffers are given back (trainer/offload/activations.py
        `release`; nothing waits in them between steps, and a no-grad forward takes none), so the phase's host-RAM
        peak is the run's without every offloaded activation beside it (what the planner counts); the next step
        takes one buffer again. Nothing without activation offloading."""
        if getattr(self, "offload", None) is not None:  # the conductor's (per expert: one shared)
            self.offload.release_activations()
        if getattr(self, "_activations", None) is not None:  # fsdp's
            self._activations.release()

    def _sampling_pass(self) -> None:
        """Sampling during training, in its phase. A pass that fails (a reference its pipeline refuses, out of
        memory in a decode, a pipeline error) must not cost the steps trained since the last checkpoint: one line
        says why, sampling stays off for the rest of the run and training goes on. Under fsdp or a sharded stream
        the other ranks may be inside the failed transformer call, so there the run still ends."""
        try:
            with self._phase("sampling", own_cache=True) as phase, self._lockstep():
                self.sample(before_decode=lambda: phase.mark("denoising"))
        except Exception as e:  # noqa: BLE001 - any failure of a sample, reported in one line
            if self.lockstep:
                raise
            self._sampling_works = False
            why = str(e).strip().splitlines()[0] if str(e).strip() else ""
            why = why if isinstance(e, UserError) else f"{type(e).__name__}: {why}"
            say(f"warning: sampling at step {self.step} failed, so sampling is off for the rest of this run and "
                f"training goes on ({why}); sample the saved LoRA with `dittrain sample` after fixing it")
            del e
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def sample(self, before_decode=None) -> list:
        """Images for sample.prompts with the model being trained, into output.dir/samples and TensorBoard.
        `before_decode()` is called once, when the VAE starts decoding (the phase marks its denoising peak).

        Runs under `fork_rng` so that nothing it does can move the training generators. (`fit` gives the activation
        buffers back before its phase: `release_activations`.)"""
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), \
                eval_weights(self.optim.optimizer):
            images = self.sampler(self.transformer, before_decode=before_decode)
        s = self.cfg.sample
        for i, (img, prompt) in enumerate(zip(images, s.prompts, strict=True)):
            meta = image_metadata(prompt=prompt, seed=s.seed + i, steps=s.steps, guidance=s.guidance,
                                  model=str(self.cfg.model.path), training_step=self.step)
            png = save_png(img, self.out / "samples" / f"step-{self.step:06d}-{i}.png", meta)
            if i < len(self.sampler.videos) and self.sampler.videos[i] is not None:  # a video: its mp4 beside it
                write_video(self.sampler.videos[i], png.with_suffix(".mp4"), video_fps(self.cfg))
        if self.monitor is not None:
            self.monitor.images(self.step, images, self.cfg.sample.prompts)
        return images

    def validate(self) -> dict[str, float]:
        """The validation loss of the model being trained (validation.py), logged as val_loss."""
        metrics = self.validator(self.transformer, self.optim.optimizer)
        if self.monitor is not None:
            self.monitor.validation(self.step, metrics)
        return metrics

    # ------------------------------------------------------------------------------------------------ close

    def close(self) -> None:
        self.stop.restore()
        if getattr(self, "_frozen", False):  # what setup froze may be collected again (the run is ending)
            gc.unfreeze()
            self._frozen = False
        if getattr(self, "optim", None) is not None:
            self.optim.close()
            self.optim = None
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
        if self.offload is not None:
            self.offload.close(keep_weights=self.keep_model)
            self.offload = None
        if self._activations is not None:
            self._activations.close()
            self._activations = None
        several = self.dist.active and not self.keep_model
        if several:
            # Several processes: what holds the process groups (the fsdp-wrapped model, its DTensor parameters,
            # the EMA, the sampler) goes while the interpreter is alive. A gloo group whose last reference dies at
            # interpreter exit can abort the process after a finished run (SIGABRT, "terminate called without an
            # active exception": seen once on rank 1 of the two-node CI test; the race pytorch/pytorch#179291 names).
            for name in ("transformer", "params", "ema", "objective", "_loader", "sampler", "validator"):
                setattr(self, name, None)
            gc.collect()
        self.dist.close()
        if several:
            gc.collect()
        if self._lock is not None:  # last: the folder is free once everything above let go of it
            self._lock.release()
            self._lock = None


def _checkpointed(setting) -> str:
    return {True: " checkpointed", False: "", "auto": " (checkpointing auto: the planner picks per block)"}[setting]


def _to(v, device, dtype):
    if isinstance(v, torch.Tensor):
        return v.to(device, dtype=dtype if v.is_floating_point() else v.dtype, non_blocking=True)
    return v
