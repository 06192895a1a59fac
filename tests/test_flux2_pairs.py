"""Flux.2's optional reference images through Kontext's pairs layout: the data decides (a `control/` folder or a
"control" metadata key makes a run train pairs, plain images train text-to-image), a tiny flux2-klein fit on pairs
hands every step's reference to `predict` (and the loss is not the one without it), the prediction is the
transformer call Flux2KleinPipeline makes with the same reference image, `dittrain sample --image` equals the
pipelines' `image=` pixel for pixel, and the planner counts the reference tokens for pair data only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from test_sample import PROMPT, _cfg, _lora_transformer, _save_lora
from test_train_support import make_config, pixels, write_images
from typer.testing import CliRunner

from trainer.cli import app
from trainer.config import Config
from trainer.models import get_adapter
from trainer.models._diffusers import pack_2x2, unpack_2x2


def _pairs(folder: Path, n: int = 4, references: int = 1) -> Path:
    """Targets with captions and their references under the same names: control/ the colours inverted, control2/
    (with `references` 2) the channels swapped."""
    write_images(folder, n=n)
    for k, sub in enumerate(("control", "control2")[:references]):
        (folder / sub).mkdir(exist_ok=True)
        for p in sorted(folder.glob("img*.png")):
            px = np.asarray(Image.open(p))
            Image.fromarray(255 - px if k == 0 else px[..., ::-1].copy()).save(folder / sub / p.name)
    return folder


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    return _pairs(tmp_path_factory.mktemp("flux2-pairs"))


@pytest.fixture(scope="module")
def pairs2(tmp_path_factory) -> Path:
    """Two references per target: control/ and control2/."""
    return _pairs(tmp_path_factory.mktemp("flux2-pairs2"), references=2)


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("flux2-plain"), n=4)


def _klein_cfg(tiny_models, folder: Path, tmp: Path, **sections) -> Config:
    return make_config(tiny_models, folder, tmp / "out", tmp / "cache", "flux2-klein",
                       train={"steps": 2, "device": "cpu"},
                       sample={"steps": 2, "width": 64, "height": 64, "guidance": 4.0}, **sections)


def test_the_data_decides_pairs_or_plain(tiny_models, pairs, plain, tmp_path):
    from trainer.data.pipeline import pairs_run, plan_data

    cfg = _klein_cfg(tiny_models, pairs, tmp_path)
    adapter = get_adapter(cfg.model)
    assert adapter.takes_reference and adapter.reference_optional and pairs_run(adapter, cfg.data)
    plan = plan_data(cfg, adapter, progress=False)
    assert len(plan.items) == 4 and not plan.report.bad  # control/ holds references, not targets
    assert all(Path(it.control) == pairs / "control" / Path(it.file).name for it in plan.items)
    assert "pairs:" in plan.summary()
    cfg = _klein_cfg(tiny_models, plain, tmp_path)
    assert not pairs_run(adapter, cfg.data)
    plan = plan_data(cfg, adapter, progress=False)
    assert len(plan.items) == 4 and not any(it.control for it in plan.items) and "pairs:" not in plan.summary()
    # metadata.jsonl: a "control" key makes pairs, none makes plain images
    meta = write_images(tmp_path / "meta", n=2)
    Image.new("RGB", (64, 64), (1, 2, 3)).save(meta / "ref.png")
    lines = [{"file": f"img{i}.png", "caption": "edit"} for i in range(2)]
    (meta / "m.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    cfg = _klein_cfg(tiny_models, meta, tmp_path)
    cfg.data.sources[0].metadata = Path("m.jsonl")  # a bare name: found inside the source folder
    assert not cfg.data.has_references()
    (meta / "m.jsonl").write_text("\n".join(json.dumps({**x, "control": "ref.png"}) for x in lines))
    assert cfg.data.has_references()
    assert [Path(it.control).name for it in plan_data(cfg, adapter, progress=False).items] == ["ref.png"] * 2
    # an edit family whose every item is a pair still scans for references without a control/ folder
    kontext = make_config(tiny_models, plain, tmp_path / "o", tmp_path / "c", "flux-kontext")
    assert pairs_run(get_adapter(kontext.model), kontext.data)


def _fit(tiny_models, data: Path, tmp: Path, **sections):
    """`dittrain fit` of a YAML config of tiny flux2-klein on `data` (2 steps): (config path, output folder, what
    each training step's `predict` got: (control_latents shape, noisy latents shape) or None)."""
    from trainer.models.flux2 import Flux2Adapter

    path = tmp / "klein.yaml"
    cfg = _klein_cfg(tiny_models, data, tmp, **sections)
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=True)))
    seen, real = [], Flux2Adapter.predict

    def spy(self, transformer, noisy, t, text, guidance=1.0):
        if torch.is_grad_enabled():  # training steps (not sampling)
            ref = text.get("control_latents")
            seen.append(None if ref is None else (tuple(ref.shape), tuple(noisy.shape)))
        return real(self, transformer, noisy, t, text, guidance)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Flux2Adapter, "predict", spy)
        r = CliRunner().invoke(app, ["fit", str(path)])
    assert r.exit_code == 0, r.output
    return path, tmp / "out", seen


