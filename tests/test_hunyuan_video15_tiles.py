"""HunyuanVideo 1.5's VAE in spatial tiles on top of its causal time chunks (trainer/models/hunyuan_video15_vae.py,
diffusers' `enable_tiling`): the tiny VAE's tiled encode and decode in time chunks against diffusers' own tiled ones
(whole clip at once); against the untiled ones; the latent cache tiles a clip where `tile_vae` says so (the
device's room, trainer/sampling/placement.py `encode_tiles`); the planner counts the tiled peak as running every
tile on meta gives it, and predicts the tiled encode where the card needs it.

Exactness. Against diffusers' tiled encode the chunked tiled latents are bitwise equal (fp32 and bf16), the decode
bitwise in bf16 and within 1.5e-6 in fp32 (the time chunks' own rounding: test_hunyuan_video15_vae.py). Tiled is
not untiled: diffusers' tiles (`tile_overlap_factor` 0.25) each see only their own pixels (convolutions pad at a
tile's edge, the middle block's attention spans one tile) and neighbours are blended linearly over a quarter of a
tile. On the tiny random VAE with tiles of 4 latent pixels (64 px) at 112x96 x 5 frames the tiled latents differ
from the untiled ones by an RMS of 0.76 x the latents' RMS (max 1.52 where they reach 1.69), the decoded frames by
0.62 x theirs (fp32 and bf16 alike): a random VAE's receptive field spans whole tiles, so these bound diffusers'
tiling on this model, not a trained VAE's seams at 256 px tiles. The test bounds both ratios at 0.9."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.data import cache as dcache
from trainer.models import adapter_class
from trainer.models.hunyuan_video15 import tiny_pipeline
from trainer.models.hunyuan_video15_vae import time_chunks
from trainer.planner.phases import CACHE_TILE_PIXELS, encode_need, encode_tiles, predict_phases
from trainer.planner.vae import _LiveBytes, _meta_vae, _tiled_peak, clip_peak

FAMILY = "hunyuan-video-1.5"
#: the tiny VAE's config (tiny_pipeline's), for the planner's meta build
TINY_VAE = {"latent_channels": 4, "block_out_channels": [8, 8, 16, 16, 16], "layers_per_block": 1}
#: a clip of two or three tiles a side (the last one shorter), the first frame and one time chunk
FRAMES, HEIGHT, WIDTH = 5, 96, 112
#: diffusers' tiling at a quarter of its default tile (256 px, 16 latent pixels) and its overlap factor: the same
#: loops and blends on a clip the CPU runs in a second
TILES = {"tile_sample_min_height": 64, "tile_sample_min_width": 64, "tile_latent_min_height": 4,
         "tile_latent_min_width": 4, "tile_overlap_factor": 0.25}


@pytest.fixture(scope="module")
def vae():
    vae = tiny_pipeline().vae.eval()
    vae.enable_tiling(**TILES)  # the sizes stay; `enable_tiling()` (the cache's, the sampler's) turns them on
    vae.disable_tiling()
    return vae


def _clip(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return (torch.rand(1, 3, FRAMES, HEIGHT, WIDTH, generator=g) * 2 - 1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiled_chunks_equal_diffusers_tiles_bitwise_and_untiled_within_the_blend(vae, dtype):
    """The adapter's encode with the cache's tiling on (`vae_memory_mode(tile=True)`: diffusers' default 256 px
    tiles, each run in time chunks) equals diffusers' own tiled encode of the whole clip times the scaling factor,
    bit for bit, and so does the tiled decode in time chunks (the pipeline's) diffusers' tiled decode; both differ
    from the untiled ones only within the bounds of the module essay."""
    vae = vae.to(dtype)
    adapter = adapter_class(FAMILY)
    x = _clip(dtype)
    try:
        with torch.no_grad():
            assert not dcache.vae_memory_mode(vae, WIDTH * HEIGHT, tile=False) and not vae.use_tiling
            untiled = adapter.encode_videos(adapter.__new__(adapter), vae, x)
            z = untiled / vae.config.scaling_factor
            # diffusers' whole clip, untiled (bf16's gap is fp32's: measured once, left out for the CPU's time)
            untiled_dec = vae.decode(z).sample if dtype == torch.float32 else None
            assert dcache.vae_memory_mode(vae, WIDTH * HEIGHT, tile=True) and vae.use_tiling
            assert (vae.tile_sample_min_height, vae.tile_overlap_factor) == (64, 0.25)
            ours = adapter.encode_videos(adapter.__new__(adapter), vae, x)
            theirs = vae.encode(x).latent_dist.mode() * vae.config.scaling_factor
            with time_chunks(vae):
                ours_dec = vae.decode(z).sample
            theirs_dec = vae.decode(z).sample
    finally:
        vae.disable_tiling()
        vae.to(torch.float32)
    assert ours.shape == untiled.shape == (1, 4, (FRAMES - 1) // 4 + 1, HEIGHT // 16, WIDTH // 16)
    assert torch.equal(ours, theirs)
    assert ours_dec.shape == x.shape
    if dtype == torch.bfloat16:
        assert torch.equal(ours_dec, theirs_dec)
    else:  # the chunks' regrouped sums (module essay)
        assert (ours_dec - theirs_dec).abs().max().item() <= 2e-6

    def rms(t: torch.Tensor) -> float:
        return t.float().pow(2).mean().sqrt().item()

    assert 0 < rms(ours - untiled) / rms(untiled) <= 0.9
    if untiled_dec is not None:
        assert 0 < rms(ours_dec - untiled_dec) / rms(untiled_dec) <= 0.9


def test_the_cache_tiles_a_clip_where_tile_vae_says_so(vae, monkeypatch):
    """`_encode_latents` asks `tile_vae(vae, width, height, frames, batch)` for each batch: True caches diffusers'
    tiled latents of the clip (below the 1024x1024 pixels that tile by themselves), False the untiled ones."""
    adapter = adapter_class(FAMILY).__new__(adapter_class(FAMILY))
    adapter.video = True
    x = _clip(torch.float32)
    monkeypatch.setattr(dcache, "_pixels_or_reason", lambda job: (x[0].clone(), None))
    job = dcache.LatentJob(key="k", file="clip.mp4", bucket=(WIDTH, HEIGHT), box=(0, 0), frames=FRAMES)
    asked, got = [], {}

    class Bar:
        def update(self, n):
            pass

    for tile in (True, False):
        store = dcache.MemoryStore()

        def tile_vae(v, w, h, f, b, tile=tile):
            asked.append((v is vae, w, h, f, b))
            return tile

        dcache._encode_latents(adapter, vae, store, [job], 1, Bar(), dcache.EncodeResult(), tile_vae=tile_vae)
        got[tile] = store.get("k")["latent"]
    vae.disable_tiling()
    assert asked == [(True, WIDTH, HEIGHT, FRAMES, 1)] * 2
    with torch.no_grad():
        untiled = vae.encode(x).latent_dist.mode()[0] * vae.config.scaling_factor
        vae.enable_tiling()
        tiled = vae.encode(x).latent_dist.mode()[0] * vae.config.scaling_factor
        vae.disable_tiling()
    assert torch.equal(got[True], tiled) and not torch.equal(tiled, untiled)
    assert (got[False] - untiled).abs().max().item() <= 2e-6  # time chunks: a few fp32 ulps (test_hunyuan_video15_vae)


@pytest.mark.parametrize("kind", ["encode", "decode"])
def test_the_planner_counts_the_tiled_peak_as_running_every_tile(kind):
    """`clip_peak(tiled=True)` (one full tile over the clip, the kept tiles and the ends' concatenations:
    `_tiled_peak`) against diffusers' tiled encode / decode in time chunks run tile by tile on meta, on the tiny VAE
    at a size with two and three tiles a side and short edge tiles: the same bytes. (At the full size, 1280x720 x 121 in
    bf16: 0.625 GB encode, 2.440 GB decode, both equal to the meta run of every tile: trainer/planner/vae.py.)"""
    width, height, frames = 416, 320, 5  # latent 26 x 20: tiles of 16 at 0, 12 (and 24: 2 wide), the last 8 high
    key = json.dumps(TINY_VAE, sort_keys=True)
    meta = _meta_vae(FAMILY, key, torch.float32)
    if kind == "encode":
        x = torch.empty(1, 3, frames, height, width, device="meta")
    else:
        x = torch.empty(1, 4, (frames - 1) // 4 + 1, height // 16, width // 16, device="meta")
    meta.enable_tiling()
    try:
        mode = _LiveBytes()
        with torch.no_grad(), time_chunks(meta), mode:
            out = meta.encode(x).latent_dist.mode() if kind == "encode" else meta.decode(x).sample
            del out
    finally:
        meta.disable_tiling()
    counted = clip_peak(FAMILY, TINY_VAE, torch.float32, kind, width, height, frames, tiled=True)
    assert counted == _tiled_peak(FAMILY, key, torch.float32, kind, width, height, frames)
    assert counted == pytest.approx(mode.peak, rel=0.02), (counted, mode.peak)
    assert counted < clip_peak(FAMILY, TINY_VAE, torch.float32, kind, width, height, frames)


@pytest.mark.slow
def test_720p_clips_encode_tiled_where_the_card_needs_it():
    """1280x720 x 121 (below the 1 MP that tiles by itself): the full-size untiled encode needs 18 GB reserved
    beside the VAE, tiled about 1.1 GB plus the clips; the cache's choice (`encode_tiles`, given the room the
    device has) and the latent-caching phase (given the card's budget) tile it on a 16 or 24 GB card, not on 48 GB."""
    full = adapter_class(FAMILY).full_vae_config
    assert 1280 * 720 <= CACHE_TILE_PIXELS
    untiled = encode_need(FAMILY, full, torch.bfloat16, 1280, 720, 121, 1, False)
    tiled = encode_need(FAMILY, full, torch.bfloat16, 1280, 720, 121, 1, True)
    assert 17e9 < untiled < 20e9 and tiled < 2.5e9
    assert encode_tiles(FAMILY, full, torch.bfloat16, 1280, 720, 121, 1, 18e9)
    assert not encode_tiles(FAMILY, full, torch.bfloat16, 1280, 720, 121, 1, 30e9)
    assert encode_tiles(FAMILY, full, torch.bfloat16, 1920, 1088, 5, 1, 1e12)  # above 1 MP: always


@pytest.mark.slow
def test_the_latent_caching_phase_counts_the_tiled_encode_under_a_small_budget():
    """The 48 GB preset's 720p x 121 (untiled there) under the budget of a 24 GB card: the latent-caching phase
    counts the tiled encode and says so; without a budget (or with room) the untiled one. `dittrain plan`'s sampling
    table gives the tiled decode beside the untiled one."""
    from trainer.config import load_config
    from trainer.planner import analyze

    cfg = load_config("configs/hunyuan-video-1.5/lora-48gb.yaml")
    assert cfg.data.clip_frames == 121
    facts = analyze(cfg)

    def caching(budget):
        return next(p for p in predict_phases(cfg, 0.0, facts, budget=budget) if p.name == "latent caching")

    plain, roomy, small = caching(None), caching(47e9), caching(23e9)
    assert plain.vram == roomy.vram and plain.note.endswith("untiled") and plain.vram > 20e9
    assert small.vram < 7e9 and "tiled (untiled 23.8 GB)" in small.note
    w, h, frames = facts.size(cfg.data.resolutions[0])  # the planner's clip of the bucket's area (960x960 x 121)
    full = adapter_class(FAMILY).full_vae_config
    saved = [clip_peak(FAMILY, full, torch.bfloat16, "encode", w, h, frames, tiled=t) for t in (False, True)]
    assert plain.vram - small.vram == pytest.approx(1.75 * (saved[0] - saved[1]))  # RESERVED_PER_COUNTED
    assert small.ram == plain.ram  # the batch's frames in RAM either way
    # `dittrain sample` at the preset's 1280x720 x 121 decodes tiled where the untiled decode does not fit: both counted
    from trainer.planner.sampling import predict_sampling

    s = cfg.sample
    samp = predict_sampling(facts, 1.0, 960, size=(s.width, s.height, s.frames))
    dec = [clip_peak(FAMILY, full, torch.bfloat16, "decode", s.width, s.height, s.frames, tiled=t) for t in (False, True)]
    assert samp.decode_reserved - samp.decode_tiled == pytest.approx(1.75 * (dec[0] - dec[1]))
    assert dec[1] == pytest.approx(2.44e9, rel=0.01)  # every tile run on meta: 2,439,917,568 bytes (planner/vae.py)


def test_the_runtime_hook_asks_the_planner_against_the_devices_room(vae, monkeypatch):
    """`placement.encode_tiles` (what fit and `dittrain cache` give the cache): on a GPU, tiles where the planner's
    untiled `encode_need` for this VAE's config and dtype is over the room the device has (`cuda_headroom`, here
    given); none on the CPU or for an image family (the pixel rule then)."""
    from trainer.sampling import placement

    assert placement.encode_tiles(FAMILY, "cpu") is None and placement.encode_tiles("flux", "cuda") is None
    hook = placement.encode_tiles(FAMILY, "cuda")
    need = encode_need(FAMILY, TINY_VAE, torch.float32, WIDTH, HEIGHT, FRAMES, 2, False)
    for room, tiled in ((need - 1, True), (need, False)):
        monkeypatch.setattr(placement, "cuda_headroom", lambda device, room=room: room)
        assert hook(vae, WIDTH, HEIGHT, FRAMES, 2) is tiled
