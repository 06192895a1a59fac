"""ERNIE-Image (`ernie-image`, issue 42) against diffusers' ErnieImagePipeline on its tiny model: captions, latents
and the transformer call as the pipeline makes them, a tiny LoRA `dittrain fit` from YAML whose file the pipeline's
`load_lora_weights` loads and that predicts exactly as in the trainer, `dittrain sample` pixel-identical to the
pipeline (with and without classifier-free guidance, with the LoRA, resident and streamed), streamed training equal
to resident, the comfy / kohya layouts (diffusers' names: the pipeline's own loader reads the comfy file), and the
planner on the shipped presets."""

from __future__ import annotations

import json
from pathlib import Path

import _family_checks as checks
import numpy as np
import pytest
import torch
import yaml
from test_sample import PROMPT
from test_train_support import write_images

from trainer.config import ModelConfig
from trainer.models import adapter_class, get_adapter

FAMILY = "ernie-image"


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("ernie-images"))


def _components(tiny_models: Path):
    mc = ModelConfig(family=FAMILY, path=tiny_models / FAMILY, dtype="fp32")
    adapter = get_adapter(mc)
    return adapter, adapter.load(mc, parts={"transformer", "vae", "text", "scheduler"}, dtype=torch.float32)


def test_text_and_predict_as_the_pipeline_does(tiny_models):
    """Captions: each prompt alone, Mistral-3's second-to-last hidden state (the pipeline's `encode_prompt`), padded
    per batch; predict: the 2x2-patchified latents at timestep 1000 t with the caption lengths, as the pipeline's
    first transformer call, unpatchified."""
    from diffusers import ErnieImagePipeline

    adapter, comps = _components(tiny_models)
    assert comps.text_encoders[0].vision_tower is None  # slimmed: captions are text
    pipe = adapter.pipeline(comps)
    prompts = [PROMPT, "a cat"]
    text = adapter.encode_prompts(comps, prompts)
    want = pipe.encode_prompt(list(prompts), "cpu")
    assert [int(n) for n in text["prompt_embeds_mask"].sum(1)] == [p.shape[0] for p in want]
    assert want[0].shape[0] != want[1].shape[0]
    for i, p in enumerate(want):
        assert torch.equal(text["prompt_embeds"][i, : p.shape[0]], p)
    batch = adapter.collate_text([{k: v[i] for k, v in text.items()} for i in range(2)])
    alone = adapter.collate_text([{k: v[1] for k, v in text.items()}])
    assert "prompt_embeds_mask" in batch and "prompt_embeds_mask" not in alone  # no mask without padding
    seen = {}

    def hook(_m, args, kwargs, out):
        seen.setdefault("call", (kwargs, out[0]))

    h = comps.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        pipe.set_progress_bar_config(disable=True)
        pipe(prompt=list(prompts), num_inference_steps=2, height=64, width=32, guidance_scale=1.0,
             output_type="latent", generator=torch.Generator().manual_seed(0))
    finally:
        h.remove()
    kw, out = seen["call"]
    sigma = pipe.scheduler.sigmas[0].item()
    torch.testing.assert_close(kw["timestep"], torch.full((2,), 1000 * sigma))
    lat = ErnieImagePipeline._unpatchify_latents(kw["hidden_states"])
    with torch.no_grad():
        got = adapter.predict(comps.transformer, lat, torch.full((2,), sigma), batch)
        one = adapter.predict(comps.transformer, lat[1:], torch.full((1,), sigma), alone)
    want_out = ErnieImagePipeline._unpatchify_latents(out)
    torch.testing.assert_close(got, want_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(one, want_out[1:], rtol=0, atol=1e-6)


def test_latents_are_normalised_as_the_pipeline_un_normalises_them(tiny_models):
    """encode_images: (B, 32 -> tiny 4, H/8, W/8), patchified and batch-norm normalised with the pipeline's eps."""
    from diffusers import ErnieImagePipeline

    adapter, comps = _components(tiny_models)
    pixels = torch.rand(2, 3, 64, 32) * 2 - 1
    lat = adapter.encode_images(comps.vae, pixels)
    assert lat.shape == (2, adapter.latent_channels, 8, 4) and adapter.resolution_divisor == 16
    vae = comps.vae
    p = ErnieImagePipeline._patchify_latents(lat)
    p = p * torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + 1e-5) + vae.bn.running_mean.view(1, -1, 1, 1)
    raw = vae.encode(pixels).latent_dist.mode()
    torch.testing.assert_close(ErnieImagePipeline._unpatchify_latents(p), raw, rtol=1e-5, atol=1e-5)


def test_blocks_hold_no_modulation_and_the_full_size_is_8b():
    cls = adapter_class(FAMILY)
    with torch.device("meta"):
        model = cls.transformer_cls.from_config(cls.full_config)
    assert len(cls().blocks(model)) == 36 and cls.modulation_linears == ""
    assert sum(p.numel() for p in model.parameters()) == 8_033_490_048


# ---------------------------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def fitted(tiny_models, images, tmp_path_factory):
    """`dittrain fit` of a LoRA YAML config: (config path, output folder)."""
    return checks.fit_from_yaml(FAMILY, tiny_models, images, tmp_path_factory.mktemp("fit-ernie"), steps=3)


