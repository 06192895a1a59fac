"""Anima (`anima`, issue 42) against diffusers' Anima modular pipeline on its tiny model: captions (Qwen3 + the LLM
adapter) and the transformer call as the modular blocks make them, a tiny LoRA `dittrain fit` from YAML whose file
`AnimaModularPipeline.load_lora_weights` loads and that predicts exactly as in the trainer, `dittrain sample`
pixel-identical to the modular pipeline run from the prompt (classifier-free guidance, the LoRA, resident and
streamed), streamed training equal to resident, the comfy layout through the modular pipeline's own loader (diffusers'
Anima LoRA converter) and the key map against diffusers' Cosmos single-file converter, the planner on the presets."""

from __future__ import annotations

import json
from pathlib import Path

import _family_checks as checks
import numpy as np
import pytest
import torch
from test_sample import PROMPT
from test_train_support import pixels, write_images

from trainer.config import Config, ModelConfig
from trainer.models import adapter_class, get_adapter
from trainer.sample import SampleRequest, run_sample

FAMILY = "anima"


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("anima-images"))


def _components(tiny_models: Path):
    mc = ModelConfig(family=FAMILY, path=tiny_models / FAMILY, dtype="fp32")
    adapter = get_adapter(mc)
    return adapter, adapter.load(mc, parts={"transformer", "vae", "text", "scheduler"}, dtype=torch.float32)


def modular_pipeline(comps, guidance: float):
    """diffusers' own Anima modular pipeline (`AnimaAutoBlocks`, its text-encoder step included) on the folder's
    parts."""
    from diffusers import AnimaAutoBlocks, ClassifierFreeGuidance

    (enc,), (tok, t5) = comps.text_encoders, comps.tokenizers
    mp = AnimaAutoBlocks().init_pipeline()
    mp.update_components(transformer=comps.transformer, vae=comps.vae, scheduler=comps.scheduler, text_encoder=enc,
                         tokenizer=tok, t5_tokenizer=t5, text_conditioner=enc.text_conditioner,
                         guider=ClassifierFreeGuidance(guidance_scale=guidance))
    mp.set_progress_bar_config(disable=True)
    return mp


def test_text_and_predict_as_the_modular_blocks_do(tiny_models):
    """Captions: the text-encoder and text-conditioning steps' embeddings (512 tokens); predict: the transformer's
    first call in the modular pipeline's loop (5-D latents, timestep t, zero padding mask), its frame axis dropped."""
    adapter, comps = _components(tiny_models)
    assert adapter.resolution_divisor == 16 and adapter.latent_channels == 4
    text = adapter.encode_prompts(comps, [PROMPT, "a cat"])
    assert text["prompt_embeds"].shape == (2, 512, 16)
    seen = {}

    def hook(_m, args, kwargs, out):
        seen.setdefault("call", (kwargs, out[0]))

    h = comps.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        modular_pipeline(comps, 1.0)(prompt=[PROMPT, "a cat"], num_inference_steps=1, height=32, width=48,
                                     generator=torch.Generator().manual_seed(0), output="latents")
    finally:
        h.remove()
    kw, out = seen["call"]
    torch.testing.assert_close(kw["encoder_hidden_states"], text["prompt_embeds"], rtol=0, atol=1e-6)
    sigma = comps.scheduler.sigmas[0].item()
    torch.testing.assert_close(kw["timestep"], torch.full((2,), sigma))
    with torch.no_grad():
        got = adapter.predict(comps.transformer, kw["hidden_states"][:, :, 0], torch.full((2,), sigma), text)
    torch.testing.assert_close(got, out[:, :, 0], rtol=0, atol=1e-6)


def test_prompts_encode_without_the_transformer_as_the_training_sampler_loads_the_pipeline(tiny_models):
    """The training sampler builds the pipeline from the VAE, text and scheduler and encodes its prompts before the
    fit's transformer joins it: the same embeddings as with the transformer (`fit` with sampling on failed there,
    reading the absent transformer's dtype: bench_program --smoke --families anima)."""
    adapter, comps = _components(tiny_models)
    whole = adapter.pipeline(comps).encode_prompt(PROMPT, "cpu")
    comps.transformer = None
    torch.testing.assert_close(adapter.pipeline(comps).encode_prompt(PROMPT, "cpu"), whole, rtol=0, atol=0)


def test_full_size_is_cosmos_predict2_2b():
    cls = adapter_class(FAMILY)
    with torch.device("meta"):
        model = cls.transformer_cls.from_config(cls.full_config)
    assert len(cls().blocks(model)) == 28
    assert sum(p.numel() for p in model.parameters()) == 1_956_405_248


# ---------------------------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def fitted(tiny_models, images, tmp_path_factory):
    """`dittrain fit` of a LoRA YAML config: (config path, output folder)."""
    return checks.fit_from_yaml(FAMILY, tiny_models, images, tmp_path_factory.mktemp("fit-anima"), steps=2)


def test_fit_writes_a_lora_the_modular_pipeline_loads(tiny_models, fitted):
    """The file through `AnimaModularPipeline.load_lora_weights` adapts every block Linear the defaults target."""
    _, out = fitted
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(np.isfinite(x["loss"]) for x in lines)
    _, comps = _components(tiny_models)
    modular_pipeline(comps, 1.0).load_lora_weights(str(out / "lora.safetensors"))
    names = {k.split(".lora_A.")[0].split(".", 2)[-1] for k in comps.transformer.state_dict() if ".lora_A." in k}
    assert names == {f"{a}.{m}" for a in ("attn1", "attn2") for m in ("to_q", "to_k", "to_v", "to_out.0")} | {
        "ff.net.0.proj", "ff.net.2"}


