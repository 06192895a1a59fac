"""LTX-2 text-to-video (`ltx2`) and image-to-video (`ltx2-i2v`), issue 45, on the tiny model built here, with tiny videos written by PyAV as for Wan
(tests/test_wan.py): the text (Gemma's stacked states through the connectors), the latents and the transformer call
as LTX2Pipeline makes them, video-only training (the prediction independent of the audio stream), a LoRA `dittrain
fit` on a video and a still whose file `LTX2Pipeline.load_lora_weights` loads, `dittrain sample` writing an mp4
whose frames are pixel-identical to diffusers' pipeline with the same seed, guidance and LoRA (resident and
streamed), streamed training equal to resident, the full-size facts (the released config, the planner's VAE); for
image-to-video the first latent frame and per-token timesteps as LTX2ImageToVideoPipeline makes them, and a fit on
the clip whose `sample --image` is pixel-identical to that pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import _family_checks as checks
import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from test_train_support import pixels, write_images
from test_wan import _frames, write_clip_and_still
from typer.testing import CliRunner

from trainer.cli import app
from trainer.config import Config
from trainer.data.video import probe_video
from trainer.models import adapter_class
from trainer.sample import SampleRequest, run_sample
from trainer.sampling.output import frame_sheet

FAMILY, I2V = "ltx2", "ltx2-i2v"
PROMPT = "a green square moving right"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A root holding only this family's tiny folder (the session's `tiny_models` writes every family)."""
    from trainer.models.tiny import make_tiny_models

    root = tmp_path_factory.mktemp("tiny-ltx2")
    make_tiny_models(root, [FAMILY, I2V])
    return root


@pytest.fixture(scope="module")
def loaded(models):
    return checks.tiny_pipeline(FAMILY, models / FAMILY)


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> Path:
    """A 9-frame (8k + 1) 24 fps mp4 and a still, captioned."""
    return write_clip_and_still(tmp_path_factory.mktemp("ltx2-data"), 9, 24, PROMPT)


def config_dict(model: Path, data: Path, tmp: Path, steps: int = 3, sample_every: int = 3, **model_extra) -> dict:
    """A tiny LTX-2 LoRA run on the clips in `data` (also tests/test_ltx2_audio.py's)."""
    return {
        "model": {"family": FAMILY, "path": str(model), "dtype": "fp32", **model_extra},
        "train": {"method": "lora", "steps": steps, "batch_size": 1, "seed": 0, "checkpoint_every": 0, "device": "cpu",
                  "timestep_sampling": "uniform"},
        "lora": {"rank": 4, "alpha": 4},
        "optimizer": {"lr": 5e-2},
        "data": {"sources": [{"path": str(data)}], "resolutions": [64], "cache_dir": str(tmp / "cache"),
                 "clip_frames": 9, "clips": "first"},
        "sample": {"prompts": [PROMPT], "steps": 2, "width": 64, "height": 64, "frames": 9, "guidance": 3.0,
                   "seed": 3, "every": sample_every},
        "output": {"dir": str(tmp / "out"), "tensorboard": False},
    }


def _config(models: Path, data: Path, tmp: Path) -> Config:
    return Config.model_validate(config_dict(models / FAMILY, data, tmp))


# ---------------------------------------------------------------------------------------------- mirrors the pipeline


def test_full_size_is_the_released_ltx2_and_the_planner_counts_its_vae():
    """diffusers' defaults but `rope_type` are the release's (module essay); 18.9 B parameters in 48 blocks; the
    planner builds the family's VAE from its own config names (32x, 8x, 128 channels) and counts a clip's decode."""
    from diffusers import LTX2VideoTransformer3DModel

    from trainer.planner.vae import clip_peak

    cls = adapter_class(FAMILY)
    with torch.device("meta"):
        full = LTX2VideoTransformer3DModel.from_config(cls.full_config)
        default = LTX2VideoTransformer3DModel()
    assert {k for k in full.config if not k.startswith("_") and full.config[k] != default.config[k]} == {"rope_type"}
    assert sum(p.numel() for p in full.parameters()) == 18_876_174_592
    assert len(cls(None).blocks(full)) == 48
    assert cls.full_tokens(512, 768, 121) == 16 * 16 * 24  # the pipeline's 121 frames at its 768x512: 6144 tokens
    from types import SimpleNamespace

    geo = cls.vae_latent_geometry(SimpleNamespace(**cls.full_vae_config))
    assert geo == (128, 32, 8)
    small = clip_peak(FAMILY, cls.full_vae_config, torch.bfloat16, "decode", 256, 256, 9)
    assert clip_peak(FAMILY, cls.full_vae_config, torch.bfloat16, "decode", 256, 256, 17) > small > 0


