"""LTX-2 with sound (`ltx2`, model.audio), issue 45, on the tiny model: a clip with a sine tone (PCM in QuickTime,
lossless, written by PyAV) is read under the clip at the audio VAE's rate; its log-mel spectrogram equals one
computed here independently (numpy: frames, rfft, a Slaney filterbank written from the formula); the cached audio
latents are the audio VAE's encode of that mel, packed and normalised as the pipeline denormalises; the joint
`predict` equals the pipeline's transformer call (video and audio); a fit on the tone clip, a silent clip and a
still trains the audio LoRA (its weights move), batches the silent clip apart, and writes a file LTX2Pipeline
loads; `dittrain sample` writes the pipeline's sound (same seed and LoRA) into the mp4; model.audio: false trains
video only."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import _family_checks as checks
import av
import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_ltx2 import PROMPT, config_dict
from test_wan import _frames
from typer.testing import CliRunner

from trainer.cli import app
from trainer.config import Config
from trainer.data.video import read_audio, write_video
from trainer.models import ltx2_audio
from trainer.sample import SampleRequest, run_sample

FAMILY = "ltx2"
RATE = 16000


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    from trainer.models.tiny import make_tiny_models

    root = tmp_path_factory.mktemp("tiny-ltx2-audio")
    make_tiny_models(root, [FAMILY])
    return root / FAMILY


def tone(n: int, freq: float = 440.0) -> np.ndarray:
    """(2, n) int16: a sine at `freq` Hz on the left, at half of it on the right."""
    t = np.arange(n) / RATE
    return (np.stack([np.sin(2 * math.pi * freq * t), 0.5 * np.sin(math.pi * freq * t)]) * 12000).astype(np.int16)


def write_clip_with_tone(path: Path, frames: int, fps: int = 24) -> np.ndarray:
    """`frames` frames (H.264) and their seconds of `tone` (16-bit PCM at 16 kHz, stereo) in one QuickTime file;
    returns the samples written."""
    wave = tone(int(frames / fps * RATE) + RATE // 10)  # a little longer than the picture
    with av.open(str(path), "w") as out:
        v = out.add_stream("libx264", rate=Fraction(fps))
        v.width, v.height, v.pix_fmt = 64, 64, "yuv420p"
        a = out.add_stream("pcm_s16le", rate=RATE, layout="stereo")
        for im in _frames(frames):
            for p in v.encode(av.VideoFrame.from_ndarray(np.asarray(im), format="rgb24")):
                out.mux(p)
        for p in v.encode():
            out.mux(p)
        fr = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave.T.reshape(1, -1)), format="s16", layout="stereo")
        fr.sample_rate = RATE
        for p in (*a.encode(fr), *a.encode(None)):
            out.mux(p)
    return wave


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A 9-frame clip with a tone, a 9-frame clip without sound, a still."""
    d = tmp_path_factory.mktemp("ltx2-audio-data")
    write_clip_with_tone(d / "tone.mov", 9)
    (d / "tone.txt").write_text(PROMPT)
    write_video(_frames(9), d / "silent.mp4", 24)
    (d / "silent.txt").write_text("a silent square")
    _frames(1)[0].save(d / "still.png")
    (d / "still.txt").write_text("a green square")
    return d


def _config(model: Path, data: Path, tmp: Path, **model_extra) -> dict:
    return config_dict(model, data, tmp, steps=6, sample_every=0, **model_extra)


# ---------------------------------------------------------------------------------------------- the sound's latents


