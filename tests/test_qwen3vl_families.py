"""The families with a Qwen3-VL text encoder (qwen-image-2.1, krea2 and its turbo folder) on their tiny models: text embeddings equal to the
pipeline's `encode_prompt`, LoRA and full fits that lower the loss, streamed training identical to resident at
several fractions, the LoRA file in the diffusers pipeline exactly as in the trainer, and `dittrain sample` pixel
for pixel equal to the pipeline with the same seed and LoRA."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_train_support import (
    fit_scored,
    lora_predictions,
    losses,
    make_config,
    pixels,
    write_images,
)

from trainer.config import Config, ModelConfig
from trainer.models import get_adapter
from trainer.sample import SampleRequest, run_sample
from trainer.train.trainer import Trainer

FAMILIES = ["qwen-image-2.1", "krea2"]
#: (family, tiny folder): every folder make-tiny writes for these families
FOLDERS = [("qwen-image-2.1", "qwen-image-2.1"), ("krea2", "krea2"), ("krea2", "krea2-turbo")]
PROMPTS = ["a red square on a blue background", "a cat", ""]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("qwen3vl-images"))


def _components(tiny_models: Path, family: str, folder: str | None = None):
    mc = ModelConfig(family=family, path=tiny_models / (folder or family), dtype="fp32")
    adapter = get_adapter(mc)
    return adapter, adapter.load(mc, parts={"transformer", "vae", "text", "scheduler"}, dtype=torch.float32)


def reference_pipeline(adapter, comps):
    """The family's diffusers pipeline built from the folder's parts (Qwen-Image 2.1's processor needs torchvision
    to load through `from_pretrained`: trainer/models/qwen_image_21.py `load_processor`)."""
    pipe = adapter.pipeline(comps)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("family", FAMILIES)
def test_text_embeddings_equal_the_pipelines(tiny_models, family):
    adapter, comps = _components(tiny_models, family)
    pipe = reference_pipeline(adapter, comps)
    text = adapter.encode_prompts(comps, PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        theirs = adapter.pipeline_embeds(pipe, prompt, None, "cpu")
        embeds, mask = theirs["prompt_embeds"], theirs["prompt_embeds_mask"]
        n = embeds.shape[1]
        valid = n if mask is None else int(mask.sum())  # Qwen-Image 2.1 leaves an all-valid mask out
        assert int(text["prompt_embeds_mask"][i].sum()) == valid
        # Qwen-Image 2.1 left-pads a batch, so shorter prompts see other positions: equal up to fp32 rounding
        torch.testing.assert_close(text["prompt_embeds"][i, :n], embeds[0], rtol=0, atol=1e-6)
    if family == "qwen-image-2.1":  # its pipeline reads the last layer before the final norm
        normed = comps.text_encoders[0].model.language_model.norm(text["prompt_embeds"][0])
        assert not torch.allclose(normed, text["prompt_embeds"][0], atol=1e-3)


@pytest.mark.parametrize("family", ["qwen-image-2.1"])
def test_latents_round_trip_through_the_pipelines_decode(tiny_models, family):
    """encode_images gives (B, C, H/16, W/16) from an opaque RGBA image, normalised as the pipeline un-normalises
    before decoding."""
    adapter, comps = _components(tiny_models, family)
    pixels = torch.rand(2, 3, 64, 96) * 2 - 1
    lat = adapter.encode_images(comps.vae, pixels)
    assert lat.shape == (2, adapter.latent_channels, 4, 6)
    c = comps.vae.config
    raw = comps.vae.encode(torch.cat([pixels, torch.ones_like(pixels[:, :1])], 1).unsqueeze(2)).latent_dist.mode()
    mean, std = torch.tensor(c.latents_mean).view(1, -1, 1, 1, 1), torch.tensor(c.latents_std).view(1, -1, 1, 1, 1)
    torch.testing.assert_close(lat.unsqueeze(2) * std + mean, raw)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("qwen3vl-cache")


def _fit(tiny_models, images, cache, out, family, method="lora", **sections):
    """Fit `family` on the test images; (trainer, output path, eval loss before, eval loss after)."""
    return fit_scored(make_config(tiny_models, images, out, cache / family, family, method, **sections))


@pytest.fixture(scope="module")
def lora_run(tiny_models, images, cache, tmp_path_factory):
    runs = {}

    def get(family):
        if family not in runs:
            out = tmp_path_factory.mktemp(f"lora-{family}")
            runs[family] = _fit(tiny_models, images, cache, out, family, train={"steps": 4},
                                optimizer={"lr": 1e-2}, lora={"rank": 4, "alpha": 2})
        return runs[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_fit_lowers_the_loss_and_loads_in_the_pipeline(lora_run, family):
    """The LoRA file, through the pipeline's `load_lora_weights`, predicts exactly what the trainer's model does."""
    t, path, before, after = lora_run(family)
    assert path.name == "lora.safetensors" and after < before, (before, after)
    ours, theirs, untrained = lora_predictions(t, path)
    assert torch.equal(ours, theirs)
    assert (theirs - untrained).abs().max() > 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_full_fit_lowers_the_loss(tiny_models, images, cache, tmp_path, family):
    t, path, before, after = _fit(tiny_models, images, cache, tmp_path / "out", family, "full",
                                  train={"steps": 4}, optimizer={"lr": 1e-3})
    assert (path / "config.json").is_file() and after < before, (before, after)
    assert len(losses(tmp_path / "out")) == 4


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("method", "fractions"), [("lora", (0.0, 0.5, 1.0)), ("full", (0.0, 0.5))])
def test_streamed_training_equals_resident(tiny_models, images, cache, tmp_path, family, method, fractions):
    """fp32 on the CPU: every fraction gives bitwise the resident run's losses."""
    runs = {}
    for fraction in fractions:
        out = tmp_path / f"f{fraction}"
        cfg = make_config(tiny_models, images, out, cache / family, family, method, train={"steps": 2},
                          offload={"transformer": fraction})
        Trainer(cfg).fit()
        runs[fraction] = losses(out)
    assert all(r == runs[0.0] for r in runs.values()), runs


