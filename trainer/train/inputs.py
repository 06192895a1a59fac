"""What the loop reads: the cached training data, filled with the VAE and text encoders only when needed.

`prepare_data` (trainer/data) makes sure the latent and text caches are complete, loading the text encoders and
then the VAE only if something is missing, one group at a time, and frees them before it returns, so they are
never in memory beside the transformer or each other. With offload.text_encoders > 0 on a GPU the encoders' blocks stream from CPU RAM (a T5-XXL alone is
9.5 GB in bf16). Several processes: rank r draws its share of every round (trainer/data).

A checkpoint stores the data position *globally* (batches handed out over all ranks), so a run resumes on any
number of processes that divides it (trainer/train/distributed.py).
"""

from __future__ import annotations

import torch

from ..captioning import caption_sources
from ..config import Config
from ..data.cache import cache_stages
from ..data.pipeline import prepare_data as _prepare
from ..sampling.placement import encode_tiles
from .distributed import global_data_state, local_data_state


def _text_fraction(cfg: Config, device: torch.device) -> float:
    """offload.text_encoders on a GPU; 0 on the CPU (nothing to save). Tests override it to stream on the CPU."""
    return float(cfg.offload.text_encoders) if device.type == "cuda" else 0.0


def prepare_data(cfg: Config, adapter, device: torch.device, dtype: torch.dtype, rank: int = 0, world_size: int = 1):
    """TrainData with complete caches; the encoders it loaded are freed before this returns. The text encoders
    (streamed at offload.text_encoders on a GPU) encode first and are freed, then the VAE (trainer/data/cache.py
    `cache_stages`): never two model groups on the device at once; a video family's clips encode in the VAE's
    spatial tiles where the untiled encode does not fit the GPU (`encode_tiles`). Before that, sources with `caption_with` get
    their missing captions (trainer/captioning; rank 0 first, so the others find them written)."""
    caption_sources(cfg.data, device)
    stages = cache_stages(cfg, adapter, device, dtype, fraction=_text_fraction(cfg, torch.device(device)),
                          tile_vae=encode_tiles(cfg.model.family, device))
    return _prepare(cfg, adapter, stages, rank=rank, world_size=world_size,
                    progress=rank == 0)


def data_state(data) -> dict:
    """The sampler's state with the global position: what a checkpoint stores."""
    return global_data_state(data.sampler.state_dict(), getattr(data, "world_size", 1))


def load_data_state(data, state: dict) -> None:
    data.sampler.load_state_dict(local_data_state(state, getattr(data, "world_size", 1)))
