"""The files `dittrain caption` reads and writes: which images and videos to caption, what the model sees of
each, and the caption written beside it.

Found: every image (trainer/data/images.py `IMAGE_SUFFIXES`) and video (trainer/data/video.py `VIDEO_SUFFIXES`)
under the folder, sub-folders included, in sorted order, except in the folders `fit` reads as something other than
training images (`masks/`, `control/`, `control2/`, ...). Its caption is the same-named `.txt` beside it, the file
`fit` reads (trainer/data/sources.py): one that exists is left alone unless `overwrite`, so a second run captions
only what the first did not reach. Written whole (temp file + rename, trainer/atomic.py), UTF-8, one line.

Seen: an image decoded as `fit` decodes it (`open_image`: upright, RGB), shrunk to at most `IMAGE_PIXELS` pixels of
area (aspect kept): a caption needs no more, and the vision tower's tokens (and the KV cache) grow with the area
(Qwen2.5-VL's processor would take up to 12.8 MP, 16,384 tokens). A video: `frames` frames spread evenly from its
first to its last (decoded twice with PyAV: once to count, once to keep those), each at most `FRAME_PIXELS`.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from PIL import Image

from ..atomic import atomic_write
from ..data.images import IMAGE_SUFFIXES, BadImage, open_image
from ..data.sources import CONTROL_DIR, MASK_DIR
from ..data.video import VIDEO_SUFFIXES, is_video, probe_video

#: an image is shown to the model at most this many pixels (1024 x 1024: ~1,340 Qwen2.5-VL tokens)
IMAGE_PIXELS = 1024 * 1024
#: each sampled video frame at most this many pixels
FRAME_PIXELS = 512 * 512


def caption_path(path: Path) -> Path:
    """The caption file `fit` reads for `path`."""
    return path.with_suffix(".txt")


def _not_training_images(rel: Path) -> bool:
    top = rel.parts[0] if len(rel.parts) > 1 else ""
    return top == MASK_DIR or re.fullmatch(rf"{CONTROL_DIR}[0-9]*", top) is not None


def find_items(root: Path, overwrite: bool, recursive: bool = True) -> tuple[list[Path], int]:
    """(files to caption, files skipped because their caption exists) under `root` (its sub-folders too with
    `recursive`, as a source's `recursive` says for `fit`)."""
    suffixes = IMAGE_SUFFIXES + VIDEO_SUFFIXES
    found = sorted(p for p in (root.rglob("*") if recursive else root.glob("*")) if p.suffix.lower() in suffixes and p.is_file()
                   and not _not_training_images(p.relative_to(root)))
    todo = [p for p in found if overwrite or not caption_path(p).exists()]
    return todo, len(found) - len(todo)


def _shrunk(im: Image.Image, pixels: int) -> Image.Image:
    w, h = im.size
    if w * h <= pixels:
        return im
    s = math.sqrt(pixels / (w * h))
    return im.resize((max(1, round(w * s)), max(1, round(h * s))), Image.Resampling.LANCZOS)


def video_frames(path: Path, n: int) -> list[Image.Image]:
    """`n` frames (fewer for a shorter video) spread evenly from the first to the last, as RGB. Raises `BadImage`."""
    import av

    total = probe_video(path, None)[2]  # decodes it whole: a corrupt file fails here with the reason
    want = sorted({round(k * (total - 1) / max(n - 1, 1)) for k in range(min(n, total))})
    out = []
    try:
        with av.open(str(path)) as container:
            for i, frame in enumerate(container.decode(container.streams.video[0])):
                if i in want:
                    out.append(_shrunk(frame.to_image().convert("RGB"), FRAME_PIXELS))
                if len(out) == len(want):
                    break
    except av.FFmpegError as e:  # probe_video decoded it a moment ago; only a file changed meanwhile lands here
        raise BadImage(f"does not decode ({e})") from None
    return out


def load_pictures(path: Path, frames: int) -> list[Image.Image]:
    """What the model sees of `path`: one image, or a video's frames. Raises `BadImage` with the reason."""
    if is_video(path):
        return video_frames(path, frames)
    return [_shrunk(open_image(path), IMAGE_PIXELS)]


def clean(text: str) -> str:
    """A generated caption as one line: whitespace runs (newlines of a detailed caption too) become one space."""
    return " ".join(text.split())


def write_caption(path: Path, text: str) -> None:
    """Write `text` as `path`'s caption file (UTF-8, a final newline), whole or not at all."""
    atomic_write(caption_path(path), lambda tmp: tmp.write_text(text + "\n", encoding="utf-8"))