@pytest.mark.parametrize(("family", "folder"), FOLDERS)
def test_declared_geometry_is_the_folders(tiny_models, family, folder):
    """`latent_scale` (the trainer's pixels per latent side for the timestep shift, and the planner's) and the
    divisor agree with the folder's VAE and transformer: Qwen-Image 2.1 is 16 px a latent, 32 px a side."""
    a = get_adapter(ModelConfig(family=family, path=tiny_models / folder, dtype="fp32"))
    assert a.latent_scale == a.vae_scale_factor
    assert a.resolution_divisor == {"qwen-image-2.1": 32, "krea2": 16}[family]
    assert a.full_image_tokens(1024, 1024) == a.image_seq_len(1024, 1024) == 4096


def test_streamed_loading_keeps_krea2s_fp32_modules_as_from_pretrained_does(tiny_models):
    """Krea 2 keeps its norms in fp32 under a bf16 model (`_keep_in_fp32_modules`): the block-by-block loader of
    `fit` gives every parameter the dtype and the value diffusers' `from_pretrained` gives it."""
    from trainer.models.stream_load import TransformerLoader, empty_transformer

    mc = ModelConfig(family="krea2", path=tiny_models / "krea2", dtype="bf16")
    adapter = get_adapter(mc)
    tr = empty_transformer(adapter, mc, torch.bfloat16)
    TransformerLoader(tr, mc, torch.bfloat16).place(tr, "cpu")
    ref = adapter.transformer_cls.from_pretrained(tiny_models / "krea2", subfolder="transformer",
                                                  torch_dtype=torch.bfloat16)
    ours, theirs = dict(tr.named_parameters()), dict(ref.named_parameters())
    assert {p.dtype for p in ours.values()} == {torch.float32, torch.bfloat16}
    assert all(ours[n].dtype == p.dtype and torch.equal(ours[n], p) for n, p in theirs.items())


def test_krea2_turbo_trains_and_samples_at_its_fixed_shift(tiny_models):
    """The distilled folder (`is_distilled` in its pipeline config) uses the pipeline's fixed mu 1.15 at every size."""
    import math

    base, turbo = (get_adapter(ModelConfig(family="krea2", path=tiny_models / f, dtype="fp32"))
                   for f in ("krea2", "krea2-turbo"))
    assert turbo.timestep_shift(64, 64) == turbo.timestep_shift(1024, 1024) == math.exp(1.15)
    assert base.timestep_shift(64, 64) < base.timestep_shift(1024, 1024)


@pytest.mark.parametrize(("family", "folder", "guidance"), [(f, d, 0.0 if "turbo" in d else 3.0) for f, d in FOLDERS])
def test_sample_equals_the_pipeline_with_the_same_seed_and_lora(tiny_models, lora_run, tmp_path, family, folder,
                                                                 guidance):
    lora = lora_run(family)[1]
    cfg = Config.model_validate({
        "model": {"family": family, "path": str(tiny_models / folder), "dtype": "fp32"},
        "sample": {"steps": 2, "width": 64, "height": 32, "guidance": guidance},
        "train": {"device": "cpu"},
        "output": {"dir": str(tmp_path / "s")},
    })
    (png,) = run_sample(cfg, SampleRequest(prompts=[PROMPTS[0]], seed=7, out=tmp_path / "s", loras=[str(lora)],
                                   offload=0.5))

    ours = pixels(png)
    adapter, comps = _components(tiny_models, family, folder)
    pipe = reference_pipeline(adapter, comps)
    pipe.load_lora_weights(str(lora), adapter_name="x")
    out = pipe(prompt=PROMPTS[0], negative_prompt="", height=32, width=64, num_inference_steps=2,
               generator=torch.Generator().manual_seed(7), **adapter.pipeline_guidance(pipe, guidance))
    theirs = np.asarray(out.images[0].convert("RGB"))
    assert ours.shape == (32, 64, 3)
    np.testing.assert_array_equal(ours, theirs)


def test_krea2_folder_whose_pipeline_selects_other_text_layers_than_the_transformer_fuses_is_one_line(
        tiny_models, tmp_path):
    """A model_index.json whose text_encoder_select_layers count differs from the transformer's num_text_layers
    would fail deep in the first forward (the text fusion's projector); it is said before captions are encoded."""
    import json
    import shutil

    from trainer.errors import UserError

    folder = tmp_path / "krea2"
    shutil.copytree(tiny_models / "krea2", folder)
    index = json.loads((folder / "model_index.json").read_text())
    good = get_adapter(ModelConfig(family="krea2", path=folder, dtype="fp32")).select_layers
    assert len(good) == json.loads((folder / "transformer" / "config.json").read_text())["num_text_layers"]
    (folder / "model_index.json").write_text(json.dumps({**index, "text_encoder_select_layers": [*good, 3]}))
    with pytest.raises(UserError, match=r"model_index.json: text_encoder_select_layers names 3 layers, but .*"
                                        r"num_text_layers is 2"):
        _ = get_adapter(ModelConfig(family="krea2", path=folder, dtype="fp32")).select_layers