def _numpy_log_mel(wave: np.ndarray, rate: int, hop: int, n_mels: int, n_fft: int = 1024) -> np.ndarray:
    """(channels, samples) -> (channels, frames, n_mels): centred frames of a reflect-padded signal, a periodic
    Hann window, |rfft|, Slaney-scale triangles from 0 Hz to rate / 2 with Slaney area norm, log(max(., 1e-5))."""

    def hz_to_mel(f):
        f = np.asarray(f, dtype=np.float64)
        lin = f / (200.0 / 3)
        return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0), lin)

    def mel_to_hz(m):
        return np.where(m >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (m - 15.0)), m * 200.0 / 3)

    fft_freqs = np.fft.rfftfreq(n_fft, 1.0 / rate)
    edges = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(rate / 2), n_mels + 2))
    bank = np.zeros((n_mels, len(fft_freqs)))
    for i in range(n_mels):
        lo, mid, hi = edges[i], edges[i + 1], edges[i + 2]
        rise = (fft_freqs - lo) / (mid - lo)
        fall = (hi - fft_freqs) / (hi - mid)
        bank[i] = np.maximum(0.0, np.minimum(rise, fall)) * 2.0 / (hi - lo)
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    out = []
    for ch in wave.astype(np.float64):
        x = np.pad(ch, n_fft // 2, mode="reflect")
        n = 1 + (len(x) - n_fft) // hop
        frames = np.stack([x[k * hop : k * hop + n_fft] * window for k in range(n)])
        mag = np.abs(np.fft.rfft(frames, axis=1))
        out.append(np.log(np.maximum(mag @ bank.T, 1e-5)))
    return np.stack(out)


def test_the_track_under_a_clip_and_its_mel(tmp_path):
    """`read_audio` gives the clip's samples (a later clip starts start / fps seconds in; silence past the track's
    end), and `log_mel` equals the independent numpy log-mel (torchaudio's MelSpectrogram as ltx-core sets it)."""
    wave = write_clip_with_tone(tmp_path / "t.mov", 17)
    got = read_audio(tmp_path / "t.mov", 24, 0, 9, RATE)
    assert got.shape == (2, 6000)
    np.testing.assert_array_equal(got.numpy(), wave[:, :6000] / 32768.0)
    later = read_audio(tmp_path / "t.mov", 24, 8, 9, RATE)
    np.testing.assert_array_equal(later.numpy(), wave[:, 8 * 2000 // 3 : 8 * 2000 // 3 + 6000] / 32768.0)
    past = read_audio(tmp_path / "t.mov", 24, 17, 9, RATE)  # the track ends 0.1 s after the picture
    assert past[:, : RATE // 10 - 10].abs().max() > 0.1 and past[:, RATE // 10 + 10 :].abs().max() == 0
    for n_mels in (8, 64):
        mel = ltx2_audio.log_mel(got[None], RATE, 160, n_mels)
        assert mel.shape == (1, 2, 1 + 6000 // 160, n_mels)
        theirs = _numpy_log_mel(got.numpy(), RATE, 160, n_mels)
        # fp32 against fp64: equal to 1e-4 relative in the mel's own (linear) units, to 1e-7 near the floor
        np.testing.assert_allclose(np.exp(mel[0].numpy()), np.exp(theirs), rtol=1e-4, atol=1e-7)
        assert np.abs(mel[0].numpy() - theirs)[theirs > -8].max() < 1e-4


def test_sound_tokens_are_the_audio_vaes_encode_normalised_as_the_pipeline(models):
    """`encode_sound`: the audio VAE's mean latents of the mel, packed (C M per token), normalised per feature
    (`_denormalize_audio_latents` gives them back), cut to the pipeline's `audio_num_frames`."""
    from diffusers import LTX2Pipeline

    adapter, comps, pipe = checks.tiny_pipeline(FAMILY, models)
    wave = torch.from_numpy(tone(6000) / 32768.0).float()[None]
    tokens = adapter.encode_sound(pipe.audio_vae, wave, 9, 24.0)["audio_latents"]
    mel = torch.from_numpy(_numpy_log_mel(wave[0].numpy(), RATE, 160, 8)).float()[None]
    with torch.no_grad():
        lat = pipe.audio_vae.encode(mel).latent_dist.mode()
    n = round(9 / 24 * RATE / 160 / 4)  # the pipeline's audio_num_frames for 9 frames
    assert tokens.shape == (1, n, 4) and lat.shape[2] >= n
    back = LTX2Pipeline._unpack_audio_latents(
        LTX2Pipeline._denormalize_audio_latents(tokens, pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std),
        n, num_mel_bins=2)
    torch.testing.assert_close(back, lat[:, :, :n], rtol=0, atol=2e-5)


def test_joint_predict_is_the_pipelines_transformer_call(models):
    """With the sound in the text dict `predict` is the pipeline's joint call (cross-modal attention on, the
    connectors' audio prompt, the step's timestep for both streams), video and audio outputs alike."""
    adapter, comps, pipe = checks.tiny_pipeline(FAMILY, models)
    seen = []
    h = comps.transformer.register_forward_hook(lambda _m, _a, kw, out: seen.append((kw, out)), with_kwargs=True)
    try:
        pipe(prompt=PROMPT, height=64, width=64, num_frames=9, num_inference_steps=2, output_type="latent",
             generator=torch.Generator().manual_seed(0))
    finally:
        h.remove()
    text = adapter.encode_prompts(comps, [PROMPT])
    pe, pm, _, _ = pipe.encode_prompt(PROMPT, do_classifier_free_guidance=False, device="cpu")
    _v, audio_embeds, _m = pipe.connectors(pe, pm, padding_side=pipe.tokenizer.padding_side)
    assert torch.equal(text["audio_prompt_embeds"], audio_embeds)
    for kw, (video, audio) in seen[::3]:  # the classifier-free batch of each step: its conditional half
        assert kw["isolate_modalities"] is False and kw["audio_num_frames"] == 9
        one = {k: (v[1:2] if isinstance(v, torch.Tensor) and v.shape[:1] == (2,) else v) for k, v in kw.items()}
        noisy = one["hidden_states"].reshape(1, 2, 2, 2, 4).permute(0, 4, 1, 2, 3)
        with torch.no_grad():
            got_v, got = adapter.predict(comps.transformer, noisy, one["timestep"] / 1000,
                                         {**text, "audio_latents": one["audio_hidden_states"]})
            want_v, want = comps.transformer(**one)  # the call alone (batch 1: same rounding)
        assert torch.equal(got_v, want_v.reshape(1, 2, 2, 2, 4).permute(0, 4, 1, 2, 3))
        assert torch.equal(got["audio_latents"], want)
        torch.testing.assert_close(want, audio[1:2], rtol=1e-5, atol=1e-6)  # the pipeline's own batch of two
        torch.testing.assert_close(want_v, video[1:2], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- fit and sample


@pytest.fixture(scope="module")
def fitted(models, data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ltx2-audio-fit")
    raw = _config(models, data, tmp)
    path = tmp / "fit.yaml"
    path.write_text(yaml.safe_dump(raw))
    r = CliRunner().invoke(app, ["fit", str(path)])
    assert r.exit_code == 0, r.output
    return Config.model_validate(raw), tmp / "out"


def test_fit_trains_the_audio_branch_on_the_clip_with_sound(fitted, models):
    """The tone clip's cache entry holds its audio tokens (the audio VAE's encode of the independent mel), the
    silent clip's and the still's none; the audio stream's LoRA weights moved; LTX2Pipeline loads the file into both
    streams and the attention between them."""
    from diffusers import LTX2Pipeline

    cfg, out = fitted
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and all(np.isfinite(x["loss"]) for x in lines)
    entries = [load_file(f) for f in Path(cfg.data.cache_dir, "latents").rglob("*.safetensors")]
    sound = [e["audio_latents"] for e in entries if "audio_latents" in e]
    assert len(entries) == 3 and len(sound) == 1 and sound[0].shape == (9, 4)
    _adapter, _comps, pipe = checks.tiny_pipeline(FAMILY, models)
    wave = read_audio(Path(cfg.data.sources[0].path) / "tone.mov", 24, 0, 9, RATE)
    mel = torch.from_numpy(_numpy_log_mel(wave.numpy(), RATE, 160, 8)).float()[None]
    with torch.no_grad():
        lat = ltx2_audio.pack(pipe.audio_vae.encode(mel).latent_dist.mode()[:, :, :9])
    want = (lat - pipe.audio_vae.latents_mean) / pipe.audio_vae.latents_std
    torch.testing.assert_close(sound[0], want[0], rtol=0, atol=2e-5)
    sd = load_file(out / "lora.safetensors")
    moved = [k for k, v in sd.items() if ".audio_attn1." in k and "lora_B" in k and v.abs().max() > 0]
    assert moved, "the audio stream's LoRA must train"
    pipe = LTX2Pipeline.from_pretrained(str(cfg.model.path), local_files_only=True)
    pipe.load_lora_weights(str(out / "lora.safetensors"))
    names = {k.split(".lora_A.")[0].split(".", 2)[-1] for k in pipe.transformer.state_dict()
             if ".lora_A." in k and k.startswith("transformer_blocks.1.")}
    assert {"audio_attn1.to_q", "audio_to_video_attn.to_v", "video_to_audio_attn.to_k", "audio_ff.net.2",
            "attn1.to_q", "ff.net.2"} <= names


def test_clips_with_sound_batch_apart(models, data, tmp_path):
    """The tone clip's entry trains sound (its own batch group), the silent clip's and the still's do not; with
    model.audio: false none does and the LoRA targets are the video stream's."""
    from trainer.data.pipeline import plan_data
    from trainer.models import get_adapter

    for audio, want in ((True, {"tone.mov": True, "silent.mp4": False, "still.png": False}),
                        (False, {"tone.mov": False, "silent.mp4": False, "still.png": False})):
        cfg = Config.model_validate(_config(models, data, tmp_path, audio=audio))
        adapter = get_adapter(cfg.model)
        plan = plan_data(cfg, adapter, progress=False)
        got = {Path(plan.items[e.item].file).name: e.audio for e in plan.entries}
        assert got == want
        groups = {Path(plan.items[e.item].file).name: e.group for e in plan.entries}
        assert (groups["tone.mov"] != groups["silent.mp4"]) == audio
        assert any(t.startswith("audio_") for t in adapter.lora_targets()) == audio


def test_sample_writes_the_pipelines_sound_into_the_mp4(fitted, tmp_path, monkeypatch):
    """`dittrain sample` with the LoRA: the mp4 has an AAC stream at the vocoder's rate, and the sound it muxed is
    the pipeline's `audio` with the same seed and LoRA, sample for sample."""
    from diffusers import LTX2Pipeline

    import trainer.sample as sample_mod
    from trainer.models._diffusers import own_aligned_memory

    cfg, out = fitted
    lora = out / "lora.safetensors"
    clips = []
    real = sample_mod.write_video
    monkeypatch.setattr(sample_mod, "write_video", lambda frames, *a, **k: (clips.append(frames), real(frames, *a, **k))[1])
    mp4, _sheet = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, loras=[str(lora)], out=tmp_path / "s"))
    pipe = LTX2Pipeline.from_pretrained(str(cfg.model.path), torch_dtype=torch.float32, local_files_only=True)
    own_aligned_memory(pipe.transformer)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora))
    s = cfg.sample
    want = pipe(prompt=PROMPT, height=s.height, width=s.width, num_frames=s.frames, num_inference_steps=s.steps,
                guidance_scale=s.guidance, generator=torch.Generator().manual_seed(3), output_type="pil")
    (clip,) = clips
    assert clip.sample_rate == pipe.vocoder.config.output_sampling_rate == 16000
    assert torch.equal(clip.audio, want.audio[0].float())
    np.testing.assert_array_equal(np.stack([np.asarray(f) for f in clip]),
                                  np.stack([np.asarray(f) for f in want.frames[0]]))
    with av.open(str(mp4)) as f:
        (a,) = f.streams.audio
        assert a.codec_context.name == "aac" and a.rate == 16000 and a.channels == 2
