"""HiDream-E1 (`hidream-e1`, issue 42) on its tiny I1-shaped folder: `predict` is the transformer on the noisy
target and the source's latents joined along the width, padded to twice its `max_seq` tokens, the target half of the
negated output (eval and training mode); a LoRA `dittrain fit` on `control/` pairs caches both latents and streams
bitwise like resident (LoRA 0.5, full 1.0); the sampling loop at guidance 1 is the plain conditional path on the
latents training caches; the three-way guidance's algebra; `dittrain sample --image` without an image is refused;
the planner sees the doubled, padded sequence and three guided passes. Against HiDream-ai's own pipeline
(`pipeline_hidream_image_editing.py`, not in this repository): `dittrain sample --image` pixel-identical, without
and with a fitted LoRA, run only
where the snapshot of github.com/HiDream-ai/HiDream-E1 is on the machine (`E1_MIRROR`), skipped elsewhere."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import _family_checks as checks
import numpy as np
import pytest
import torch
from PIL import Image
from test_edit_models import _pairs, _streamed_and_resident_losses
from test_sample import PROMPT
from test_train_support import losses, pixels

from trainer.config import Config
from trainer.models import adapter_class
from trainer.sample import SampleRequest, run_sample

FAMILY = "hidream-e1"
#: a bare git snapshot of github.com/HiDream-ai/HiDream-E1 (MIT), where this machine has one
E1_MIRROR = Path("/work/.mirror/HiDream-ai+HiDream-E1/repo")


@pytest.fixture(scope="module")
def parts(tiny_models):
    """(adapter, components, pipeline) of the tiny folder, fp32; read-only for the tests."""
    return checks.tiny_pipeline(FAMILY, tiny_models / FAMILY)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    return _pairs(tmp_path_factory.mktemp("e1-pairs"))


def _text(adapter, comps):
    return adapter.encode_prompts(comps, [PROMPT, "make it blue"])


def test_predict_is_the_transformer_on_target_and_source_side_by_side(parts):
    """The transformer's own patchify at `max_seq` doubled (what inference_e1_1.py sets on it), the left half
    negated, bitwise in eval mode; the same in training mode; the source and the padding count both matter."""
    adapter, comps, _ = parts
    tr = comps.transformer
    g = torch.Generator().manual_seed(0)
    x, src = torch.randn(2, 4, 6, 4, generator=g), torch.randn(2, 4, 6, 4, generator=g)
    t = torch.tensor([0.3, 0.8])
    text = _text(adapter, comps)
    kw = dict(timesteps=t * 1000.0, encoder_hidden_states_t5=text["t5"],
              encoder_hidden_states_llama3=text["llama"].transpose(0, 1), pooled_embeds=text["pooled"],
              return_dict=False)
    own = tr.max_seq
    with torch.no_grad():
        got = adapter.predict(tr, x, t, {**text, "control_latents": src})
        tr.max_seq = 2 * own
        try:
            want = -tr(hidden_states=torch.cat([x, src], dim=-1), **kw)[0][..., :4]
        finally:
            tr.max_seq = own
        unpadded_more = -tr(hidden_states=torch.cat([x, src], dim=-1), **kw)[0][..., :4]  # padded to max_seq only
        other = adapter.predict(tr, x, t, {**text, "control_latents": src.flip(0)})
        tr.train()
        try:
            trained = adapter.predict(tr, x, t, {**text, "control_latents": src})
        finally:
            tr.eval()
    assert got.shape == x.shape and torch.equal(got, want)
    assert (got - unpadded_more).abs().max() > 1e-5, "the padding count changes the output"
    assert (got - other).abs().max() > 1e-4, "the source must change the prediction"
    torch.testing.assert_close(trained, got, rtol=1e-5, atol=1e-6)


def test_guidance_one_samples_the_conditional_path_on_the_training_latents(parts):
    """At guidance 1 the pipeline's loop is `predict` on the source's latents as training caches them
    (`encode_images`), stepped by the scheduler: the same final latents."""
    adapter, comps, pipe = parts
    rng = np.random.default_rng(1)
    img = Image.fromarray(rng.integers(0, 256, (48, 32, 3), dtype=np.uint8))
    got = pipe(prompt=PROMPT, image=img, height=48, width=32, num_inference_steps=3, guidance_scale=1.0,
               generator=torch.Generator().manual_seed(4), output_type="latent").images
    pixels_ = torch.from_numpy(np.array(img)).permute(2, 0, 1)[None].float() / 127.5 - 1
    src = adapter.encode_images(comps.vae, pixels_)
    text = adapter.encode_prompts(comps, [PROMPT])
    sched = type(comps.scheduler).from_config(comps.scheduler.config)
    sched.set_timesteps(3)
    lat = torch.randn(1, 4, 6, 4, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for t in sched.timesteps:
            v = adapter.predict(comps.transformer, lat, (t / 1000).reshape(1), {**text, "control_latents": src})
            lat = sched.step(v, t, lat, return_dict=False)[0]
    torch.testing.assert_close(got, lat, rtol=1e-4, atol=1e-5)


def test_three_way_guidance():
    """Without the norm clip: uncond + ig (image - uncond) + g (full - image), so ig = g = 1 is the full pass; with
    it the text-guided prediction is scaled down to the full pass's channel norm, never up."""
    from trainer.models.hidream_e1 import _guided

    g = torch.Generator().manual_seed(0)
    u, i, f = (torch.randn(1, 4, 3, 3, generator=g) for _ in range(3))
    torch.testing.assert_close(_guided(u, i, f, 1.0, 1.0, False), f)
    torch.testing.assert_close(_guided(u, i, f, 3.0, 2.0, False), u + 2 * (i - u) + 3 * (f - i))
    text = i + 3 * (f - i)
    out = _guided(u, i, f, 3.0, 1.0, True)  # image guidance 1: the clipped text prediction itself
    assert (out.norm(dim=1) <= f.norm(dim=1) + 1e-5).all() and (out.norm(dim=1) <= text.norm(dim=1) + 1e-5).all()
    torch.testing.assert_close(_guided(u, i, f, 1.0, 1.0, True), f, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------- training


def _config(model: Path, data: Path, tmp: Path, **extra) -> dict:
    from test_edit_models import _config as kontext_config

    cfg = kontext_config(model, data, tmp, **extra)
    cfg["model"]["family"] = FAMILY
    cfg["sample"]["guidance"] = 1.0
    return cfg


def test_fit_on_pairs_caches_both_latents(tiny_models, pairs, tmp_path):
    from trainer.data import prepare_data
    from trainer.train.trainer import Trainer

    cfg = Config.model_validate(_config(tiny_models / FAMILY, pairs, tmp_path, train={"steps": 2}))
    t = Trainer(cfg)
    t.fit()
    got = losses(tmp_path / "out")
    assert len(got) == 2 and all(np.isfinite(got))
    data = prepare_data(cfg, t.adapter, progress=False)
    assert data.encode.latents_new == 0 and data.encode.latents_hit == 8  # 4 targets + 4 sources
    b = data.batch_at(0)
    assert b.text["control_latents"].shape == b.latents.shape and not torch.equal(b.text["control_latents"],
                                                                                   b.latents)


@pytest.mark.parametrize(("method", "fraction"), [("lora", 0.5), ("full", 1.0)])
def test_streamed_e1_trains_like_resident(method, fraction, tiny_models, pairs, tmp_path, monkeypatch):
    got = _streamed_and_resident_losses(_config, tiny_models / FAMILY, pairs, method, fraction, tmp_path,
                                        monkeypatch)
    assert len(got[1]) == 2
    assert got[0] == got[1]


def test_sampling_during_training_from_the_pairs_source_streamed_as_resident(tiny_models, pairs, tmp_path,
                                                                               monkeypatch):
    """`sample.image` (a pair's control image) at guidance 4 after each of 2 steps, LoRA streamed at 0.5 and
    resident: the same losses and the same samples, at the size asked."""
    from trainer.train.trainer import Trainer

    sample = {"prompts": [PROMPT], "every": 1, "steps": 2, "width": 32, "height": 48, "guidance": 4.0,
              "image": str(pairs / "control" / "img0.png")}
    runs = {}
    for f in (0.0, 0.5):
        if f:
            monkeypatch.setattr(Trainer, "_can_stream", lambda self: True)
        cfg = _config(tiny_models / FAMILY, pairs, tmp_path, train={"steps": 2}, sample=sample,
                      output={"dir": str(tmp_path / f"f{f}")}, offload={"transformer": f})
        Trainer(Config.model_validate(cfg)).fit()
        runs[f] = losses(tmp_path / f"f{f}"), sorted((tmp_path / f"f{f}" / "samples").rglob("*.png"))
    assert runs[0.5][0] == runs[0.0][0]
    assert len(runs[0.0][1]) == len(runs[0.5][1]) == 2
    for x, y in zip(runs[0.0][1], runs[0.5][1], strict=True):
        assert pixels(x).shape == (48, 32, 3)
        np.testing.assert_array_equal(pixels(x), pixels(y))


def test_sampling_during_training_without_a_source_is_refused_before_training(tiny_models, pairs, tmp_path):
    from trainer.errors import UserError
    from trainer.train.trainer import Trainer

    cfg = _config(tiny_models / FAMILY, pairs, tmp_path, sample={"prompts": [PROMPT], "every": 1})
    with pytest.raises(UserError, match="need a reference image"):
        Trainer(Config.model_validate(cfg)).fit()
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_sample_needs_the_source_image(tiny_models, tmp_path):
    from trainer.errors import UserError
    from trainer.sampling.request import check_image

    with pytest.raises(UserError, match="need a reference image"):  # before any weights are read
        check_image(None, adapter_class(FAMILY))
    cfg = Config.model_validate({"model": {"family": FAMILY, "path": str(tiny_models / FAMILY), "dtype": "fp32"},
                                 "sample": {"steps": 1, "width": 32, "height": 32}, "train": {"device": "cpu"},
                                 "output": {"dir": str(tmp_path)}})
    with pytest.raises(UserError, match="need a reference image"):
        run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=1, out=tmp_path / "a"))


