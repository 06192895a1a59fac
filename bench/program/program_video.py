"""The video half of bench/program/bench_program.py: the clips a video family (an adapter with `video`: Wan, LTX-2)
trains on in the whole-program benchmark, and the config lines that make a run train and sample them.

Clips. `write_clips` writes a few H.264 mp4s (PyAV, trainer/data/video.py `write_video`) at the clip's exact size
and the family's frame rate (`default_fps`: Wan's 16, LTX-2's 24, which its config must read clips at),
`frames + 4` frames each (a clip of `frames` at data.fps, whatever rounding the reader's frame times do), each with
a caption. The content moves: diagonal colour bands drift and a square crosses the frame, different in every clip,
so the VAE encodes frames that differ as a real video's do (not one still repeated) and x264 still writes 81 frames
of 1280x720 in a few seconds. A family that trains sound (`sound`: LTX-2, whose audio stream trains only on clips
with an audio track) gets one: a stereo AAC track as long as the clip (`tone`: a sine whose pitch differs per
clip and per channel and glides up over the clip, at half scale, `SOUND_RATE` Hz; the family's reader resamples
it to its audio VAE's rate). An image-to-video family samples from the first frame of the first clip
(`first_frame`), kept outside the data folder so it is not a training item.

Size. `--resolution 480p` is 832x480, `720p` 1280x720 (each side rounded down to the family's divisor: Wan 2.2
TI2V-5B's 32 makes 720p 1280x704, the size its pipeline samples at), or `WxH`. The trainer buckets by area
(trainer/data/buckets.py): `data.resolutions: [R]` with `data.bucket_step` the divisor, R chosen so that the bucket
nearest to a WxH clip is WxH itself (`bucket_resolution`): the clip trains at its own size, uncropped and
unscaled, and the sample is drawn at the same size with `sample.frames` frames (short: sampling during a fit and
`dittrain sample` are measured, not watched).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

#: `--resolution` names of video sizes, (width, height)
VIDEO_SIZES = {"480p": (832, 480), "720p": (1280, 720)}
#: frame rate of the clips written and of data.fps where the family gives none (Wan 2.1's training rate)
FPS = 16.0
#: sample rate of the clips' audio track (AAC's usual 48 kHz)
SOUND_RATE = 48_000


@dataclass(frozen=True)
class Clips:
    """What a video family's runs train and sample: clips of `frames` at `width` x `height` and `fps`, with an audio
    track where `sound`, samples of `sample_frames`."""

    width: int
    height: int
    frames: int
    sample_frames: int
    fps: float = FPS
    sound: bool = False


def divisor(adapter_cls) -> int:
    """Pixels per token side of the full-size family (its VAE's scale times the transformer's patch)."""
    return adapter_cls.latent_scale * adapter_cls.token_patch


def video_size(spec: str, div: int) -> tuple[int, int]:
    """(width, height) of a `--resolution` value (480p, 720p or WxH), each side rounded down to `div`."""
    if spec in VIDEO_SIZES:
        w, h = VIDEO_SIZES[spec]
    else:
        try:
            w, h = (int(x) for x in spec.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--resolution {spec}: a video family takes 480p, 720p or WxH (e.g. 832x480)") from None
    return max(div, w // div * div), max(div, h // div * div)


def bucket_resolution(width: int, height: int, div: int) -> int:
    """The data.resolutions entry R (with data.bucket_step = `div`) whose bucket nearest to a `width` x `height`
    clip is that size itself, the one closest to sqrt(width * height)."""
    from trainer.data.buckets import bucket_sizes, nearest_bucket

    r0 = round(math.sqrt(width * height))
    for r in sorted(range(max(16, r0 - 64), r0 + 65), key=lambda r: abs(r - r0)):
        if nearest_bucket(width, height, bucket_sizes(r, div, step=div)) == (width, height):
            return r
    raise SystemExit(f"no data.resolutions value near {r0} makes {width}x{height} a bucket (bucket_step {div})")


def _frame(clip: int, k: int, width: int, height: int, grid):
    import numpy as np

    yy, xx = grid
    band = ((xx + yy + 6 * k * (clip + 1)) // max(8, height // 20)) % 2
    a = np.stack([(xx * 255 // width + 7 * k) % 256, yy * 255 // height, 60 + 140 * band], -1).astype(np.uint8)
    side = max(4, height // 6)
    cx = (k * width // 60 + clip * width // 3) % width  # a square crossing the frame in 60 frames
    cy = height // 2 + (clip % 3 - 1) * height // 5
    a[max(0, cy - side // 2):cy + side // 2, max(0, cx - side // 2):cx + side // 2] = (240, 240, 60 * clip % 256)
    return a


def tone(clip: int, seconds: float, rate: int = SOUND_RATE):
    """(2, samples) float32 in [-0.5, 0.5]: clip `clip`'s sound, a sine per channel (220 Hz times 1 + clip % 4 on the
    left, a fifth above on the right) gliding up by half over `seconds`, so the mel frames differ along the clip."""
    import torch

    t = torch.arange(round(seconds * rate), dtype=torch.float64) / rate
    glide = t * (1 + 0.25 * t / max(seconds, 1e-9))  # phase of a pitch rising linearly to 1.5x
    f = 220.0 * (1 + clip % 4)
    return (0.5 * torch.sin(2 * torch.pi * torch.stack([f * glide, 1.5 * f * glide]))).float()


def write_clips(folder: Path, n: int, clips: Clips) -> Path:
    """`n` mp4 clips of `clips.frames + 4` frames at `clips.fps`, `clips.width` x `clips.height`, with captions,
    and with `clips.sound` an audio track as long as each (`tone`)."""
    import numpy as np
    from PIL import Image

    from trainer.data.video import write_video
    from trainer.models.base import Clip

    folder.mkdir(parents=True, exist_ok=True)
    grid = np.mgrid[0:clips.height, 0:clips.width]
    for i in range(n):
        frames = [Image.fromarray(_frame(i, k, clips.width, clips.height, grid)) for k in range(clips.frames + 4)]
        if clips.sound:
            frames = Clip(frames, tone(i, len(frames) / clips.fps), SOUND_RATE)
        write_video(frames, folder / f"clip{i}.mp4", clips.fps)
        (folder / f"clip{i}.txt").write_text(f"a test clip number {i}, a yellow square moving over drifting stripes")
    return folder


def first_frame(path: Path, clips: Clips) -> Path:
    """The first frame of clip 0 as a PNG at `path` (an image-to-video family's `sample.image`)."""
    import numpy as np
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(_frame(0, 0, clips.width, clips.height, np.mgrid[0:clips.height, 0:clips.width])).save(path)
    return path


def video_config(d: dict, adapter_cls, data: Path, clips: Clips, image: Path | None) -> None:
    """Point the config dict `d` (its data and sample sections already set as for images) at the clips in
    `data`: one bucket of the clips' size, data.fps / clip_frames / clips: first, samples of `sample_frames` at
    the same size, from `image` (an image-to-video family's first frame) where given."""
    div = divisor(adapter_cls)
    d["data"].update({"sources": [{"path": str(data)}], "resolutions": [bucket_resolution(clips.width, clips.height,
                                                                                          div)],
                      "bucket_step": div, "fps": clips.fps, "clip_frames": clips.frames, "clips": "first"})
    d["sample"].update({"width": clips.width, "height": clips.height, "frames": clips.sample_frames})
    if image is not None:
        d["sample"]["image"] = str(image)
