"""Reading one image file into pixels the VAE can take.

Every image goes through the same three steps, so that the scan, the cache and the in-memory path see the same
pixels:

1. `open_image`: decode fully (a truncated file fails here, not halfway through training), apply the EXIF
   orientation (phone photos are stored sideways with a tag saying so), and convert to 8-bit RGB: alpha is
   composited on white (the usual choice for product shots and drawings, and what a viewer shows), grayscale,
   palette, CMYK and 16-bit images are converted. Colour profiles are not applied (left out: pixel values are
   taken as sRGB).
2. `cover_and_crop`: resize so the image covers its bucket (one scale for both sides, Lanczos), then crop the
   bucket out of it at a given box (`crop_box` picks the centre, or a seeded random box).
3. `to_tensor`: (3, H, W) float32 in [-1, 1].

Any decoding problem is a `BadImage` with a short reason; the scan turns it into a "left out" line.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


class BadImage(Exception):
    """An image file that cannot be used; `str(e)` is the reason shown in the scan report."""


def open_image(path: str | Path) -> Image.Image:
    """Decode `path` completely and return it upright, as 8-bit RGB. Raises `BadImage` with the reason."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise BadImage(f"unreadable ({e.strerror or e})") from None
    if size == 0:
        raise BadImage("zero-byte file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # EXIF / palette warnings are not the user's problem
            with Image.open(path) as im:
                im.load()  # full decode: truncated data raises here
                im = ImageOps.exif_transpose(im)
    except Image.DecompressionBombError:
        raise BadImage("too many pixels (decompression-bomb limit)") from None
    except PermissionError:
        raise BadImage("unreadable (permission denied)") from None
    except OSError as e:
        msg = str(e)
        if "truncated" in msg.lower():
            raise BadImage("truncated image data") from None
        if "cannot identify image file" in msg:
            raise BadImage("not an image or corrupt (cannot identify format)") from None
        raise BadImage(f"corrupt image ({msg})") from None
    except (ValueError, SyntaxError) as e:  # PIL raises these for some malformed headers
        raise BadImage(f"corrupt image ({e})") from None
    return to_rgb(im)


def to_rgb(im: Image.Image) -> Image.Image:
    """Any PIL mode -> RGB; alpha composited on white, 16-bit scaled to 8-bit."""
    if im.mode == "RGB":
        return im
    if im.mode == "P":
        im = im.convert("RGBA" if "transparency" in im.info else "RGB")
    if im.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        # PIL's own I -> L conversion clips at 255 instead of scaling, turning 16-bit scans white.
        arr = np.asarray(im, dtype=np.float64)
        top = 65535.0 if im.mode.startswith("I;16") or arr.max() > 255 else 255.0
        im = Image.fromarray(np.clip(arr / top * 255.0 + 0.5, 0, 255).astype(np.uint8), "L")
    if im.mode == "F":
        arr = np.asarray(im, dtype=np.float64)
        im = Image.fromarray(np.clip(arr * (255.0 if arr.max() <= 1.0 else 1.0), 0, 255).astype(np.uint8), "L")
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return im.convert("RGB")  # L, 1, CMYK, YCbCr, LAB, HSV


def cover_size(width: int, height: int, bucket: tuple[int, int]) -> tuple[int, int]:
    """Size (w, h) of the image resized with one scale so that it covers `bucket` (w, h)."""
    bw, bh = bucket
    scale = max(bw / width, bh / height)
    return max(bw, round(width * scale)), max(bh, round(height * scale))


def crop_box(width: int, height: int, bucket: tuple[int, int], mode: str, seed_text: str = "") -> tuple[int, int]:
    """Top-left corner (left, top) of the bucket inside the covering resize of a width x height image.

    "center" centres it. "random" draws the corner from a hash of `seed_text` (the caller passes the run seed and
    the file's content hash), so the same image gets the same crop every time the cache is built: one fixed
    random crop per image, not a new one per epoch."""
    cw, ch = cover_size(width, height, bucket)
    free_x, free_y = cw - bucket[0], ch - bucket[1]
    if mode == "center":
        return free_x // 2, free_y // 2
    digest = hashlib.sha256(f"crop|{seed_text}|{bucket}".encode()).digest()
    rx, ry = int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:16], "little")
    return rx % (free_x + 1), ry % (free_y + 1)


def cover_and_crop(
    im: Image.Image, bucket: tuple[int, int], box: tuple[int, int], resample=Image.Resampling.LANCZOS
) -> Image.Image:
    """Resize `im` to cover `bucket` and cut the bucket out at `box` (left, top)."""
    cw, ch = cover_size(im.width, im.height, bucket)
    if (cw, ch) != im.size:
        im = im.resize((cw, ch), resample)
    left, top = box
    return im.crop((left, top, left + bucket[0], top + bucket[1]))


def to_tensor(im: Image.Image) -> torch.Tensor:
    """RGB PIL image -> (3, H, W) float32 in [-1, 1]."""
    arr = np.asarray(im, dtype=np.uint8)  # (H, W, 3)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).float().div_(127.5).sub_(1.0)


def load_pixels(path: str | Path, bucket: tuple[int, int], box: tuple[int, int]) -> torch.Tensor:
    """The whole path from file to (3, bh, bw) pixels in [-1, 1]."""
    return to_tensor(cover_and_crop(open_image(path), bucket, box))


def load_mask(path: str | Path, bucket: tuple[int, int], box: tuple[int, int]) -> torch.Tensor:
    """A loss mask through the same resize and crop as its image: (1, bh, bw) float32 in [0, 1] (white = 1).

    Bilinear, not Lanczos: Lanczos rings past 0 and 1 at a mask's hard edges."""
    im = cover_and_crop(open_image(path).convert("L"), bucket, box, Image.Resampling.BILINEAR)
    return torch.from_numpy(np.asarray(im, dtype=np.uint8).copy()).float().div_(255.0)[None]