def test_text_latents_and_predict_as_the_pipeline_does(loaded):
    """The cached text is the connectors' output on the pipeline's own Gemma states (all 1024 rows valid: the
    registers fill the padding; Gemma loaded without its vision tower); latents are normalised as the pipeline denormalises; `predict` equals the
    pipeline's transformer call with the cross-modal attention off, and does not depend on the audio stream."""
    from diffusers import LTX2Pipeline

    adapter, comps, pipe = loaded
    prompts = [PROMPT, "a dog"]
    text = adapter.encode_prompts(comps, prompts)
    pe, pm, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device="cpu")
    video, _audio, mask = pipe.connectors(pe, pm, padding_side=pipe.tokenizer.padding_side)
    assert torch.equal(text["prompt_embeds"], video) and torch.equal(text["prompt_attention_mask"], mask)
    assert text["prompt_embeds"].shape == (2, 1024, 32) and mask.sum(1).tolist() == [1024, 1024]
    assert comps.text_encoders[0].model.vision_tower is None  # slimmed: captions never reach it
    assert pm.sum(1).tolist()[0] > pm.sum(1).tolist()[1] > 0 and not pm[:, 0].any()  # left-padded
    px = torch.rand(1, 3, 9, 64, 32) * 2 - 1
    with torch.no_grad():
        lat = adapter.encode_videos(comps.vae, px)
        assert lat.shape == (1, 4, 2, 2, 1)
        back = LTX2Pipeline._denormalize_latents(lat, comps.vae.latents_mean, comps.vae.latents_std,
                                                 comps.vae.config.scaling_factor)
        torch.testing.assert_close(back, comps.vae.encode(px).latent_dist.mode(), rtol=0, atol=1e-6)
    seen = []
    h = comps.transformer.register_forward_hook(lambda _m, _a, kw, out: seen.append((kw, out[0])), with_kwargs=True)
    try:
        pipe(prompt=PROMPT, height=64, width=64, num_frames=9, num_inference_steps=2, output_type="latent",
             generator=torch.Generator().manual_seed(0))
    finally:
        h.remove()
    assert len(seen) == 6  # 2 steps x (CFG batch, spatio-temporal guidance, modality guidance)
    ours = adapter.encode_prompts(comps, [PROMPT])
    for kw, _ in seen[::3]:
        assert kw["fps"] == 24.0 and (kw["num_frames"], kw["height"], kw["width"]) == (2, 2, 2)
        one = {k: (v[1:2] if isinstance(v, torch.Tensor) and v.shape[:1] == (2,) else v) for k, v in kw.items()}
        with torch.no_grad():
            want = comps.transformer(**{**one, "isolate_modalities": True})[0]
            noisy = one["hidden_states"].reshape(1, 2, 2, 2, 4).permute(0, 4, 1, 2, 3)
            got = adapter.predict(comps.transformer, noisy, one["timestep"] / 1000, ours)
            other = comps.transformer(**{**one, "isolate_modalities": True,
                                         "audio_hidden_states": torch.randn_like(one["audio_hidden_states"])})[0]
        assert torch.equal(got, want.reshape(1, 2, 2, 2, 4).permute(0, 4, 1, 2, 3))
        assert torch.equal(other, want)  # the video stream does not see the audio one
    assert [kw["timestep"][0].item() for kw, _ in seen[::3]][0] == 1000.0


# ---------------------------------------------------------------------------------------------- fit and sample


@pytest.fixture(scope="module")
def fitted(models, videos, tmp_path_factory):
    """`dittrain fit` of a LoRA YAML config on the clip and the still (its last step samples: a frame sheet)."""
    tmp = tmp_path_factory.mktemp("ltx2-fit")
    cfg = _config(models, videos, tmp)
    path = tmp / "fit.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=True)))
    r = CliRunner().invoke(app, ["fit", str(path)])
    assert r.exit_code == 0, r.output
    return cfg, tmp / "out"


