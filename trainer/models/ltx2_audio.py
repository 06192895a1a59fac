"""LTX-2's sound: a clip's audio track as the audio latents `LTX2Pipeline` denoises (trainer/models/ltx2.py).

The pipeline generates sound as audio-VAE latents (B, C, L, M): C = 8 channels over M = 16 latent mel bins, L
latent frames of 4 mel frames each; it packs them to L tokens of C * M = 128 features (`_pack_audio_latents`,
mel bins innermost), normalises the packed tokens per feature with the audio VAE's `latents_mean` / `latents_std`
(`_normalize_audio_latents`; undone by `_denormalize_audio_latents` before `audio_vae.decode`), and asks for
L = round(frames / frame_rate * sample_rate / hop_length / 4) latent frames (`audio_num_frames`: 126 for 121 frames
at 24 fps). The vocoder turns the decoded log-mel spectrogram into a waveform at its `output_sampling_rate`.

Training goes the other way, as Lightricks' trainer prepares it (ltx-trainer `scripts/process_videos.py`,
ltx-core `model/audio_vae/ops.py` `AudioProcessor`): the clip's stretch of the track, stereo at the audio VAE's
`sample_rate` (trainer/data/video.py `read_audio`), then a log-mel spectrogram

    magnitude STFT: n_fft = win_length = MEL_N_FFT, hop = `mel_hop_length`, periodic Hann window, centred with
    reflect padding (torchaudio's Spectrogram, power 1); Slaney-scale mel filterbank from 0 Hz to sample_rate / 2
    with Slaney area normalisation (torchaudio's `melscale_fbanks(norm="slaney", mel_scale="slaney")`), `mel_bins`
    filters; log(max(mel, 1e-5)); laid out (B, channels, frames, mel_bins)

written here with torch.stft (torchaudio is not a dependency); then the audio VAE's encoder, the mean of its
latent distribution (`latent_dist.mode()`; ltx-core takes the same first half of the encoder's channels), packed
and normalised as the pipeline does, and cut to the pipeline's L (the encoder is causal in time: a latent frame
sees only the mel frames up to it, so the first L latent frames of the clip are those of its first L * 4 mel
frames; the encoder gives L or L + 1).

Where each number comes from: `sample_rate` 16000, `mel_hop_length` 160, `mel_bins` 64, `latent_channels` 8 are
AutoencoderKLLTX2Audio's config (diffusers' defaults, the release's); the 4x latent compression in time and mel is
its `temporal_compression_ratio` / `mel_compression_ratio`; the STFT window (n_fft 1024), the window shape,
centring, power 1, the mel range and the Slaney scale and norm are not in diffusers (its audio VAE has no
preprocessing, and LTX2VocoderWithBWE's `MelSTFT` is LTX-2.3's vocoder-side causal STFT, not the encoder's input):
they are ltx-core's `AudioProcessor` and its `AudioEncoderConfigurator` default (`preprocessing.stft.filter_length`
1024), from Lightricks' public LTX-2 repository, not from an installed package. A folder's audio VAE config
decides the rest (a tiny model's 8 mel bins).
"""

from __future__ import annotations

import math

import torch
from torch import nn

#: the STFT size (and window length) of the audio VAE's mel input: ltx-core's default `stft.filter_length`
MEL_N_FFT = 1024
#: latent frames per mel frame and latent mel bins per mel bin (AutoencoderKLLTX2Audio's LATENT_DOWNSAMPLE_FACTOR)
AUDIO_COMPRESSION = 4

_F_SP, _MIN_LOG_HZ = 200.0 / 3, 1000.0
_MIN_LOG_MEL, _LOGSTEP = _MIN_LOG_HZ / _F_SP, math.log(6.4) / 27.0


def _hz_to_mel(hz: float) -> float:
    """Slaney's scale: linear below 1 kHz, logarithmic above."""
    return hz / _F_SP if hz < _MIN_LOG_HZ else _MIN_LOG_MEL + math.log(hz / _MIN_LOG_HZ) / _LOGSTEP


