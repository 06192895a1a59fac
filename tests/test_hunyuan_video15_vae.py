"""HunyuanVideo 1.5's VAE in causal time chunks (trainer/models/hunyuan_video15_vae.py): the tiny VAE's chunked
encode and decode against diffusers' whole-clip ones, on two frame counts beyond one and two aspect buckets, fp32
and bf16; and what the planner counts for it (its meta count equals the count on real tensors, and stays flat in
frames at the full size)."""

from __future__ import annotations

import pytest
import torch

from trainer.models import adapter_class
from trainer.models.hunyuan_video15 import tiny_pipeline
from trainer.models.hunyuan_video15_vae import time_chunks
from trainer.planner.vae import _LiveBytes, clip_peak

FAMILY = "hunyuan-video-1.5"
#: (frames, height, width): an image, two clip lengths (2 and 4 chunks after the first frame), a portrait and a
#: landscape bucket of the 16 px grid
CLIPS = ((1, 64, 48), (9, 64, 48), (9, 48, 80), (17, 64, 48), (17, 48, 80))
#: the tiny VAE's config (tiny_pipeline's), for the planner's meta build
TINY_VAE = {"latent_channels": 4, "block_out_channels": [8, 8, 16, 16, 16], "layers_per_block": 1}


@pytest.fixture(scope="module")
def vae():
    return tiny_pipeline().vae.eval()


def _clip(frames: int, height: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(frames * 1000 + height + width)
    return (torch.rand(1, 3, frames, height, width, generator=g) * 2 - 1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_encode_and_decode_equal_the_whole_clip(vae, dtype):
    """The adapter's encode (the chunked one) against diffusers' whole-clip `encode` times the scaling factor, and
    the chunked decode of those latents against the whole decode. The convolutions, norms and the attention's rows
    (full key length, diffusers' mask rows) are the same computations; only the down- and upsamplers' shortcut
    `mean` over a chunk's frames can round differently from the clip's (the CPU reduction groups by size). Measured on
    this CPU (AVX2, torch 2.11): fp32 latents bitwise for 1 and 9 frames at 64x48, at most 7.3e-7 elsewhere
    (values up to 1.6), decodes bitwise but 17 frames at 48x80 (1.5e-6, pixels in [-1, 1]); bf16 bitwise in all."""
    vae = vae.to(dtype)
    adapter = adapter_class(FAMILY)
    tol = 2e-6 if dtype == torch.float32 else 1 / 64  # fp32: a few ulps; bf16: half an ulp at 1-2 (bitwise here)
    for frames, height, width in CLIPS:
        x = _clip(frames, height, width, dtype)
        with torch.no_grad():
            whole = vae.encode(x).latent_dist.mode() * vae.config.scaling_factor
            chunked = adapter.encode_videos(adapter.__new__(adapter), vae, x)
            assert chunked.shape == whole.shape == (1, 4, (frames - 1) // 4 + 1, height // 16, width // 16)
            assert (chunked.float() - whole.float()).abs().max().item() <= tol, (frames, height, width)
            z = whole / vae.config.scaling_factor
            dec = vae.decode(z).sample
            with time_chunks(vae):
                dec_chunked = vae.decode(z).sample
        assert dec_chunked.shape == dec.shape == x.shape
        assert (dec_chunked.float() - dec.float()).abs().max().item() <= 2 * tol, (frames, height, width)
    if dtype == torch.float32:  # the short clip at the portrait bucket is bitwise (no regrouped sums)
        x = _clip(9, 64, 48, dtype)
        with torch.no_grad(), time_chunks(vae):
            chunked = vae.encode(x).latent_dist.mode()
        with torch.no_grad():
            assert torch.equal(chunked, vae.encode(x).latent_dist.mode())
    vae.to(torch.float32)


def test_the_context_restores_diffusers_forwards_and_spatial_tiles_run_in_chunks(vae):
    """Inside, the layers run time-chunked functions through a swapped class (no instance gets a `forward`); on exit
    every module is diffusers' own class again with nothing of the chunks left; inside, diffusers' spatial tiling (`enable_tiling`) runs each tile
    in time chunks: the same latents as its whole-clip tiled encode."""
    x = _clip(9, 64, 48, torch.float32)
    # 32 px tiles every 16 px: every tile's sides divide by 16 at 64x48 (diffusers' tiles must)
    vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_latent_min_height=2,
                      tile_latent_min_width=2, tile_overlap_factor=0.5)
    try:
        with torch.no_grad():
            whole = vae.encode(x).latent_dist.mode()
            with time_chunks(vae):
                chunked_layers = [m for m in vae.modules() if "_time_chunk_fn" in vars(m)]
                assert len(chunked_layers) > 10
                assert all(type(m).__name__.startswith("TimeChunked") for m in chunked_layers)
                assert not any("forward" in vars(m) for m in vae.modules())
                chunked = vae.encode(x).latent_dist.mode()
    finally:
        vae.disable_tiling()
        vae.enable_tiling(256, 256, 16, 16, 0.25)  # diffusers' defaults back (tiling stays off)
        vae.disable_tiling()
    assert not any("forward" in vars(m) or "_time_chunk_fn" in vars(m) for m in vae.modules())
    assert not any(type(m).__name__.startswith("TimeChunked") for m in vae.modules())
    assert whole.shape == chunked.shape and (whole - chunked).abs().max().item() <= 2e-6


def test_the_planner_counts_what_the_chunked_encode_holds(vae):
    """The planner runs the family's `vae_time_chunks` on the meta device: its peak equals the same count over real
    CPU tensors of the tiny VAE (fp32), so the meta run allocates what the real chunked run does; at the full size it
    is flat in frames (one chunk's working set, the carried frames, the clip's keys and values at the latent grid)
    and far below diffusers' whole-clip encode."""
    assert adapter_class(FAMILY).vae_time_chunks is not None
    for frames, height, width in ((9, 64, 48), (17, 48, 80)):
        x = _clip(frames, height, width, torch.float32)
        for kind in ("encode", "decode"):
            if kind == "decode":
                x = torch.randn(1, 4, (frames - 1) // 4 + 1, height // 16, width // 16)
            mode = _LiveBytes()
            with torch.no_grad(), time_chunks(vae), mode:
                out = vae.encode(x).latent_dist.mode() if kind == "encode" else vae.decode(x).sample
                del out
            meta = clip_peak(FAMILY, TINY_VAE, torch.float32, kind, width, height, frames)
            assert meta == mode.peak, (kind, frames, height, width)
    full = adapter_class(FAMILY).full_vae_config
    peak = {f: clip_peak(FAMILY, full, torch.bfloat16, "encode", 832, 480, f) for f in (33, 121)}
    assert 2.5e9 < peak[33] <= peak[121] < 1.15 * peak[33]  # measured 3.57 and 3.82 GB (9 and 31 chunks)
    dec = {f: clip_peak(FAMILY, full, torch.bfloat16, "decode", 832, 480, f) for f in (33, 121)}
    assert dec[33] <= dec[121] < 1.15 * dec[33]  # 4.56 and 5.02 GB
