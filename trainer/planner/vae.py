"""What a video family's VAE holds on the GPU while it encodes one clip or decodes one, counted on the meta device.

Why count rather than scale a per-pixel figure: AutoencoderKLWan (the causal video VAE of every Wan family) encodes
time in chunks by itself: the first frame alone, then 4 frames at a time, each chunk through the encoder with a
feature cache of the previous chunk's last frames (diffusers' `_encode`); it decodes one latent frame at a time the
same way. Its peak is one chunk's working set plus the caches and what it has concatenated so far, not the clip's:
counted for the full-size Wan 2.1 VAE in bf16 at 832x480, the encode peaks at 0.93 GB for one frame, 2.97 GB for 9
frames and 2.98 GB for 81 (1280x720: 3.09, 6.85, 6.87 GB); the decode at 1.38, 4.06 and 4.24 GB (1280x720: 3.19,
9.38, 9.79 GB). A figure per pixel of one image (phases.py `VAE_ACT_ENCODE`, which the image families keep) cannot
say that.

HunyuanVideo 1.5's VAE (AutoencoderKLHunyuanVideo15) runs every frame at once in diffusers; the family runs it in
causal time chunks instead (trainer/models/hunyuan_video15_vae.py), and declares that as `vae_time_chunks`, a
context the meta clip below runs in: 3.57 GB counted for the encode at 832x480 x 33 frames, 3.82 at x 121 (diffusers'
whole-clip encode: 23.7 GB at 33 frames), bf16.

How: the family's VAE is built on the meta device from its config (the model folder's vae/config.json, else the
family's `full_vae_config`) and run on a meta clip (batch 1: the cache and `dittrain sample` slice batches) under a
dispatch mode that keeps a running sum of the bytes of the tensors the ops make, each storage from the op that makes
it until the last Python reference to it goes (`_LiveBytes`, weak-reference finalizers; a view of a tensor made
outside the mode, such as a chunk sliced from the input clip, makes nothing); the peak of that sum is the activation
peak. Weights and the input clip are made outside the mode and are not in it: callers add the weights, the batch of
clips on the GPU and `WORKSPACE`, and turn the count into reserved bytes with `RESERVED_PER_COUNTED`.

Tiled modes (the latent cache tiles frames above 1024x1024 pixels, and a clip whose untiled encode does not fit
the card, trainer/data/cache.py and trainer/sampling/placement.py `encode_tiles`; sampling during training decodes
frames above 512x512 pixels tiled, trainer/sampling/placement.py): running the tiles on meta takes minutes (15 tiles
of 81 frames at 832x480; HunyuanVideo 1.5 at 1280x720 x 121, 28 tiles: 85 s to encode, 195 s to decode), so one
full tile (the VAE's `tile_sample_min_height` x `_width`, 256 px for Wan and HunyuanVideo 1.5) is counted over the
whole clip and the tiles' outputs are added from diffusers' own tiling arithmetic (`_tiled_peak`): a tiled decode
keeps every decoded tile until all are blended, then holds the blended rows and their concatenation (and Wan's
decode its clamped copy: the family's `vae_tiled_decode_copies`) at once (Wan: 0.93 and 2.08 GB at 832x480 and
1280x720, 81 frames, where running every tile on meta gave 0.92 and 2.09; HunyuanVideo 1.5 at 1280x720 x 121 in
bf16: 2.440 GB, running every tile 2.440); a tiled encode keeps only latent tiles beside the one it runs
(HunyuanVideo 1.5 there: 0.625 GB counted and run, against 10.49 GB untiled).

Measured (bench/diag/diag_vae_peak.py on an H100, torch 2.11, diffusers 0.42.1, random bf16 weights, 2026-11-27): the
GPU's `max_memory_allocated` over the weights and input was 1.00-1.16x the count (cuDNN's convolution workspaces
are not in it), `max_memory_reserved` 1.50-1.73x for untiled encodes and decodes of 9 and 81 frames at 832x480,
1280x720 and TI2V-5B's 1280x704, 1.21-1.67x tiled: the caching allocator keeps the segments of the chunks' growing
concatenations. Hence `RESERVED_PER_COUNTED`, not the transformer's ALLOCATOR_OVERHEAD.
"""

from __future__ import annotations

import functools
import json
import weakref
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..models import adapter_class
from .meta_ops import MetaOps

