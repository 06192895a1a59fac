"""Writing sampled images: PNG text metadata that says how each image was made, and a contact sheet.

A video family's sample is an mp4 (trainer/data/video.py `write_video`) with a PNG of its frames beside it
(`frame_sheet`, same name), which carries the metadata below. Every PNG carries tEXt chunks `prompt`, `seed`, `steps`, `guidance`, `width`, `height`, `model` (model.path),
`dtype`, `family`, `loras` (`path:weight`, comma-separated; absent without LoRAs), `offload`, `software`, and
`transformer_file` / `negative_prompt` when set, plus `dittrain` with all of them as one JSON object, so an image
found later can be remade. Read them with `PIL.Image.open(p).text`. The contact sheet lists its `prompts` and
`files` instead.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from .. import __version__


def image_metadata(**fields: Any) -> dict[str, str]:
    """String metadata for one image; None values are left out."""
    meta = {k: str(v) for k, v in fields.items() if v is not None}
    meta["software"] = f"dittrain {__version__}"
    meta["dittrain"] = json.dumps({k: v for k, v in meta.items() if k != "software"}, sort_keys=True)
    return meta


def save_png(image: Image.Image, path: Path, metadata: dict[str, str]) -> Path:
    info = PngInfo()
    for key, value in metadata.items():
        info.add_text(key, value)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG", pnginfo=info)
    return path


def frame_sheet(frames: list[Image.Image], most: int = 9) -> Image.Image:
    """A video's contact sheet: up to `most` of its frames evenly spaced from the first to the last (all of them
    when it has no more), row-major on a grid of up to 3 columns."""
    n = len(frames)
    picks = sorted({round(i * (n - 1) / (most - 1)) for i in range(most)}) if n > most else range(n)
    return contact_sheet([frames[i] for i in picks], columns=min(3, n))


def contact_sheet(images: list[Image.Image], columns: int | None = None, pad: int = 4) -> Image.Image:
    """All images on one white grid, row-major in the given order (one row per prompt when `columns` = --num).

    Cells take the size of the largest image; smaller ones are centred."""
    if not images:
        raise ValueError("contact_sheet needs at least one image")
    n = len(images)
    cols = columns if columns and columns > 1 else math.ceil(math.sqrt(n))
    cols = min(cols, n)
    rows = math.ceil(n / cols)
    cw = max(im.width for im in images)
    ch = max(im.height for im in images)
    sheet = Image.new("RGB", (cols * cw + (cols + 1) * pad, rows * ch + (rows + 1) * pad), "white")
    for k, im in enumerate(images):
        r, c = divmod(k, cols)
        x = pad + c * (cw + pad) + (cw - im.width) // 2
        y = pad + r * (ch + pad) + (ch - im.height) // 2
        sheet.paste(im.convert("RGB"), (x, y))
    return sheet


def video_fps(cfg) -> float:
    """The frame rate a video family's samples are written at: the rate its clips trained at (data.fps), else the
    family's `default_fps` (16, Wan's; 24 for LTX-2)."""
    from ..models import adapter_class

    return float(getattr(cfg.data, "fps", None) or adapter_class(cfg.model.family).default_fps)
