"""Edit families trained on image pairs (flux-kontext): the adapter builds the transformer inputs exactly as
FluxKontextPipeline does, pairs are found in `control/` folders or a metadata `control` column and both latents
are cached, a tiny fit from YAML lowers nothing it should not and writes a LoRA that FluxKontextPipeline loads,
`dittrain sample --image` equals the pipeline called with the same reference, and the planner sees the doubled
sequence."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from test_train_support import pixels, write_images
from typer.testing import CliRunner

from trainer.cli import app
from trainer.config import Config, ModelConfig
from trainer.models import get_adapter

PROMPT = "a red square on a blue background"


@pytest.fixture(scope="module")
def kontext(tiny_models) -> Path:
    """The tiny Kontext model folder (tests/conftest.py)."""
    return tiny_models / "flux-kontext"


def _pairs(folder: Path, n: int = 4) -> Path:
    """Targets with captions, their references (inverted colours) in control/ under the same names."""
    write_images(folder, n=n)
    (folder / "control").mkdir(exist_ok=True)
    for p in sorted(folder.glob("img*.png")):
        Image.fromarray(255 - np.asarray(Image.open(p))).save(folder / "control" / p.name)
    return folder


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    return _pairs(tmp_path_factory.mktemp("pairs"))


def _config(model: Path, data: Path, tmp: Path, **extra) -> dict:
    cfg = {
        "model": {"family": "flux-kontext", "path": str(model), "dtype": "fp32"},
        "train": {"steps": 3, "batch_size": 2, "seed": 0, "checkpoint_every": 0, "device": "cpu"},
        "lora": {"rank": 4, "alpha": 8},
        "optimizer": {"lr": 1e-2},
        "data": {"sources": [{"path": str(data)}], "resolutions": [64], "cache_dir": str(tmp / "cache")},
        "sample": {"steps": 2, "width": 32, "height": 32, "guidance": 3.5},
        "output": {"dir": str(tmp / "out"), "tensorboard": False},
    }
    for k, v in extra.items():
        cfg.setdefault(k, {}).update(v)
    return cfg


@pytest.fixture(scope="module")
def fitted(kontext, pairs, tmp_path_factory):
    """`dittrain fit` of a YAML config on the pairs: (config path, output folder)."""
    tmp = tmp_path_factory.mktemp("kontext-fit")
    path = tmp / "kontext.yaml"
    path.write_text(yaml.safe_dump(_config(kontext, pairs, tmp)))
    r = CliRunner().invoke(app, ["fit", str(path)])
    assert r.exit_code == 0, r.output
    return path, tmp / "out"


def test_predict_builds_the_inputs_as_flux_kontext_pipeline_does(kontext):
    from diffusers import FluxKontextPipeline

    adapter = get_adapter(ModelConfig(family="flux-kontext", path=kontext, dtype="fp32"))
    tr = adapter.load(adapter.cfg, parts={"transformer"}, dtype=torch.float32).transformer.eval()
    pipe = FluxKontextPipeline.from_pretrained(str(kontext), transformer=tr, torch_dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    b, h, w, rh, rw = 2, 4, 6, 4, 6  # latent sides (target and reference)
    x, ref = torch.randn(b, 4, h, w, generator=g), torch.randn(b, 4, rh, rw, generator=g)
    t = torch.tensor([0.3, 0.8])
    text = {"prompt_embeds": torch.randn(b, 7, 32, generator=g), "pooled_prompt_embeds": torch.randn(b, 32, generator=g)}
    with torch.no_grad():
        ours = adapter.predict(tr, x, t, {**text, "control_latents": ref}, guidance=2.5)
        # the pipeline's own helpers: packed latents and ids (image ids of the reference with first id 1)
        lat, img_lat, lat_ids, img_ids = pipe.prepare_latents(
            ref, b, 4, h * 8, w * 8, torch.float32, "cpu", None, latents=pipe._pack_latents(x, b, 4, h, w))
        assert img_ids[0, 0] == 1
        out = tr(hidden_states=torch.cat([lat, img_lat], 1), timestep=t, guidance=torch.full((b,), 2.5),
                 pooled_projections=text["pooled_prompt_embeds"], encoder_hidden_states=text["prompt_embeds"],
                 txt_ids=torch.zeros(7, 3), img_ids=torch.cat([lat_ids, img_ids]), return_dict=False)[0]
        theirs = pipe._unpack_latents(out[:, : lat.shape[1]], h * 8, w * 8, 8)
        plain = adapter.predict(tr, x, t, text, guidance=2.5)  # no reference: plain Flux
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert (ours - plain).abs().max() > 1e-4


def test_pairs_from_control_folders_and_metadata(pairs, tmp_path):
    from trainer.data.sources import scan_sources

    src = lambda p, **k: Config.model_validate(  # noqa: E731
        {"model": {"family": "flux", "path": "x"}, "data": {"sources": [{"path": str(p), **k}]},
         "output": {"dir": "o"}}).data.sources[0]
    rep = scan_sources([src(pairs)], controls=True)
    assert len(rep.items) == 4 and not rep.bad  # control/ holds references, not training images
    assert all(Path(it.control) == pairs / "control" / Path(it.file).name for it in rep.items)
    assert all(it.control_sha and it.control_size == (64, 64) for it in rep.items)
    plain = scan_sources([src(pairs)])  # without pairs, control/ is scanned as images (which lack captions)
    assert len(plain.items) == 4 and sum("control" in f for f, _ in plain.bad) == 4
    # a target without a reference is left out with the reason
    broken = _pairs(tmp_path / "broken", n=2)
    (broken / "control" / "img1.png").unlink()
    rep = scan_sources([src(broken)], controls=True)
    assert [Path(it.file).name for it in rep.items] == ["img0.png"]
    assert "missing reference image" in rep.bad[0][1]
    # metadata.jsonl with a control column (any file name)
    meta = tmp_path / "meta"
    write_images(meta, n=2)
    Image.new("RGB", (64, 64), (1, 2, 3)).save(meta / "ref.png")
    (meta / "metadata.jsonl").write_text("\n".join(
        json.dumps({"file": f"img{i}.png", "caption": "edit", "control": "ref.png"}) for i in range(2)))
    rep = scan_sources([src(meta, metadata=Path("metadata.jsonl"))], controls=True)
    assert [Path(it.control).name for it in rep.items] == ["ref.png", "ref.png"] and not rep.bad


def test_fit_from_yaml_caches_both_latents_and_the_lora_loads_in_kontext_pipeline(fitted, kontext):
    from diffusers import FluxKontextPipeline

    from trainer.data import prepare_data
    from trainer.train.objective import FlowMatching

    path, out = fitted
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and all(np.isfinite(x["loss"]) for x in lines)
    cfg = Config.model_validate(yaml.safe_load(path.read_text()))
    adapter = get_adapter(cfg.model)
    data = prepare_data(cfg, adapter, progress=False)
    assert data.encode.latents_new == 0 and data.encode.latents_hit == 8  # 4 targets + 4 references, all cached
    b = data.batch_at(0)
    ref = b.text["control_latents"]
    assert ref.shape == b.latents.shape and not torch.equal(ref, b.latents)
    # the reference is the control image's latent: encoding control/<name> gives it
    comps = adapter.load(cfg.model, parts={"vae"}, dtype=torch.float32)
    from trainer.data.images import load_pixels

    want = adapter.encode_images(comps.vae, load_pixels(data.plan.items[0].control, (64, 64), (0, 0))[None])[0]
    keys = [data.plan.control_key(e) for e in data.entries if e.item == 0]
    torch.testing.assert_close(data.plan.latent_store.get(keys[0])["latent"], want)

    pipe = FluxKontextPipeline.from_pretrained(str(kontext), torch_dtype=torch.float32, local_files_only=True)
    base = type(pipe.transformer).from_pretrained(str(kontext), subfolder="transformer").eval()
    pipe.load_lora_weights(str(out / "lora.safetensors"))
    n = FlowMatching(cfg.train.model_copy(update={"timestep_sampling": "uniform"}), seed=5).noise(b.latents)
    with torch.no_grad():
        tuned = adapter.predict(pipe.transformer.eval(), n.noisy, n.t, b.text, guidance=3.5)
        untrained = adapter.predict(base, n.noisy, n.t, b.text, guidance=3.5)
    assert (tuned - untrained).abs().max() > 1e-4


def test_sample_with_image_equals_the_kontext_pipeline(fitted, kontext, tmp_path):
    from diffusers import FluxKontextPipeline

    from trainer.models._diffusers import own_aligned_memory

    path, out = fitted
    ref = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    ref.save(tmp_path / "ref.png")
    other = tmp_path / "other.png"
    Image.new("RGB", (48, 40), (200, 10, 10)).save(other)
    lora = str(out / "lora.safetensors")

    def sample(image: Path, folder: str) -> np.ndarray:
        r = CliRunner().invoke(app, ["sample", str(path), "-p", PROMPT, "--image", str(image), "--seed", "3",
                                     "--lora", lora, "--out", str(tmp_path / folder)])
        assert r.exit_code == 0, r.output
        (png,) = sorted((tmp_path / folder).glob("*.png"))
        with Image.open(png) as im:
            assert json.loads(im.info["dittrain"])["image"] == str(image)
            return np.asarray(im.convert("RGB")).copy()

    ours = sample(tmp_path / "ref.png", "a")
    pipe = FluxKontextPipeline.from_pretrained(str(kontext), torch_dtype=torch.float32, local_files_only=True)
    own_aligned_memory(pipe.transformer)  # as our loader does: same memory alignment, same CPU rounding
    pipe.load_lora_weights(lora)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(prompt=PROMPT, image=ref, _auto_resize=False, height=32, width=32, max_area=32 * 32,
                  num_inference_steps=2, guidance_scale=3.5, generator=torch.Generator().manual_seed(3)).images[0]
    assert ours.shape == (32, 32, 3)  # the size asked for, not the pipeline's ~1 MP (issue 30 item 2)
    np.testing.assert_array_equal(ours, np.asarray(theirs.convert("RGB")))
    assert (sample(other, "b") != ours).any(), "the reference image must change the result"


def test_image_flag_is_refused_for_families_without_a_reference(tiny_models, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"family": "flux", "path": str(tiny_models / "flux")},
                                   "output": {"dir": str(tmp_path / "o")}}))
    Image.new("RGB", (32, 32)).save(tmp_path / "r.png")
    r = CliRunner().invoke(app, ["sample", str(cfg), "-p", "x", "--image", str(tmp_path / "r.png")])
    assert r.exit_code != 0 and "--image is for edit models" in r.output


def test_planner_sees_the_reference_tokens():
    from trainer.models import adapter_class

    flux, kon = adapter_class("flux"), adapter_class("flux-kontext")
    with torch.device("meta"):
        model = flux.transformer_cls.from_config(flux.full_config)
    a = flux.dummy_inputs(model, 1, 1024, 1024, 512, torch.bfloat16)
    b = kon.dummy_inputs(model, 1, 1024, 1024, 512, torch.bfloat16)
    assert a["hidden_states"].shape[1] == 4096 and b["hidden_states"].shape[1] == 8192
    assert b["img_ids"].shape[0] == 8192


def _streamed_and_resident_losses(make_config, model, pairs, method, fraction, tmp_path, monkeypatch):
    """[losses streamed at `fraction` through the conductor's CPU path, losses resident] of a 2-step fit."""
    from trainer.train.trainer import Trainer

    def cfg(name, f):
        c = make_config(model, pairs, tmp_path, train={"steps": 2, "method": method},
                        output={"dir": str(tmp_path / name)}, offload={"transformer": f})
        if method == "full":
            c["optimizer"].update({"lr": 1e-4, "fused_back_pass": True, "max_grad_norm": None})
        return Config.model_validate(c)

    Trainer(cfg("ref", 0.0)).fit()
    monkeypatch.setattr(Trainer, "_can_stream", lambda self: True)
    Trainer(cfg("off", fraction)).fit()
    return [[json.loads(x)["loss"] for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()]
            for n in ("off", "ref")]


@pytest.mark.parametrize("method,fraction", [("lora", 0.5), ("full", 1.0)])
def test_streamed_kontext_trains_like_resident(method, fraction, kontext, pairs, tmp_path, monkeypatch):
    """LoRA and full fine-tuning through the conductor's CPU path (the doubled sequence streams like any other):
    the same losses as resident."""
    got = _streamed_and_resident_losses(_config, kontext, pairs, method, fraction, tmp_path, monkeypatch)
    assert len(got[1]) == 2
    assert got[0] == pytest.approx(got[1], rel=1e-6)


# ---------------------------------------------------------------------------------------------- qwen-image-edit


@pytest.fixture(scope="module")
def qwen_edit(tiny_models) -> Path:
    """The tiny Qwen-Image-Edit folder (tests/conftest.py)."""
    return tiny_models / "qwen-image-edit"


def _qwen_config(model: Path, data: Path, tmp: Path, **extra) -> dict:
    cfg = _config(model, data, tmp, **extra)
    cfg["model"]["family"] = "qwen-image-edit"
    cfg["sample"]["guidance"] = 1.0
    return cfg


@pytest.fixture(scope="module")
def qwen_fitted(qwen_edit, pairs, tmp_path_factory):
    """`dittrain fit` of a qwen-image-edit YAML config on the pairs: (config path, output folder)."""
    tmp = tmp_path_factory.mktemp("qwen-edit-fit")
    path = tmp / "qwen-edit.yaml"
    path.write_text(yaml.safe_dump(_qwen_config(qwen_edit, pairs, tmp)))
    r = CliRunner().invoke(app, ["fit", str(path)])
    assert r.exit_code == 0, r.output
    return path, tmp / "out"


def test_qwen_edit_predict_and_text_as_the_pipeline_does(qwen_edit):
    """predict: [target, reference] tokens with two img_shapes, the target part returned; the text: the
    pipeline's own encode_prompt with the reference image."""
    from diffusers import QwenImageEditPipeline

    from trainer.models.qwen_image_edit import load_processor

    adapter = get_adapter(ModelConfig(family="qwen-image-edit", path=qwen_edit, dtype="fp32"))
    comps = adapter.load(adapter.cfg, parts={"transformer", "text"}, dtype=torch.float32)
    tr = comps.transformer.eval()
    pipe = QwenImageEditPipeline.from_pretrained(str(qwen_edit), transformer=tr, processor=load_processor(
        qwen_edit / "processor"), torch_dtype=torch.float32, local_files_only=True)
    g = torch.Generator().manual_seed(0)
    b, h, w = 2, 4, 6
    x, ref = torch.randn(b, 4, h, w, generator=g), torch.randn(b, 4, h, w, generator=g)
    t = torch.tensor([0.3, 0.8])
    ims = [Image.fromarray(np.random.default_rng(i).integers(0, 256, (48, 64, 3), dtype=np.uint8)) for i in range(b)]
    ours = adapter.encode_prompts(comps, [PROMPT, "edit"], images=ims)
    pe, mask = pipe.encode_prompt(prompt=[PROMPT, "edit"], image=ims, device="cpu")
    torch.testing.assert_close(ours["prompt_embeds"], pe, rtol=0, atol=0)
    other = adapter.encode_prompts(comps, [PROMPT, "edit"], images=ims[::-1])
    assert (other["prompt_embeds"][0] - ours["prompt_embeds"][0]).abs().max() > 1e-4  # the image is seen
    text = {"prompt_embeds": pe, "prompt_embeds_mask": mask}
    with torch.no_grad():
        got = adapter.predict(tr, x, t, {**text, "control_latents": ref})
        lat, img_lat = pipe.prepare_latents(ref[:, :, None], b, 4, h * 8, w * 8, torch.float32, "cpu", None,
                                            latents=pipe._pack_latents(x[:, :, None], b, 4, h, w))
        out = tr(hidden_states=torch.cat([lat, img_lat], 1), timestep=t, encoder_hidden_states=pe,
                 encoder_hidden_states_mask=mask, img_shapes=[[(1, h // 2, w // 2), (1, h // 2, w // 2)]] * b,
                 return_dict=False)[0]
        theirs = pipe._unpack_latents(out[:, : lat.shape[1]], h * 8, w * 8, 8)[:, :, 0]
        plain = adapter.predict(tr, x, t, text)
    torch.testing.assert_close(got, theirs, rtol=0, atol=0)
    assert (got - plain).abs().max() > 1e-4


def test_qwen_edit_text_cache_key_includes_the_reference(qwen_edit, tmp_path):
    """Same captions, references differing only in content: different text-cache keys, and both are encoded."""
    from trainer.data.pipeline import plan_data

    a, b = _pairs(tmp_path / "a", n=2), _pairs(tmp_path / "b", n=2)
    Image.new("RGB", (64, 64), (0, 200, 0)).save(b / "control" / "img0.png")  # only this reference differs

    def plan(folder):
        cfg = Config.model_validate(_qwen_config(qwen_edit, folder, tmp_path / folder.name))
        return cfg, plan_data(cfg, get_adapter(cfg.model), progress=False)

    (_, pa), (_, pb) = plan(a), plan(b)
    ka = {Path(pa.items[e.item].file).name: pa.text_id(e, PROMPT) for e in pa.entries}
    kb = {Path(pb.items[e.item].file).name: pb.text_id(e, PROMPT) for e in pb.entries}
    assert ka["img0.png"] != kb["img0.png"] and ka["img1.png"] == kb["img1.png"]
    jobs = pa.captions()
    assert all(j.ref is not None for j in jobs) and {j.caption for j in jobs} >= {""}
    assert len({j.key for j in jobs}) == len(jobs)


def test_qwen_edit_fit_caches_both_latents_and_the_lora_loads_in_the_pipeline(qwen_fitted, qwen_edit):
    from diffusers import QwenImageEditPipeline

    from trainer.data import prepare_data
    from trainer.models.qwen_image_edit import load_processor
    from trainer.train.objective import FlowMatching

    path, out = qwen_fitted
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and all(np.isfinite(x["loss"]) for x in lines)
    cfg = Config.model_validate(yaml.safe_load(path.read_text()))
    adapter = get_adapter(cfg.model)
    data = prepare_data(cfg, adapter, progress=False)
    assert data.encode.latents_new == 0 and data.encode.latents_hit == 8  # 4 targets + 4 references
    assert data.encode.texts_new == 0 and data.encode.texts_hit == 8  # (caption, reference) and ("", reference)
    b = data.batch_at(0)
    assert b.text["control_latents"].shape == b.latents.shape
    pipe = QwenImageEditPipeline.from_pretrained(str(qwen_edit), processor=load_processor(qwen_edit / "processor"),
                                                 torch_dtype=torch.float32, local_files_only=True)
    base = type(pipe.transformer).from_pretrained(str(qwen_edit), subfolder="transformer").eval()
    pipe.load_lora_weights(str(out / "lora.safetensors"))
    n = FlowMatching(cfg.train.model_copy(update={"timestep_sampling": "uniform"}), seed=5).noise(b.latents)
    with torch.no_grad():
        tuned = adapter.predict(pipe.transformer.eval(), n.noisy, n.t, b.text)
        untrained = adapter.predict(base, n.noisy, n.t, b.text)
    assert (tuned - untrained).abs().max() > 1e-4


def test_qwen_edit_sample_with_image_equals_the_pipeline(qwen_fitted, qwen_edit, tmp_path):
    from diffusers import QwenImageEditPipeline

    from trainer.models._diffusers import own_aligned_memory
    from trainer.models.qwen_image_edit import load_processor

    path, out = qwen_fitted
    ref = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    ref.save(tmp_path / "ref.png")
    lora = str(out / "lora.safetensors")
    r = CliRunner().invoke(app, ["sample", str(path), "-p", PROMPT, "--image", str(tmp_path / "ref.png"), "--seed",
                                 "3", "--lora", lora, "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    (png,) = sorted((tmp_path / "a").glob("*.png"))
    ours = pixels(png)
    pipe = QwenImageEditPipeline.from_pretrained(str(qwen_edit), processor=load_processor(qwen_edit / "processor"),
                                                 torch_dtype=torch.float32, local_files_only=True)
    own_aligned_memory(pipe.transformer)
    pipe.load_lora_weights(lora)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(prompt=PROMPT, image=ref, height=32, width=32, num_inference_steps=2, true_cfg_scale=1.0,
                  generator=torch.Generator().manual_seed(3)).images[0]
    np.testing.assert_array_equal(ours, np.asarray(theirs.convert("RGB")))
    r = CliRunner().invoke(app, ["sample", str(path), "-p", PROMPT, "--out", str(tmp_path / "b")])
    assert r.exit_code != 0 and "need a reference image" in r.output


def test_qwen_edit_planner_sees_the_reference_tokens():
    from trainer.models import adapter_class

    qi, qe = adapter_class("qwen-image"), adapter_class("qwen-image-edit")
    with torch.device("meta"):
        model = qi.transformer_cls.from_config(qi.full_config)
    a = qi.dummy_inputs(model, 1, 1024, 1024, 256, torch.bfloat16)
    b = qe.dummy_inputs(model, 1, 1024, 1024, 256, torch.bfloat16)
    assert a["hidden_states"].shape[1] == 4096 and b["hidden_states"].shape[1] == 8192
    assert b["img_shapes"] == [[(1, 64, 64), (1, 64, 64)]]
    assert qe.text_tokens > qi.text_tokens  # the reference's vision tokens sit in the text sequence


@pytest.mark.parametrize("method,fraction", [("lora", 0.5), ("full", 1.0)])
def test_streamed_qwen_edit_trains_like_resident(method, fraction, qwen_edit, pairs, tmp_path, monkeypatch):
    got = _streamed_and_resident_losses(_qwen_config, qwen_edit, pairs, method, fraction, tmp_path, monkeypatch)
    assert len(got[1]) == 2
    assert got[0] == pytest.approx(got[1], rel=1e-6)


# ---------------------------------------------------------------------------------------------- qwen-image-edit-plus


@pytest.fixture(scope="module")
def qwen_plus(tiny_models) -> Path:
    """The tiny Qwen-Image-Edit-2509 folder (saved as a QwenImageEditPlusPipeline)."""
    return tiny_models / "qwen-image-edit-plus"


def _plus_config(model: Path, data: Path, tmp: Path, **extra) -> dict:
    cfg = _qwen_config(model, data, tmp, **extra)
    cfg["model"]["family"] = "qwen-image-edit-plus"
    return cfg


def _plus_pipe(folder: Path, **kw):
    from diffusers import QwenImageEditPlusPipeline

    from trainer.models.qwen_image_edit import load_processor

    return QwenImageEditPlusPipeline.from_pretrained(str(folder), processor=load_processor(folder / "processor"),
                                                     torch_dtype=torch.float32, local_files_only=True, **kw)


@pytest.fixture(scope="module")
def plus_fitted(qwen_plus, pairs, tmp_path_factory):
    """`dittrain fit` of a qwen-image-edit-plus YAML config on the pairs: (config path, output folder)."""
    tmp = tmp_path_factory.mktemp("qwen-plus-fit")
    path = tmp / "qwen-plus.yaml"
    path.write_text(yaml.safe_dump(_plus_config(qwen_plus, pairs, tmp)))
    r = CliRunner().invoke(app, ["fit", str(path)])
    assert r.exit_code == 0, r.output
    return path, tmp / "out"


def test_qwen_plus_text_and_predict_as_the_pipeline_does(qwen_plus):
    """The text: QwenImageEditPlusPipeline's encode_prompt with the reference at its condition size (the
    pipeline's own resize to ~384x384 area) and its "Picture 1:" template; predict: the transformer called as
    that pipeline calls it."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
        CONDITION_IMAGE_SIZE,
        calculate_dimensions,
    )

    adapter = get_adapter(ModelConfig(family="qwen-image-edit-plus", path=qwen_plus, dtype="fp32"))
    comps = adapter.load(adapter.cfg, parts={"transformer", "text"}, dtype=torch.float32)
    tr = comps.transformer.eval()
    pipe = _plus_pipe(qwen_plus, transformer=tr)
    rng = np.random.default_rng(0)
    ims = [Image.fromarray(rng.integers(0, 256, s, dtype=np.uint8)) for s in ((48, 64, 3), (80, 40, 3))]
    prompts = [PROMPT, "edit"]
    batched = adapter.encode_prompts(comps, prompts, images=ims)
    for i, (p, im) in enumerate(zip(prompts, ims, strict=True)):
        w, h = calculate_dimensions(CONDITION_IMAGE_SIZE, im.width / im.height)
        pe, mask = pipe.encode_prompt(prompt=p, image=[pipe.image_processor.resize(im, h, w)], device="cpu")
        ours = adapter.encode_prompts(comps, [p], images=[im])
        torch.testing.assert_close(ours["prompt_embeds"], pe, rtol=0, atol=0)
        n = pe.shape[1]
        assert int(batched["prompt_embeds_mask"][i].sum()) == n
        torch.testing.assert_close(batched["prompt_embeds"][i, :n], pe[0], rtol=1e-4, atol=1e-5)
    # not Qwen-Image-Edit's text: another template, the reference seen at another size
    edit = get_adapter(ModelConfig(family="qwen-image-edit", path=qwen_plus, dtype="fp32"))
    old = edit.encode_prompts(comps, [PROMPT], images=ims[:1])["prompt_embeds"]
    new = adapter.encode_prompts(comps, [PROMPT], images=ims[:1])["prompt_embeds"]
    assert old.shape != new.shape or (old - new).abs().max() > 1e-4

    g = torch.Generator().manual_seed(0)
    b, h, w = 1, 4, 6  # the Plus pipeline runs one prompt at a time
    x, ref = torch.randn(b, 4, h, w, generator=g), torch.randn(b, 4, h, w, generator=g)
    t = torch.tensor([0.3])
    text = adapter.encode_prompts(comps, [PROMPT], images=ims[:1])
    with torch.no_grad():
        got = adapter.predict(tr, x, t, {**text, "control_latents": ref})
        lat, img_lat = pipe.prepare_latents([ref[:, :, None]], b, 4, h * 8, w * 8, torch.float32, "cpu", None,
                                            latents=pipe._pack_latents(x[:, :, None], b, 4, h, w))
        out = tr(hidden_states=torch.cat([lat, img_lat], 1), timestep=t, encoder_hidden_states=text["prompt_embeds"],
                 encoder_hidden_states_mask=text["prompt_embeds_mask"],
                 img_shapes=[[(1, h // 2, w // 2), (1, h // 2, w // 2)]] * b, return_dict=False)[0]
        theirs = pipe._unpack_latents(out[:, : lat.shape[1]], h * 8, w * 8, 8)[:, :, 0]
    torch.testing.assert_close(got, theirs, rtol=0, atol=0)


def test_qwen_plus_fit_caches_both_latents_and_the_lora_loads_in_the_pipeline(plus_fitted, qwen_plus):
    from trainer.data import prepare_data
    from trainer.train.objective import FlowMatching

    path, out = plus_fitted
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and all(np.isfinite(x["loss"]) for x in lines)
    cfg = Config.model_validate(yaml.safe_load(path.read_text()))
    adapter = get_adapter(cfg.model)
    data = prepare_data(cfg, adapter, progress=False)
    assert data.encode.latents_new == 0 and data.encode.latents_hit == 8  # 4 targets + 4 references
    assert data.encode.texts_new == 0 and data.encode.texts_hit == 8  # (caption, reference) and ("", reference)
    b = data.batch_at(0)
    assert b.text["control_latents"].shape == b.latents.shape
    pipe = _plus_pipe(qwen_plus)
    base = type(pipe.transformer).from_pretrained(str(qwen_plus), subfolder="transformer").eval()
    pipe.load_lora_weights(str(out / "lora.safetensors"))
    n = FlowMatching(cfg.train.model_copy(update={"timestep_sampling": "uniform"}), seed=5).noise(b.latents)
    with torch.no_grad():
        tuned = adapter.predict(pipe.transformer.eval(), n.noisy, n.t, b.text)
        untrained = adapter.predict(base, n.noisy, n.t, b.text)
    assert (tuned - untrained).abs().max() > 1e-4


def test_qwen_plus_sample_with_image_equals_the_pipeline(plus_fitted, qwen_plus, tmp_path):
    from trainer.models._diffusers import own_aligned_memory

    path, out = plus_fitted
    ref = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    ref.save(tmp_path / "ref.png")
    lora = str(out / "lora.safetensors")
    r = CliRunner().invoke(app, ["sample", str(path), "-p", PROMPT, "--image", str(tmp_path / "ref.png"), "--seed",
                                 "3", "--lora", lora, "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    (png,) = sorted((tmp_path / "a").glob("*.png"))
    ours = pixels(png)
    pipe = _plus_pipe(qwen_plus)
    own_aligned_memory(pipe.transformer)
    pipe.load_lora_weights(lora)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(prompt=PROMPT, image=ref, height=32, width=32, num_inference_steps=2, true_cfg_scale=1.0,
                  generator=torch.Generator().manual_seed(3)).images[0]
    np.testing.assert_array_equal(ours, np.asarray(theirs.convert("RGB")))
    r = CliRunner().invoke(app, ["sample", str(path), "-p", PROMPT, "--out", str(tmp_path / "b")])
    assert r.exit_code != 0 and "need a reference image" in r.output


def test_qwen_plus_planner_counts_the_smaller_reference_in_the_text():
    from trainer.models import adapter_class

    qi, qe, qp = (adapter_class(f) for f in ("qwen-image", "qwen-image-edit", "qwen-image-edit-plus"))
    with torch.device("meta"):
        model = qi.transformer_cls.from_config(qi.full_config)
    assert qp.dummy_inputs(model, 1, 1024, 1024, 256, torch.bfloat16)["img_shapes"] == [[(1, 64, 64), (1, 64, 64)]]
    assert qi.text_tokens < qp.text_tokens < qe.text_tokens  # ~196 vision tokens of a 384x384 condition image
