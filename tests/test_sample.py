"""`dittrain sample` on the tiny models: determinism, equality with diffusers' own pipeline and LoRA loading,
offload fractions on the CPU path, the in-memory sampling the training loop uses, PNG metadata, contact sheet."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_train_support import pixels

from trainer.config import Config
from trainer.models import get_adapter
from trainer.sample import SHEET_NAME, SampleRequest, run_sample
from trainer.sampling import SampleSettings, TrainingSampler, encode_prompts, generate
from trainer.sampling.engine import text_encoder_names

PROMPT = "a red square on a blue background"
# guidance > 1 runs SD3's, Qwen-Image's, Flux.2-klein's and Chroma's classifier-free guidance (negative pass;
# Z-Image's runs above 0), Flux dev's and Flux.2-dev's guidance embedding
GUIDANCE = {"flux": 3.5, "sd3": 4.0, "qwen-image": 4.0, "flux2": 4.0, "flux2-klein": 4.0, "z-image": 2.0, "chroma": 3.0}
FAMILIES = list(GUIDANCE)


def _cfg(tiny_models: Path, family: str, out: Path, **sample) -> Config:
    return Config.model_validate(
        {
            "model": {"family": family, "path": str(tiny_models / family), "dtype": "fp32"},
            "sample": {"steps": 2, "width": 32, "height": 32, "guidance": GUIDANCE[family], **sample},
            "train": {"device": "cpu"},
            "output": {"dir": str(out)},
        }
    )


def _diffusers_image(cfg: Config, seed: int, lora: tuple[Path, float] | None = None) -> np.ndarray:
    """The reference: the family's pipeline as a diffusers user would call it, with diffusers' LoRA loading."""
    from diffusers import DiffusionPipeline

    from trainer.models._diffusers import own_aligned_memory

    pipe = DiffusionPipeline.from_pretrained(
        str(cfg.model.path), torch_dtype=torch.float32, local_files_only=True
    )
    own_aligned_memory(pipe.transformer)  # as our loader does: same memory alignment, same CPU rounding
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora[0]), adapter_name="x")
        pipe.set_adapters(["x"], adapter_weights=[lora[1]])
    s, g = cfg.sample, cfg.sample.guidance
    kw = (
        {"true_cfg_scale": g, "negative_prompt": ""}
        if cfg.model.family == "qwen-image"  # the config spells families as the registry does
        else {"guidance_scale": g}
    )
    out = pipe(
        prompt=PROMPT,
        height=s.height,
        width=s.width,
        num_inference_steps=s.steps,
        generator=torch.Generator().manual_seed(seed),
        **kw,
    )
    return np.asarray(out.images[0].convert("RGB"))


def _lora_transformer(cfg: Config, seed: int = 0):
    """The family's transformer with a random (non-zero) LoRA, as the training loop holds it."""
    from peft import LoraConfig

    adapter = get_adapter(cfg.model)
    comps = adapter.load(cfg.model, parts={"transformer"}, dtype=torch.float32)
    torch.manual_seed(seed)
    comps.transformer.add_adapter(
        LoraConfig(
            r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False
        )
    )
    return comps.transformer


def _save_lora(transformer, path: Path) -> Path:
    from trainer.train.checkpoint import save_lora

    save_lora(path, transformer, {"step": "1"})
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_same_seed_same_image_and_equal_to_diffusers(tiny_models, tmp_path, family):
    cfg = _cfg(tiny_models, family, tmp_path)
    a = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=7, num=2, out=tmp_path / "a"))  # seeds 7 and 8
    b = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=7, out=tmp_path / "b"))
    assert a[0].name == b[0].name
    img = pixels(a[0])
    assert img.shape == (32, 32, 3)
    np.testing.assert_array_equal(img, pixels(b[0]))
    assert (img != pixels(a[1])).any(), "a different seed must give a different image"
    # Encoding first and denoising from stored embeddings is bit-identical to diffusers' pipe(prompt=...).
    np.testing.assert_array_equal(img, _diffusers_image(cfg, seed=7))


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_offload_fraction_gives_identical_images_on_cpu(tiny_models, tmp_path, monkeypatch, fraction):
    """On a CPU the conductor still packs the blocks into its host arena and replays the cyclic plan through a
    (CPU) ring: the images must not change, and blocks must really have been offloaded."""
    import trainer.sampling.placement as placement

    calls, stats = [], []
    real = placement._attach

    def spy(blocks, dev, f, **kw):
        handle = real(blocks, dev, f, **kw)
        calls.append((len(blocks), f))
        close = handle.close
        handle.close = lambda *a: (stats.append(handle.stats()), close(*a))
        return handle

    monkeypatch.setattr(placement, "_attach", spy)
    cfg = _cfg(tiny_models, "flux", tmp_path)
    ref = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, offload=0.0, out=tmp_path / "f0"))
    adapter = get_adapter(cfg.model)
    n_blocks = len(
        adapter.blocks(adapter.load(cfg.model, parts={"transformer"}, dtype=torch.float32).transformer)
    )
    assert calls == [(n_blocks, 0.0)]  # at 0 too: the conductor fills the blocks from the files, resident
    assert stats[0]["offloaded_bytes"] == 0
    got = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, offload=fraction, out=tmp_path / "f1"))
    assert calls[1] == (n_blocks, fraction), "the conductor must be attached to every block at fraction > 0"
    assert stats[1]["offloaded_bytes"] > 0 and stats[1]["ring_bytes"] < stats[1]["block_bytes"]
    np.testing.assert_array_equal(pixels(ref[0]), pixels(got[0]))
    with Image.open(got[0]) as im:
        assert im.text["offload"] == str(fraction)