def test_fit_trains_a_video_lora_that_the_pipeline_loads(fitted):
    """Three finite losses, the step-3 sample sheet (9 frames), latents cached through the LTX-2 VAE at (C, 2, 2, 2)
    for the clip, and a file `LTX2Pipeline.load_lora_weights` loads into both streams and the attention between them
    (the default targets while model.audio is on; these clips have no sound, tests/test_ltx2_audio.py trains it)."""
    from diffusers import LTX2Pipeline

    cfg, out = fitted
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and all(np.isfinite(x["loss"]) for x in lines)
    assert Image.open(out / "samples" / "step-000003-0.png").size == (3 * 64 + 4 * 4, 3 * 64 + 4 * 4)
    shapes = set()
    for f in Path(cfg.data.cache_dir).rglob("*.safetensors"):
        from safetensors.torch import load_file

        shapes |= {tuple(v.shape) for k, v in load_file(f).items() if k.endswith("latent")}
    assert (4, 2, 2, 2) in shapes and (4, 1, 2, 2) in shapes, shapes  # the clip and the still
    pipe = LTX2Pipeline.from_pretrained(str(cfg.model.path), local_files_only=True)
    pipe.load_lora_weights(str(out / "lora.safetensors"))
    names = {k.split(".lora_A.")[0] for k in pipe.transformer.state_dict() if ".lora_A." in k}
    block = {n.split(".", 2)[-1] for n in names if n.startswith("transformer_blocks.1.")}
    attns = ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
    assert block == {f"{a}.{m}" for a in attns for m in ("to_q", "to_k", "to_v", "to_out.0")} | {
        "ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2"}


def _pipeline_frames(cfg: Config, lora: Path, weight: float, seed: int) -> list[Image.Image]:
    """The reference: diffusers' own LTX2Pipeline from the folder, the LoRA through `load_lora_weights` at `weight`,
    called from the prompt at the pipeline's defaults but the sample's size, frames, steps and guidance."""
    from diffusers import LTX2Pipeline

    from trainer.models._diffusers import own_aligned_memory

    pipe = LTX2Pipeline.from_pretrained(str(cfg.model.path), torch_dtype=torch.float32, local_files_only=True)
    own_aligned_memory(pipe.transformer)  # as our loader does: same memory alignment, same CPU rounding
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora), adapter_name="x")
    pipe.set_adapters(["x"], adapter_weights=[weight])
    s = cfg.sample
    return pipe(prompt=PROMPT, height=s.height, width=s.width, num_frames=s.frames, num_inference_steps=s.steps,
                guidance_scale=s.guidance, generator=torch.Generator().manual_seed(seed), output_type="pil").frames[0]


def test_sample_writes_an_mp4_and_frames_pixel_identical_to_the_pipeline(fitted, tmp_path):
    """Guidance 3 (with the pipeline's audio guidance, STG and modality passes), the fitted LoRA at 0.7; then every
    block streamed; the mp4 is written at the pipeline's 24 fps."""
    cfg, out = fitted
    lora = out / "lora.safetensors"
    plain = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, out=tmp_path / "plain"))
    mp4, sheet = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, loras=[f"{lora}:0.7"], out=tmp_path / "l"))
    assert mp4.suffix == ".mp4" and Image.open(sheet).text["frames"] == "9"
    want = _pipeline_frames(cfg, lora, 0.7, seed=3)
    assert len(want) == 9
    np.testing.assert_array_equal(pixels(sheet), np.asarray(frame_sheet(want)))
    assert (pixels(sheet) != pixels(plain[1])).mean() > 0.05, "the trained LoRA must change the video"
    streamed = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, loras=[f"{lora}:0.7"], offload=1.0,
                                             out=tmp_path / "streamed"))
    np.testing.assert_array_equal(pixels(streamed[1]), pixels(sheet))
    assert probe_video(mp4, None) == (64, 64, 9)
    import av

    with av.open(str(mp4)) as f:
        assert float(f.streams.video[0].average_rate) == 24.0


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("ltx2-images"))


@pytest.mark.parametrize("method, fraction", [("lora", 1.0), ("lora", 0.5), ("full", 1.0)])
def test_streamed_training_equals_resident(models, images, tmp_path, monkeypatch, method, fraction):
    """Stills (1-frame clips) through the conductor's CPU path, fp32: bitwise the resident losses (LoRA with every
    block or half of them streamed; a full fine-tune of every weight, streamed)."""
    checks.streamed_training_equals_resident(FAMILY, models, images, tmp_path, monkeypatch, method, fraction)


# ---------------------------------------------------------------------------------------------- image-to-video


