"""Wan image-to-video (issue 39): Wan 2.1 I2V (`wan-i2v`: first-frame latents and a CLIP image embedding) and Wan 2.2
I2V A14B (`wan2.2-a14b-i2v`: first-frame latents, two experts), on tiny models built here. The conditioning the
clip's first frame gets in training is the pipeline's own (its transformer call, captured), a fit trains a LoRA
that WanImageToVideoPipeline loads, and `dittrain sample --image` is pixel-identical to the pipeline."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from test_train_support import pixels
from test_wan import PROMPT, _frames
from typer.testing import CliRunner

from trainer.cli import app
from trainer.config import Config, ModelConfig
from trainer.data.video import write_video
from trainer.errors import UserError
from trainer.models import get_adapter
from trainer.sample import SampleRequest, run_sample
from trainer.sampling.output import frame_sheet

FAMILIES = ("wan-i2v", "wan2.2-a14b-i2v")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from trainer.models.tiny import make_tiny_models

    root = tmp_path_factory.mktemp("tiny-wan-i2v")
    return dict(zip(FAMILIES, make_tiny_models(root, list(FAMILIES)), strict=True))


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("wan-i2v-data")
    frames = [f.resize((32, 32)) for f in _frames(9)]
    write_video(frames, d / "clip.mp4", 16)
    (d / "clip.txt").write_text(PROMPT)
    frames[0].save(d.parent / "first.png")  # the sample's --image, outside the data
    return d


def _config(family: str, model: Path, data: Path, tmp: Path, **model_kw) -> Config:
    return Config.model_validate({
        "model": {"family": family, "path": str(model), "dtype": "fp32", **model_kw},
        "train": {"method": "lora", "steps": 2, "batch_size": 1, "seed": 0, "checkpoint_every": 0, "device": "cpu"},
        "lora": {"rank": 4, "alpha": 4},
        "optimizer": {"lr": 5e-2},
        "data": {"sources": [{"path": str(data)}], "resolutions": [32], "cache_dir": str(tmp / "cache"),
                 "clip_frames": 5, "clips": "first"},
        "sample": {"prompts": [PROMPT], "steps": 2, "width": 32, "height": 32, "frames": 5, "guidance": 5.0,
                   "seed": 3, "image": str(data.parent / "first.png"), "every": 2},
        "output": {"dir": str(tmp / "out"), "tensorboard": False},
    })


@pytest.mark.parametrize("family", FAMILIES)
def test_the_first_frame_conditions_predict_as_the_pipeline_does(models, family):
    mc = ModelConfig(family=family, path=models[family], dtype="fp32",
                     expert="high_noise" if "a14b" in family else None)
    adapter = get_adapter(mc)
    comps = adapter.load(mc, parts={"transformer", "experts", "vae", "text", "scheduler"}, dtype=torch.float32)
    pipe = adapter.pipeline(comps)
    assert type(pipe).__name__ == "WanImageToVideoPipeline" and (pipe.image_encoder is not None) == (family == "wan-i2v")
    arr = (np.random.RandomState(0).rand(32, 32, 3) * 255).astype(np.uint8)
    seen = {}

    def hook(_m, _args, kw, out):
        seen.setdefault("call", (kw, out[0]))

    h = comps.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        pipe(**adapter.pipeline_embeds(pipe, PROMPT, None, "cpu"), image=Image.fromarray(arr), height=32, width=32,
             num_frames=5, num_inference_steps=2, guidance_scale=1.0, output_type="latent",
             generator=torch.Generator().manual_seed(0))
    finally:
        h.remove()
    kw, out = seen["call"]
    # the clip's first frame (every frame the same here) gives the pipeline's condition channels and CLIP tokens
    px = (torch.from_numpy(arr).float().permute(2, 0, 1) / 255 * 2 - 1)[None, :, None].repeat(1, 1, 5, 1, 1)
    cond = adapter.encode_conditions(comps.vae, px)
    x = kw["hidden_states"]
    assert x.shape == (1, 12, 2, 4, 4)
    torch.testing.assert_close(cond["image_latents"], x[:, 8:], rtol=0, atol=1e-6)  # 1/std vs / std
    assert x[:, 4:8, 0].eq(1).all() and x[:, 4:8, 1:].eq(0).all()  # the mask: the first latent frame
    assert ("image_embeds" in cond) == (family == "wan-i2v")
    if "image_embeds" in cond:
        assert torch.equal(cond["image_embeds"], kw["encoder_hidden_states_image"])
    text = {**adapter.encode_prompts(comps, [PROMPT]), **cond}
    with torch.no_grad():
        got = adapter.predict(comps.transformer, x[:, :4], kw["timestep"].float() / 1000, text)
    torch.testing.assert_close(got, out, rtol=0, atol=1e-5)


def _fit(cfg: Config, tmp: Path) -> Path:
    path = tmp / "fit.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=True)))
    r = CliRunner().invoke(app, ["fit", str(path)])
    assert r.exit_code == 0, r.output
    return Path(cfg.output.dir)


def _pipeline_frames(cfg: Config, lora: Path, image: Image.Image, seed: int) -> list:
    """The reference: WanImageToVideoPipeline with the LoRA as diffusers loads it. The prompt goes in as WanPipeline
    encodes it (diffusers 0.42's I2V copy of that code needs ftfy, which is not installed here)."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    from trainer.models._diffusers import own_aligned_memory

    pipe = WanImageToVideoPipeline.from_pretrained(str(cfg.model.path), torch_dtype=torch.float32,
                                                   local_files_only=True)
    for tr in (pipe.transformer, pipe.transformer_2):
        if tr is not None:
            own_aligned_memory(tr)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora), load_into_transformer_2="low_noise" in lora.name)
    s = cfg.sample
    with torch.no_grad():  # as inside the pipeline's call (with grad, CPU attention takes another kernel)
        pe, npe = (WanPipeline._get_t5_prompt_embeds(pipe, prompt=p, max_sequence_length=512) for p in (PROMPT, ""))
    return pipe(image=image, prompt_embeds=pe, negative_prompt_embeds=npe, height=s.height, width=s.width,
                num_frames=s.frames, num_inference_steps=s.steps, guidance_scale=s.guidance,
                generator=torch.Generator().manual_seed(seed), output_type="pil").frames[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_fit_and_sample_with_image_are_pixel_identical_to_the_pipeline(models, clip, family, tmp_path):
    expert = {"expert": "low_noise"} if "a14b" in family else {}
    cfg = _config(family, models[family], clip, tmp_path, **expert)
    out = _fit(cfg, tmp_path)
    lora = out / ("lora-low_noise.safetensors" if expert else "lora.safetensors")
    assert lora.is_file() and (out / "samples" / "step-000002-0.png").is_file()  # sampled with the image
    _, sheet = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, loras=[str(lora)], out=tmp_path / "s"))
    image = Image.open(clip.parent / "first.png").convert("RGB")
    want = _pipeline_frames(cfg, lora, image, seed=3)
    np.testing.assert_array_equal(pixels(sheet), np.asarray(frame_sheet(want)))
    with pytest.raises(UserError, match="is image-to-video: pass --image"):
        run_sample(cfg.model_copy(update={"sample": cfg.sample.model_copy(update={"image": None})}),
                   SampleRequest(prompts=[PROMPT], out=tmp_path / "none"))