def test_fit_from_yaml_writes_a_lora_the_pipeline_loads(fitted):
    path, out = fitted
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and all(np.isfinite(x["loss"]) for x in lines)
    model = yaml.safe_load(path.read_text())["model"]["path"]
    pipe = adapter_class(FAMILY).pipeline_cls.from_pretrained(model, torch_dtype=torch.float32, local_files_only=True)
    pipe.load_lora_weights(str(out / "lora.safetensors"))
    lora_keys = [k for k in pipe.transformer.state_dict() if ".lora_A." in k]
    assert {k.split(".lora_A.")[0].split(".", 2)[-1] for k in lora_keys} == {
        "self_attention.to_q", "self_attention.to_k", "self_attention.to_v", "self_attention.to_out.0",
        "mlp.gate_proj", "mlp.up_proj", "mlp.linear_fc2"}


def test_lora_changes_the_pipeline_exactly_as_in_the_trainer(tiny_models, images, tmp_path):
    checks.lora_changes_the_pipeline_exactly(FAMILY, tiny_models, images, tmp_path)


@pytest.mark.parametrize(("method", "fraction"), [("lora", 1.0), ("full", 0.5)])
def test_streamed_training_equals_resident(tiny_models, images, tmp_path, monkeypatch, method, fraction):
    checks.streamed_training_equals_resident(FAMILY, tiny_models, images, tmp_path, monkeypatch, method, fraction)


# ---------------------------------------------------------------------------------------------- sampling


def test_sample_without_cfg_equals_the_pipeline(tiny_models, tmp_path):
    checks.sample_without_cfg_equals_the_pipeline(FAMILY, tiny_models, tmp_path)


def test_sample_with_the_fitted_lora_equals_the_pipeline_resident_and_streamed(tiny_models, fitted, tmp_path):
    """Guidance 4 (the positive and negative prompt in one batch)."""
    checks.sample_with_the_fitted_lora_equals_the_pipeline(FAMILY, tiny_models, fitted[1] / "lora.safetensors",
                                                            tmp_path)


# ---------------------------------------------------------------------------------------------- LoRA layouts


def test_comfy_layout_names_load_in_the_pipelines_own_loader(tiny_models, tmp_path):
    """The comfy file's names (`diffusion_model.<diffusers name>`, ERNIE's original layout) through
    ErnieImagePipeline's `load_lora_weights` give the trained layer outputs. Its loader reads no `.alpha` tensors,
    so here the scale alpha / rank is multiplied into `lora_up` and the alphas dropped (the alphas themselves are
    checked as ComfyUI reads them, below)."""
    from safetensors.torch import load_file, save_file
    from test_lora_format import (
        adapted,
        bare_pipeline,
        base_model,
        outputs,
        peft_deltas,
        save_checkpoint_file,
    )

    from trainer import lora_format as lfm

    t, adapter, cfg = adapted(tiny_models, FAMILY, "lora")
    src = save_checkpoint_file(t, cfg, tmp_path / "ck.safetensors")
    lfm.convert_lora(src, tmp_path / "comfy.safetensors", "comfy")
    sd = load_file(str(tmp_path / "comfy.safetensors"))
    assert sd and all(k.startswith("diffusion_model.layers.") for k in sd)
    baked = {}
    for k, v in sd.items():
        if k.endswith(".lora_up.weight"):
            m = k.removesuffix(".lora_up.weight")
            rank = sd[f"{m}.lora_down.weight"].shape[0]
            baked[f"{m}.lora_B.weight"] = v * (sd[f"{m}.alpha"].item() / rank)
        elif k.endswith(".lora_down.weight"):
            baked[k.replace(".lora_down.", ".lora_A.")] = v
    save_file(baked, str(tmp_path / "names.safetensors"))
    base = base_model(adapter, cfg)
    bare_pipeline(adapter, base).load_lora_weights(str(tmp_path / "names.safetensors"), adapter_name="x")
    mods = list(peft_deltas(t))
    want, got = outputs(t, mods), outputs(base, mods)
    for m in mods:
        torch.testing.assert_close(got[m], want[m], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["comfy", "kohya"])
def test_original_layout_gives_the_diffusers_update(tiny_models, tmp_path, fmt):
    from test_lora_format import test_original_layout_gives_the_diffusers_update as check

    check(tiny_models, tmp_path, FAMILY, "lora", fmt)


def test_round_trips_through_every_layout(tiny_models, tmp_path):
    from test_lora_format import test_round_trips_through_every_layout as check

    check(tiny_models, tmp_path, FAMILY, "loha")


# ---------------------------------------------------------------------------------------------- planner


def test_planner_on_the_presets():
    """The shipped 8 GB presets of both methods plan at the full-size config and fit their card."""
    from trainer.config import load_config
    from trainer.planner import analyze, report

    for method in ("lora", "full"):
        cfg = load_config(Path("configs") / FAMILY / f"{method}-8gb.yaml", [])
        facts = analyze(cfg)
        assert facts.family == FAMILY and len(facts.block_param_bytes) == 36
        lines, fraction = report(cfg, vram_gb=8, facts=facts)
        assert fraction is not None and 0 < fraction <= 1, lines