def test_several_references_per_image(tiny_models, pairs2, tmp_path):
    """control2/ (or a "control" list) adds a second reference; every image needs as many; an edit family that
    joins one refuses such data; the planner counts both."""
    from trainer.data.pipeline import plan_data
    from trainer.errors import UserError
    from trainer.planner import analyze

    cfg = _klein_cfg(tiny_models, pairs2, tmp_path)
    assert cfg.data.references() == 2 and analyze(cfg).references == 2
    plan = plan_data(cfg, get_adapter(cfg.model), progress=False)
    assert len(plan.items) == 4 and not plan.report.bad and "2 reference images" in plan.summary()
    assert all([Path(f).parent.name for f, _, _ in it.references] == ["control", "control2"] for it in plan.items)
    # one image without its second reference is left out, with the reason
    short = _pairs(tmp_path / "short", n=3, references=2)
    (short / "control2" / "img1.png").unlink()
    plan = plan_data(_klein_cfg(tiny_models, short, tmp_path), get_adapter(cfg.model), progress=False)
    assert [Path(it.file).name for it in plan.items] == ["img0.png", "img2.png"]
    assert "1 reference image, other images have 2" in plan.report.bad[0][1]
    # metadata.jsonl: a "control" list
    meta = write_images(tmp_path / "meta", n=2)
    for name in ("a.png", "b.png"):
        Image.new("RGB", (64, 64), (len(name), 2, 3)).save(meta / name)
    (meta / "m.jsonl").write_text("\n".join(json.dumps({"file": f"img{i}.png", "caption": "x", "control": ["a.png", "b.png"]})
                                            for i in range(2)))
    mcfg = _klein_cfg(tiny_models, meta, tmp_path)
    mcfg.data.sources[0].metadata = Path("m.jsonl")
    assert mcfg.data.references() == 2
    assert [[Path(f).name for f, _, _ in it.references] for it in plan_data(mcfg, get_adapter(cfg.model),
                                                                            progress=False).items] == [["a.png", "b.png"]] * 2
    kontext = make_config(tiny_models, pairs2, tmp_path / "o", tmp_path / "c", "flux-kontext")
    with pytest.raises(UserError, match="2 reference images each .* flux-kontext takes at most 1"):
        plan_data(kontext, get_adapter(kontext.model), progress=False)


def test_validation_images_carry_their_references(tiny_models, pairs2, tmp_path):
    """data.validation on pairs: the held-out image's references are cached and reach `predict` as in training."""
    from trainer.data import prepare_data

    raw = _klein_cfg(tiny_models, pairs2, tmp_path).model_dump(mode="json", exclude_unset=True)
    raw["data"]["validation"], raw["train"]["validate_every"] = {"fraction": 0.25}, 1
    cfg = Config.model_validate(raw)
    data = prepare_data(cfg, get_adapter(cfg.model), progress=False)
    assert data.encode.latents_new == 4 * 3  # 3 training + 1 held-out targets, each with 2 references
    (b,) = list(data.validation.batches())
    assert b.text["control_latents"].shape == (1, 2, *b.latents.shape[1:])
    (item,) = data.plan.validation.items
    want = [data.plan.latent_store.get(j.key)["latent"] for j in data.plan.validation.latent_jobs()[1:]]
    assert len(item.references) == 2 and all(torch.equal(b.text["control_latents"][0, k], want[k]) for k in (0, 1))