# ---------------------------------------------------------------------------------------------- planner


def test_planner_sees_the_padded_double_width_and_three_passes():
    from trainer.planner.sampling import cfg_batch

    hi, e1 = adapter_class("hidream"), adapter_class(FAMILY)
    with torch.device("meta"):
        model = hi.transformer_cls.from_config(hi.full_config)
    a = hi.dummy_inputs(model, 1, 1024, 1024, 128, torch.bfloat16)
    b = e1.dummy_inputs(model, 1, 768, 768, 128, torch.bfloat16)
    c = e1.dummy_inputs(model, 1, 1024, 1024, 128, torch.bfloat16)
    assert a["hidden_states"].shape == (1, 16, 128, 128)
    assert b["hidden_states"].shape == (1, 8192, 64) and b["img_ids"].shape == (1, 8192, 3)  # 4608 + padding
    assert c["hidden_states"].shape == (1, 8192, 64) and c["hidden_states_masks"].shape == (1, 8192)
    assert cfg_batch(FAMILY, 5.0) == 3 and cfg_batch("hidream", 5.0) == 2 and cfg_batch(FAMILY, 1.0) == 1


# ---------------------------------------------------------------------------------------------- the official pipeline


@pytest.mark.skipif(not (E1_MIRROR / "HEAD").is_file() or shutil.which("git") is None,
                    reason="no snapshot of github.com/HiDream-ai/HiDream-E1 on this machine")
