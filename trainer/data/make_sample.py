"""Write the bundled sample data set: simple coloured shapes with captions, in varied aspect ratios.

    python -m trainer.data.make_sample [--out data]

writes `data/shapes/` (12 images with same-named .txt captions, PNG, JPEG and WebP, one in a sub-folder, sizes
from 64x64 to 192x128 and 64x128) and `data/shapes_meta/` (4 images listed in a metadata.jsonl). The images are
drawn with PIL from fixed parameters, so running it again writes the same pictures. They exercise the machinery
(buckets, caches, a few training steps of a tiny model), not image quality.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {
    "red": (220, 40, 40), "blue": (40, 70, 210), "green": (40, 170, 70), "yellow": (240, 210, 40),
    "white": (245, 245, 245), "black": (20, 20, 20), "orange": (245, 140, 30), "purple": (130, 50, 170),
}

# name, (w, h), shape, colour, background, file suffix
SHAPES = [
    ("red_square", (64, 64), "square", "red", "blue", ".png"),
    ("green_circle", (64, 64), "circle", "green", "white", ".png"),
    ("yellow_triangle", (64, 64), "triangle", "yellow", "black", ".jpg"),
    ("blue_square_wide", (128, 64), "square", "blue", "yellow", ".png"),
    ("orange_circle_wide", (128, 64), "circle", "orange", "purple", ".webp"),
    ("purple_triangle_tall", (64, 128), "triangle", "purple", "green", ".png"),
    ("white_circle_tall", (64, 128), "circle", "white", "red", ".jpg"),
    ("black_square", (96, 64), "square", "black", "orange", ".png"),
    ("red_circle_tall", (64, 96), "circle", "red", "yellow", ".png"),
    ("green_triangle_big", (128, 128), "triangle", "green", "blue", ".png"),
    ("blue_circle_big", (192, 128), "circle", "blue", "white", ".jpg"),
    ("nested/yellow_square", (80, 112), "square", "yellow", "purple", ".png"),
]

META = [
    ("m_red_triangle.png", (64, 64), "triangle", "red", "white"),
    ("m_blue_circle.png", (96, 64), "circle", "blue", "green"),
    ("m_green_square.png", (64, 96), "square", "green", "black"),
    ("m_orange_square.png", (128, 64), "square", "orange", "blue"),
]


def draw(size: tuple[int, int], shape: str, colour: str, background: str) -> Image.Image:
    w, h = size
    im = Image.new("RGB", size, COLOURS[background])
    d = ImageDraw.Draw(im)
    s = int(min(w, h) * 0.6)
    x0, y0 = (w - s) // 2, (h - s) // 2
    box = (x0, y0, x0 + s, y0 + s)
    if shape == "square":
        d.rectangle(box, fill=COLOURS[colour])
    elif shape == "circle":
        d.ellipse(box, fill=COLOURS[colour])
    else:
        d.polygon([(x0 + s // 2, y0), (x0, y0 + s), (x0 + s, y0 + s)], fill=COLOURS[colour])
    return im


def caption(shape: str, colour: str, background: str) -> str:
    article = "an" if colour[0] in "aeiou" else "a"
    return f"{article} {colour} {shape} on a {background} background"


def _save(im: Image.Image, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jpg":
        im.save(path, quality=90)
    elif path.suffix == ".webp":
        im.save(path, quality=90, method=6)
    else:
        im.save(path, optimize=True)


def make_sample(out: Path = Path("data")) -> list[Path]:
    """Write both sample folders under `out`; returns the image paths."""
    written = []
    for name, size, shape, colour, bg, suffix in SHAPES:
        path = out / "shapes" / f"{name}{suffix}"
        _save(draw(size, shape, colour, bg), path)
        path.with_suffix(".txt").write_text(caption(shape, colour, bg) + "\n")
        written.append(path)
    meta_dir = out / "shapes_meta"
    lines = []
    for name, size, shape, colour, bg in META:
        _save(draw(size, shape, colour, bg), meta_dir / name)
        lines.append(json.dumps({"file": name, "caption": caption(shape, colour, bg)}))
        written.append(meta_dir / name)
    (meta_dir / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("data"))
    for p in make_sample(ap.parse_args().out):
        print(p)


if __name__ == "__main__":
    main()
