"""The families added for issue 27 (z-image, chroma), each against its own diffusers pipeline on the tiny models:
text and transformer inputs built as the pipeline builds them, a tiny LoRA fit from YAML whose file the pipeline's
`load_lora_weights` loads and that changes its transformer exactly as in the trainer, `dittrain sample` pixel-
identical to the pipeline (with and without classifier-free guidance, with the LoRA), LoRA and full fine-tuning
streamed at several fractions giving the resident run's losses, and the planner on the full-size config."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from test_sample import PROMPT, _diffusers_image, _lora_transformer, _save_lora
from test_train_support import lora_predictions, make_config, pixels, write_images
from typer.testing import CliRunner

from trainer.cli import app
from trainer.config import Config, ModelConfig
from trainer.models import adapter_class, get_adapter
from trainer.sample import SampleRequest, run_sample

FAMILIES = ["z-image", "chroma"]
#: a guidance that runs each pipeline's classifier-free guidance (negative pass), and one that does not
CFG_ON = {"z-image": 2.0, "chroma": 3.0}
CFG_OFF = {"z-image": 0.0, "chroma": 1.0}


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("more-families-images"))


def _sample_cfg(tiny_models: Path, family: str, out: Path, guidance: float) -> Config:
    return Config.model_validate({
        "model": {"family": family, "path": str(tiny_models / family), "dtype": "fp32"},
        "sample": {"steps": 2, "width": 32, "height": 32, "guidance": guidance},
        "train": {"device": "cpu"},
        "output": {"dir": str(out)},
    })


def _components(tiny_models: Path, family: str):
    cfg = ModelConfig(family=family, path=tiny_models / family, dtype="fp32")
    adapter = get_adapter(cfg)
    return adapter, adapter.load(cfg, parts={"transformer", "vae", "text", "scheduler"}, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------- mirrors the pipeline


def test_z_image_text_and_predict_as_the_pipeline_does(tiny_models):
    """Captions: the second-to-last hidden state at the valid tokens (lengths differ); predict: lists into the
    transformer at 1 - t, and the negated output (the pipeline negates before its scheduler step)."""
    adapter, comps = _components(tiny_models, "z-image")
    prompts = [PROMPT, "a cat"]
    text = adapter.encode_prompts(comps, prompts)
    want, _ = adapter.pipeline(comps).encode_prompt(prompt=list(prompts), device="cpu", do_classifier_free_guidance=False)
    assert [int(n) for n in text["prompt_embeds_mask"].sum(1)] == [p.shape[0] for p in want]
    assert want[0].shape[0] != want[1].shape[0]
    for i, p in enumerate(want):
        assert torch.equal(text["prompt_embeds"][i, : p.shape[0]], p)
    batch = adapter.collate_text([{k: v[i] for k, v in text.items()} for i in range(2)])
    alone = adapter.collate_text([{k: v[1] for k, v in text.items()}])
    assert "prompt_embeds_mask" in batch and "prompt_embeds_mask" not in alone  # no mask without padding
    # the pipeline's own first transformer call (captured), against predict on its latents at its sigma
    pipe, seen = adapter.pipeline(comps), {}

    def hook(_m, args, out):
        seen.setdefault("call", (args, out[0]))

    h = comps.transformer.register_forward_hook(hook)
    try:
        pipe(prompt=list(prompts), num_inference_steps=2, height=64, width=64, guidance_scale=0.0,
             output_type="latent", generator=torch.Generator().manual_seed(0))
    finally:
        h.remove()
    (x, tt, caps), out = seen["call"]
    sigma = pipe.scheduler.sigmas[0].item()
    assert all(torch.equal(a, b) for a, b in zip(caps, want, strict=True))
    assert torch.allclose(tt, torch.full((2,), 1 - sigma))
    with torch.no_grad():
        got = adapter.predict(comps.transformer, torch.stack(x).squeeze(2), torch.full((2,), sigma), batch)
    assert torch.allclose(got, -torch.stack(out).squeeze(2), atol=1e-6)


def test_modulation_linears():
    """Z-Image's modulation Linears are each block's `adaLN_modulation.0` (the refiners of the caption have none);
    Chroma's blocks have none (its modulation network is outside them)."""
    from trainer import quant

    want = {"z-image": "adaLN_modulation.0", "chroma": None}
    for family in FAMILIES:
        cls = adapter_class(family)
        with torch.device("meta"):
            model = cls.transformer_cls.from_config(cls.full_config)
        blocks = cls().blocks(model)
        names = [n for b in blocks for n, m in b.named_modules() if isinstance(m, torch.nn.Linear)]
        kept = {n for n in names if quant.is_modulation(n, cls.modulation_linears)}
        if want[family] is None:
            assert not kept, family
        else:
            assert kept == {want[family]}
            n_mod = sum(1 for b in blocks for n, _ in b.named_modules() if n == want[family])
            assert n_mod == cls.full_config["n_layers"] + cls.full_config["n_refiner_layers"]