def test_sample_equals_hidream_ais_own_pipeline(tiny_models, pairs, tmp_path, monkeypatch):
    """`dittrain sample --image` at guidance 4 (its default image guidance 2, clip_cfg_norm) against the official
    HiDreamImageEditingPipeline on the same folder with `max_seq` doubled as inference_e1_1.py sets it, pixel for
    pixel, without and with a LoRA fitted on pairs (the official pipeline's `load_lora_weights`); its file is read
    from the snapshot into tmp_path, never into the repository."""
    from diffusers import DiffusionPipeline

    from trainer.models._diffusers import own_aligned_memory
    from trainer.train.trainer import Trainer

    src = subprocess.run(["git", "-C", str(E1_MIRROR), "show", "HEAD:pipeline_hidream_image_editing.py"],
                         capture_output=True, text=True, check=True).stdout
    (tmp_path / "pipeline_hidream_image_editing.py").write_text(src)
    monkeypatch.syspath_prepend(str(tmp_path))
    from pipeline_hidream_image_editing import HiDreamImageEditingPipeline

    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 32, 3), dtype=np.uint8))
    img.save(tmp_path / "src.png")
    cfg = Config.model_validate({
        "model": {"family": FAMILY, "path": str(tiny_models / FAMILY), "dtype": "fp32"},
        "sample": {"steps": 3, "width": 32, "height": 48, "guidance": 4.0}, "train": {"device": "cpu"},
        "output": {"dir": str(tmp_path)}})
    lora = Trainer(Config.model_validate(_config(tiny_models / FAMILY, pairs, tmp_path, train={"steps": 2},
                                                 optimizer={"lr": 1e-2}))).fit()
    ours = {}
    for name, loras in (("plain", []), ("lora", [str(lora)])):
        (png,) = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=5, image=tmp_path / "src.png", loras=loras,
                                               out=tmp_path / name))
        base = DiffusionPipeline.from_pretrained(str(tiny_models / FAMILY), torch_dtype=torch.float32,
                                                 local_files_only=True)
        pipe = HiDreamImageEditingPipeline(**base.components)
        own_aligned_memory(pipe.transformer)
        pipe.transformer.max_seq *= 2
        pipe.set_progress_bar_config(disable=True)
        if loras:
            pipe.load_lora_weights(loras[0])
        theirs = pipe(prompt=PROMPT, image=img, num_inference_steps=3, guidance_scale=4.0, refine_strength=0.0,
                      generator=torch.Generator().manual_seed(5)).images[0]
        ours[name] = pixels(png)
        assert ours[name].shape == (48, 32, 3)
        np.testing.assert_array_equal(ours[name], np.asarray(theirs.convert("RGB")))
    assert (ours["plain"] != ours["lora"]).any(), "the LoRA must change the image"
    del sys.modules["pipeline_hidream_image_editing"]

