"""`make demo`'s picture and plot: what the untrained and the trained model make, and the loss curve.

The demo model (trainer/models/demo_model.py) decodes any latent to the picture it depicts, so a LoRA that learns to
denoise its latents learns to paint the bundled shapes, while the untrained transformer (the LoRA at zero, the
same seeds) paints colour noise. `write_report` puts the samples of both beside the training image of each prompt,
and draws the loss curve from metrics.jsonl, with PIL alone (matplotlib is not a dependency).

Run by the Makefile: `python -m trainer.demo model models/tiny/flux-demo`, and after `dittrain fit` and two
`dittrain sample` runs, `python -m trainer.demo report configs/tiny/flux-demo.yaml`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont, ImageOps

from .models.demo_model import make_demo_model

SCALE = 3  # 64 px samples are drawn 192 px wide: nearest-neighbour, so each latent pixel stays a crisp block


def _font(size: int):
    try:
        return ImageFont.load_default(size=size)  # a scalable font where Pillow has FreeType
    except (TypeError, OSError):
        return ImageFont.load_default()


def _by_prompt(folder: Path) -> dict[str, Path]:
    """Sample PNGs in `folder` by the prompt in their metadata (dittrain sample writes it)."""
    out = {}
    for p in sorted(folder.glob("*.png")):
        prompt = Image.open(p).text.get("prompt")
        if prompt is not None:
            out.setdefault(prompt, p)
    return out


def _training_images(sources) -> dict[str, Path]:
    """caption -> image of the data set (the first image of each caption)."""
    from .data.sources import scan_sources

    out: dict[str, Path] = {}
    for item in scan_sources(sources, progress=False).items:
        for caption in item.all_captions:
            out.setdefault(caption, Path(item.file))
    return out


def comparison(prompts: list[str], columns: dict[str, dict[str, Path]], size: int) -> Image.Image:
    """One row per prompt, one column per entry of `columns` (title -> prompt -> image); missing cells blank."""

    cell, pad, head = size * SCALE, 8, 28
    font, small = _font(18), _font(14)
    width = pad + len(columns) * (cell + pad)
    sheet = Image.new("RGB", (width, head + len(prompts) * (cell + pad + 20) + pad), "white")
    draw = ImageDraw.Draw(sheet)
    for c, title in enumerate(columns):
        draw.text((pad + c * (cell + pad) + cell // 2, head // 2 + 2), title, fill="black", font=font, anchor="mm")
    for r, prompt in enumerate(prompts):
        y = head + r * (cell + pad + 20)
        draw.text((pad, y), prompt, fill="#444444", font=small)
        for c, images in enumerate(columns.values()):
            x = pad + c * (cell + pad)
            if prompt in images:
                im = ImageOps.fit(Image.open(images[prompt]).convert("RGB"), (size, size), Image.Resampling.BICUBIC)
                sheet.paste(im.resize((cell, cell), Image.Resampling.NEAREST), (x, y + 18))
            else:
                draw.rectangle([x, y + 18, x + cell - 1, y + 18 + cell - 1], outline="#cccccc")
    return sheet


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round tick values covering [lo, hi]."""
    span = (hi - lo) or 1.0
    step = 10 ** math.floor(math.log10(span / n))
    step *= next(m for m in (1, 2, 5, 10) if span / (step * m) <= n)
    return [k * step for k in range(math.ceil(lo / step), math.floor(hi / step) + 1)]


def loss_plot(metrics: Path, size: tuple[int, int] = (640, 360)) -> Image.Image:
    """The loss per step (grey) and its smoothed curve (blue) from a run's metrics.jsonl."""

    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "loss" in r]
    if not rows:
        raise ValueError(f"{metrics} holds no loss values")
    steps = [r["step"] for r in rows]
    raw, smooth = [r["loss"] for r in rows], [r.get("loss_smoothed", r["loss"]) for r in rows]
    w, h = size
    left, right, top, bottom = 56, 16, 30, 36
    lo, hi = min(raw), max(raw)
    x0, x1 = 0, max(steps)
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    font = _font(13)

    def xy(step: float, value: float) -> tuple[float, float]:
        fx = (step - x0) / ((x1 - x0) or 1)
        fy = (value - lo) / ((hi - lo) or 1)
        return left + fx * (w - left - right), h - bottom - fy * (h - top - bottom)

    for v in _ticks(lo, hi):
        _, y = xy(x0, v)
        d.line([(left, y), (w - right, y)], fill="#eeeeee")
        d.text((left - 6, y), f"{v:g}", fill="#444444", font=font, anchor="rm")
    for s in _ticks(x0, x1):
        x, _ = xy(s, lo)
        d.line([(x, top), (x, h - bottom)], fill="#eeeeee")
        d.text((x, h - bottom + 6), f"{s:g}", fill="#444444", font=font, anchor="ma")
    d.rectangle([left, top, w - right, h - bottom], outline="#888888")
    d.line([xy(s, v) for s, v in zip(steps, raw, strict=True)], fill="#bbbbbb", width=1)
    d.line([xy(s, v) for s, v in zip(steps, smooth, strict=True)], fill="#1f5fbf", width=2)
    d.text((left, 8), "training loss (grey: per step, blue: smoothed)", fill="black", font=_font(15))
    d.text((w - right, h - 14), "step", fill="#444444", font=font, anchor="rm")
    return img


def write_report(config: str | Path, overrides: list[str] | None = None) -> tuple[Path, Path]:
    """After `make demo`'s fit and samples: <output.dir>/demo.png (training image | untrained | trained, one row
    per sample prompt) and <output.dir>/loss.png. Returns their paths."""
    from .config import load_config

    # `dittrain fit` validated this config: the report reads its paths and prompts, no family fact, and so leaves
    # out the checks that import the family's module (diffusers, transformers: most of its start-up)
    cfg = load_config(config, overrides or [], family_checks=False)
    out = Path(cfg.output.dir)
    prompts = list(cfg.sample.prompts)
    columns = {
        "training image": _training_images(cfg.data.sources) if cfg.data else {},
        "untrained": _by_prompt(out / "untrained"),
        "trained (LoRA)": _by_prompt(out / "trained"),
    }
    picture = out / "demo.png"
    comparison(prompts, columns, cfg.sample.height).save(picture)
    plot = out / "loss.png"
    loss_plot(out / "metrics.jsonl").save(plot)
    return picture, plot


def main(argv: list[str] | None = None) -> None:
    """`python -m trainer.demo model FOLDER` or `python -m trainer.demo report CONFIG`."""
    import logging
    import sys

    # As the CLI does (cli.py): transformers' notice that torchvision is missing is noise here.
    logging.getLogger("transformers.utils.import_utils").setLevel(logging.ERROR)
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "model":
        print(f"wrote {make_demo_model(args[1])}")
    elif len(args) >= 2 and args[0] == "report":  # report CONFIG [KEY=VALUE ...] (as --set)
        picture, plot = write_report(args[1], args[2:])
        print(f"untrained | trained: {picture}\nloss curve: {plot}")
    else:
        raise SystemExit("usage: python -m trainer.demo model FOLDER | report CONFIG [KEY=VALUE ...]")


if __name__ == "__main__":
    main()
