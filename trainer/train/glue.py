"""The trainer's calls into the other parts (models, data, optim, offload, sample), in one place.

Each function here is a thin adapter over another package's public API, so the loop in trainer.py reads the
same whichever way those packages spell things.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import Config


def get_adapter(model_cfg):
    from ..models import get_adapter as _get

    return _get(model_cfg)


# ---------------------------------------------------------------------------------------------- data


def _text_fraction(cfg: Config, device: torch.device) -> float:
    return float(cfg.offload.text_encoders) if device.type == "cuda" else 0.0


def _load_encoders(cfg: Config, adapter, device, dtype, parts: set[str], handles: list):
    """VAE and text encoders on the device; with offload.text_encoders > 0 (on a GPU) the encoders' blocks are
    streamed from CPU RAM (a T5-XXL alone is 9.5 GB in bf16). Stream handles are appended to `handles`."""
    f = _text_fraction(cfg, device)
    comps = adapter.load(cfg.model, parts=parts, dtype=dtype, device="cpu" if f > 0 else device)
    if f > 0:
        from ..sampling.placement import place_encoder

        if comps.vae is not None:
            comps.vae.to(device)
        for enc in comps.text_encoders:
            handles.append(place_encoder(enc, device, f))
    return comps


def prepare_data(cfg: Config, adapter, device: torch.device, dtype: torch.dtype, rank: int = 0, world_size: int = 1):
    """TrainData with complete caches. The VAE and text encoders are loaded only if something is missing, and
    freed before this returns. Several processes: rank r draws its share of every round (trainer/data)."""
    from ..data.pipeline import prepare_data as _prepare

    handles: list = []
    try:
        return _prepare(cfg, adapter, lambda: _load_encoders(cfg, adapter, device, dtype, {"vae", "text"}, handles),
                        rank=rank, world_size=world_size, progress=rank == 0)
    finally:
        for h in handles:
            h.close()


def data_state(data) -> dict:
    from .distributed import global_data_state  # the global position: resumable on any number of processes

    return global_data_state(data.sampler.state_dict(), getattr(data, "world_size", 1))


def load_data_state(data, state: dict) -> None:
    from .distributed import local_data_state

    data.sampler.load_state_dict(local_data_state(state, getattr(data, "world_size", 1)))


# ---------------------------------------------------------------------------------------------- optimizer


class Optim:
    """Optimizer, schedule and (optionally) the fused back pass, stepped the same way from the loop.

    Unfused: backward fills `.grad`; `step()` clips, steps and zeroes. Fused (trainer/optim/fused.py): each
    parameter steps inside backward and its gradient is freed; `step()` only closes the step. Either way the
    schedule advances once per optimizer step."""

    def __init__(self, cfg: Config, params: list[torch.nn.Parameter]):
        from ..optim.build import build_optimizer, build_scheduler

        self.cfg = cfg.optimizer
        self.params = params
        self.optimizer = build_optimizer(params, cfg.optimizer, seed=cfg.train.seed)
        self.scheduler = build_scheduler(self.optimizer, cfg.optimizer, cfg.train.steps)
        self.fused = None
        if cfg.optimizer.fused_back_pass:
            from ..optim.fused import FusedBackPass

            self.fused = FusedBackPass(self.optimizer)

    def keep_state_in_ram(self, params: list[torch.nn.Parameter]) -> None:
        """Full fine-tune with streamed blocks: the optimizer state of these parameters lives in pinned CPU RAM
        between steps and visits the GPU only while its parameter steps (trainer/optim StateOffload)."""
        if not params:
            return
        from ..optim.fused import StateOffload

        off = StateOffload(params)
        self.fused.add_step_hooks(pre=off.pre, post=off.post, synchronize=off.synchronize)

    def before_backward(self, track_norm: bool) -> None:
        if self.fused is not None:
            self.fused.track_grad_norm = track_norm

    def step(self):
        """Finish the optimizer step. Returns the gradient norm (a float, a 0-dim tensor read later on logging
        steps only, or None)."""
        norm = None
        if self.fused is not None:
            norm = self.fused.finish_step()
        else:
            if self.cfg.max_grad_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return norm

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def save(self, folder: Path) -> None:
        from ..optim.state import save_optimizer_state

        save_optimizer_state(self.fused or self.optimizer, folder)

    def load(self, folder: Path, scheduler_state: dict) -> None:
        from ..optim.state import load_optimizer_state

        load_optimizer_state(self.fused or self.optimizer, folder)
        self.scheduler.load_state_dict(scheduler_state)

    def close(self) -> None:
        if self.fused is not None:
            self.fused.remove()


# ---------------------------------------------------------------------------------------------- offload


def offload_fraction(cfg: Config) -> float:
    """The transformer's offload fraction: the config's number, or the planner's choice for `auto`."""
    if cfg.offload.transformer == "auto":
        from ..planner import resolve_fraction

        return float(resolve_fraction(cfg))
    return float(cfg.offload.transformer)


