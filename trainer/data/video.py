"""Reading video files into clips of frames for the video families (`adapter.video`: Wan).

Decoder: PyAV (`av`, pinned in pyproject.toml). Its wheels bundle FFmpeg's libraries, so mp4 (H.264 / H.265 /
AV1), webm (VP8 / VP9), mov, mkv and gif decode on a fresh machine with nothing else installed, on Linux, macOS and
Windows, CPU only; it hands out each frame with its presentation time, which the frame-rate conversion below needs.
(torchcodec decodes on the GPU too, but needs a system FFmpeg of a matching version and is tied to one torch
release; decord has no wheels for current Pythons.)

**Frame rate.** Frames are read at `data.fps` by their timestamps: output frame k shows the last decoded frame whose
time (from the first frame's) is at or before k / fps, so a 30 fps video read at 16 fps skips frames and an 8 fps
one repeats them, and the clip lasts as long as the video's stretch does. `data.fps: null` takes every frame as
stored. A video has n frames at that rate (`probe_video`), n = floor(t_last * fps) + 1.

**Clips.** A clip is `data.clip_frames` consecutive frames at that rate (4k + 1 for Wan: the VAE encodes the first
frame alone, then groups of 4). `data.clips` picks which: `first` (frames 0 .. L-1), `uniform` (`data.clips_per_video`
clips spread evenly from the first frame to the last, overlapping when the video is short) or `all` (every
non-overlapping clip from the start). Each clip is one training entry with its own cached latent. An image in the
same run is a 1-frame clip.

**Bad files.** A file PyAV cannot open or decode, one with no video stream or no frames, is a `BadImage` with the
reason (the scan's "left out" line); one shorter than a clip is left out by the data plan with its frame count.

**Sound** (families that train it: LTX-2). `has_audio` says whether a file has an audio stream (its header only);
`read_audio` decodes the stretch of it under a clip, `frames / fps` seconds from the clip's first frame (times from
each stream's start), resampled to stereo at the rate the family's audio encoder takes (FFmpeg's resampler, through
PyAV); a track that ends before the clip is padded with silence, as Lightricks' trainer pads it. `write_video`
muxes a sample's sound (trainer/models/base.py `Clip.audio`) into the mp4 as AAC.

Left out: rotation metadata (phone videos stored sideways are read as stored), variable-size streams (the first
frame's size is the video's), colour-space conversions beyond FFmpeg's default RGB.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .images import BadImage, cover_and_crop

VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".mkv", ".gif")
#: timestamps closer than this (seconds) count as the same instant
_EPS = 1e-6


def is_video(path: str | Path) -> bool:
    return Path(path).suffix.lower() in VIDEO_SUFFIXES


def _open(path: Path):
    import av

    try:
        size = path.stat().st_size
    except OSError as e:
        raise BadImage(f"unreadable ({e.strerror or e})") from None
    if size == 0:
        raise BadImage("zero-byte file")
    try:
        container = av.open(str(path))
    except av.FFmpegError as e:
        raise BadImage(f"not a video or corrupt ({_reason(e)})") from None
    except OSError as e:
        raise BadImage(f"unreadable ({e.strerror or e})") from None
    if not container.streams.video:
        container.close()
        raise BadImage("no video stream")
    return container


def _reason(e: Exception) -> str:
    msg = getattr(e, "strerror", None) or str(e)
    return str(msg).strip().splitlines()[0] if str(msg).strip() else type(e).__name__


def _frames(path: Path):
    """Yield (time in seconds or None, av.VideoFrame) of the first video stream, in decoding order."""
    import av

    container = _open(path)
    try:
        stream = container.streams.video[0]
        for frame in container.decode(stream):
            yield frame.time, frame
    except av.FFmpegError as e:
        raise BadImage(f"does not decode ({_reason(e)})") from None
    finally:
        container.close()


def _times(raw: list[float | None], rate: float | None) -> list[float]:
    """Frame times from the first frame's; frames without a timestamp get their index over the stream's rate."""
    if any(t is None for t in raw):
        r = rate or 25.0
        return [i / r for i in range(len(raw))]
    return [t - raw[0] for t in raw]


def pick_frames(times: list[float], fps: float | None) -> list[int]:
    """For each frame at `fps` (None: every decoded frame), the index of the decoded frame it shows."""
    if fps is None:
        return list(range(len(times)))
    n = math.floor(times[-1] * fps + _EPS) + 1
    out, i = [], 0
    for k in range(n):
        t = k / fps + _EPS
        while i + 1 < len(times) and times[i + 1] <= t:
            i += 1
        out.append(i)
    return out


def probe_video(path: str | Path, fps: float | None) -> tuple[int, int, int]:
    """(width, height, frames at `fps`) of a video, decoding it completely (a truncated file fails here, at the
    scan, not during caching). Raises `BadImage` with the reason."""
    path = Path(path)
    raw, size = [], None
    for t, frame in _frames(path):
        raw.append(t)
        size = size or (frame.width, frame.height)
    if not raw:
        raise BadImage("no frames decoded")
    return size[0], size[1], len(pick_frames(_times(raw, None), fps))


def clip_starts(frames: int, length: int, mode: str, count: int = 1) -> list[int]:
    """First frames (at data.fps) of the clips of `length` frames a video of `frames` frames gives (empty: shorter
    than one clip). `mode`: first, uniform (`count` clips spread evenly) or all (every non-overlapping one)."""
    if frames < length:
        return []
    last = frames - length
    if mode == "first":
        return [0]
    if mode == "all":
        return list(range(0, last + 1, length))
    if mode == "uniform":
        if count <= 1:
            return [0]
        return sorted({round(i * last / (count - 1)) for i in range(count)})
    raise ValueError(f"unknown clip mode {mode!r}")


def read_clip(path: str | Path, fps: float | None, start: int, length: int) -> list[Image.Image]:
    """Frames start .. start + length - 1 (at `fps`) as RGB PIL images, decoding only up to the clip's end and
    converting only the frames it shows (the rule of `pick_frames`, applied while decoding). Raises `BadImage`."""
    path = Path(path)
    end = start + length
    out: list[Image.Image] = []
    k, n, t0, prev, prev_im = 0, 0, None, None, None

    def show(frame):  # each decoded frame converted once, however often it repeats
        nonlocal prev_im
        if prev_im is None:
            prev_im = frame.to_image().convert("RGB")
        return prev_im

    for t, frame in _frames(path):
        r = n / 25.0 if t is None else t - (t0 if t0 is not None else t)
        t0 = t if t0 is None else t0
        n += 1
        if fps is None:
            if k >= start:
                out.append(frame.to_image().convert("RGB"))
            k += 1
        else:
            while prev is not None and r > k / fps + _EPS and k < end:  # output k shows the previous frame
                if k >= start:
                    out.append(show(prev))
                k += 1
            prev, prev_im = frame, None
            last = r
        if k >= end:
            return out
    if fps is not None and prev is not None:
        while k < end and k / fps <= last + _EPS:  # the last frame shows until the stream's end
            if k >= start:
                out.append(show(prev))
            k += 1
    if len(out) < length:
        raise BadImage(f"has {k} frames at {fps or 'its own'} fps, the clip needs {end} (changed since the scan?)")
    return out


def load_clip(path: str | Path, bucket: tuple[int, int], box: tuple[int, int], fps: float | None, start: int,
              length: int) -> torch.Tensor:
    """The whole path from file to (3, F, bh, bw) pixels in [-1, 1]: every frame resized to cover the bucket and
    cropped at `box`, like an image (images.py)."""
    arr = np.stack([np.asarray(cover_and_crop(im, bucket, box), dtype=np.uint8)
                    for im in read_clip(path, fps, start, length)])  # (F, H, W, 3)
    return torch.from_numpy(arr).permute(3, 0, 1, 2).float().div_(127.5).sub_(1.0)


def has_audio(path: str | Path) -> bool:
    """Whether the file has an audio stream (reads its header only)."""
    import av

    try:
        with av.open(str(path)) as container:
            return bool(container.streams.audio)
    except (av.FFmpegError, OSError):
        return False


def _start(stream) -> float:
    """The stream's first timestamp in seconds (0 where the container gives none)."""
    return float(stream.start_time * stream.time_base) if stream.start_time is not None else 0.0