# ---------------------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("family", FAMILIES)
def test_sample_without_cfg_equals_the_pipeline(tiny_models, tmp_path, family):
    """At the guidance that runs no negative pass (Z-Image-Turbo's 0, Chroma-Flash's 1); with CFG on:
    tests/test_sample.py, which has both families."""
    g = CFG_OFF[family]
    assert not adapter_class(family).runs_cfg(g) and adapter_class(family).runs_cfg(CFG_ON[family])
    cfg = _sample_cfg(tiny_models, family, tmp_path, g)
    a = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=7, out=tmp_path / "a"))
    np.testing.assert_array_equal(pixels(a[0]), _diffusers_image(cfg, seed=7))


@pytest.mark.parametrize("family", FAMILIES)
def test_sample_with_a_lora_equals_the_pipeline_and_streams_identically(tiny_models, tmp_path, family):
    cfg = _sample_cfg(tiny_models, family, tmp_path, CFG_ON[family])
    lora = _save_lora(_lora_transformer(cfg), tmp_path / "lora.safetensors")
    plain = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=1, out=tmp_path / "plain"))
    ours = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=1, loras=[f"{lora}:0.7"], out=tmp_path / "l"))
    img = pixels(ours[0])
    assert (img != pixels(plain[0])).mean() > 0.1, "the LoRA must change the image"
    np.testing.assert_array_equal(img, _diffusers_image(cfg, seed=1, lora=(lora, 0.7)))
    streamed = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=1, loras=[f"{lora}:0.7"], offload=1.0,
                                             out=tmp_path / "s"))
    np.testing.assert_array_equal(img, pixels(streamed[0]))


# ---------------------------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def fitted(tiny_models, images, tmp_path_factory):
    """`dittrain fit` of a LoRA YAML config per family: {family: (config path, output folder)}."""
    out = {}
    for family in FAMILIES:
        tmp = tmp_path_factory.mktemp(f"fit-{family}")
        cfg = make_config(tiny_models, images, tmp / "out", tmp / "cache", family, train={"steps": 3, "device": "cpu"},
                          optimizer={"lr": 1e-2}, lora={"rank": 4, "alpha": 2})
        path = tmp / "fit.yaml"
        path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=True)))
        r = CliRunner().invoke(app, ["fit", str(path)])
        assert r.exit_code == 0, r.output
        out[family] = (path, tmp / "out")
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_fit_from_yaml_writes_a_lora_the_pipeline_loads(fitted, family):
    path, out = fitted[family]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and all(np.isfinite(x["loss"]) for x in lines)
    model = yaml.safe_load(path.read_text())["model"]["path"]
    pipe = adapter_class(family).pipeline_cls.from_pretrained(model, torch_dtype=torch.float32, local_files_only=True)
    pipe.load_lora_weights(str(out / "lora.safetensors"))
    adapter = get_adapter(ModelConfig(family=family, path=model, dtype="fp32"))
    lora_keys = [k for k in pipe.transformer.state_dict() if ".lora_A." in k]
    targets = {k.split(".lora_A.")[0].rsplit(".", 1)[-1] for k in lora_keys}
    assert lora_keys and targets <= {t.rsplit(".", 1)[-1] for t in adapter.default_lora_targets}
    text = {"prompt_embeds": torch.randn(1, 7, pipe.transformer.config.get("cap_feat_dim", 0)
                                         or pipe.transformer.config.get("joint_attention_dim"))}
    lat, t = torch.randn(1, 4, 8, 8), torch.tensor([0.5])
    with torch.no_grad():
        tuned = adapter.predict(pipe.transformer.eval(), lat, t, text)
        pipe.disable_lora()
        base = adapter.predict(pipe.transformer, lat, t, text)
    assert (tuned - base).abs().max() > 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_changes_the_pipeline_exactly_as_in_the_trainer(tiny_models, images, caches, tmp_path, family):
    from trainer.train.trainer import Trainer

    cfg = make_config(tiny_models, images, tmp_path / "out", caches / family, family,
                      train={"steps": 3, "device": "cpu"}, optimizer={"lr": 1e-2}, lora={"rank": 4, "alpha": 2})
    t = Trainer(cfg)
    path = t.fit()
    ours, theirs, untrained = lora_predictions(t, path)
    assert torch.equal(ours, theirs)
    assert (theirs - untrained).abs().max() > 1e-4


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> Path:
    """One latent / caption cache per family for the module's fits (`caches / family`): every run of a family
    encodes the same images and captions with the same encoders, so the first encodes and the others reuse."""
    return tmp_path_factory.mktemp("more-families-caches")