def test_i2v_replaces_the_first_latent_frame_as_the_pipeline_does(models):
    """The pipeline's first latent frame is the image's (encoded alone: `encode_conditions`, with its CRF
    re-compression off), its tokens at timestep 0; `predict` on any first frame gives the pipeline's transformer
    output (cross-modal attention off, as in text-to-video); the first frame is out of the loss."""
    adapter, comps, pipe = checks.tiny_pipeline(I2V, models / I2V)
    assert type(pipe).__name__ == "LTX2ImageToVideoPipeline"
    arr = (np.random.RandomState(1).rand(64, 64, 3) * 255).astype(np.uint8)
    seen = []
    h = comps.transformer.register_forward_hook(lambda _m, _a, kw, out: seen.append((kw, out[0])), with_kwargs=True)
    try:
        pipe(prompt=PROMPT, image=Image.fromarray(arr), image_crf=0, height=64, width=64, num_frames=17,
             num_inference_steps=2, output_type="latent", generator=torch.Generator().manual_seed(0))
    finally:
        h.remove()
    kw, out = seen[0]
    one = {k: (v[1:2] if isinstance(v, torch.Tensor) and v.shape[:1] == (2,) else v) for k, v in kw.items()}
    ts = one["timestep"]
    assert ts.shape == (1, 12) and ts[0, :4].eq(0).all() and ts[0, 4:].eq(1000).all()  # 3 latent frames of 2x2
    x = one["hidden_states"].reshape(1, 3, 2, 2, 4).permute(0, 4, 1, 2, 3)
    px = (torch.from_numpy(arr).float().permute(2, 0, 1) / 255 * 2 - 1)[None, :, None].repeat(1, 1, 17, 1, 1)
    with torch.no_grad():
        cond = adapter.encode_conditions(comps.vae, px)
        torch.testing.assert_close(cond["image_latents"], x[:, :, :1], rtol=0, atol=1e-6)
        text = {**adapter.encode_prompts(comps, [PROMPT]), "image_latents": x[:, :, :1]}
        noisy = torch.cat([torch.randn_like(x[:, :, :1]), x[:, :, 1:]], dim=2)  # frame 0 is replaced, whatever it is
        got = adapter.predict(comps.transformer, noisy, ts[:, -1] / 1000, text)
        want = comps.transformer(**{**one, "isolate_modalities": True})[0]
    assert torch.equal(got, want.reshape(1, 3, 2, 2, 4).permute(0, 4, 1, 2, 3))
    assert adapter.frame_loss_weights(3).tolist() == [0.0, 1.0, 1.0]


def test_i2v_fit_and_sample_with_image_are_pixel_identical_to_the_pipeline(models, videos, tmp_path):
    """A LoRA fit on the clip (its first frame conditions, left out of the loss), then `sample` with the image:
    the frames of LTX2ImageToVideoPipeline with the same image, seed and LoRA."""
    from diffusers import LTX2ImageToVideoPipeline

    from trainer.models._diffusers import own_aligned_memory

    _frames(1)[0].save(tmp_path / "first.png")
    base = _config(models, videos, tmp_path).model_dump(mode="json", exclude_unset=True)
    base["model"]["path"] = str(models / I2V)
    base["model"]["family"] = I2V
    base["train"]["steps"] = 2
    base["sample"] |= {"image": str(tmp_path / "first.png"), "every": 0}
    cfg = Config.model_validate(base)
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(base))
    r = CliRunner().invoke(app, ["fit", str(path)])
    assert r.exit_code == 0, r.output
    lora = tmp_path / "out" / "lora.safetensors"
    _, sheet = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, loras=[str(lora)], out=tmp_path / "s"))
    pipe = LTX2ImageToVideoPipeline.from_pretrained(str(models / I2V), torch_dtype=torch.float32,
                                                    local_files_only=True)
    own_aligned_memory(pipe.transformer)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora))
    s = cfg.sample
    want = pipe(image=Image.open(tmp_path / "first.png").convert("RGB"), prompt=PROMPT, height=s.height,
                width=s.width, num_frames=s.frames, num_inference_steps=s.steps, guidance_scale=s.guidance,
                generator=torch.Generator().manual_seed(3), output_type="pil").frames[0]
    np.testing.assert_array_equal(pixels(sheet), np.asarray(frame_sheet(want)))