@pytest.fixture(scope="module")
def fitted(tiny_models, pairs, tmp_path_factory):
    return _fit(tiny_models, pairs, tmp_path_factory.mktemp("klein-pairs-fit"))


@pytest.fixture(scope="module")
def fitted2(tiny_models, pairs2, tmp_path_factory):
    return _fit(tiny_models, pairs2, tmp_path_factory.mktemp("klein-pairs2-fit"))


def test_two_steps_on_pairs_hand_the_reference_to_predict(fitted):
    _, out, seen = fitted
    assert len(seen) == 2 and all(s is not None and s[0] == s[1] for s in seen)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(np.isfinite(x["loss"]) for x in lines)


def _predicts_as_the_pipeline(fitted, references: int) -> None:
    """The cached references give the tokens and ids Flux2KleinPipeline makes of the control images (its list of
    images, in order), and the loss on the batch is not the loss without them."""
    from diffusers import Flux2KleinPipeline

    from trainer.data import prepare_data
    from trainer.train.objective import FlowMatching

    path, out, _ = fitted
    cfg = Config.model_validate(yaml.safe_load(path.read_text()))
    adapter = get_adapter(cfg.model)
    data = prepare_data(cfg, adapter, progress=False)
    assert data.encode.latents_new == 0 and data.encode.latents_hit == 4 * (1 + references)  # all cached
    b = data.batch_at(0)
    ref = b.text["control_latents"]
    assert ref.shape == (b.latents.shape if references == 1 else (2, references, *b.latents.shape[1:]))
    pipe = Flux2KleinPipeline.from_pretrained(str(cfg.model.path), torch_dtype=torch.float32, local_files_only=True)
    pipe.load_lora_weights(str(out / "lora.safetensors"))
    tr = pipe.transformer.eval()
    n = FlowMatching(cfg.train.model_copy(update={"timestep_sampling": "uniform"}), seed=5).noise(b.latents)
    with torch.no_grad():
        ours = adapter.predict(tr, n.noisy, n.t, b.text)
        plain = adapter.predict(tr, n.noisy, n.t, {k: v for k, v in b.text.items() if k != "control_latents"})
        for i in range(len(b.files)):  # the pipeline's own path from the reference files, one sample at a time
            item = next(it for it in data.plan.items if it.file == b.files[i])
            assert len(item.references) == references
            imgs = []
            for f, _, _ in item.references:
                with Image.open(f) as im:
                    imgs.append(pipe.image_processor.preprocess(im.convert("RGB"), height=64, width=64,
                                                                resize_mode="crop"))
            refs, ref_ids = pipe.prepare_image_latents(imgs, 1, None, "cpu", torch.float32)
            x = pack_2x2(n.noisy[i : i + 1])
            embeds = b.text["prompt_embeds"][i : i + 1]
            ids = pipe._prepare_latent_ids(pipe._patchify_latents(n.noisy[i : i + 1]))
            out_i = tr(hidden_states=torch.cat([x, refs], 1), timestep=n.t[i : i + 1], guidance=None,
                       encoder_hidden_states=embeds, txt_ids=pipe._prepare_text_ids(embeds),
                       img_ids=torch.cat([ids, ref_ids], 1), return_dict=False)[0]
            theirs = unpack_2x2(out_i[:, : x.shape[1]], *n.noisy.shape[-2:])
            torch.testing.assert_close(ours[i : i + 1], theirs, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(((ours - n.target) ** 2).mean(), ((plain - n.target) ** 2).mean())


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_streamed_pair_training_is_bitwise_resident(fitted2, tiny_models, pairs2, tmp_path, fraction):
    """The longer sequence of two references changes nothing in streaming: the LoRA after 2 steps streamed at
    `fraction` equals the resident one bit for bit."""
    from safetensors.torch import load_file

    _, out, _ = fitted2
    _, streamed, seen = _fit(tiny_models, pairs2, tmp_path, offload={"transformer": fraction})
    assert len(seen) == 2 and all(s is not None for s in seen)
    a, b = load_file(out / "lora.safetensors"), load_file(streamed / "lora.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_pair_batch_predicts_as_the_pipeline_with_the_reference_image(fitted):
    _predicts_as_the_pipeline(fitted, 1)


def test_two_references_per_target_train_as_the_pipelines_list_of_images(fitted2):
    _, out, seen = fitted2
    assert len(seen) == 2 and all(s is not None and s[0] == (s[1][0], 2, *s[1][1:]) for s in seen)
    _predicts_as_the_pipeline(fitted2, 2)


def test_fit_without_the_reference_has_another_loss(fitted, tiny_models, tmp_path):
    """The same run with the reference taken out of `predict`'s input: same batches and noise, other losses."""
    from trainer.models.flux2 import Flux2Adapter

    path, out, _ = fitted
    raw = yaml.safe_load(path.read_text())
    raw["output"]["dir"] = str(tmp_path / "out")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    real = Flux2Adapter.predict
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Flux2Adapter, "predict", lambda self, tr, x, t, text, guidance=1.0: real(
            self, tr, x, t, {k: v for k, v in text.items() if k != "control_latents"}, guidance))
        r = CliRunner().invoke(app, ["fit", str(tmp_path / "c.yaml")])
    assert r.exit_code == 0, r.output
    with_ref = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    without = [json.loads(x)["loss"] for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert with_ref[0] != without[0]


@pytest.mark.parametrize("family", ["flux2", "flux2-klein"])
def test_sample_with_image_equals_the_pipeline_with_image(tiny_models, tmp_path, family):
    from diffusers import DiffusionPipeline

    from trainer.models._diffusers import own_aligned_memory
    from trainer.sample import run_sample
    from trainer.sampling.request import SampleRequest

    cfg = _cfg(tiny_models, family, tmp_path, width=64, height=64)  # Flux.2's pipelines take references >= 64 px
    lora = _save_lora(_lora_transformer(cfg), tmp_path / "lora.safetensors")
    ref = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))  # sample size
    ref.save(tmp_path / "ref.png")
    got = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=1, loras=[str(lora)], image=tmp_path / "ref.png",
                                        out=tmp_path / "a"))
    pipe = DiffusionPipeline.from_pretrained(str(cfg.model.path), torch_dtype=torch.float32, local_files_only=True)
    own_aligned_memory(pipe.transformer)  # as our loader does: same memory alignment, same CPU rounding
    pipe.load_lora_weights(str(lora))
    pipe.set_progress_bar_config(disable=True)
    s = cfg.sample
    kw = dict(prompt=PROMPT, height=s.height, width=s.width, num_inference_steps=s.steps, guidance_scale=s.guidance)
    theirs = pipe(image=ref, generator=torch.Generator().manual_seed(1), **kw).images[0]
    np.testing.assert_array_equal(pixels(got[0]), np.asarray(theirs.convert("RGB")))
    plain = pipe(generator=torch.Generator().manual_seed(1), **kw).images[0]
    assert (pixels(got[0]) != np.asarray(plain.convert("RGB"))).any(), "the reference image must change the result"