def read_audio(path: str | Path, fps: float, start: int, frames: int, rate: int) -> torch.Tensor:
    """The sound under the clip of `frames` frames from frame `start` at `fps`: (2, int(frames / fps * rate))
    float32 samples in [-1, 1] at `rate` Hz, stereo (a mono track on both sides, FFmpeg's downmix of more
    channels), silence where the track has none. Raises `BadImage` where the audio does not decode."""
    import av

    first = start / fps
    n = int(frames / fps * rate)
    out = np.zeros((2, n), dtype=np.float32)
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise BadImage("no audio stream")
            vstart = _start(container.streams.video[0]) if container.streams.video else 0.0
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="fltp", layout="stereo", rate=rate)
            chunks = []
            for frame in container.decode(stream):
                chunks += [f.to_ndarray() for f in resampler.resample(frame)]
            chunks += [f.to_ndarray() for f in resampler.resample(None)]
            offset = _start(stream) - vstart  # the track's first sample, in seconds of the video
    except av.FFmpegError as e:
        raise BadImage(f"its audio does not decode ({_reason(e)})") from None
    if not chunks:
        return torch.from_numpy(out)
    wave = np.concatenate(chunks, axis=1)
    a = int(round((first - offset) * rate))  # the clip's first sample in the track (negative: before it starts)
    src, dst = max(a, 0), max(-a, 0)
    take = max(0, min(n - dst, wave.shape[1] - src))
    out[:, dst : dst + take] = wave[:, src : src + take]
    return torch.from_numpy(out)