def check_plan(cfg: Config, fraction: float, device: torch.device, step_s: float) -> None:
    """Log the planner's predicted peak VRAM and step time beside what the first real steps measured."""
    from ..planner import check_line, expected
    from .monitor import say

    try:
        pred = expected(cfg, fraction)
    except Exception as e:  # a prediction that cannot be made must never stop training
        say(f"offload: no planner prediction to compare with ({type(e).__name__}: {e})")
        return
    say(check_line(pred, torch.cuda.max_memory_reserved(device), step_s))


def attach_offload(transformer, blocks, cfg: Config, device: torch.device, fraction: float, optim: Optim):
    """Stream the blocks (trainer/offload); move everything outside the blocks to the device ourselves (the
    conductor's contract). The conductor checkpoints each block itself (recognising blocks already wrapped by
    `checkpoint_blocks`).

    Full fine-tuning streams the block weights as trainable: the fused back pass steps each while its block is
    on the GPU, then the block is written back. The optimizer state (AdamW's moments, Adafactor's factors) is
    packed beside each weight and crosses PCIe with it (trainer/offload/fused.py); 8-bit AdamW's, whose layout
    is unknown before a step, waits in pinned RAM and visits the GPU while its parameter steps
    (trainer/optim StateOffload)."""
    from ..offload import attach_offload as _attach
    from ..offload import move_outside_blocks
    from ..offload.fused import PACKED_STATE_OPTIMIZERS, bind_fused

    full = cfg.train.method == "full"
    packed = full and optim.fused is not None and cfg.optimizer.name in PACKED_STATE_OPTIMIZERS
    handle = _attach(
        blocks, device, fraction, mode="train", activations=cfg.offload.activations,
        nano_batches=cfg.offload.nano_batches, trainable=full, checkpointing=cfg.train.gradient_checkpointing,
        optimizer_state=optim.fused.state_layout if packed else (),
    )
    move_outside_blocks(transformer, blocks, device)
    if packed:
        bind_fused(handle, optim.fused)
    elif full:
        optim.keep_state_in_ram(streamed_params(handle, blocks))
    return handle


def streamed_params(handle, blocks) -> list[torch.nn.Parameter]:
    """Parameters of the blocks the conductor streams (their optimizer state must not stay on the GPU)."""
    return [p for i in handle.plan.streamed for p in blocks[i].parameters() if p.requires_grad]


# ---------------------------------------------------------------------------------------------- samples


def training_sampler(cfg: Config, adapter, device: torch.device, dtype: torch.dtype):
    """Images of sample.prompts made with the model being trained (trainer/sampling/training.py): the prompts are
    encoded once here, before the transformer is loaded, and the text encoders freed."""
    from ..sampling.training import TrainingSampler

    return TrainingSampler(cfg, adapter, device, dtype)