def test_offloaded_lora_sampling_is_identical(tiny_models, tmp_path):
    """LoRA layers live inside the blocks: loaded first, frozen, then packed and streamed with them."""
    cfg = _cfg(tiny_models, "sd3", tmp_path)
    lora = _save_lora(_lora_transformer(cfg), tmp_path / "lora.safetensors")
    a = run_sample(cfg, SampleRequest(prompts=[PROMPT], loras=[str(lora)], offload=0.0, out=tmp_path / "a"))
    b = run_sample(cfg, SampleRequest(prompts=[PROMPT], loras=[str(lora)], offload=1.0, out=tmp_path / "b"))
    np.testing.assert_array_equal(pixels(a[0]), pixels(b[0]))


@pytest.mark.parametrize("family", ["flux", "sd3", "flux2", "flux2-klein"])
def test_lora_changes_output_exactly_as_diffusers_load_lora_weights(tiny_models, tmp_path, family):
    cfg = _cfg(tiny_models, family, tmp_path)
    lora = _save_lora(_lora_transformer(cfg), tmp_path / "lora.safetensors")
    plain = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=1, out=tmp_path / "plain"))
    with_lora = run_sample(
        cfg, SampleRequest(prompts=[PROMPT], seed=1, loras=[f"{lora}:0.7"], out=tmp_path / "l")
    )
    ours = pixels(with_lora[0])
    assert (ours != pixels(plain[0])).mean() > 0.1, "the LoRA must change the image"
    np.testing.assert_array_equal(ours, _diffusers_image(cfg, seed=1, lora=(lora, 0.7)))
    with Image.open(with_lora[0]) as im:
        assert im.text["loras"] == f"{lora}:0.7"


def test_two_loras_with_weights(tiny_models, tmp_path):
    cfg = _cfg(tiny_models, "flux", tmp_path)
    a = _save_lora(_lora_transformer(cfg, seed=1), tmp_path / "a.safetensors")
    b = _save_lora(_lora_transformer(cfg, seed=2), tmp_path / "b.safetensors")
    both = run_sample(
        cfg, SampleRequest(prompts=[PROMPT], loras=[f"{a}:0.5", f"{b}:1.5"], out=tmp_path / "ab")
    )
    only_a = run_sample(cfg, SampleRequest(prompts=[PROMPT], loras=[f"{a}:0.5"], out=tmp_path / "a"))
    assert (pixels(both[0]) != pixels(only_a[0])).any()
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(cfg.model.path), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(a), adapter_name="a")
    pipe.load_lora_weights(str(b), adapter_name="b")
    pipe.set_adapters(["a", "b"], adapter_weights=[0.5, 1.5])
    s = cfg.sample
    ref = pipe(
        prompt=PROMPT,
        height=s.height,
        width=s.width,
        num_inference_steps=s.steps,
        guidance_scale=s.guidance,
        generator=torch.Generator().manual_seed(s.seed),
    ).images[0]
    np.testing.assert_array_equal(pixels(both[0]), np.asarray(ref))


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_the_model_in_training_matches_its_saved_lora(tiny_models, tmp_path, family):
    """What the training loop does: sample with its in-memory transformer, without copying it."""
    cfg = _cfg(tiny_models, family, tmp_path)
    adapter = get_adapter(cfg.model)
    comps = adapter.load(cfg.model, parts={"transformer", "vae", "text", "scheduler"}, dtype=torch.float32)
    s = cfg.sample
    settings = SampleSettings(steps=s.steps, guidance=s.guidance, width=s.width, height=s.height)
    embeds = encode_prompts(adapter.pipeline(comps), family, [PROMPT], guidance=s.guidance)
    comps.text_encoders, comps.tokenizers = [], []  # the loop may free them after encoding
    model = _lora_transformer(cfg)
    model.train()
    sched_before = comps.scheduler.timesteps.clone()
    rng = torch.get_rng_state()
    images = generate(comps, adapter, embeds, settings=settings, seeds=[s.seed], transformer=model)
    assert model.training, "generate must restore the model's training flag"
    assert torch.equal(torch.get_rng_state(), rng), "generate must not touch the global RNG"
    assert torch.equal(comps.scheduler.timesteps, sched_before), (
        "generate must not change the caller's scheduler"
    )
    assert comps.transformer is not model
    lora = _save_lora(model, tmp_path / "lora.safetensors")
    from_file = run_sample(cfg, SampleRequest(prompts=[PROMPT], loras=[str(lora)], out=tmp_path / "f"))
    np.testing.assert_array_equal(np.asarray(images[0].convert("RGB")), pixels(from_file[0]))
    # The loop's object: prompts encoded once at setup, then called with the model every sample.every steps.
    sampler = TrainingSampler(
        cfg.model_copy(update={"sample": s.model_copy(update={"prompts": [PROMPT]})}),
        adapter,
        "cpu",
        torch.float32,
    )
    assert text_encoder_names(sampler.pipe) == []
    (again,) = sampler(model)
    assert model.training
    np.testing.assert_array_equal(np.asarray(again.convert("RGB")), pixels(from_file[0]))


