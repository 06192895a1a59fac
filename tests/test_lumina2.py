"""Lumina-Image 2.0 (`lumina2`, issue 42) against diffusers' Lumina2Pipeline on its tiny model: captions and the
transformer call as the pipeline makes them, a tiny LoRA `dittrain fit` from YAML whose file the pipeline's
`load_lora_weights` loads and that predicts exactly as in the trainer, `dittrain sample` pixel-identical to the
pipeline (with and without classifier-free guidance, with the LoRA, resident and streamed), streamed training equal
to resident, the comfy / kohya layouts (grouped-query q/k/v fused) against diffusers' single-file converter, and the
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

FAMILY = "lumina2"


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("lumina2-images"))


def _components(tiny_models: Path):
    mc = ModelConfig(family=FAMILY, path=tiny_models / FAMILY, dtype="fp32")
    adapter = get_adapter(mc)
    return adapter, adapter.load(mc, parts={"transformer", "vae", "text", "scheduler"}, dtype=torch.float32)


def test_text_and_predict_as_the_pipeline_does(tiny_models):
    """Captions: the pipeline's system prompt, Gemma 2's second-to-last hidden state at the valid tokens; predict:
    the transformer at 1 - t with the caption mask, output negated (the pipeline negates before its step)."""
    from trainer.models.lumina2 import SYSTEM_PROMPT

    adapter, comps = _components(tiny_models)
    pipe = adapter.pipeline(comps)
    assert pipe.system_prompt == SYSTEM_PROMPT
    prompts = [PROMPT, "a cat"]
    text = adapter.encode_prompts(comps, prompts)
    pe, mask, _, _ = pipe.encode_prompt(prompt=list(prompts), device="cpu", do_classifier_free_guidance=False)
    lengths = [int(n) for n in mask.sum(1)]
    assert [int(n) for n in text["prompt_embeds_mask"].sum(1)] == lengths and lengths[0] != lengths[1]
    for i, n in enumerate(lengths):
        assert torch.equal(text["prompt_embeds"][i, :n], pe[i, :n])
    batch = adapter.collate_text([{k: v[i] for k, v in text.items()} for i in range(2)])
    alone = adapter.collate_text([{k: v[1] for k, v in text.items()}])
    assert "prompt_embeds_mask" in batch and "prompt_embeds_mask" not in alone  # no mask without padding
    seen = {}

    def hook(_m, args, kwargs, out):
        seen.setdefault("call", (kwargs, out[0]))

    h = comps.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        pipe.set_progress_bar_config(disable=True)
        pipe(prompt=list(prompts), num_inference_steps=2, height=64, width=64, guidance_scale=1.0,
             output_type="latent", generator=torch.Generator().manual_seed(0))
    finally:
        h.remove()
    kw, out = seen["call"]
    sigma = pipe.scheduler.sigmas[0].item()
    torch.testing.assert_close(kw["timestep"], torch.full((2,), 1 - sigma))
    with torch.no_grad():
        got = adapter.predict(comps.transformer, kw["hidden_states"], torch.full((2,), sigma), batch)
        one = adapter.predict(comps.transformer, kw["hidden_states"][1:], torch.full((1,), sigma), alone)
    torch.testing.assert_close(got, -out, rtol=0, atol=1e-6)
    torch.testing.assert_close(one, -out[1:], rtol=0, atol=1e-6)


def test_modulation_linears_and_blocks():
    """`norm1.linear` of every modulated block (the context refiners have none) stays out of an 8-bit base; the
    blocks are listed in the order the forward runs them (context refiners first)."""
    from trainer import quant

    cls = adapter_class(FAMILY)
    with torch.device("meta"):
        model = cls.transformer_cls.from_config(cls.full_config)
    blocks = cls().blocks(model)
    assert blocks[0] is model.context_refiner[0] and blocks[-1] is model.layers[-1]
    kept = [n for b in blocks for n, m in b.named_modules()
            if isinstance(m, torch.nn.Linear) and quant.is_modulation(n, cls.modulation_linears)]
    assert set(kept) == {"norm1.linear"}
    assert len(kept) == cls.full_config["num_layers"] + cls.full_config["num_refiner_layers"]
    assert sum(p.numel() for p in model.parameters()) == 2_609_769_152


# ---------------------------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def fitted(tiny_models, images, tmp_path_factory):
    """`dittrain fit` of a LoRA YAML config: (config path, output folder)."""
    return checks.fit_from_yaml(FAMILY, tiny_models, images, tmp_path_factory.mktemp("fit-lumina2"), steps=3)


def test_fit_from_yaml_writes_a_lora_the_pipeline_loads(fitted):
    path, out = fitted
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and all(np.isfinite(x["loss"]) for x in lines)
    model = yaml.safe_load(path.read_text())["model"]["path"]
    pipe = adapter_class(FAMILY).pipeline_cls.from_pretrained(model, torch_dtype=torch.float32, local_files_only=True)
    pipe.load_lora_weights(str(out / "lora.safetensors"))
    lora_keys = [k for k in pipe.transformer.state_dict() if ".lora_A." in k]
    assert {k.split(".lora_A.")[0].split(".", 2)[-1] for k in lora_keys} == {
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "feed_forward.linear_1", "feed_forward.linear_2",
        "feed_forward.linear_3"}


def test_lora_changes_the_pipeline_exactly_as_in_the_trainer(tiny_models, images, tmp_path):
    checks.lora_changes_the_pipeline_exactly(FAMILY, tiny_models, images, tmp_path)


@pytest.mark.parametrize(("method", "fraction"), [("lora", 1.0), ("full", 0.5)])
def test_streamed_training_equals_resident(tiny_models, images, tmp_path, monkeypatch, method, fraction):
    checks.streamed_training_equals_resident(FAMILY, tiny_models, images, tmp_path, monkeypatch, method, fraction)


# ---------------------------------------------------------------------------------------------- sampling


def test_sample_without_cfg_equals_the_pipeline(tiny_models, tmp_path):
    checks.sample_without_cfg_equals_the_pipeline(FAMILY, tiny_models, tmp_path)


def test_sample_with_the_fitted_lora_equals_the_pipeline_resident_and_streamed(tiny_models, fitted, tmp_path):
    """Guidance 4 (the pipeline's normalized CFG)."""
    checks.sample_with_the_fitted_lora_equals_the_pipeline(FAMILY, tiny_models, fitted[1] / "lora.safetensors",
                                                            tmp_path)


# ---------------------------------------------------------------------------------------------- LoRA layouts


def test_key_map_places_rows_where_diffusers_single_file_converter_takes_them():
    """`convert_lumina2_to_diffusers` (full size: it splits qkv at 2304 / 768 / 768), run on row ids
    (trainer/models/original_layout.py) over a header of the map's original names, takes each adapted weight from
    exactly the original tensor and rows the map stacks it at (as tests/test_lora_format.py checks other families)."""
    from accelerate import init_empty_weights

    from trainer.models import original_layout

    cls = adapter_class(FAMILY)
    kmap = cls.lora_key_map
    with init_empty_weights():
        model = cls.transformer_cls.from_config(dict(cls.full_config))
    shapes = {k: v.shape for k, v in model.state_dict().items() if k.endswith(".weight") and kmap.place(k[:-7])}
    header = {}
    for k, shape in shapes.items():
        place = kmap.place(k[:-7])
        rows = round(sum(w * shape[1] for w in place.rule.widths)) if place.rule.fused else shape[0]
        header[f"{place.original}.weight"] = {"dtype": "BF16", "shape": [rows, *shape[1:]]}
    layout = original_layout.row_map(cls.transformer_cls, dict(cls.full_config), header, shapes, lambda k: False)
    assert layout is not None
    checked = 0
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and kmap.place(name) is not None:
            place = kmap.place(name)
            start = round(sum(w * m.in_features for w in place.rule.widths[: place.index]))
            assert layout.runs[f"{name}.weight"] == [(f"{place.original}.weight", start, start + m.out_features)], name
            checked += 1
    assert checked == len(shapes) > 30 * 7


@pytest.mark.parametrize("fmt", ["comfy", "kohya"])
def test_original_layout_gives_the_diffusers_update(tiny_models, tmp_path, fmt):
    """The fused `attention.qkv` (k and v a third of q's width) holds the stacked updates, read as ComfyUI reads it."""
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
        assert facts.family == FAMILY and len(facts.block_param_bytes) == 30
        lines, fraction = report(cfg, vram_gb=8, facts=facts)
        assert fraction is not None and 0 < fraction <= 1, lines


def test_dynamic_shift_uses_the_latent_channels_as_the_pipeline_does(monkeypatch):
    """Lumina2Pipeline (diffusers 0.42) hands calculate_shift latents.shape[1], the latent channels, whatever the
    image size: the same shift at every bucket."""
    import math

    cls = adapter_class(FAMILY)
    sched = {"use_dynamic_shifting": True, "base_image_seq_len": 256, "max_image_seq_len": 4096,
             "base_shift": 0.5, "max_shift": 1.15}
    monkeypatch.setattr(cls, "scheduler_config", property(lambda self: sched))
    monkeypatch.setattr(cls, "latent_channels", property(lambda self: 16))
    a = cls()
    m = (1.15 - 0.5) / (4096 - 256)
    want = math.exp(16 * m + (0.5 - m * 256))
    assert a.timestep_shift(512, 512) == a.timestep_shift(1024, 768) == pytest.approx(want)
