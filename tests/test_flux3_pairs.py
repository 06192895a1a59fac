"""Flux.3's optional reference images (the `image_cond` mode) through the pairs layout: the data decides (control/,
control2/ train pairs, plain images text-to-image), a pairs run streams and trains the reference-mode blocks (LoRA
on them), each training prediction is the transformer call diffusers' modular pipeline makes with the same reference
images (one and two), streamed pair training equals resident bit for bit (sampling with a reference during
training included), `dittrain sample --image` equals the modular pipeline's `image=` pixel for pixel with the same
seed and LoRA (one and two references, base and step-distilled), and the planner counts the reference tokens and
blocks for pair data only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from test_flux2_pairs import _pairs
from test_flux3 import modular_pipeline
from test_train_support import losses, make_config, pixels, write_images
from typer.testing import CliRunner

from trainer.cli import app
from trainer.config import Config
from trainer.models import get_adapter
from trainer.models._diffusers import pack_2x2, unpack_2x2

PROMPT = "a cat"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    return _pairs(tmp_path_factory.mktemp("flux3-pairs"))


@pytest.fixture(scope="module")
def pairs2(tmp_path_factory) -> Path:
    """Two references per target: control/ and control2/."""
    return _pairs(tmp_path_factory.mktemp("flux3-pairs2"), references=2)


def _cfg(tiny_models, data: Path, tmp: Path, **sections) -> Config:
    return make_config(tiny_models, data, tmp / "out", tmp / "cache", "flux3", train={"steps": 2},
                       optimizer={"lr": 1e-2}, **sections)


def _fit(tiny_models, data: Path, tmp: Path, **sections):
    """`dittrain fit` of tiny Flux.3 on `data` (2 steps, a reference sample after each): (config path, output folder,
    per training step the (control_latents, noisy latents) shapes `predict` got, or None)."""
    from trainer.models.flux3 import Flux3Adapter

    path = tmp / "flux3.yaml"
    ref = data / "control" / "img0.png"
    sample = {"prompts": [PROMPT], "every": 1, "steps": 2, "width": 64, "height": 64, "guidance": 2.0,
              "image": str(ref)}
    cfg = _cfg(tiny_models, data, tmp, sample=sample, **sections)
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=True)))
    seen, real = [], Flux3Adapter.predict

    def spy(self, transformer, noisy, t, text, guidance=1.0):
        if torch.is_grad_enabled():  # training steps (sampling calls the transformer through the pipeline)
            r = text.get("control_latents")
            seen.append(None if r is None else (tuple(r.shape), tuple(noisy.shape)))
        return real(self, transformer, noisy, t, text, guidance)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Flux3Adapter, "predict", spy)
        r = CliRunner().invoke(app, ["fit", str(path)])
    assert r.exit_code == 0, r.output
    return path, tmp / "out", seen


@pytest.fixture(scope="module")
def fitted2(tiny_models, pairs2, tmp_path_factory):
    return _fit(tiny_models, pairs2, tmp_path_factory.mktemp("flux3-pairs2-fit"))


def test_the_data_decides_blocks_and_lora_targets(tiny_models, pairs, pairs2, tmp_path):
    """Plain images: text-to-image, the reference-mode blocks neither stream nor get LoRA; control/ (and control2/):
    pairs, those blocks stream in the order they run and LoRA targets them."""
    from trainer.data.pipeline import pairs_run, plan_data

    plain = write_images(tmp_path / "plain", n=2)
    cfg = _cfg(tiny_models, plain, tmp_path)
    adapter = get_adapter(cfg.model, references=cfg.data.references())
    assert not pairs_run(adapter, cfg.data) and adapter.references == 0
    tr = adapter.load(cfg.model, parts={"transformer"}, dtype=torch.float32).transformer
    plain_blocks = adapter.blocks(tr)
    assert not any(b in plain_blocks for b in tr.mode_blocks["image_cond"])
    assert not any("image_cond" in t for t in adapter.lora_targets())
    for data, k in ((pairs, 1), (pairs2, 2)):
        cfg = _cfg(tiny_models, data, tmp_path)
        adapter = get_adapter(cfg.model, references=cfg.data.references())
        assert pairs_run(adapter, cfg.data) and adapter.references == k
        plan = plan_data(cfg, adapter, progress=False)
        assert len(plan.items) == 4 and all(len(it.references) == k for it in plan.items)
        blocks = adapter.blocks(tr)
        n_txt, n_img = len(tr.txt_mode_blocks), len(tr.mode_blocks["image"])
        assert blocks[n_txt + n_img: n_txt + 2 * n_img] == list(tr.mode_blocks["image_cond"])
        assert len(blocks) == len(plain_blocks) + len(tr.mode_blocks["image_cond"])
        assert any(t.startswith("mode_blocks.image_cond.0.") for t in adapter.lora_targets())


def test_pairs_fit_hands_the_references_to_predict_and_trains_the_reference_blocks(fitted2, tmp_path):
    from safetensors.torch import load_file

    from trainer import lora_format as lfm

    _, out, seen = fitted2
    assert len(seen) == 2 and all(s is not None and s[0] == (s[1][0], 2, *s[1][1:]) for s in seen)
    assert all(np.isfinite(losses(out)))
    assert len(list((out / "samples").rglob("*.png"))) == 2  # a sample with the reference after each step
    lora = load_file(out / "lora.safetensors")
    cond = [k for k in lora if ".mode_blocks.image_cond." in k and "lora_B" in k]
    assert cond and any(lora[k].abs().max() > 0 for k in cond)  # trained: lora_B starts at zero
    lfm.convert_lora(out / "lora.safetensors", tmp_path / "comfy.safetensors", "comfy")  # BFL's names for them
    comfy = load_file(tmp_path / "comfy.safetensors")
    assert sum(".content_mode_blocks.image_cond." in k and k.endswith("lora_down.weight") for k in comfy) \
        == sum(".image_cond." in k and "lora_A" in k for k in lora)


def _first_call(mp, **kw):
    """The kwargs and output of the first transformer call the modular pipeline makes for `kw`."""
    calls = []

    def hook(_module, _args, kwargs, output):
        if not calls:
            calls.append(({k: v for k, v in kwargs.items()}, output[0]))

    handle = mp.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        mp(**kw, output="images")
    finally:
        handle.remove()
    return calls[0]


@pytest.mark.parametrize("references", [1, 2])
def test_pair_batch_predicts_as_the_modular_pipeline_with_the_reference_images(fitted2, tiny_models, pairs, pairs2,
                                                                               tmp_path, references):
    """The cached references give the tokens and ids the modular pipeline's reference steps make of the control files
    (one reference: its "fill" preparation, two: "crop"; both the image as it is at 64 px), and `predict` on the
    pipeline's first transformer inputs gives its output; the loss without them is another."""
    from diffusers import ClassifierFreeGuidance

    from trainer.data import prepare_data
    from trainer.models.flux3 import image_ids
    from trainer.train.objective import FlowMatching

    path, out, _ = fitted2
    cfg = _cfg(tiny_models, pairs if references == 1 else pairs2, tmp_path)
    adapter = get_adapter(cfg.model, references=references)
    data = prepare_data(cfg, adapter, progress=False)
    b = data.batch_at(0)
    ref = b.text["control_latents"]
    assert ref.shape == (b.latents.shape if references == 1 else (2, 2, *b.latents.shape[1:]))
    _, comps = _components(tiny_models)
    mp = modular_pipeline(comps)
    mp.load_lora_weights(str(out / "lora.safetensors"))
    mp.update_components(guider=ClassifierFreeGuidance(guidance_scale=1.0))
    tr = mp.transformer.eval()
    item = next(it for it in data.plan.items if it.file == b.files[0])
    images = []
    for f, _, _ in item.references:
        with Image.open(f) as im:
            images.append(im.convert("RGB"))
    kw, theirs = _first_call(mp, prompt=PROMPT, image=images if references > 1 else images[0], height=64, width=64,
                             num_inference_steps=1, generator=torch.Generator().manual_seed(0))
    mine = ref[:1].unbind(1) if references > 1 else (ref[:1],)
    torch.testing.assert_close(torch.cat([pack_2x2(r) for r in mine], 1), kw["image_cond_hidden_states"],
                               rtol=1e-4, atol=1e-4)
    assert torch.equal(torch.cat([image_ids(4, 4, "cpu", -(k + 1)) for k in range(references)]), kw["image_cond_ids"])
    # `predict` on the pipeline's own first inputs (its reference tokens back in our latent layout) is its call
    own = torch.stack([unpack_2x2(c, 8, 8) for c in kw["image_cond_hidden_states"].chunk(references, 1)], 1)
    text = {"prompt_embeds": kw["encoder_hidden_states"], "control_latents": own if references > 1 else own[:, 0]}
    with torch.no_grad():
        ours = adapter.predict(tr, unpack_2x2(kw["hidden_states"], 8, 8), kw["timestep"], text)
    assert torch.equal(pack_2x2(ours), theirs)
    n = FlowMatching(cfg.train.model_copy(update={"timestep_sampling": "uniform"}), seed=5).noise(b.latents)
    with torch.no_grad():
        with_ref = adapter.predict(tr, n.noisy, n.t, b.text)
        plain = adapter.predict(tr, n.noisy, n.t, {k: v for k, v in b.text.items() if k != "control_latents"})
    assert not torch.allclose(((with_ref - n.target) ** 2).mean(), ((plain - n.target) ** 2).mean())


