"""What the loop reads: the cached training data, filled with the VAE and text encoders only when needed.

`prepare_data` (trainer/data) makes sure the latent and text caches are complete, loading the VAE and text
encoders only if something is missing, and frees them before it returns, so they are never in memory beside the
transformer. With offload.text_encoders > 0 on a GPU the encoders' blocks stream from CPU RAM (a T5-XXL alone is
9.5 GB in bf16). Several processes: rank r draws its share of every round (trainer/data).

A checkpoint stores the data position *globally* (batches handed out over all ranks), so a run resumes on any
number of processes that divides it (trainer/train/distributed.py).
"""

from __future__ import annotations

import torch

from ..config import Config
from ..data.pipeline import prepare_data as _prepare
from ..sampling.placement import place_encoder
from .distributed import global_data_state, local_data_state


def _text_fraction(cfg: Config, device: torch.device) -> float:
    return float(cfg.offload.text_encoders) if device.type == "cuda" else 0.0


def _load_encoders(cfg: Config, adapter, device, dtype, parts: set[str], handles: list):
    """VAE and text encoders on the device, their blocks streamed when offload.text_encoders > 0 (on a GPU).
    Stream handles are appended to `handles`."""
    f = _text_fraction(cfg, device)
    comps = adapter.load(cfg.model, parts=parts, dtype=dtype, device="cpu" if f > 0 else device)
    if f > 0:
        if comps.vae is not None:
            comps.vae.to(device)
        for enc in comps.text_encoders:
            handles.append(place_encoder(enc, device, f))
    return comps


def prepare_data(cfg: Config, adapter, device: torch.device, dtype: torch.dtype, rank: int = 0, world_size: int = 1):
    """TrainData with complete caches; the encoders it loaded are freed before this returns."""
    handles: list = []
    try:
        return _prepare(cfg, adapter, lambda: _load_encoders(cfg, adapter, device, dtype, {"vae", "text"}, handles),
                        rank=rank, world_size=world_size, progress=rank == 0)
    finally:
        for h in handles:
            if h is not None:  # None: an encoder without blocks to stream, put on the device whole
                h.close()


def data_state(data) -> dict:
    """The sampler's state with the global position: what a checkpoint stores."""
    return global_data_state(data.sampler.state_dict(), getattr(data, "world_size", 1))


def load_data_state(data, state: dict) -> None:
    data.sampler.load_state_dict(local_data_state(state, getattr(data, "world_size", 1)))