def test_sample_cli_image_on_the_pairs_fit_equals_flux2_klein_pipeline(fitted, tmp_path):
    from diffusers import Flux2KleinPipeline

    from trainer.models._diffusers import own_aligned_memory

    path, out, _ = fitted
    ref = Image.fromarray(np.random.default_rng(1).integers(0, 256, (80, 64, 3), dtype=np.uint8))  # 64 x 80
    ref.save(tmp_path / "ref.png")
    lora = str(out / "lora.safetensors")

    r = CliRunner().invoke(app, ["sample", str(path), "-p", PROMPT, "--image", str(tmp_path / "ref.png"), "--seed",
                                 "3", "--lora", lora, "--out", str(tmp_path / "s")])
    assert r.exit_code == 0, r.output
    (png,) = sorted((tmp_path / "s").glob("*.png"))
    cfg = Config.model_validate(yaml.safe_load(path.read_text()))
    pipe = Flux2KleinPipeline.from_pretrained(str(cfg.model.path), torch_dtype=torch.float32, local_files_only=True)
    own_aligned_memory(pipe.transformer)
    pipe.load_lora_weights(lora)
    pipe.set_progress_bar_config(disable=True)
    cut = ref.crop((0, 8, 64, 72))  # the training rule: cover 64 x 64, centre crop (no resize needed here)
    theirs = pipe(prompt=PROMPT, image=cut, height=64, width=64, num_inference_steps=2, guidance_scale=4.0,
                  generator=torch.Generator().manual_seed(3)).images[0]
    np.testing.assert_array_equal(pixels(png), np.asarray(theirs.convert("RGB")))