def _components(tiny_models: Path, folder: str = "flux3"):
    from trainer.config import ModelConfig

    mc = ModelConfig(family="flux3", path=tiny_models / folder, dtype="fp32")
    adapter = get_adapter(mc)
    return adapter, adapter.load(mc, parts={"transformer", "vae", "text", "scheduler"}, dtype=torch.float32)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_streamed_pair_training_is_bitwise_resident(fitted2, tiny_models, pairs2, tmp_path, fraction):
    """Streaming the reference-mode blocks with the rest changes nothing: losses, the LoRA after 2 steps and the
    samples with a reference made through the training ring equal the resident run's bit for bit."""
    from safetensors.torch import load_file

    _, out, _ = fitted2
    _, streamed, seen = _fit(tiny_models, pairs2, tmp_path, offload={"transformer": fraction})
    assert len(seen) == 2 and all(s is not None for s in seen)
    assert losses(streamed) == losses(out)
    a, b = load_file(out / "lora.safetensors"), load_file(streamed / "lora.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    pngs = [sorted((o / "samples").rglob("*.png")) for o in (out, streamed)]
    assert len(pngs[0]) == len(pngs[1]) == 2
    for x, y in zip(*pngs, strict=True):
        np.testing.assert_array_equal(pixels(x), pixels(y))


@pytest.mark.parametrize(("method", "model"), [("full", {}), ("lora", {"quantize": "fp8"})], ids=["full", "lora-fp8"])
def test_streamed_full_and_fp8_pair_training_equal_resident(tiny_models, pairs, tmp_path, method, model):
    """A full fine-tune streams the reference-mode blocks' weights with their optimizer state, an fp8 base quantizes
    them like the other blocks: either way half the blocks streamed trains as resident, bit for bit (LoRA: with
    text-to-image samples, which skip the reference-mode blocks in the training ring, equal too)."""
    from trainer.train.trainer import Trainer

    runs = {}
    sample = {"sample": {"prompts": [PROMPT], "every": 1, "steps": 2, "width": 32, "height": 32, "guidance": 2.0}}
    for fraction in (0.0, 0.5):
        out = tmp_path / f"f{fraction}"
        cfg = make_config(tiny_models, pairs, out, tmp_path / "cache", "flux3", method, train={"steps": 2},
                          model=model, offload={"transformer": fraction}, **(sample if method == "lora" else {}))
        t = Trainer(cfg)
        t.fit()
        assert t.adapter.references == 1
        if model:  # the reference-mode blocks' Linears are 8-bit like the other blocks'
            q = t.transformer.get_submodule("mode_blocks.image_cond.0.attn.to_q").base_layer.weight
            assert q.dtype == torch.float8_e4m3fn
        runs[fraction] = losses(out)
    assert runs[0.5] == runs[0.0] and all(np.isfinite(runs[0.0]))
    if method == "lora":
        pngs = [sorted((tmp_path / f"f{f}" / "samples").rglob("*.png")) for f in (0.0, 0.5)]
        assert len(pngs[0]) == len(pngs[1]) == 2
        for x, y in zip(*pngs, strict=True):
            np.testing.assert_array_equal(pixels(x), pixels(y))


@pytest.mark.parametrize(("folder", "guidance"), [("flux3", 2.0), ("flux3-distilled", 1.0)])
def test_sample_cli_image_equals_the_modular_pipeline(fitted2, tiny_models, tmp_path, folder, guidance):
    """`dittrain sample --image` (streamed at 0.5, the reference cut to the sample's size) with the pairs LoRA: the
    modular pipeline's `image=` with the same seed, pixel for pixel; two `--image`s: its list, in order."""
    from diffusers import ClassifierFreeGuidance

    path, out, _ = fitted2
    raw = yaml.safe_load(path.read_text())
    raw["model"]["path"] = str(tiny_models / folder)
    raw["sample"]["guidance"] = guidance
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    rng = np.random.default_rng(1)
    refs = [Image.fromarray(rng.integers(0, 256, (80, 64, 3), dtype=np.uint8)) for _ in range(2)]  # 64 x 80
    for k, im in enumerate(refs):
        im.save(tmp_path / f"r{k}.png")
    cut = [im.crop((0, 8, 64, 72)) for im in refs]  # the training rule: cover 64 x 64, centre crop
    lora = str(out / "lora.safetensors")
    _, comps = _components(tiny_models, folder)
    mp = modular_pipeline(comps, "distilled" in folder)
    mp.load_lora_weights(lora)
    kw = {} if "distilled" in folder else {"negative_prompt": ""}
    if "distilled" not in folder:
        mp.update_components(guider=ClassifierFreeGuidance(guidance_scale=guidance))
    for images in (["r0.png"], ["r0.png", "r1.png"]):
        args = [a for f in images for a in ("--image", str(tmp_path / f))]
        dest = tmp_path / f"out{len(images)}"
        r = CliRunner().invoke(app, ["sample", str(tmp_path / "c.yaml"), "-p", PROMPT, *args, "--seed", "3",
                                     "--lora", lora, "--offload", "0.5", "--out", str(dest)])
        assert r.exit_code == 0, r.output
        (png,) = sorted(dest.glob("*.png"))
        image = cut[0] if len(images) == 1 else cut
        (theirs,) = mp(prompt=PROMPT, image=image, height=64, width=64, num_inference_steps=2,
                       generator=torch.Generator().manual_seed(3), output="images", **kw)
        np.testing.assert_array_equal(pixels(png), np.asarray(theirs.convert("RGB")))
    (plain,) = mp(prompt=PROMPT, height=64, width=64, num_inference_steps=2,
                  generator=torch.Generator().manual_seed(3), output="images", **kw)
    assert (pixels(png) != np.asarray(plain.convert("RGB"))).any(), "the references must change the result"


def test_planner_counts_the_reference_tokens_and_blocks_for_pair_data_only(tiny_models, pairs, pairs2, tmp_path):
    from trainer.planner import analyze
    from trainer.planner import report as planner_report
    from trainer.planner import trace as ptrace

    plain = write_images(tmp_path / "plain", n=2)
    without, one, two = (analyze(_cfg(tiny_models, d, tmp_path)) for d in (plain, pairs, pairs2))
    assert (without.references, one.references, two.references) == (0, 1, 2)
    cond = without.model.config.num_layers  # reference-mode blocks of the tiny model
    assert len(one.blocks) == len(two.blocks) == len(without.blocks) + cond
    assert one.trainable_params > without.trainable_params  # LoRA on the reference-mode blocks
    n = 64 // 16 * (64 // 16)  # image tokens of one 64 px image
    kw = ptrace.forward_inputs("flux3", two.model, 2, 64, 64, 8, torch.float32, references=2)
    assert kw["image_cond_hidden_states"].shape[1] == kw["image_cond_ids"].shape[0] == 2 * n
    assert without.trace(64).checkpoint_inputs < one.trace(64).checkpoint_inputs < two.trace(64).checkpoint_inputs
    cfg = _cfg(tiny_models, pairs, tmp_path)
    cfg.data.resolutions = [1024]
    lines, _ = planner_report(cfg, facts=analyze(cfg))
    assert any("8192+" in line for line in lines)  # 4096 image tokens at 1024 px, twice with a reference


def test_more_references_than_the_pipeline_takes_is_one_line(tiny_models, tmp_path):
    from trainer.models.flux3 import Flux3Adapter

    assert Flux3Adapter.max_references == 10
    path = tmp_path / "c.yaml"
    cfg = _cfg(tiny_models, write_images(tmp_path / "d", n=1), tmp_path)
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=True)))
    Image.new("RGB", (64, 64)).save(tmp_path / "r.png")
    r = CliRunner().invoke(app, ["sample", str(path), "-p", PROMPT, *["--image", str(tmp_path / "r.png")] * 11])
    assert r.exit_code != 0 and "--image given 11 times: flux3 takes at most 10 reference images" in r.output