def test_the_comfy_key_map_places_the_image_cross_attention_where_diffusers_converter_takes_it():
    """Wan 2.1 I2V trains add_k_proj / add_v_proj (ComfyUI's k_img / v_img) too: checked with diffusers' own
    single-file converter run on row ids, as for Wan (tests/test_wan.py)."""
    from test_lora_format import (
        test_key_map_places_rows_where_diffusers_single_file_converter_takes_them as check,
    )

    check("wan-i2v")


def test_validation_scores_stills_with_their_first_frame_conditioning(models, tmp_path):
    """data.validation (stills only: videos are not taken there yet) hands the held-out entries' cached first-frame
    conditioning to predict, as the training batches do."""
    import json

    train, held = tmp_path / "train", tmp_path / "held"
    for d, k in ((train, 0), (held, 3)):
        d.mkdir()
        _frames(k + 1)[k].resize((32, 32)).save(d / "still.png")
        (d / "still.txt").write_text(PROMPT)
    cfg = _config("wan-i2v", models["wan-i2v"], train, tmp_path)
    cfg = Config.model_validate({**cfg.model_dump(mode="json", exclude_unset=True),
                                 "train": {**cfg.train.model_dump(mode="json", exclude_unset=True), "validate_every": 2},
                                 "data": {**cfg.data.model_dump(mode="json", exclude_unset=True),
                                          "validation": {"sources": [{"path": str(held)}], "timesteps": [0.5]}},
                                 "sample": {**cfg.sample.model_dump(mode="json", exclude_unset=True), "every": 0}})
    out = _fit(cfg, tmp_path)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(np.isfinite(x.get("val_loss", np.nan)) for x in lines)


# ---------------------------------------------------------------------------------------------- TI2V-5B, image-to-video