def _fit_losses(tiny_models, images, out: Path, cache: Path, family, method="lora", **sections) -> list[float]:
    """The losses of a 2-step CPU fit of `family` (`sections` update make_config's)."""
    from trainer.train.trainer import Trainer

    train = {"steps": 2, "device": "cpu", **sections.pop("train", {})}
    cfg = make_config(tiny_models, images, out, cache, family, method, train=train, **sections)
    t = Trainer(cfg)
    t.fit()
    t.close()
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def resident(tiny_models, images, caches, tmp_path_factory):
    """`resident(family, method)`: the losses of the 2-step resident (offload 0) fit, run once per family and
    method in the module: the reference of the streamed runs (every fraction) and of the compiled one."""
    done = {}

    def get(family, method):
        if (family, method) not in done:
            out = tmp_path_factory.mktemp(f"resident-{family}-{method}")
            done[family, method] = _fit_losses(tiny_models, images, out, caches / family, family, method,
                                               offload={"transformer": 0.0})
        return done[family, method]

    return get


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method,fraction", [("lora", 0.25), ("lora", 1.0), ("full", 0.5)])
def test_streamed_training_equals_resident(tiny_models, images, caches, resident, tmp_path, monkeypatch, family,
                                           method, fraction):
    """Streamed at `fraction` through the conductor's CPU path: the resident run's losses."""
    from trainer.train.trainer import Trainer

    ref = resident(family, method)
    monkeypatch.setattr(Trainer, "_can_stream", lambda self: True)
    got = _fit_losses(tiny_models, images, tmp_path / "off", caches / family, family, method,
                      offload={"transformer": fraction})
    assert len(ref) == 2 and all(np.isfinite(ref))
    assert got == ref


# ---------------------------------------------------------------------------------------------- planner


@pytest.mark.parametrize("family", FAMILIES)
def test_planner_on_the_presets(family):
    """The shipped 8 GB presets of both methods plan at the full-size config and fit their card."""
    from trainer.config import load_config
    from trainer.planner import analyze, report

    for method in ("lora", "full"):
        cfg = load_config(Path("configs") / family / f"{method}-8gb.yaml", [])
        facts = analyze(cfg)
        assert facts.family == family and len(facts.block_param_bytes) == len(adapter_class(family)().blocks(facts.model))
        lines, fraction = report(cfg, vram_gb=8, facts=facts)
        assert fraction is not None and 0 < fraction <= 1, lines