def test_metadata_names_and_contact_sheet(tiny_models, tmp_path):
    cfg = _cfg(tiny_models, "flux", tmp_path, prompts=["a green circle", PROMPT])
    written = run_sample(cfg, SampleRequest(num=2, seed=10, steps=1, width=48, height=32))
    out = tmp_path / "samples" / "base"  # default without --lora: <output.dir>/samples/base, not the run's samples/
    names = [p.name for p in written]
    assert names == [
        "0000-seed10-a-green-circle.png",
        "0001-seed11-a-green-circle.png",
        "0002-seed12-a-red-square-on-a-blue-background.png",
        "0003-seed13-a-red-square-on-a-blue-background.png",
        SHEET_NAME,
    ]
    assert all(p.parent == out and p.is_file() for p in written)
    with Image.open(written[2]) as im:
        meta = dict(im.text)
        assert im.size == (48, 32)
    assert meta["prompt"] == PROMPT and meta["seed"] == "12" and meta["steps"] == "1"
    assert meta["guidance"] == "3.5" and meta["model"] == str(cfg.model.path) and meta["family"] == "flux"
    assert meta["software"].startswith("dittrain") and '"seed": "12"' in meta["dittrain"]
    assert "loras" not in meta
    with Image.open(written[-1]) as sheet:
        # 2 rows (prompts) x 2 columns (--num) of 48x32 cells with 4 px padding
        assert sheet.size == (2 * 48 + 3 * 4, 2 * 32 + 3 * 4)
        cell = np.asarray(sheet.convert("RGB"))[4 + 32 + 4 : 4 + 32 + 4 + 32, 4 + 48 + 4 : 4 + 48 + 4 + 48]
    np.testing.assert_array_equal(cell, pixels(written[3]))
    # Image k depends only on its prompt and seed: the second prompt's first image alone is identical.
    alone = run_sample(
        cfg, SampleRequest(prompts=[PROMPT], seed=12, steps=1, width=48, height=32, out=tmp_path / "x")
    )
    assert [p.name for p in alone] == ["0000-seed12-a-red-square-on-a-blue-background.png"]
    np.testing.assert_array_equal(pixels(alone[0]), pixels(written[2]))


def test_training_sampler_without_prompts_makes_nothing(tiny_models, tmp_path):
    cfg = _cfg(tiny_models, "sd3", tmp_path)
    adapter = get_adapter(cfg.model)
    model = adapter.load(cfg.model, parts={"transformer"}, dtype=torch.float32).transformer
    assert TrainingSampler(cfg, adapter, "cpu", torch.float32)(model) == []