#: reserved VRAM per counted byte of a video VAE's encode or decode: the most the H100 measurement gave (module essay)
RESERVED_PER_COUNTED = 1.75


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages the ops return while they live (a storage counted once however many views share it):
    `peak` is the most alive at once.

    On meta tensors an op that makes new tensors is run once per layout of its arguments (`MetaOps`; `reused`
    counts the calls it answered): the chunks of a clip repeat the same ops on the same shapes (the full-size
    HunyuanVideo 1.5 encode of 121 frames is ~10k ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self._ops = MetaOps()
        self._bytes: dict[int, int] = {}  # storage -> its bytes, while some tensor on it lives
        self._refs: dict[int, int] = {}  # storage -> live tensors on it

    def _gone(self, sid: int) -> None:
        self._refs[sid] -= 1
        if not self._refs[sid]:
            del self._refs[sid]
            self.now -= self._bytes.pop(sid)

    @property
    def reused(self) -> int:
        return self._ops.reused

    def _run(self, func, args, kwargs):
        return self._ops.run(func, args, kwargs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = self._run(func, args, kwargs or {})
        # a view of an input (or the input itself, in place) is no new storage: counted only if the mode made it
        given = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            s = t.untyped_storage()
            sid = s._cdata
            if sid not in self._refs and sid in given:
                continue  # a view of a tensor made outside the mode (the input clip, a weight)
            if sid not in self._refs:
                self._bytes[sid], self._refs[sid] = s.nbytes(), 0
                self.now += s.nbytes()
                self.peak = max(self.peak, self.now)
            self._refs[sid] += 1
            weakref.finalize(t, self._gone, sid)
        return out


def vae_config(cfg) -> dict | None:
    """The VAE config the planner runs for `cfg`: the model folder's vae/config.json where it has one, else the
    family's `full_vae_config` (None: the family declares none, an image family)."""
    full = adapter_class(cfg.model.family).full_vae_config
    if full is None:
        return None
    path = Path(cfg.model.path) / "vae" / "config.json"
    if path.is_file():
        try:
            return {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
        except (OSError, ValueError):
            pass  # the loader says what is wrong with it; plan the full-size VAE
    return dict(full)


@functools.lru_cache(maxsize=8)
def _meta_vae(family: str, config: str, dtype: torch.dtype) -> nn.Module:
    import diffusers

    cls = getattr(diffusers, adapter_class(family).vae_cls_name)
    with torch.device("meta"):
        vae = cls.from_config(json.loads(config))
    nn.Module.to(vae, dtype)  # torch's: ModelMixin's warns about modules kept in fp32 (none here)
    return vae.eval().requires_grad_(False)


@functools.lru_cache(maxsize=64)
def _untiled_peak(family: str, config: str, dtype: torch.dtype, kind: str, width: int, height: int,
                  frames: int) -> int:
    """Activation peak (bytes) of one untiled encode ("encode": pixels -> the latent distribution's mode) or decode
    ("decode": latents -> frames) of a clip of `frames` pixel frames, width x height, batch 1."""
    vae = _meta_vae(family, config, dtype)
    c = vae.config
    if kind == "encode":
        x = torch.empty(1, 3, frames, height, width, device="meta", dtype=dtype)
    else:
        z, s, t = adapter_class(family).vae_latent_geometry(c)  # the family's VAE config names
        x = torch.empty(1, z, (frames - 1) // t + 1, height // s, width // s, device="meta", dtype=dtype)
    vae.disable_tiling()
    mode = _LiveBytes()
    with torch.no_grad(), adapter_class(family).vae_time_chunks(vae), mode:
        out = vae.encode(x).latent_dist.mode() if kind == "encode" else vae.decode(x).sample
        del out
    return mode.peak


def _spans(size: int, tile: int, stride: int) -> list[int]:
    """Extents of diffusers' tiles along one latent side (`range(0, size, stride)`, each up to `tile`)."""
    return [min(tile, size - i) for i in range(0, size, stride)]


def _tiled_peak(family: str, config: str, dtype: torch.dtype, kind: str, width: int, height: int,
                frames: int) -> float:
    """diffusers' `tiled_encode` / `tiled_decode` (AutoencoderKLWan's, AutoencoderKLHunyuanVideo15's: the same
    loops): each tile runs over the whole clip beside the outputs of the tiles before it (one full tile's untiled
    peak, scaled by the tile's area), then every tile's output with the blended rows and their concatenation
    (module essay). A tile's output: its decoded pixels, or its encoded moments (2 x the latent channels); at the
    end of a decode the family's `vae_tiled_decode_copies` output-sized tensors beside the tiles, of an encode two
    (the rows, their concatenation) and the latent distribution's clamped log-variance, std and var (half the
    moments each: diffusers' DiagonalGaussianDistribution)."""
    vae = _meta_vae(family, config, dtype)
    cls = adapter_class(family)
    z, r, t = cls.vae_latent_geometry(vae.config)
    th, tw, sh, sw = cls.vae_tiles(vae)  # the family's tiling (HunyuanVideo 1.5: by an overlap factor)
    th, tw = min(th, height), min(tw, width)  # a frame smaller than a tile is one tile along that side
    rows = _spans(height // r, th // r, sh // r)
    cols = _spans(width // r, tw // r, sw // r)
    if kind == "decode":
        per_px, end = frames * 3 * dtype.itemsize, cls.vae_tiled_decode_copies  # a decoded pixel, every frame
    else:  # a tile's moments per pixel of its input: 2z channels at 1 / r^2 of the pixels, every latent frame
        per_px, end = 2 * z * ((frames - 1) // t + 1) * dtype.itemsize / (r * r), 2 + 1.5
    one = _untiled_peak(family, config, dtype, kind, tw, th, frames)
    done = peak = 0.0
    for h in rows:
        for w in cols:
            area = h * w * r * r
            peak = max(peak, done + one * area / (th * tw))
            done += area * per_px
    return max(peak, done + end * width * height * per_px)


def clip_peak(family: str, config: dict, dtype: torch.dtype, kind: str, width: int, height: int, frames: int,
              tiled: bool = False) -> float:
    """Activation peak (bytes, batch 1) of the family's VAE encoding (`kind` "encode") or decoding ("decode") one
    clip of `frames` frames at width x height, untiled or `tiled` as diffusers tiles it (module essay)."""
    key = json.dumps(config, sort_keys=True)
    if not tiled:
        return float(_untiled_peak(family, key, dtype, kind, width, height, frames))
    return _tiled_peak(family, key, dtype, kind, width, height, frames)


def clip_bytes(width: int, height: int, frames: int, dtype: torch.dtype) -> int:
    """Bytes of one clip's pixels (3 channels) in `dtype`."""
    return 3 * frames * width * height * dtype.itemsize