def _mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    return torch.where(mel >= _MIN_LOG_MEL, _MIN_LOG_HZ * torch.exp(_LOGSTEP * (mel - _MIN_LOG_MEL)), _F_SP * mel)


def mel_filterbank(n_fft: int, n_mels: int, rate: int) -> torch.Tensor:
    """(n_fft // 2 + 1, n_mels) triangular Slaney-scale filters over 0 .. rate / 2, each scaled to unit area
    (2 / its width in Hz), float64."""
    freqs = torch.linspace(0, rate // 2, n_fft // 2 + 1, dtype=torch.float64)
    pts = _mel_to_hz(torch.linspace(_hz_to_mel(0.0), _hz_to_mel(rate / 2), n_mels + 2, dtype=torch.float64))
    width = pts[1:] - pts[:-1]
    slopes = pts[None, :] - freqs[:, None]
    down, up = -slopes[:, :-2] / width[:-1], slopes[:, 2:] / width[1:]
    fb = torch.clamp(torch.minimum(down, up), min=0.0)
    return fb * (2.0 / (pts[2:] - pts[:-2]))[None, :]


def log_mel(wave: torch.Tensor, rate: int, hop: int, n_mels: int, n_fft: int = MEL_N_FFT) -> torch.Tensor:
    """(B, channels, samples) waveform -> (B, channels, 1 + samples // hop, n_mels) log-mel spectrogram, in the
    waveform's dtype (computed in fp32)."""
    b, ch, n = wave.shape
    x = wave.reshape(b * ch, n).float()
    window = torch.hann_window(n_fft, device=x.device)
    spec = torch.stft(x, n_fft, hop_length=hop, win_length=n_fft, window=window, center=True, pad_mode="reflect",
                      normalized=False, onesided=True, return_complex=True).abs()  # (B ch, freqs, frames)
    fb = mel_filterbank(n_fft, n_mels, rate).to(x.device, torch.float32)
    mel = torch.matmul(spec.transpose(-1, -2), fb)  # (B ch, frames, n_mels)
    return torch.log(torch.clamp(mel, min=1e-5)).reshape(b, ch, -1, n_mels).to(wave.dtype)


def latent_frames(frames: int, fps: float, rate: int, hop: int) -> int:
    """The pipeline's `audio_num_frames` for a clip of `frames` video frames at `fps`."""
    return round(frames / fps * (rate / hop / AUDIO_COMPRESSION))


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, L, M) -> (B, L, C M): the pipeline's `_pack_audio_latents` without patches."""
    return latents.transpose(1, 2).flatten(2, 3)


def unpack(tokens: torch.Tensor, mel_bins: int) -> torch.Tensor:
    """Inverse of `pack` for `mel_bins` latent mel bins (the pipeline's `_unpack_audio_latents`)."""
    return tokens.unflatten(2, (-1, mel_bins)).transpose(1, 2)


@torch.no_grad()
def encode_sound(audio_vae: nn.Module, wave: torch.Tensor, frames: int, fps: float) -> torch.Tensor:
    """(B, 2, samples) stereo at the audio VAE's rate under clips of `frames` frames at `fps` -> (B, L, C M)
    normalised audio tokens, the transformer's `audio_hidden_states` for the clean sound (module essay)."""
    c = audio_vae.config
    mel = log_mel(wave, int(c.sample_rate), int(c.mel_hop_length), int(c.mel_bins))
    lat = audio_vae.encode(mel.to(audio_vae.dtype)).latent_dist.mode()
    n = latent_frames(frames, fps, int(c.sample_rate), int(c.mel_hop_length))
    if lat.shape[2] < n:
        raise ValueError(f"the audio VAE gave {lat.shape[2]} latent frames for a clip that needs {n}")
    tokens = pack(lat[:, :, :n]).float()
    mean, std = audio_vae.latents_mean.to(tokens), audio_vae.latents_std.to(tokens)
    return (tokens - mean) / std