def test_comfy_layout_names_are_the_originals_diffusers_converter_reads(fitted, tmp_path):
    """The comfy file's module names (`diffusion_model.<original>`) are LTX-2's original ones: diffusers' own
    converter for original-layout LTX-2 LoRAs (`_convert_non_diffusers_ltx2_lora_to_diffusers`, which reads them as
    lora_A / lora_B) maps them onto the modules the diffusers file adapts, with the same update; and the comfy file
    converts back to the diffusers one."""
    from diffusers import LTX2Pipeline
    from safetensors.torch import load_file, save_file

    cfg, out = fitted
    lora, comfy, back = out / "lora.safetensors", tmp_path / "comfy.safetensors", tmp_path / "back.safetensors"
    for src, dst, fmt in ((lora, comfy, "comfy"), (comfy, back, "diffusers")):
        r = CliRunner().invoke(app, ["convert-lora", str(src), str(dst), "--to", fmt])
        assert r.exit_code == 0, r.output
    sd = load_file(comfy)
    assert "diffusion_model.transformer_blocks.1.attn1.to_q.lora_down.weight" in sd
    as_ab = {}  # the same update in the lora_A / lora_B names diffusers' converter takes (alpha folded into B)
    for k, v in sd.items():
        if k.endswith(".lora_up.weight"):
            m = k.removesuffix(".lora_up.weight")
            as_ab[m + ".lora_B.weight"] = v * (sd[m + ".alpha"] / v.shape[1])
            as_ab[m + ".lora_A.weight"] = sd[m + ".lora_down.weight"]
    save_file(as_ab, tmp_path / "ab.safetensors")
    got = []
    for f in (lora, tmp_path / "ab.safetensors", back):
        pipe = LTX2Pipeline.from_pretrained(str(cfg.model.path), local_files_only=True)
        pipe.load_lora_weights(str(f), adapter_name="x")
        tr = pipe.transformer
        got.append({n: m.get_delta_weight("x") for n, m in tr.named_modules() if hasattr(m, "get_delta_weight")})
    assert got[0].keys() == got[1].keys() == got[2].keys() and len(got[0]) == 2 * 28
    for n in got[0]:
        torch.testing.assert_close(got[1][n], got[0][n], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got[2][n], got[0][n], rtol=0, atol=0)


def test_clips_are_read_at_the_rate_the_model_is_told(models, videos, tmp_path):
    """data.fps unset reads LTX-2's 24 fps; another rate (or null, as stored) is refused in one line, since the
    transformer's positions assume 24 fps."""
    base = _config(models, videos, tmp_path).model_dump(mode="json", exclude_unset=True)
    base["data"].pop("fps")  # the validator set the family's (as it sets bucket_step)
    assert Config.model_validate(base).data.fps == 24.0
    for fps in (16, None):
        with pytest.raises(ValueError, match="ltx2 is told 24 fps"):
            Config.model_validate({**base, "data": {**base["data"], "fps": fps}})
    assert Config.model_validate({**base, "data": {**base["data"], "fps": 24}}).data.fps == 24.0


def test_tiled_decode_leaves_no_one_row_tile(models):
    """`fit`'s sampling at the 16 GB preset (832x480, tiled) failed in diffusers' tiled decode: 15 latent rows in
    tiles of 16 every 14 leave a one-row tile that the VAE's reflect-padded convs refuse (bench/history/2026-11-28.md).
    `tile_decode` keeps one tile where a dimension fits one, and fixes the strides afresh for each size."""
    from diffusers import AutoencoderKLLTX2Video

    from trainer.sampling.placement import tile_decode

    vae = AutoencoderKLLTX2Video.from_pretrained(models / FAMILY, subfolder="vae").eval()
    z = torch.randn(1, vae.config.latent_channels, 2, 15, 26, generator=torch.Generator().manual_seed(0))
    vae.enable_tiling()
    with pytest.raises(RuntimeError, match="Padding size"):  # diffusers' own tiles
        vae.decode(z, return_dict=False)
    assert tile_decode(vae, 480, 832)
    assert vae.tile_sample_stride_height == vae.tile_sample_min_height  # 15 rows: one tile
    assert vae.tile_sample_stride_width == 448  # 26 columns: diffusers' tiles, the last one 12 wide
    with torch.no_grad():
        video = vae.decode(z, return_dict=False)[0]
    assert video.shape[-2:] == (480, 832) and torch.isfinite(video).all()
    assert tile_decode(vae, 32 * 29, 832)  # 29 rows: tiles at 0, 14, 28 would leave one row; the stride shrinks
    n, stride = 29, vae.tile_sample_stride_height // 32
    assert stride < 14 and n - (n - 1) // stride * stride >= 2
    assert tile_decode(vae, 32 * 40, 832) and vae.tile_sample_stride_height == 448  # from diffusers' strides again