def write_video(frames: list[Image.Image], path: str | Path, fps: float = 16.0) -> Path:
    """Write RGB frames as an H.264 mp4 (yuv420p: what players and browsers show; sides are padded to even
    pixels by repeating the edge) with PyAV, and the sound of frames that carry one (`audio`, `sample_rate`:
    trainer/models/base.py `Clip`) as an AAC stream beside them. Returns the path."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w, h = frames[0].size
    ew, eh = w + w % 2, h + h % 2
    from fractions import Fraction

    with av.open(str(path), mode="w") as out:
        stream = out.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = ew, eh, "yuv420p"
        stream.options = {"crf": "18"}
        sound = getattr(frames, "audio", None)
        sound = None if sound is None else _audio_stream(out, sound, int(frames.sample_rate))
        for im in frames:
            a = np.asarray(im.convert("RGB"), dtype=np.uint8)
            if (ew, eh) != (w, h):
                a = np.pad(a, ((0, eh - h), (0, ew - w), (0, 0)), mode="edge")
            for packet in stream.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
        if sound is not None:
            stream, frame = sound
            for packet in (*stream.encode(frame), *stream.encode(None)):
                out.mux(packet)
    return path


def _audio_stream(out, audio: torch.Tensor, rate: int):
    """An AAC stream (FFmpeg's encoder, 192 kb/s) for (channels, samples) float audio, added before anything is
    muxed, and the one frame that holds the sound (the encoder cuts it into its own frames)."""
    import av

    wave = np.ascontiguousarray(audio.detach().float().clamp(-1, 1).cpu().numpy().astype(np.float32))
    layout = "stereo" if wave.shape[0] == 2 else "mono"
    stream = out.add_stream("aac", rate=rate, layout=layout)
    stream.bit_rate = 192_000
    frame = av.AudioFrame.from_ndarray(wave, format="fltp", layout=layout)
    frame.sample_rate = rate
    return stream, frame