@pytest.mark.parametrize("family", ["flux", "qwen-image", "flux2", "flux2-klein", "z-image", "chroma"])
def test_streamed_text_encoders_give_identical_images(tiny_models, tmp_path, monkeypatch, family):
    import trainer.sampling.placement as placement
    from trainer.models.base import text_encoder_blocks

    attached = []
    real = placement.place_encoder

    def spy(encoder, device, fraction):
        handle = real(encoder, device, fraction)
        if handle is not None:  # its blocks streamed by the conductor
            attached.append(len(text_encoder_blocks(encoder)))
        return handle

    monkeypatch.setattr(placement, "place_encoder", spy)
    cfg = _cfg(tiny_models, family, tmp_path)
    ref = run_sample(cfg, SampleRequest(prompts=[PROMPT], out=tmp_path / "a"))
    cfg.offload.text_encoders = 1.0
    got = run_sample(cfg, SampleRequest(prompts=[PROMPT], out=tmp_path / "b"))
    # Flux: CLIP's and T5's layer lists; the others: the language model's layers
    assert len(attached) == (2 if family == "flux" else 1) and all(n >= 2 for n in attached)
    np.testing.assert_array_equal(pixels(ref[0]), pixels(got[0]))


def test_generate_encodes_string_prompts_like_stored_embeddings(tiny_models, tmp_path):
    cfg = _cfg(tiny_models, "sd3", tmp_path)
    adapter = get_adapter(cfg.model)
    pipe = adapter.pipeline(
        adapter.load(cfg.model, parts={"transformer", "vae", "text", "scheduler"}, dtype=torch.float32)
    )
    settings = SampleSettings.from_config(cfg.sample)
    embeds = encode_prompts(pipe, "sd3", [PROMPT, "a green circle"], guidance=settings.guidance)
    a = generate(pipe, adapter, [PROMPT, embeds[1]], settings=settings, seeds=[4, 5], output_type="np")
    b = generate(pipe, adapter, embeds, settings=settings, seeds=[4, 5], output_type="np")
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[0], a[1])
    with pytest.raises(ValueError, match="2 prompts but 1 seeds"):
        generate(pipe, adapter, embeds, settings=settings, seeds=[4])


def test_streamed_sampling_builds_the_transformer_from_its_files(tiny_models, tmp_path, monkeypatch):
    """At every --offload the transformer is built with placeholders and its blocks read straight from the files
    into the arena (> 0) or onto the device (0, after the text encoders are gone): no whole copy in RAM. A
    full fine-tune's own transformer folder loads whole."""
    import trainer.models.stream_load as sl

    seen, real = [], sl.load
    monkeypatch.setattr(sl, "load", lambda *a, **k: seen.append(a[-1]) or real(*a, **k))
    cfg = _cfg(tiny_models, "flux", tmp_path)
    run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, offload=0.5, out=tmp_path / "a"))
    assert seen == [True]
    run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, offload=0.0, out=tmp_path / "b"))
    assert seen == [True, True]


def test_dora_lora_files_are_recognised_so_the_base_loads_first(tmp_path):
    from safetensors.torch import save_file

    from trainer.lora_format import is_dora_file as _is_dora

    w = {"a.lora_A.weight": torch.zeros(2, 2)}
    save_file(w, str(tmp_path / "plain.safetensors"))
    save_file(w, str(tmp_path / "meta.safetensors"), metadata={"dittrain.dora": "True"})  # as checkpoint.py writes
    save_file({**w, "a.lora_magnitude_vector": torch.ones(2)}, str(tmp_path / "keys.safetensors"))
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    assert [_is_dora(tmp_path / f"{n}.safetensors") for n in ("plain", "meta", "keys", "broken")] == [
        False, True, True, False]


def test_the_base_models_images_go_to_samples_base_not_beside_the_runs_own(tmp_path):
    """Without --out: a LoRA's (or a full fine-tune's transformer's) images go to <output.dir>/samples, the base
    model's to <output.dir>/samples/base (`dittrain sample --help` says so)."""
    from typer.testing import CliRunner

    from trainer.cli import app
    from trainer.sample import default_out

    cfg = Config.model_validate({"model": {"family": "flux", "path": str(tmp_path / "m")},
                                 "output": {"dir": str(tmp_path / "run")}})
    assert default_out(cfg, loras=True) == tmp_path / "run" / "samples"
    assert default_out(cfg, loras=False) == tmp_path / "run" / "samples" / "base"
    full = cfg.model_copy(update={"train": cfg.train.model_copy(update={"method": "full"})})
    assert default_out(full, loras=False) == tmp_path / "run" / "samples" / "base"  # nothing trained yet
    (tmp_path / "run" / "transformer").mkdir(parents=True)
    assert default_out(full, loras=False) == tmp_path / "run" / "samples"  # the trained transformer's
    assert default_out(full, loras=False, base=True) == tmp_path / "run" / "samples" / "base"
    help_text = " ".join(CliRunner().invoke(app, ["sample", "--help"], terminal_width=200).output.split())
    assert "the base model's images, without them, go to <output.dir>/samples/base" in help_text
