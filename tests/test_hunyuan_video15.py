"""HunyuanVideo 1.5 text-to-video (`hunyuan-video-1.5`, issue 45) on the tiny model built here, with tiny videos
written by PyAV as for Wan (tests/test_wan.py): both text encoders (Qwen's template crop, the ByT5 glyph branch),
the latents and the transformer call as HunyuanVideo15Pipeline makes them, a LoRA `dittrain fit` on a video and a
still whose file diffusers loads (the modular pipeline's `load_lora_weights`, the transformer's
`load_lora_adapter`), `dittrain sample` writing an mp4 whose frames are pixel-identical to diffusers' pipeline with
the same seed, guidance and LoRA (resident and streamed) once its transformer attends through the same prefix form
(trainer/models/hunyuan_video15_attention.py; within one 8-bit level of its masked call), and streamed training
equal to resident."""

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
from test_wan import write_clip_and_still
from typer.testing import CliRunner

from trainer.cli import app
from trainer.config import Config
from trainer.data.video import probe_video, read_clip
from trainer.models import adapter_class
from trainer.sample import SampleRequest, run_sample
from trainer.sampling.output import frame_sheet

FAMILY = "hunyuan-video-1.5"
#: quoted text reaches the ByT5 glyph encoder
PROMPT = 'a green square moving right past a sign saying "go"'


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A root holding only this family's tiny folder (the session's `tiny_models` writes every family)."""
    from trainer.models.tiny import make_tiny_models

    root = tmp_path_factory.mktemp("tiny-hunyuan-video15")
    make_tiny_models(root, [FAMILY])
    return root


@pytest.fixture(scope="module")
def loaded(models):
    return checks.tiny_pipeline(FAMILY, models / FAMILY)


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> Path:
    """A 9-frame 16 fps mp4 and a still, captioned."""
    return write_clip_and_still(tmp_path_factory.mktemp("hv15-data"), 9, 16, PROMPT)


def _config(models: Path, data: Path, tmp: Path) -> Config:
    return Config.model_validate({
        "model": {"family": FAMILY, "path": str(models / FAMILY), "dtype": "fp32"},
        "train": {"method": "lora", "steps": 3, "batch_size": 1, "seed": 0, "checkpoint_every": 0, "device": "cpu",
                  "timestep_sampling": "uniform"},
        "lora": {"rank": 4, "alpha": 4},
        "optimizer": {"lr": 5e-2},
        "data": {"sources": [{"path": str(data)}], "resolutions": [64], "cache_dir": str(tmp / "cache"),
                 "clip_frames": 9, "clips": "first"},
        "sample": {"prompts": [PROMPT], "steps": 2, "width": 48, "height": 64, "frames": 5, "guidance": 6.0,
                   "seed": 3, "every": 3},
        "output": {"dir": str(tmp / "out"), "tensorboard": False},
    })


# ---------------------------------------------------------------------------------------------- mirrors the pipeline


def test_the_recipe_is_the_pipelines_and_the_full_size_is_the_released_t2v_model(loaded):
    """The prompt settings the adapter passes are the pipeline's own; the tiny Qwen tokenizer puts the template's
    system part in 108 tokens, as Qwen2.5-VL's does, so the pipeline's crop drops exactly it; the full-size config is
    diffusers' defaults (task_type aside) at 8.3 B."""
    from diffusers import HunyuanVideo15Transformer3DModel

    from trainer.models.hunyuan_video15 import RECIPE, TEMPLATE_PREFIX

    adapter, comps, pipe = loaded
    assert {k: getattr(pipe, k) for k in RECIPE} == RECIPE
    assert len(comps.tokenizers[0](TEMPLATE_PREFIX).input_ids) == RECIPE["prompt_template_encode_start_idx"]
    assert adapter.resolution_divisor == 16 and adapter.latent_channels == 4 and adapter.timestep_shift(64, 64) == 5.0
    cls = adapter_class(FAMILY)
    with torch.device("meta"):
        full = HunyuanVideo15Transformer3DModel.from_config(cls.full_config)
        default = HunyuanVideo15Transformer3DModel()
    differ = {k: default.config[k] for k in cls.full_config if full.config[k] != default.config[k]}
    assert differ == {"task_type": "i2v"}
    assert sum(p.numel() for p in full.parameters()) == 8_326_608_160 and len(adapter.blocks(full)) == 54
    for g in (1.0, 0.5, 6.0):  # the negative prompt is encoded exactly when the pipeline's guider runs it
        assert cls.runs_cfg(g) == (pipe.guider.new(guidance_scale=g).num_conditions > 1)


