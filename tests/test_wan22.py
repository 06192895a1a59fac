"""Wan 2.2 A14B (issue 39): two experts split at the pipeline's boundary_ratio, one trained per run
(`model.expert`), on the tiny two-expert Wan built here: each expert trains only its own timesteps and writes
`lora-<expert>.safetensors`, which WanPipeline loads (the low-noise one with `load_into_transformer_2=True`), and
`dittrain sample` with both LoRAs is pixel-identical to WanPipeline, resident and with every block streamed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from test_train_support import pixels
from test_wan import PROMPT, _frames
from typer.testing import CliRunner

from trainer.cli import app
from trainer.config import Config, ModelConfig
from trainer.data.video import probe_video, write_video
from trainer.errors import UserError
from trainer.models import get_adapter
from trainer.sample import SampleRequest, run_sample
from trainer.sampling.output import frame_sheet
from trainer.train.objective import FlowMatching

FAMILY = "wan2.2-a14b"


@pytest.fixture(scope="module")
def a14b(tmp_path_factory) -> Path:
    from trainer.models.tiny import make_tiny_models

    (folder,) = make_tiny_models(tmp_path_factory.mktemp("tiny-wan22"), [FAMILY])
    return folder


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("wan22-data")
    write_video([f.resize((32, 32)) for f in _frames(9)], d / "clip.mp4", 16)
    (d / "clip.txt").write_text(PROMPT)
    return d


def _config(model: Path, data: Path, tmp: Path, expert: str | None, **sample) -> Config:
    return Config.model_validate({
        "model": {"family": FAMILY, "path": str(model), "dtype": "fp32", "expert": expert},
        "train": {"method": "lora", "steps": 2, "batch_size": 1, "seed": 0, "checkpoint_every": 0, "device": "cpu"},
        "lora": {"rank": 4, "alpha": 4},
        "optimizer": {"lr": 5e-2},
        "data": {"sources": [{"path": str(data)}], "resolutions": [32], "cache_dir": str(tmp / "cache"),
                 "clip_frames": 5, "clips": "first"},
        "sample": {"prompts": [PROMPT], "steps": 2, "width": 32, "height": 32, "frames": 5, "guidance": 5.0,
                   "seed": 3, **sample},
        "output": {"dir": str(tmp / "out"), "tensorboard": False},
    })


def test_each_expert_owns_its_side_of_the_boundary(a14b):
    high = get_adapter(ModelConfig(family=FAMILY, path=a14b, expert="high_noise"))
    low = get_adapter(ModelConfig(family=FAMILY, path=a14b, expert="low_noise"))
    assert (high.transformer_dir, low.transformer_dir) == ("transformer", "transformer_2")
    assert high.train_timesteps() == (0.875, 1.0) and low.train_timesteps() == (0.0, 0.875)
    with pytest.raises(UserError, match="trains one expert per run, or both: set model.expert to high_noise"):
        get_adapter(ModelConfig(family=FAMILY, path=a14b)).train_timesteps()
    with pytest.raises(UserError, match="model.expert: 'mid_noise': wan2.2-a14b's experts are high_noise, low_noise"):
        get_adapter(ModelConfig(family=FAMILY, path=a14b, expert="mid_noise"))
    with pytest.raises(UserError, match="wan has one transformer"):
        get_adapter(ModelConfig(family="wan", path=a14b, expert="low_noise"))
    # the objective maps the shifted t into the expert's range: every draw on its side (the pipeline's t >= 875)
    cfg = _config(a14b, a14b, a14b, "high_noise").train
    for lo, hi in (high.train_timesteps(), low.train_timesteps()):
        t = FlowMatching(cfg, lambda h, w: 3.0, t_range=(lo, hi)).noise(torch.zeros(256, 4, 2, 4, 4)).t
        assert lo <= t.min() and t.max() <= hi and t.max() - t.min() > 0.5 * (hi - lo)
    from trainer.sampling.request import check_guidance_2

    with pytest.raises(UserError, match="sample.guidance_2: wan has one transformer"):
        check_guidance_2(2.0, get_adapter(ModelConfig(family="wan", path=a14b)))
    # the Wan variants share WanPipeline: a folder of another one is refused in one line naming it
    with pytest.raises(UserError, match=r"two experts \(transformer_2, boundary_ratio\), not wan: use model.family: "
                                        r"wan2.2-a14b$"):
        get_adapter(ModelConfig(family="wan", path=a14b)).load(ModelConfig(family="wan", path=a14b), parts={"vae"},
                                                               dtype=torch.float32)
    # a LoRA file goes to its expert by its name: every file a run writes says which
    from trainer.train.method import method_for
    from trainer.train.run import step_lora_name

    run = _config(a14b, a14b, a14b, "low_noise")
    assert method_for(run).final_output(Path("o")) == Path("o/lora-low_noise.safetensors")
    assert method_for(run)._named(Path("o"), "-ema") == Path("o/lora-low_noise-ema.safetensors")
    assert step_lora_name(run, 500) == "lora-low_noise-step-000500.safetensors"
    assert high.lora_load_kwargs("out/lora-low_noise.safetensors") == {"load_into_transformer_2": True}
    assert high.lora_load_kwargs("wan22_Low-Noise_v1.safetensors") == {"load_into_transformer_2": True}
    assert high.lora_load_kwargs("out/lora-high_noise.safetensors") == {}


@pytest.fixture(scope="module")
def fitted(a14b, clip, tmp_path_factory) -> dict[str, tuple[Config, Path]]:
    """Both experts fitted, one run each; the low-noise run samples at its last step (the high-noise expert's base
    weights loaded beside it)."""
    runs = {}
    for expert in ("high_noise", "low_noise"):
        tmp = tmp_path_factory.mktemp(f"wan22-{expert}")
        cfg = _config(a14b, clip, tmp, expert, every=2 if expert == "low_noise" else 0)
        path = tmp / "fit.yaml"
        path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=True)))
        r = CliRunner().invoke(app, ["fit", str(path)])
        assert r.exit_code == 0, r.output
        runs[expert] = cfg, tmp / "out"
    return runs


def test_each_run_writes_its_experts_lora_that_wan_pipeline_loads(fitted):
    from diffusers import WanPipeline

    (cfg, high), (_, low) = fitted["high_noise"], fitted["low_noise"]
    assert (high / "lora-high_noise.safetensors").is_file() and not (high / "lora.safetensors").exists()
    assert (low / "lora-low_noise.safetensors").is_file()
    assert (low / "samples" / "step-000002-0.png").is_file()  # sampled with both experts during the fit
    assert probe_video(low / "samples" / "step-000002-0.mp4", None) == (32, 32, 5)  # and its mp4 beside it
    import shutil

    from trainer.train.run import clear

    copy = Path(shutil.copytree(low, low.parent / "copy"))
    clear(copy)  # --overwrite: the fit's sample videos go with their frame PNGs
    assert not (copy / "samples").exists()
    pipe = WanPipeline.from_pretrained(str(cfg.model.path), torch_dtype=torch.float32, local_files_only=True)
    pipe.load_lora_weights(str(high / "lora-high_noise.safetensors"), adapter_name="high")
    pipe.load_lora_weights(str(low / "lora-low_noise.safetensors"), adapter_name="low",
                           load_into_transformer_2=True)
    assert pipe.get_list_adapters() == {"transformer": ["high"], "transformer_2": ["low"]}


def _pipeline_frames(cfg: Config, loras: list[Path], seed: int, **kw) -> tuple[list, list[str]]:
    """The reference: WanPipeline with both experts, each LoRA loaded as a diffusers user loads it; and which
    expert ran each step."""
    from diffusers import WanPipeline

    from trainer.models._diffusers import own_aligned_memory

    pipe = WanPipeline.from_pretrained(str(cfg.model.path), torch_dtype=torch.float32, local_files_only=True)
    for tr in (pipe.transformer, pipe.transformer_2):
        own_aligned_memory(tr)  # as our loader does: same memory alignment, same CPU rounding
    pipe.set_progress_bar_config(disable=True)
    for i, lora in enumerate(loras):
        pipe.load_lora_weights(str(lora), adapter_name=f"l{i}", load_into_transformer_2="low_noise" in lora.name)
    ran = []
    for name in ("transformer", "transformer_2"):
        getattr(pipe, name).register_forward_pre_hook(lambda *_, n=name: ran.append(n))
    s = cfg.sample
    frames = pipe(prompt=PROMPT, height=s.height, width=s.width, num_frames=s.frames, num_inference_steps=s.steps,
                  guidance_scale=s.guidance, generator=torch.Generator().manual_seed(seed), output_type="pil",
                  **kw).frames[0]
    return frames, ran


def test_sample_with_both_experts_loras_is_pixel_identical_to_wan_pipeline(fitted, tmp_path):
    (cfg, high), (_, low) = fitted["high_noise"], fitted["low_noise"]
    loras = [high / "lora-high_noise.safetensors", low / "lora-low_noise.safetensors"]
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"expert": None})})  # sampling: both
    _, sheet = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, loras=[str(p) for p in loras],
                                             out=tmp_path / "both"))
    want, ran = _pipeline_frames(cfg, loras, seed=3)
    assert ran == ["transformer"] * 2 + ["transformer_2"] * 2  # step 1 high noise, step 2 low (with CFG)
    np.testing.assert_array_equal(pixels(sheet), np.asarray(frame_sheet(want)))
    # the low-noise LoRA went to transformer_2 and changes the video there
    _, high_only = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, loras=[str(loras[0])],
                                                 out=tmp_path / "high"))
    assert (pixels(high_only) != pixels(sheet)).mean() > 0.05
    # both experts streamed by the conductor (its CPU ring): the same frames
    _, streamed = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, loras=[str(p) for p in loras],
                                                offload=1.0, out=tmp_path / "streamed"))
    np.testing.assert_array_equal(pixels(streamed), pixels(sheet))
    # the low-noise steps' own guidance (sample.guidance_2), as guidance_scale_2
    cfg2 = cfg.model_copy(update={"sample": cfg.sample.model_copy(update={"guidance_2": 2.0})})
    _, two = run_sample(cfg2, SampleRequest(prompts=[PROMPT], seed=3, loras=[str(p) for p in loras],
                                            out=tmp_path / "g2"))
    want, _ = _pipeline_frames(cfg, loras, seed=3, guidance_scale_2=2.0)
    np.testing.assert_array_equal(pixels(two), np.asarray(frame_sheet(want)))
    assert (pixels(two) != pixels(sheet)).mean() > 0.05


def test_sample_frames_on_the_command_line(fitted, tmp_path):
    cfg, low = fitted["low_noise"]
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=True)))
    r = CliRunner().invoke(app, ["sample", str(path), "--frames", "9", "--lora", str(low / "lora-low_noise.safetensors"),
                                 "--out", str(tmp_path / "s")])
    assert r.exit_code == 0, r.output
    (mp4,) = (tmp_path / "s").glob("*.mp4")
    assert probe_video(mp4, None) == (32, 32, 9)
    r = CliRunner().invoke(app, ["sample", str(path), "--frames", "8", "--out", str(tmp_path / "t")])
    assert r.exit_code != 0 and "sample.frames 8: wan2.2-a14b makes 4k+1 frames" in r.output


# ---------------------------------------------------------------------------------------------- TI2V-5B


@pytest.fixture(scope="module")
def ti2v(tmp_path_factory) -> Path:
    from trainer.models.tiny import make_tiny_models

    (folder,) = make_tiny_models(tmp_path_factory.mktemp("tiny-wan22-ti2v"), ["wan2.2-ti2v-5b"])
    return folder


def test_ti2v_latents_and_per_token_timesteps_as_wan_pipeline(ti2v):
    mc = ModelConfig(family="wan2.2-ti2v-5b", path=ti2v, dtype="fp32")
    adapter = get_adapter(mc)
    assert adapter.resolution_divisor == 32 and adapter.expand_timesteps
    other = ModelConfig(family="wan2.2-a14b", path=ti2v)
    with pytest.raises(UserError, match="with expand_timesteps, not wan2.2-a14b: use model.family: wan2.2-ti2v-5b"):
        get_adapter(other).load(other, parts={"vae"}, dtype=torch.float32)
    comps = adapter.load(mc, parts={"transformer", "vae", "text", "scheduler"}, dtype=torch.float32)
    pipe = adapter.pipeline(comps)
    assert pipe.config.expand_timesteps
    # Wan 2.2's VAE: 2x2 patchify, then 8x: a latent pixel is 16x16 pixels
    assert adapter.encode_videos(comps.vae, torch.rand(1, 3, 5, 64, 64) * 2 - 1).shape == (1, 8, 2, 4, 4)
    seen = {}

    def hook(_m, _args, kw, out):
        seen.setdefault("call", (kw, out[0]))

    h = comps.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        pipe(prompt=PROMPT, num_inference_steps=2, height=64, width=64, num_frames=5, guidance_scale=1.0,
             output_type="latent", generator=torch.Generator().manual_seed(0))
    finally:
        h.remove()
    kw, out = seen["call"]
    assert kw["timestep"].shape == (1, 2 * 2 * 2)  # one per token: 2 latent frames of 2x2 tokens
    with torch.no_grad():
        got = adapter.predict(comps.transformer, kw["hidden_states"], kw["timestep"][:, 0].float() / 1000,
                              {"prompt_embeds": kw["encoder_hidden_states"]})
    torch.testing.assert_close(got, out, rtol=0, atol=1e-5)


def test_ti2v_fit_and_sample_are_pixel_identical_to_wan_pipeline(ti2v, clip, tmp_path):
    from diffusers import WanPipeline

    from trainer.models._diffusers import own_aligned_memory

    cfg = _config(ti2v, clip, tmp_path, None)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"family": "wan2.2-ti2v-5b"})})
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=True)))
    r = CliRunner().invoke(app, ["fit", str(path)])
    assert r.exit_code == 0, r.output
    lora = tmp_path / "out" / "lora.safetensors"
    _, sheet = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, loras=[str(lora)], out=tmp_path / "s"))
    pipe = WanPipeline.from_pretrained(str(ti2v), torch_dtype=torch.float32, local_files_only=True)
    own_aligned_memory(pipe.transformer)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora))
    s = cfg.sample
    want = pipe(prompt=PROMPT, height=s.height, width=s.width, num_frames=s.frames, num_inference_steps=s.steps,
                guidance_scale=s.guidance, generator=torch.Generator().manual_seed(3), output_type="pil").frames[0]
    np.testing.assert_array_equal(pixels(sheet), np.asarray(frame_sheet(want)))


def test_a_full_fine_tune_of_the_low_noise_expert_samples_in_transformer_2(a14b, clip, tmp_path):
    """`train.method: full` with model.expert low_noise: output.dir/transformer holds the trained transformer_2, and
    `dittrain sample` puts it back there (the high-noise expert as in the folder)."""
    from diffusers import WanPipeline

    from trainer.models._diffusers import own_aligned_memory
    from trainer.train.checkpoint import load_transformer_weights

    cfg = _config(a14b, clip, tmp_path, "low_noise")
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"method": "full", "steps": 1}),
                                 "optimizer": cfg.optimizer.model_copy(update={"lr": 1e-3})})
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=True)))
    r = CliRunner().invoke(app, ["fit", str(path)])
    assert r.exit_code == 0, r.output
    _, sheet = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, out=tmp_path / "s"))
    pipe = WanPipeline.from_pretrained(str(a14b), torch_dtype=torch.float32, local_files_only=True)
    load_transformer_weights(tmp_path / "out" / "transformer", pipe.transformer_2)
    for tr in (pipe.transformer, pipe.transformer_2):
        own_aligned_memory(tr)
    pipe.set_progress_bar_config(disable=True)
    s = cfg.sample
    want = pipe(prompt=PROMPT, height=s.height, width=s.width, num_frames=s.frames, num_inference_steps=s.steps,
                guidance_scale=s.guidance, generator=torch.Generator().manual_seed(3), output_type="pil").frames[0]
    np.testing.assert_array_equal(pixels(sheet), np.asarray(frame_sheet(want)))