TI2V = "wan2.2-ti2v-5b-i2v"


@pytest.fixture(scope="module")
def ti2v(tmp_path_factory) -> Path:
    from trainer.models.tiny import make_tiny_models

    (folder,) = make_tiny_models(tmp_path_factory.mktemp("tiny-ti2v-i2v"), [TI2V])
    return folder


def test_ti2v_image_to_video_replaces_the_first_latent_frame_as_the_pipeline_does(ti2v):
    mc = ModelConfig(family=TI2V, path=ti2v, dtype="fp32")
    adapter = get_adapter(mc)
    comps = adapter.load(mc, parts={"transformer", "vae", "text", "scheduler"}, dtype=torch.float32)
    pipe = adapter.pipeline(comps)  # the TI2V folder (saved as WanPipeline) read as WanImageToVideoPipeline
    assert type(pipe).__name__ == "WanImageToVideoPipeline" and pipe.config.expand_timesteps
    arr = (np.random.RandomState(1).rand(64, 64, 3) * 255).astype(np.uint8)
    seen = {}

    def hook(_m, _args, kw, out):
        seen.setdefault("call", (kw, out[0]))

    h = comps.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        pipe(**adapter.pipeline_embeds(pipe, PROMPT, None, "cpu"), image=Image.fromarray(arr), height=64, width=64,
             num_frames=5, num_inference_steps=2, guidance_scale=1.0, output_type="latent",
             generator=torch.Generator().manual_seed(0))
    finally:
        h.remove()
    kw, out = seen["call"]
    x, ts = kw["hidden_states"], kw["timestep"]
    assert x.shape == (1, 8, 2, 4, 4) and ts.shape == (1, 8)
    assert ts[0, :4].eq(0).all() and ts[0, 4:].gt(0).all()  # the image's tokens at timestep 0
    px = (torch.from_numpy(arr).float().permute(2, 0, 1) / 255 * 2 - 1)[None, :, None].repeat(1, 1, 5, 1, 1)
    cond = adapter.encode_conditions(comps.vae, px)
    torch.testing.assert_close(cond["image_latents"], x[:, :, :1], rtol=0, atol=1e-6)
    text = {**adapter.encode_prompts(comps, [PROMPT]), **cond}
    noisy = torch.cat([torch.randn_like(x[:, :, :1]), x[:, :, 1:]], dim=2)  # whatever frame 0 holds, it is replaced
    with torch.no_grad():
        got = adapter.predict(comps.transformer, noisy, ts[:, -1].float() / 1000, text)
    torch.testing.assert_close(got, out, rtol=0, atol=1e-5)
    assert adapter.frame_loss_weights(3).tolist() == [0.0, 1.0, 1.0]


def test_ti2v_image_to_video_fit_leaves_the_first_frame_out_and_samples_as_the_pipeline(ti2v, clip, tmp_path):
    from diffusers import WanImageToVideoPipeline, WanPipeline

    from trainer.config import Config as C
    from trainer.data.pipeline import prepare_data

    cfg = _config(TI2V, ti2v, clip, tmp_path)
    batch = prepare_data(cfg, get_adapter(cfg.model), progress=False).next_batch()
    assert batch.mask is not None and batch.mask.shape == (1, 1, 2, 2, 2)  # (B, 1, F', h, w): frame 0 at 0
    assert batch.mask[0, 0].flatten(1).tolist() == [[0.0] * 4, [1.0] * 4]
    out = _fit(C.model_validate(cfg.model_dump(mode="json", exclude_unset=True)), tmp_path)
    lora = out / "lora.safetensors"
    _, sheet = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, loras=[str(lora)], out=tmp_path / "s"))
    pipe = WanImageToVideoPipeline.from_pretrained(str(ti2v), torch_dtype=torch.float32, local_files_only=True,
                                                   expand_timesteps=True)
    from trainer.models._diffusers import own_aligned_memory

    own_aligned_memory(pipe.transformer)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora))
    s = cfg.sample
    with torch.no_grad():
        pe, npe = (WanPipeline._get_t5_prompt_embeds(pipe, prompt=p, max_sequence_length=512) for p in (PROMPT, ""))
    want = pipe(image=Image.open(clip.parent / "first.png").convert("RGB"), prompt_embeds=pe, negative_prompt_embeds=npe,
                height=s.height, width=s.width, num_frames=s.frames, num_inference_steps=s.steps,
                guidance_scale=s.guidance, generator=torch.Generator().manual_seed(3), output_type="pil").frames[0]
    np.testing.assert_array_equal(pixels(sheet), np.asarray(frame_sheet(want)))