def test_text_latents_and_predict_as_the_pipeline_does(loaded):
    adapter, comps, pipe = loaded
    prompts = [PROMPT, "a dog"]
    text = adapter.encode_prompts(comps, prompts)
    want = pipe.encode_prompt(prompts, device="cpu", batch_size=2)
    assert [tuple(v.shape) for v in text.values()] == [(2, 1000, 32), (2, 1000), (2, 256, 32), (2, 256)]
    for got, w in zip(text.values(), want, strict=True):
        assert torch.equal(got, w)
    glyph = text["prompt_embeds_mask_2"].sum(1).tolist()  # 'Text "go". ' in bytes, and an end token; none for the dog
    assert glyph == [len('Text "go". ') + 1, 0] and not text["prompt_embeds_2"][1].any()
    assert text["prompt_embeds_mask"].sum(1).tolist()[0] > text["prompt_embeds_mask"].sum(1).tolist()[1] > 0
    # latents: the VAE's mean times its scaling factor, (B, C, 1 + (F - 1) / 4, H / 16, W / 16)
    px = torch.rand(1, 3, 9, 64, 48) * 2 - 1
    with torch.no_grad():
        lat = adapter.encode_videos(comps.vae, px)
        assert lat.shape == (1, 4, 3, 4, 3)
        assert torch.equal(lat, comps.vae.encode(px).latent_dist.mode() * comps.vae.config.scaling_factor)
        assert adapter.encode_images(comps.vae, px[:, :, 0]).shape == (1, 4, 1, 4, 3)
    # predict: the pipeline's own transformer calls (captured, with CFG: the prompt's and the negative's)
    seen = []

    def hook(_m, _args, kw, out):
        seen.append((kw, out[0]))

    h = comps.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        adapter.pipeline_guidance(pipe, 6.0)
        pipe(prompt=PROMPT, height=64, width=48, num_frames=9, num_inference_steps=2, output_type="latent",
             generator=torch.Generator().manual_seed(0))
    finally:
        h.remove()
    assert len(seen) == 4  # 2 steps x (prompt, negative)
    neg = adapter.encode_prompts(comps, [""])
    for i, (kw, out) in enumerate(seen):
        x = kw["hidden_states"]
        assert x.shape == (1, 9, 3, 4, 3) and not x[:, 4:].any()  # zero condition latents and mask channels
        assert not kw["image_embeds"].any() and kw["image_embeds"].shape == (1, 729, 16)
        with torch.no_grad():
            got = adapter.predict(comps.transformer, x[:, :4], kw["timestep"] / 1000,
                                  adapter.encode_prompts(comps, [PROMPT]) if i % 2 == 0 else neg)
        torch.testing.assert_close(got, out, rtol=0, atol=1e-6)
    assert [kw["timestep"].item() for kw, _ in seen[::2]] == pytest.approx([1000.0, 1000 * 5 * 0.5 / (1 + 4 * 0.5)])


# ---------------------------------------------------------------------------------------------- fit and sample


@pytest.fixture(scope="module")
def fitted(models, videos, tmp_path_factory):
    """`dittrain fit` of a LoRA YAML config on the clip and the still (its last step samples: a frame sheet)."""
    tmp = tmp_path_factory.mktemp("hv15-fit")
    cfg = _config(models, videos, tmp)
    path = tmp / "fit.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=True)))
    r = CliRunner().invoke(app, ["fit", str(path)])
    assert r.exit_code == 0, r.output
    return cfg, tmp / "out"


def test_fit_trains_a_lora_on_a_video_that_diffusers_loads(fitted):
    """HunyuanVideo15Pipeline has no `load_lora_weights` in diffusers 0.42; its modular pipeline's does (the
    HunyuanVideo LoRA loader): it adapts every block Linear the defaults target."""
    from diffusers import HunyuanVideo15AutoBlocks, HunyuanVideo15Transformer3DModel

    cfg, out = fitted
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and all(np.isfinite(x["loss"]) for x in lines)
    sheet = Image.open(out / "samples" / "step-000003-0.png")
    assert sheet.size == (3 * 48 + 4 * 4, 2 * 64 + 3 * 4)  # 5 frames on a 3 x 2 grid
    tr = HunyuanVideo15Transformer3DModel.from_pretrained(str(cfg.model.path), subfolder="transformer")
    mp = HunyuanVideo15AutoBlocks().init_pipeline()
    mp.update_components(transformer=tr)
    mp.load_lora_weights(str(out / "lora.safetensors"))
    names = {k.split(".lora_A.")[0] for k in tr.state_dict() if ".lora_A." in k}
    block = {n.split(".", 2)[-1] for n in names if n.startswith("transformer_blocks.1.")}
    assert block == {f"attn.{m}" for m in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                                          "add_v_proj", "to_add_out")} | {
        f"{ff}.net.{m}" for ff in ("ff", "ff_context") for m in ("0.proj", "2")}


