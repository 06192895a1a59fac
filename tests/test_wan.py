"""Wan 2.1 text-to-video (issue 39, first slice) on the tiny Wan built here, with tiny videos written by PyAV in the
tests: frames read at a target rate into 4k+1 clips, bad videos left out with one line each, captions and the
transformer call as WanPipeline makes them, a LoRA `dittrain fit` on a video and an image whose file WanPipeline's
`load_lora_weights` loads, and `dittrain sample` writing an mp4 and a frame sheet pixel-identical to WanPipeline
with the same seed and LoRA."""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from test_train_support import pixels
from typer.testing import CliRunner

from trainer.cli import app
from trainer.config import Config, ModelConfig
from trainer.data.pipeline import plan_data
from trainer.data.video import clip_starts, probe_video, read_clip, write_video
from trainer.models import get_adapter
from trainer.sample import SampleRequest, run_sample
from trainer.sampling.output import frame_sheet

PROMPT = "a green square moving right"


def _frames(n: int, size: int = 64) -> list[Image.Image]:
    """A green square moving right on red; frame k's top-left pixel holds the level 10 k (to tell frames apart)."""
    yy, xx = np.mgrid[0:size, 0:size]
    out = []
    for k in range(n):
        a = np.zeros((size, size, 3), np.uint8)
        a[:] = (200, 40, 40)
        a[(abs(xx - 12 - 2 * k) < 8) & (abs(yy - size // 2) < 8)] = (40, 200, 40)
        a[:8, :8] = 10 * k
        out.append(Image.fromarray(a))
    return out


def write_clip_and_still(d: Path, frames: int, fps: float, prompt: str) -> Path:
    """`d` with a captioned mp4 of `frames` `_frames` at `fps` (clip.mp4) and a captioned still (still.png): the
    video families' fit data."""
    write_video(_frames(frames), d / "clip.mp4", fps)
    (d / "clip.txt").write_text(prompt)
    _frames(1)[0].save(d / "still.png")
    (d / "still.txt").write_text("a green square")
    return d


def _level(im: Image.Image) -> int:
    return int(round(np.asarray(im)[:8, :8].mean() / 10))


@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> Path:
    """The tiny Wan folder (only this family: the session's `tiny_models` writes every family)."""
    from trainer.models.tiny import make_tiny_models

    root = tmp_path_factory.mktemp("tiny-wan")
    (folder,) = make_tiny_models(root, ["wan"])
    return folder


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> Path:
    """A source folder: a 17-frame 16 fps mp4, a still, and three bad files (corrupt, 5 frames, audio only)."""
    d = write_clip_and_still(tmp_path_factory.mktemp("wan-data"), 17, 16, PROMPT)
    (d / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not really a video")
    (d / "broken.txt").write_text("broken")
    write_video(_frames(5), d / "short.mp4", 16)
    (d / "short.txt").write_text("short")
    with av.open(str(d / "sound.mkv"), "w") as out:  # a container with an audio stream and no video
        s = out.add_stream("pcm_s16le", rate=8000)
        fr = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        fr.sample_rate = 8000
        for p in (*s.encode(fr), *s.encode()):
            out.mux(p)
    (d / "sound.txt").write_text("sound")
    return d


def _config(wan: Path, data: Path, tmp: Path, **data_kw) -> Config:
    return Config.model_validate({
        "model": {"family": "wan", "path": str(wan), "dtype": "fp32"},
        "train": {"method": "lora", "steps": 4, "batch_size": 1, "seed": 0, "checkpoint_every": 0, "device": "cpu",
                  "timestep_sampling": "uniform"},
        "lora": {"rank": 4, "alpha": 4},
        "optimizer": {"lr": 5e-2},
        "data": {"sources": [{"path": str(data)}], "resolutions": [64], "cache_dir": str(tmp / "cache"),
                 "clip_frames": 9, **data_kw},
        "sample": {"prompts": [PROMPT], "steps": 2, "width": 64, "height": 64, "frames": 9, "guidance": 5.0,
                   "seed": 3},
        "output": {"dir": str(tmp / "out"), "tensorboard": False},
    })


# ---------------------------------------------------------------------------------------------- video data


def test_frames_are_read_at_the_target_rate_into_clips(tmp_path):
    path = write_video(_frames(17), tmp_path / "v.mp4", 16)
    assert probe_video(path, 16) == (64, 64, 17)
    assert probe_video(path, 8) == (64, 64, 9)  # every other frame
    assert probe_video(path, None) == (64, 64, 17)
    assert probe_video(path, 32) == (64, 64, 33)  # each frame twice
    assert [_level(im) for im in read_clip(path, 8, 0, 9)] == list(range(0, 17, 2))
    assert [_level(im) for im in read_clip(path, 16, 4, 5)] == [4, 5, 6, 7, 8]
    assert [_level(im) for im in read_clip(path, 32, 0, 5)] == [0, 0, 1, 1, 2]
    assert clip_starts(17, 9, "first") == [0]
    assert clip_starts(17, 9, "uniform", 3) == [0, 4, 8]
    assert clip_starts(40, 9, "all") == [0, 9, 18, 27]
    assert clip_starts(5, 9, "all") == []


def test_videos_become_clip_entries_and_bad_ones_are_left_out_with_one_line(wan, videos, tmp_path):
    cfg = _config(wan, videos, tmp_path, clips="uniform", clips_per_video=3)
    plan = plan_data(cfg, get_adapter(cfg.model), progress=False)
    bad = dict((Path(f).name, why) for f, why in plan.report.bad)
    assert bad.keys() == {"broken.mp4", "short.mp4", "sound.mkv"}
    assert bad["sound.mkv"] == "no video stream"
    assert bad["short.mp4"].startswith("5 frames at 16.0 fps, shorter than one clip of 9")
    assert "not a video or corrupt" in bad["broken.mp4"]
    clips = sorted((e.start, e.frames, e.group) for e in plan.entries if plan.items[e.item].frames)
    assert clips == [(0, 9, (64, 64, 9)), (4, 9, (64, 64, 9)), (8, 9, (64, 64, 9))]
    still = [e for e in plan.entries if not plan.items[e.item].frames]
    assert [(e.frames, e.group) for e in still] == [(1, (64, 64))]
    assert len({plan.latent_key(e) for e in plan.entries}) == 4  # each clip its own latent
    text = plan.summary()
    assert "64x64x9f" in text and "3 clips of 9 frames at 16.0 fps" in text and "left out 3 files" in text
    with pytest.raises(Exception, match=r"data.clip_frames 8: wan trains clips of 4k\+1 frames .* use 5 or 9"):
        plan_data(_config(wan, videos, tmp_path, clip_frames=8), get_adapter(cfg.model), progress=False)


# ---------------------------------------------------------------------------------------------- mirrors the pipeline


def test_text_latents_and_predict_as_wan_pipeline_does(wan):
    mc = ModelConfig(family="wan", path=wan, dtype="fp32")
    adapter = get_adapter(mc)
    comps = adapter.load(mc, parts={"transformer", "vae", "text", "scheduler"}, dtype=torch.float32)
    assert type(comps.scheduler).__name__ == "UniPCMultistepScheduler" and adapter.timestep_shift(64, 64) == 3.0
    pipe = adapter.pipeline(comps)
    text = adapter.encode_prompts(comps, [PROMPT, "a cat"])
    want, _ = pipe.encode_prompt([PROMPT, "a cat"], do_classifier_free_guidance=False, max_sequence_length=512,
                                 device="cpu")
    assert text["prompt_embeds"].shape == (2, 512, 32) and torch.equal(text["prompt_embeds"], want)
    # latents: (B, C, F, h, w), F = 1 + (frames - 1) / 4; an image is one latent frame
    px = torch.rand(1, 3, 9, 64, 64) * 2 - 1
    assert adapter.encode_videos(comps.vae, px).shape == (1, 4, 3, 8, 8)
    assert adapter.encode_images(comps.vae, px[:, :, 0]).shape == (1, 4, 1, 8, 8)
    # predict: the pipeline's own first transformer call (captured), against predict at its sigma
    seen = {}

    def hook(_m, _args, kw, out):
        seen.setdefault("call", (kw, out[0]))

    h = comps.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        pipe(prompt=PROMPT, num_inference_steps=2, height=64, width=64, num_frames=9, guidance_scale=1.0,
             output_type="latent", generator=torch.Generator().manual_seed(0))
    finally:
        h.remove()
    kw, out = seen["call"]
    # UniPC hands the transformer sigma * 1000 cut to an integer; predict takes t = timestep / 1000 (training
    # draws t continuously)
    sigma = pipe.scheduler.sigmas[0].item()
    assert kw["timestep"].tolist() == [int(sigma * 1000)]
    with torch.no_grad():
        got = adapter.predict(comps.transformer, kw["hidden_states"], kw["timestep"].float() / 1000,
                              {"prompt_embeds": kw["encoder_hidden_states"]})
    torch.testing.assert_close(got, out, rtol=0, atol=1e-5)


def test_the_comfy_key_map_is_where_diffusers_single_file_converter_takes_the_weights():
    """Wan's original names (ComfyUI's WanModel, the Wan-AI files), checked with diffusers' own converter run on row
    ids (as for the other families: tests/test_lora_format.py)."""
    from test_lora_format import (
        test_key_map_places_rows_where_diffusers_single_file_converter_takes_them as check,
    )

    check("wan")


# ---------------------------------------------------------------------------------------------- fit and sample


@pytest.fixture(scope="module")
def fitted(wan, videos, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wan-fit")
    cfg = _config(wan, videos, tmp)
    cfg.sample.every = 4  # the last step samples with the model being trained: a frame sheet PNG
    path = tmp / "fit.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=True)))
    r = CliRunner().invoke(app, ["fit", str(path)])
    assert r.exit_code == 0, r.output
    return cfg, tmp / "out"


def test_fit_trains_a_lora_on_a_video_that_wan_pipeline_loads(fitted):
    cfg, out = fitted
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(np.isfinite(x["loss"]) for x in lines)
    sheet = Image.open(out / "samples" / "step-000004-0.png")
    assert sheet.size == (3 * 64 + 4 * 4, 3 * 64 + 4 * 4)  # 9 frames on a 3 x 3 grid
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(cfg.model.path), torch_dtype=torch.float32, local_files_only=True)
    pipe.load_lora_weights(str(out / "lora.safetensors"))
    names = {k.split(".lora_A.")[0] for k in pipe.transformer.state_dict() if ".lora_A." in k}
    assert "blocks.0.attn1.to_q" in names and "blocks.1.ffn.net.2" in names


def _pipeline_frames(cfg: Config, lora: Path, seed: int) -> list[Image.Image]:
    """The reference: WanPipeline as a diffusers user calls it, with diffusers' LoRA loading."""
    from diffusers import WanPipeline

    from trainer.models._diffusers import own_aligned_memory

    pipe = WanPipeline.from_pretrained(str(cfg.model.path), torch_dtype=torch.float32, local_files_only=True)
    own_aligned_memory(pipe.transformer)  # as our loader does: same memory alignment, same CPU rounding
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora))
    s = cfg.sample
    return pipe(prompt=PROMPT, height=s.height, width=s.width, num_frames=s.frames, num_inference_steps=s.steps,
                guidance_scale=s.guidance, generator=torch.Generator().manual_seed(seed), output_type="pil").frames[0]


def test_sample_writes_an_mp4_and_frames_pixel_identical_to_wan_pipeline(fitted, tmp_path, capsys):
    cfg, out = fitted
    lora = out / "lora.safetensors"
    plain = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, out=tmp_path / "plain"))
    assert f"wrote 1 video (mp4, each with a PNG of its frames) to {tmp_path / 'plain'}" in capsys.readouterr().err
    ours = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, loras=[str(lora)], out=tmp_path / "lora"))
    mp4, sheet = ours
    assert mp4.suffix == ".mp4" and sheet.suffix == ".png" and mp4.stem == sheet.stem
    assert Image.open(sheet).text["frames"] == "9"
    want = _pipeline_frames(cfg, lora, seed=3)
    assert len(want) == 9
    np.testing.assert_array_equal(pixels(sheet), np.asarray(frame_sheet(want)))  # all 9 frames, bit for bit
    assert (pixels(sheet) != pixels(plain[1])).mean() > 0.05, "the trained LoRA must change the video"
    # every block streamed by the offload conductor (its CPU ring here): the same frames
    streamed = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, loras=[str(lora)], offload=1.0,
                                             out=tmp_path / "streamed"))
    np.testing.assert_array_equal(pixels(streamed[1]), pixels(sheet))
    # the mp4: 9 frames of 64x64 at 16 fps, H.264 close to the frames (lossy)
    assert probe_video(mp4, None) == (64, 64, 9)
    got = read_clip(mp4, None, 0, 9)
    err = np.mean([np.abs(np.asarray(a, float) - np.asarray(b, float)).mean() for a, b in zip(got, want, strict=True)])
    assert err < 12, err


def test_frames_must_be_a_clip_the_vae_makes(fitted, tmp_path):
    cfg, _ = fitted
    with pytest.raises(Exception, match=r"sample.frames 8: wan makes 4k\+1 frames: use 5 or 9"):
        run_sample(cfg, SampleRequest(prompts=[PROMPT], frames=8, out=tmp_path))
