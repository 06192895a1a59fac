"""`make demo`: a tiny Flux in which training is visible, and the picture and loss plot that show it.

The tiny models of `trainer/models/tiny.py` have random weights everywhere, so whatever they make is noise before
and after training. The demo model differs in two parts, and only these:

- The VAE is built, not trained: its encoder is exact 4x4 average pooling of the pixels and its decoder exact
  nearest-neighbour upsampling, so the 3 latent channels *are* the image at a quarter of the size and any latent
  decodes to the picture it depicts. It is a real diffusers `AutoencoderKL` (the same loading path as a real VAE);
  its weights are set by hand. Residual blocks and the mid-block attention pass their input through (their last
  projection is zero). The one obstacle is the GroupNorm before each `conv_out`, which would subtract every
  image's mean and divide by its spread: each colour channel c travels as the group (c, -c, +K, -K), whose mean
  is 0 by construction and whose variance (mean(c^2) + K^2) / 2 is K^2 / 2 to within 1e-4 for |c| <= 1 and
  K = 64, so the norm becomes a fixed scale that the affine weight undoes. A bias of +24 carries (c, -c) through
  the SiLU that follows, where SiLU(y) = y to 1e-9, and `conv_out` takes the half difference, which cancels it.
- The transformer is a little wider than the tests' (4 heads instead of 2) and reads 3-channel latents.

The text encoders, tokenizers and scheduler are the tiny Flux's own (`make_tiny_models`). So a LoRA that learns
to denoise these latents learns to paint the bundled shapes, and the untrained transformer (LoRA at zero, the same
seed) paints colour noise beside it. `report` draws that comparison, with the training image per prompt, and the
loss curve from metrics.jsonl, with PIL alone (matplotlib is not a dependency).

Run by the Makefile: `python -m trainer.demo model models/tiny/flux-demo`, and after `dittrain fit` and two
`dittrain sample` runs, `python -m trainer.demo report configs/tiny/flux-demo.yaml`.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFont, ImageOps

K = 64.0  # the constant channels' size: the GroupNorm scale is K / sqrt(2) to 1 / (2 K^2) relative
SILU_BIAS = 24.0  # SiLU(y) = y - y * sigmoid(-y): off by 24 * e^-24 = 9e-10 here
FACTOR = 4  # pixels per latent side: 64x64 images -> 16x16 latents -> 8x8 tokens of 2x2 latent pixels
WIDTH = 12  # 3 groups (one per colour) of (c, -c, +K, -K)


def _set_group_norm(norm: torch.nn.GroupNorm) -> None:
    """Normalised c and -c back to c and -c (shifted by SILU_BIAS for the SiLU); the constant channels to 0."""
    for g in range(3):
        norm.weight[4 * g: 4 * g + 2] = K / math.sqrt(2)
        norm.bias[4 * g: 4 * g + 2] = SILU_BIAS


def _set_pairs_in(conv: torch.nn.Conv2d) -> None:
    """3 channels in -> the 12-channel layout (c, -c, +K, -K) per colour, centre tap only (no padding reached)."""
    for c in range(3):
        conv.weight[4 * c, c, 1, 1] = 1.0
        conv.weight[4 * c + 1, c, 1, 1] = -1.0
        conv.bias[4 * c + 2], conv.bias[4 * c + 3] = K, -K


def _set_pairs_out(conv: torch.nn.Conv2d) -> None:
    """(SILU_BIAS + c, SILU_BIAS - c) -> c: half their difference."""
    for c in range(3):
        conv.weight[c, 4 * c, 1, 1], conv.weight[c, 4 * c + 1, 1, 1] = 0.5, -0.5


def exact_vae(shift: float, scale: float):
    """An AutoencoderKL whose latents are the image average-pooled 4x4 and whose decoder upsamples them back."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=3, sample_size=64, layers_per_block=1, norm_num_groups=3,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(WIDTH,) * 3, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=shift, scaling_factor=scale,
    )
    enc, dec = vae.encoder, vae.decoder
    with torch.no_grad():
        for p in vae.parameters():
            p.zero_()  # residual branches and attention outputs at zero: every block passes its input through
        _set_pairs_in(enc.conv_in)
        for block in enc.down_blocks:
            for down in block.downsamplers or ():
                # Downsample2D pads one zero row and column at the end, then a stride-2 3x3 conv: the kernel's
                # top-left 2x2 sees exactly the block it pools.
                for j in range(WIDTH):
                    down.conv.weight[j, j, :2, :2] = 0.25
        _set_group_norm(enc.conv_norm_out)
        _set_pairs_out(enc.conv_out)  # the mean; the log-variance channels stay 0 (unused: latents are the mode)
        _set_pairs_in(dec.conv_in)
        for block in dec.up_blocks:
            for up in block.upsamplers or ():
                for j in range(WIDTH):
                    up.conv.weight[j, j, 1, 1] = 1.0  # after the nearest-neighbour interpolation: keep it
        _set_group_norm(dec.conv_norm_out)
        _set_pairs_out(dec.conv_out)
    return vae


def _transformer():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(20)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=4 * 3, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )


def make_demo_model(out: str | Path, tiny: str | Path | None = None) -> Path:
    """Write the demo Flux into `out`, replacing it: the text side of a tiny Flux (`tiny`, a folder written by
    `make_tiny_models`, or one made here), the exact VAE and a new transformer. Written beside `out` and renamed
    into place, so an interrupted build never leaves a folder that looks complete (the Makefile checks for it)."""
    from .models.tiny import make_tiny_models

    out = Path(out)
    part = out.with_name(out.name + ".partial")
    shutil.rmtree(part, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tiny) if tiny else next(p for p in make_tiny_models(tmp, ["flux"]) if p.name == "flux")
        shutil.copytree(src, part, ignore=shutil.ignore_patterns("vae", "transformer"))
    # Scaled latents (z - shift) * scale: near zero mean and unit spread for pictures of flat, bright colours.
    exact_vae(shift=0.0, scale=1.5).save_pretrained(part / "vae", safe_serialization=True)
    _transformer().save_pretrained(part / "transformer", safe_serialization=True)
    shutil.rmtree(out, ignore_errors=True)
    part.rename(out)
    return out


# ------------------------------------------------------------------------------------------------- the report

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

    cfg = load_config(config, overrides or [])
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
    import sys

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