def test_streamed_training_equals_resident_and_the_lora_predicts_as_in_the_trainer(fitted, monkeypatch):
    """The fit's config again with the transformer streamed at fraction 1.0 (the conductor's CPU path, fp32): bitwise
    the `dittrain fit` run's losses; its LoRA file through the pipeline's `load_lora_weights` predicts exactly what
    the trainer's model does."""
    checks.streamed_fit_equals_the_fit(*fitted, monkeypatch)


# ---------------------------------------------------------------------------------------------- sampling


def test_sample_with_the_fitted_lora_equals_the_modular_pipeline_resident_and_streamed(tiny_models, fitted,
                                                                                        tmp_path):
    """Guidance 4 (the negative prompt "" as a second pass), the LoRA `dittrain fit` wrote at weight 0.7: the image is
    the modular pipeline's from the prompt, pixel for pixel; streamed (offload 1.0) too."""
    lora = fitted[1] / "lora.safetensors"
    cfg = Config.model_validate({
        "model": {"family": FAMILY, "path": str(tiny_models / FAMILY), "dtype": "fp32"},
        "sample": {"steps": 2, "width": 32, "height": 48, "guidance": 4.0},
        "train": {"device": "cpu"},
        "output": {"dir": str(tmp_path)},
    })
    (ours,) = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=1, loras=[f"{lora}:0.7"], out=tmp_path / "l"))
    _, comps = _components(tiny_models)
    mp = modular_pipeline(comps, 4.0)
    mp.load_lora_weights(str(lora), adapter_name="x")
    mp.set_adapters(["x"], adapter_weights=[0.7])
    (image,) = mp(prompt=PROMPT, negative_prompt="", height=48, width=32, num_inference_steps=2,
                  generator=torch.Generator().manual_seed(1), output="images")
    img = pixels(ours)
    assert img.shape == (48, 32, 3)
    np.testing.assert_array_equal(img, np.asarray(image.convert("RGB")))
    (streamed,) = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=1, loras=[f"{lora}:0.7"], offload=1.0,
                                                out=tmp_path / "s"))
    np.testing.assert_array_equal(img, pixels(streamed))


# ---------------------------------------------------------------------------------------------- LoRA layouts


def test_comfy_layout_loads_in_the_modular_pipelines_own_loader(tiny_models, tmp_path):
    """The comfy file's names (`diffusion_model.blocks.N.self_attn.q_proj`, ...) through
    `AnimaModularPipeline.load_lora_weights`, which renames them with diffusers' Anima LoRA converter, give the trained
    layer outputs. That loader reads no `.alpha` tensors, so alpha / rank is multiplied into `lora_up` here."""
    from safetensors.torch import load_file, save_file
    from test_lora_format import adapted, base_model, outputs, peft_deltas, save_checkpoint_file

    from trainer import lora_format as lfm

    t, adapter, cfg = adapted(tiny_models, FAMILY, "lora")
    src = save_checkpoint_file(t, cfg, tmp_path / "ck.safetensors")
    lfm.convert_lora(src, tmp_path / "comfy.safetensors", "comfy")
    sd = load_file(str(tmp_path / "comfy.safetensors"))
    assert sd and all(k.startswith("diffusion_model.blocks.") for k in sd)
    baked = {}
    for k, v in sd.items():
        if k.endswith(".lora_up.weight"):
            m = k.removesuffix(".lora_up.weight")
            baked[f"{m}.lora_B.weight"] = v * (sd[f"{m}.alpha"].item() / sd[f"{m}.lora_down.weight"].shape[0])
        elif k.endswith(".lora_down.weight"):
            baked[k.replace(".lora_down.", ".lora_A.")] = v
    save_file(baked, str(tmp_path / "names.safetensors"))
    from diffusers import AnimaAutoBlocks

    base = base_model(adapter, cfg)
    mp = AnimaAutoBlocks().init_pipeline()
    mp.update_components(transformer=base)
    mp.load_lora_weights(str(tmp_path / "names.safetensors"), adapter_name="x")
    mods = list(peft_deltas(t))
    want, got = outputs(t, mods), outputs(base, mods)
    for m in mods:
        torch.testing.assert_close(got[m], want[m], rtol=1e-5, atol=1e-5)


def test_key_map_against_diffusers_single_file_converter():
    from test_lora_format import (
        test_key_map_places_rows_where_diffusers_single_file_converter_takes_them as check,
    )

    check(FAMILY)


@pytest.mark.parametrize("fmt", ["comfy", "kohya"])
def test_original_layout_gives_the_diffusers_update(tiny_models, tmp_path, fmt):
    from test_lora_format import test_original_layout_gives_the_diffusers_update as check

    check(tiny_models, tmp_path, FAMILY, "lora", fmt)


# ---------------------------------------------------------------------------------------------- planner


def test_planner_on_the_presets():
    """The shipped 8 GB LoRA preset plans at the full-size config and fits its card (resident: 2 B in bf16)."""
    from trainer.config import load_config
    from trainer.planner import analyze, report

    cfg = load_config(Path("configs") / FAMILY / "lora-8gb.yaml", [])
    facts = analyze(cfg)
    assert facts.family == FAMILY and len(facts.block_param_bytes) == 28
    lines, fraction = report(cfg, vram_gb=8, facts=facts)
    assert fraction is not None and 0 <= fraction <= 1, lines