def test_sample_cli_two_images_equal_the_pipelines_list(fitted2, tmp_path):
    """`--image` repeated: the references in order, as Flux2KleinPipeline's list of images; more than the family
    takes is one line."""
    from diffusers import Flux2KleinPipeline

    from trainer.models._diffusers import own_aligned_memory

    path, out, _ = fitted2
    refs = [Image.fromarray(np.random.default_rng(k).integers(0, 256, (64, 64, 3), dtype=np.uint8)) for k in (1, 2)]
    for k, im in enumerate(refs):
        im.save(tmp_path / f"r{k}.png")
    lora = str(out / "lora.safetensors")

    def sample(*images: str) -> tuple:
        args = [a for f in images for a in ("--image", str(tmp_path / f))]
        r = CliRunner().invoke(app, ["sample", str(path), "-p", PROMPT, *args, "--seed", "3", "--lora", lora,
                                     "--out", str(tmp_path / "-".join(images))])
        return r, sorted((tmp_path / "-".join(images)).glob("*.png"))

    r, (png,) = sample("r0.png", "r1.png")
    assert r.exit_code == 0, r.output
    cfg = Config.model_validate(yaml.safe_load(path.read_text()))
    pipe = Flux2KleinPipeline.from_pretrained(str(cfg.model.path), torch_dtype=torch.float32, local_files_only=True)
    own_aligned_memory(pipe.transformer)
    pipe.load_lora_weights(lora)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(prompt=PROMPT, image=refs, height=64, width=64, num_inference_steps=2, guidance_scale=4.0,
                  generator=torch.Generator().manual_seed(3)).images[0]
    np.testing.assert_array_equal(pixels(png), np.asarray(theirs.convert("RGB")))
    r, _ = sample(*["r0.png"] * 5)
    assert r.exit_code != 0 and "--image given 5 times: flux2-klein takes at most 4 reference images" in r.output


def test_a_reference_the_pipeline_refuses_is_one_line():
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    from trainer.errors import UserError
    from trainer.models.flux2 import Flux2Adapter

    pipe = type("Flux2Pipeline", (), {"image_processor": Flux2ImageProcessor()})()
    assert Flux2Adapter.pipeline_image(pipe, None) == {}
    assert "image" in Flux2Adapter.pipeline_image(pipe, Image.new("RGB", (64, 96)))
    with pytest.raises(UserError, match="32x32 .*sample at least 64x64"):
        Flux2Adapter.pipeline_image(pipe, Image.new("RGB", (32, 32)))


def test_planner_counts_the_reference_tokens_for_pair_data_only(tiny_models, pairs, plain, tmp_path):
    from trainer.planner import analyze
    from trainer.planner import report as planner_report
    from trainer.planner import trace as ptrace

    with_ref, without = (analyze(_klein_cfg(tiny_models, d, tmp_path)) for d in (pairs, plain))
    assert (with_ref.references, without.references) == (1, 0)
    n = 64 // 16 * (64 // 16)  # image tokens of one 64 px image
    kw = ptrace.forward_inputs("flux2-klein", with_ref.model, 2, 64, 64, 8, torch.float32, references=1)
    assert kw["hidden_states"].shape[1] == kw["img_ids"].shape[0] == 2 * n
    assert with_ref.trace(64).checkpoint_inputs > without.trace(64).checkpoint_inputs
    # `dittrain plan`'s token column: the full-size model's 4096 image tokens at 1024 px, twice with a reference
    cfg = _klein_cfg(tiny_models, pairs, tmp_path)
    cfg.data.resolutions = [1024]
    lines, _ = planner_report(cfg, facts=analyze(cfg))
    assert any("8192+" in line for line in lines)
    # where kontext doubles in dummy_inputs, the pair data adds nothing more
    kontext = make_config(tiny_models, pairs, tmp_path / "o", tmp_path / "c", "flux-kontext")
    assert analyze(kontext).references == 0