def test_chroma_text_and_predict_as_the_pipeline_does(tiny_models):
    """Captions: T5 on 512 tokens with its mask, the pipeline's `<= length` mask cached beside them; predict: the
    Flux packing and ids, the text mask followed by ones for the image tokens, timestep t."""
    adapter, comps = _components(tiny_models, "chroma")
    prompts = [PROMPT, "a cat"]
    text = adapter.encode_prompts(comps, prompts)
    pe, ids, mask, *_ = adapter.pipeline(comps).encode_prompt(prompt=list(prompts), device="cpu",
                                                              do_classifier_free_guidance=False)
    assert torch.equal(text["prompt_embeds"], pe) and torch.equal(text["prompt_attention_mask"], mask)
    assert mask.shape == (2, 512) and 0 < mask[1].sum() < mask[0].sum() < 512
    batch = adapter.collate_text([{k: v[i] for k, v in text.items()} for i in range(2)])
    lat, t = torch.randn(2, 4, 8, 8), torch.tensor([0.3, 0.8])
    pipe = adapter.pipeline(comps)
    packed = pipe._pack_latents(lat, 2, 4, 8, 8)
    img_ids = pipe._prepare_latent_image_ids(2, 4, 4, "cpu", torch.float32)
    full_mask = pipe._prepare_attention_mask(2, packed.shape[1], torch.float32, mask)
    with torch.no_grad():
        got = adapter.predict(comps.transformer, lat, t, batch)
        out = comps.transformer(hidden_states=packed, timestep=t, encoder_hidden_states=pe, txt_ids=ids,
                                img_ids=img_ids, attention_mask=full_mask, return_dict=False)[0]
    assert torch.equal(got, pipe._unpack_latents(out, 64, 64, 8))


@pytest.mark.parametrize("family,mode", [("z-image", "fp8"), ("chroma", "int8")])
def test_lora_fit_on_an_8bit_base_streams(tiny_models, images, caches, tmp_path, monkeypatch, family, mode):
    """model.quantize: the block Linears are 8-bit, modulation Linears (z-image: adaLN_modulation) keep the model
    dtype, non-block modules (chroma's modulation network) are untouched; a streamed LoRA fit on that base gives
    finite losses and a LoRA the pipeline reproduces up to the base's rounding."""
    from trainer import quant
    from trainer.train.trainer import Trainer

    monkeypatch.setattr(Trainer, "_can_stream", lambda self: True)
    cfg = make_config(tiny_models, images, tmp_path / "out", caches / family, family, model={"quantize": mode},
                      train={"steps": 2, "device": "cpu"}, optimizer={"lr": 1e-2}, offload={"transformer": 0.5})
    t = Trainer(cfg)
    path = t.fit()
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(np.isfinite(x["loss"]) for x in lines)
    lin = {n.removesuffix(".base_layer"): m for b in t.adapter.blocks(t.transformer) for n, m in b.named_modules()
           if isinstance(m, torch.nn.Linear) and "lora_" not in n}
    q = {n for n, m in lin.items() if isinstance(m, quant.QuantizedLinear)}
    kept = set(lin) - q
    assert q and all(quant.is_modulation(n, adapter_class(family).modulation_linears) for n in kept)
    assert bool(kept) == bool(adapter_class(family).modulation_linears)
    mine, theirs, untrained = lora_predictions(t, path)
    assert (theirs - untrained).abs().max() > 1e-3
    assert (mine - theirs).abs().max() / theirs.abs().max() < 0.1


@pytest.mark.parametrize("family,kind", [("z-image", "lokr"), ("chroma", "dora")])
def test_lora_kind_streams_like_resident(tiny_models, images, caches, tmp_path, monkeypatch, family, kind):
    """LoKr / DoRA (lora.type, lora.dora) on the family's default targets: offload 0.5 through the conductor's CPU
    path gives the resident run's losses."""
    from test_lora_types import KINDS

    from trainer.train.trainer import Trainer

    def run(name, f):
        return _fit_losses(tiny_models, images, tmp_path / name, caches / family, family,
                           lora={"rank": 4, "alpha": 8, **KINDS[kind]}, offload={"transformer": f})

    ref = run("ref", 0.0)
    monkeypatch.setattr(Trainer, "_can_stream", lambda self: True)
    assert run("off", 0.5) == ref and all(np.isfinite(ref))


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_training_matches_eager(tiny_models, images, caches, resident, tmp_path, monkeypatch, family):
    """train.compile: the family's block classes compiled (aot_eager on the CPU) train like eager (the module's
    resident LoRA fit: the same config without train.compile)."""
    from trainer.offload import compiled

    monkeypatch.setenv("DITTRAIN_COMPILE_BACKEND", "aot_eager")
    eager = resident(family, "lora")
    got = _fit_losses(tiny_models, images, tmp_path / "out", caches / family, family, train={"compile": True},
                      offload={"transformer": 0.0})
    assert compiled.stats()["graphs"] >= 1
    torch.testing.assert_close(torch.tensor(got), torch.tensor(eager), rtol=1e-5, atol=1e-6)
