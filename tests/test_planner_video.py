"""The planner counts a video family's clip (issue 39): `data.resolutions: [480p]` names Wan's 832x480 frame, the
planned clip has the tokens the VAE's real latents give, the VAE's encode peak is a causal chunk's, its tiled decode
is modelled as diffusers tiles it, and the phases count the clip and the sampled frames."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.config import Config
from trainer.data.buckets import bucket_sizes, nearest_bucket
from trainer.models import ADAPTERS, adapter_class, get_adapter
from trainer.planner import analyze, report
from trainer.planner import trace as ptrace
from trainer.planner.phases import predict_phases
from trainer.planner.vae import _LiveBytes, _meta_vae, _tiled_peak, clip_peak, vae_config

#: family -> its tiny folder: Wan 2.1's VAE (8x in space) and Wan 2.2 TI2V-5B's (16x, 2x2 patchify)
TINY = {"wan": "wan", "wan2.2-ti2v-5b": "wan22-ti2v"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    from trainer.models.tiny import make_tiny_models

    root = tmp_path_factory.mktemp("tiny-video")
    make_tiny_models(root, list(TINY))
    return {family: root / folder for family, folder in TINY.items()}


def _cfg(path, family: str = "wan", **data) -> Config:
    return Config.model_validate({
        "model": {"family": family, "path": str(path), "dtype": "bf16"},
        "train": {"method": "lora", "gradient_checkpointing": True},
        "data": {"sources": [{"path": "/tmp"}], "resolutions": [72], "clip_frames": 9, **data},
        "offload": {"transformer": 1.0},
        "sample": {"prompts": ["a cat"], "every": 10, "width": 64, "height": 64, "frames": 9},
        "output": {"dir": "/tmp/out"},
    })


def test_a_video_height_names_the_frame_whose_area_buckets_keep():
    """480p is Wan's 832x480 (resolution 632), 720p 1280x720 (960); a video family's buckets step by 16 px (32
    for TI2V-5B's divisor), so those frames are buckets and an 832x480 video trains uncropped, unscaled; an image
    family keeps 64 and a step set in the config stays."""
    cfg = _cfg("/nonexistent", resolutions=["480p", "720P", 512])
    assert cfg.data.resolutions == [632, 960, 512] and cfg.data.bucket_step == 16
    assert _cfg("/nonexistent", bucket_step=64).data.bucket_step == 64
    assert _cfg("/nonexistent", "flux").data.bucket_step == 64
    for family, at_480p, at_720p in (("wan", (832, 480), (1280, 720)), ("wan2.2-ti2v-5b", (832, 480), (1280, 704))):
        cls = adapter_class(family)
        div = cls.latent_scale * cls.token_patch
        for res, frame in ((632, at_480p), (960, at_720p)):
            sizes = bucket_sizes(res, div, 4.0, cls.bucket_step)
            assert frame in sizes and frame[::-1] in sizes and nearest_bucket(*frame, sizes) == frame, (family, res)
    with pytest.raises(ValueError):
        _cfg("/nonexistent", resolutions=["480i"])


@pytest.mark.parametrize("family", list(TINY))
def test_the_planned_clip_has_the_tokens_of_the_vaes_real_latents(tiny, family):
    """The clip the planner traces is a bucket of the resolution, and the tiny model's VAE encodes a clip of that
    size to latents of exactly the traced shape (F = (frames - 1) / 4 + 1 latent frames, the bucket's latent grid):
    the token count is the real one."""
    cfg = _cfg(tiny[family], family)
    facts = analyze(cfg)
    w, h, frames = facts.size(72)
    adapter = get_adapter(cfg.model)
    assert frames == 9 and (w, h) in bucket_sizes(72, adapter.resolution_divisor, 4.0, cfg.data.bucket_step)
    vae = adapter.load(cfg.model, parts={"vae"}, dtype=torch.float32).vae
    with torch.no_grad():
        lat = adapter.encode_videos(vae, torch.rand(1, 3, frames, h, w) * 2 - 1)
    p = adapter.patch_size
    assert facts.tokens(72) == lat.shape[2] * (lat.shape[3] // p) * (lat.shape[4] // p) > 0
    traced = ptrace.forward_inputs(family, facts.model, 1, h, w, 8, torch.bfloat16, frames=frames)
    assert traced["hidden_states"].shape[2:] == lat.shape[2:]
    # the full-size model: Wan's 480p x 81 is 21 latent frames of 30 x 52 tokens, 720p x 81 of 45 x 80
    if family == "wan":
        full = analyze(_cfg("/nonexistent", resolutions=["480p", "720p"], clip_frames=81))
        assert (full.size(632), full.tokens(632)) == ((640, 624, 81), 21 * 30 * 52)
        assert full.tokens(960) == 21 * 45 * 80 == adapter_class(family).full_tokens(720, 1280, 81)


def test_live_bytes_count_what_lives_at_once():
    """The VAE counter's semantics: a storage counts from the op that makes it until its last tensor goes; views
    share their storage; tensors made outside the mode are not counted."""
    x = torch.empty(1000, device="meta")  # made outside: not counted
    mode = _LiveBytes()
    with mode:
        w = x[:10]  # a view of a tensor made outside: not counted either
        a = x * 2  # 4000 bytes
        v = a[:10]  # a view: nothing new
        b = a + 1  # 8000 alive
        del a  # the view keeps a's storage
        c = b * 3  # 12000 alive
        del v, b, w
        d = c + 1  # a and b gone: 8000
        del c, d
    assert mode.peak == 12000 and mode.now == 0


@pytest.mark.parametrize("family", [f for f in ADAPTERS if adapter_class(f).full_vae_config is not None])
def test_the_planned_vae_is_the_familys_full_size_one(family):
    """The VAE the planner runs without a folder (`full_vae_config`, on the meta device) has the family's declared
    `vae_params` (the weights every phase adds)."""
    import json

    vae = _meta_vae(family, json.dumps(adapter_class(family).full_vae_config, sort_keys=True), torch.bfloat16)
    assert sum(p.numel() for p in vae.parameters()) == adapter_class(family).vae_params


def test_the_vae_encode_peak_is_a_chunks_not_the_clips(tiny):
    """AutoencoderKLWan encodes the first frame, then 4 frames at a time with a feature cache: a clip of 81 frames
    peaks little above one of 9 (the latents it concatenates), though it is 9 times the pixels."""
    config = vae_config(_cfg(tiny["wan"]))
    nine, long = (clip_peak("wan", config, torch.bfloat16, "encode", 64, 64, f) for f in (9, 81))
    assert 0 < nine < long < 1.2 * nine


@pytest.mark.parametrize("kind", ["encode", "decode"])
def test_the_count_runs_each_op_once_per_layout_and_counts_what_running_every_op_counts(kind):
    """`_LiveBytes` on meta tensors runs an op that makes new tensors once per layout of its arguments and remakes
    its outputs after (the chunks repeat their ops): the peak is the one it counts running every op (the cache
    off), and the later chunks of a 13-frame clip reuse ops. HunyuanVideo 1.5's chunked VAE and Wan's, tiny."""
    import json

    from trainer.planner import meta_ops

    for family, config in (("hunyuan-video-1.5", {"latent_channels": 4, "block_out_channels": [8, 8, 16, 16, 16],
                                                  "layers_per_block": 1}),
                           ("wan", {"base_dim": 8, "z_dim": 4, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1,
                                    "temperal_downsample": [False, True, True]})):
        vae = _meta_vae(family, json.dumps(config, sort_keys=True), torch.float32)
        z, s, t = adapter_class(family).vae_latent_geometry(vae.config)
        x = (torch.empty(1, 3, 13, 32, 32, device="meta") if kind == "encode"
             else torch.empty(1, z, 12 // t + 1, 32 // s, 32 // s, device="meta"))
        peaks = []
        for cached in (True, False):
            mode = _LiveBytes()
            if not cached:
                mode._run = lambda func, args, kwargs: func(*args, **kwargs)
            with torch.no_grad(), adapter_class(family).vae_time_chunks(vae), mode:
                out = vae.encode(x).latent_dist.mode() if kind == "encode" else vae.decode(x).sample
                del out
            peaks.append(mode.peak)
            if cached:
                assert mode.reused > 0, family
        assert peaks[0] == peaks[1] > 0, (family, peaks)
    assert meta_ops._key([torch.empty(2, 3, device="meta"), 1]) == ("list", ("T", (2, 3), (3, 1), torch.float32, 0), 1)
    with pytest.raises(meta_ops._Uncached):  # a real tensor is never a key: the cache is for meta tensors only
        meta_ops._key(torch.empty(2))


def test_the_tiled_decode_model_is_diffusers_tiling(tiny):
    """Sampling during training decodes frames above 512x512 tiled: the planner counts one tile and adds the tiles'
    outputs as AutoencoderKLWan.tiled_decode keeps them; running every tile on meta gives the same peak (within 5 %:
    a tile at the edge is counted at its share of a full tile's working set)."""
    import json

    config = vae_config(_cfg(tiny["wan"]))
    key = json.dumps(config, sort_keys=True)
    width, height, frames = 448, 320, 5
    vae = _meta_vae("wan", key, torch.bfloat16)
    z = torch.empty(1, vae.config.z_dim, 2, height // 8, width // 8, device="meta", dtype=torch.bfloat16)
    vae.enable_tiling()
    try:
        mode = _LiveBytes()
        with torch.no_grad(), mode:
            out = vae.decode(z).sample
            del out
    finally:
        vae.disable_tiling()
    model = _tiled_peak("wan", key, torch.bfloat16, "decode", width, height, frames)
    assert model == pytest.approx(mode.peak, rel=0.05)
    assert clip_peak("wan", config, torch.bfloat16, "decode", width, height, frames, tiled=True) == model


def test_the_phases_count_the_clip_and_the_sampled_frames(tiny):
    """Latent caching encodes the bucket's clip (and holds the batch of clips on the GPU); the sampling phase
    denoises and decodes sample.frames frames; `dittrain plan` shows the clip's tokens."""
    cfg = _cfg(tiny["wan"])
    facts = analyze(cfg)
    phases = {p.name: p for p in predict_phases(cfg, 1.0, facts)}
    assert phases["latent caching"].note == "64x80x9 clips, untiled" and "64x80x9 clips" in phases["training step"].note
    batch = {p.name: p for p in predict_phases(cfg.model_copy(update={"data": cfg.data.model_copy(
        update={"encode_batch_size": 8})}), 1.0, facts)}
    assert batch["latent caching"].vram - phases["latent caching"].vram == pytest.approx(4 * 3 * 9 * 64 * 80 * 2)
    one = cfg.model_copy(update={"sample": cfg.sample.model_copy(update={"frames": 1})})
    still = {p.name: p for p in predict_phases(one, 1.0, facts)}
    assert still["sampling"].vram < phases["sampling"].vram and "64x64x9" in phases["sampling"].note
    lines, _ = report(cfg, facts=facts)
    text = "\n".join(lines)
    assert f"{facts.tokens(72)}+{facts.text_tokens}" in text and "72 px (64x80x9)" in text


def test_hunyuan_video15_tiles_by_its_overlap_factor():
    """AutoencoderKLHunyuanVideo15 has no `tile_sample_stride_*`: its tiles step by `tile_overlap_factor`; the family's
    `vae_tiles` gives the steps its `tiled_decode` takes (192 px: 12 latent pixels of 16), and the planner's tiled
    decode runs on them (it read `tile_sample_stride_*` before, which this VAE lacks)."""
    import json

    cls = adapter_class("hunyuan-video-1.5")
    vae = _meta_vae("hunyuan-video-1.5", json.dumps(cls.full_vae_config, sort_keys=True), torch.bfloat16)
    assert not hasattr(vae, "tile_sample_stride_height") and vae.tile_overlap_factor == 0.25
    th, tw, sh, sw = cls.vae_tiles(vae)
    assert (th, tw) == (256, 256) and sh == sw == int(vae.tile_latent_min_height * (1 - vae.tile_overlap_factor)) * 16
    assert (sh, sw) == (192, 192)
    key = json.dumps(cls.full_vae_config, sort_keys=True)
    assert _tiled_peak("hunyuan-video-1.5", key, torch.bfloat16, "decode", 480, 320, 5) > 0


def test_experts_parked_on_disk_count_one_experts_blocks_in_ram_and_a_read_per_switch(tmp_path):
    """model.expert: both (Wan 2.2 A14B, fp8 base, 720p x 81, every block streamed): offload.park: ram pins both
    experts' blocks; disk one expert's arena, the idle one's blocks read back from its files at each switch
    (`DISK_READ`), half a switch per step; auto picks disk exactly where the whole run's predicted RAM peak with
    the idle expert in RAM exceeds the host RAM it plans for (offload.host_ram_gb) and the peak on disk does not."""
    from dataclasses import replace

    from trainer.planner.phases import predict_phases, run_ram_peaks
    from trainer.planner.prediction import DISK_READ, HOST_BASE, predict
    from trainer.planner.timing import reference_rates, transfer_seconds

    cfg = Config.model_validate({
        "model": {"family": "wan2.2-a14b", "path": "/nonexistent", "dtype": "bf16", "expert": "both",
                  "quantize": "fp8"},
        "train": {"method": "lora", "gradient_checkpointing": True},
        "data": {"sources": [{"path": "/tmp"}], "resolutions": ["720p"], "clip_frames": 81},
        "offload": {"transformer": 1.0, "activations": True, "park": "ram"},
        "output": {"dir": "/tmp/out"},
    })
    facts = analyze(cfg)
    assert facts.experts == 2 and facts.park == "ram"
    blocks = sum(facts.packed)
    ram = predict(facts, 1.0, 960, True)
    disk = predict(replace(facts, park="disk"), 1.0, 960, True)
    assert (ram.park, disk.park) == ("ram", "disk")
    assert ram.pinned == 2 * blocks and disk.pinned == blocks  # every block streams: the arena is one expert's
    # on disk the idle expert holds neither its blocks nor its frozen embedders (read back at a switch)
    assert ram.ram_peak - disk.ram_peak == pytest.approx(blocks + facts.nonblock_bytes)
    # a switch reads the blocks as the files hold them: a bf16 folder's (quantized to fp8 as read), twice the packed,
    # and the embedders; it copies the incoming ring and resident part in, the outgoing LoRA and state out
    read = facts.block_file_bytes
    assert read == pytest.approx(2 * blocks, rel=0.05)
    rates = reference_rates()
    lora = facts.trainable_params * 4 + facts.state_gpu  # the LoRA's fp32 weights and AdamW state
    incoming = ram.ring + facts.nonblock_bytes + lora
    assert ram.switch_s == pytest.approx(transfer_seconds(incoming, incoming - ram.ring, rates))
    assert disk.switch_s == pytest.approx(transfer_seconds(incoming, incoming - ram.ring - facts.nonblock_bytes, rates)
                                          + (read + facts.nonblock_bytes) / DISK_READ)
    assert lora > 0 and disk.step_s - ram.step_s == pytest.approx((read + facts.nonblock_bytes) / DISK_READ / 2,
                                                                   rel=1e-3)
    # an fp8 single file under quantize fp8 is read as it is packed (its bytes adopted)
    from safetensors.torch import save_file

    from trainer.planner.prediction import _block_file_bytes

    fp8 = tmp_path / "fp8.safetensors"
    save_file({"w": torch.zeros(4, 4).to(torch.float8_e4m3fn)}, str(fp8))
    with_file = cfg.model_copy(update={"model": cfg.model.model_copy(update={"transformer_file": fp8})})
    assert _block_file_bytes(with_file, facts.blocks) is None
    assert predict(replace(facts, park="disk", block_file_bytes=None), 1.0, 960, True).switch_s == pytest.approx(
        disk.switch_s - (read - blocks) / DISK_READ)
    # outside the training step (load, sampling, checkpoint save) no offloaded activations are held: the trainer
    # gives their buffers back before sampling and saving (trainer/offload/activations.py `release`)
    phases = {ph.name: ph.ram for ph in predict_phases(cfg, 1.0, replace(facts, park="disk"))}
    between = disk.ram_peak - disk.act_checkpoint_host
    assert phases["training step"] == disk.ram_peak and phases["load"] == between
    assert phases["checkpoint save"] == pytest.approx(between + facts.trainable_params * 4 + facts.state_gpu)
    assert max(phases.values()) == disk.ram_peak  # at 720p x 81 the step is the run's RAM peak
    # auto: disk exactly where the whole run's RAM peak (its largest phase, the offloaded activations included)
    # with the idle expert in RAM exceeds the host RAM planned for and the peak with it on disk does not
    peaks = run_ram_peaks(cfg, 1.0, facts)
    assert peaks == {m: max(ph.ram for ph in predict_phases(cfg, 1.0, replace(facts, park=m))) for m in peaks}
    assert peaks["ram"] >= ram.ram_peak and peaks["disk"] >= disk.ram_peak and peaks["disk"] < peaks["ram"]
    assert ram.act_checkpoint_host > 10e9  # 720p x 81: the activations weigh as much as the blocks
    over = replace(facts, park="auto", host_ram=peaks["ram"] - 1)
    under = replace(facts, park="auto", host_ram=peaks["ram"])
    neither = replace(facts, park="auto", host_ram=peaks["disk"] - 1)  # disk would not fit either: ram
    assert predict(over, 1.0, 960, True).park == "disk" and predict(under, 1.0, 960, True).park == "ram"
    assert predict(neither, 1.0, 960, True).park == "ram"
    # both experts' blocks and the process fit this RAM (the rule before: ram), the run with its activations not
    blocks_fit = replace(facts, park="auto", host_ram=peaks["disk"])
    assert 2 * blocks + HOST_BASE < blocks_fit.host_ram < peaks["ram"] and blocks_fit.parks_on_disk_at(1.0)
    assert not replace(over, loads_whole=True).parks_on_disk_at(1.0)  # nothing to read the blocks back from
    assert cfg.offload.host_ram_gb is None and analyze(cfg.model_copy(update={"offload": cfg.offload.model_copy(
        update={"host_ram_gb": 40.0, "park": "auto"})})).host_ram == 40e9
    # `dittrain plan` says both modes' RAM and switch, and which one auto takes
    from trainer.planner.report import _experts

    (line,) = [x for x in _experts(cfg, over, 1.0, True, reference_rates()) if x]
    assert f"offload.park: auto -> disk (the {over.host_ram / 1e9:.1f} GB of offload.host_ram_gb)" in line
    assert f"ram: RAM peak {peaks['ram'] / 1e9:.1f} GB (largest phase)" in line
    assert f"disk: RAM peak {peaks['disk'] / 1e9:.1f} GB (largest phase), a switch {disk.switch_s:.1f} s" in line