def near_pixels(got: np.ndarray, want: np.ndarray) -> None:
    """dittrain's frames against diffusers' pipeline with its masked attention: the prefix form
    (trainer/models/hunyuan_video15_attention.py) rounds fp32 a few ulps apart, which moves an 8-bit value by one
    level here and there (1 to 4 of 67,200-87,360 here); the same pipeline with the prefix form is bitwise."""
    d = np.abs(got.astype(int) - want.astype(int))
    assert d.max() <= 1 and (d > 0).mean() < 1e-3, (d.max(), (d > 0).sum())


def _pipeline_frames(cfg: Config, lora: Path, weight: float, seed: int, prefix: bool = False) -> list[Image.Image]:
    """The reference: diffusers' own HunyuanVideo15Pipeline from the folder, the LoRA through the transformer's
    `load_lora_adapter` at `weight`, its guider at the sample's scale, called from the prompt; `prefix`: its
    transformer attending through dittrain's prefix form instead of the masked call."""
    import diffusers

    from trainer.models._diffusers import own_aligned_memory
    from trainer.models.hunyuan_video15_attention import use_prefix_attention

    pipe = diffusers.HunyuanVideo15Pipeline.from_pretrained(str(cfg.model.path), torch_dtype=torch.float32,
                                                            local_files_only=True)
    own_aligned_memory(pipe.transformer)  # as our loader does: same memory alignment, same CPU rounding
    use_prefix_attention(pipe.transformer, prefix)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.load_lora_adapter(str(lora), adapter_name="x")
    pipe.transformer.set_adapters(["x"], weights=[weight])
    s = cfg.sample
    pipe.guider = pipe.guider.new(guidance_scale=s.guidance)
    return pipe(prompt=PROMPT, height=s.height, width=s.width, num_frames=s.frames, num_inference_steps=s.steps,
                generator=torch.Generator().manual_seed(seed), output_type="pil").frames[0]


def test_sample_writes_an_mp4_and_frames_pixel_identical_to_the_pipeline(fitted, tmp_path):
    """Guidance 6 (a negative pass), the glyph branch, the fitted LoRA at 0.7; then every block streamed."""
    cfg, out = fitted
    lora = out / "lora.safetensors"
    plain = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, out=tmp_path / "plain"))
    mp4, sheet = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, loras=[f"{lora}:0.7"], out=tmp_path / "l"))
    assert mp4.suffix == ".mp4" and Image.open(sheet).text["frames"] == "5"
    want = _pipeline_frames(cfg, lora, 0.7, seed=3)
    assert len(want) == 5
    near_pixels(pixels(sheet), np.asarray(frame_sheet(want)))  # all 5 frames, within a level of diffusers' own
    same = _pipeline_frames(cfg, lora, 0.7, seed=3, prefix=True)
    np.testing.assert_array_equal(pixels(sheet), np.asarray(frame_sheet(same)))  # bit for bit, the same attention
    assert (pixels(sheet) != pixels(plain[1])).mean() > 0.05, "the trained LoRA must change the video"
    streamed = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, loras=[f"{lora}:0.7"], offload=1.0,
                                             out=tmp_path / "streamed"))
    np.testing.assert_array_equal(pixels(streamed[1]), pixels(sheet))
    # the mp4: 5 frames of 48x64, lossy H.264 of noise-like frames: nearer the sample's frames than the same reversed
    assert probe_video(mp4, None) == (48, 64, 5)
    got = read_clip(mp4, None, 0, 5)

    def err(frames: list) -> float:
        return np.mean([np.abs(np.asarray(a, float) - np.asarray(b, float)).mean() for a, b in zip(got, frames,
                                                                                                  strict=True)])

    assert err(want) < 0.75 * err(want[::-1]), (err(want), err(want[::-1]))


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("hv15-images"))


def test_streamed_training_equals_resident(models, images, tmp_path, monkeypatch):
    """Stills (1-frame clips) through the conductor's CPU path at fraction 1.0, fp32: bitwise the resident losses."""
    checks.streamed_training_equals_resident(FAMILY, models, images, tmp_path, monkeypatch, "lora", 1.0)
