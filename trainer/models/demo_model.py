"""The demo's model: a tiny Flux in which training is visible (`make demo`; the report is trainer/demo.py).

The tiny models of `tiny.py` have random weights everywhere, so whatever they make is noise before and after
training. The demo model differs in two parts, and only these:

- The VAE is built, not trained: its encoder is exact 4x4 average pooling of the pixels and its decoder exact
  nearest-neighbour upsampling, so the 3 latent channels *are* the image at a quarter of the size and any latent
  decodes to the picture it depicts. It is a real diffusers `AutoencoderKL` (the same loading path as a real VAE);
  its weights are set by hand. Residual blocks and the mid-block attention pass their input through (their last
  projection is zero). The one obstacle is the GroupNorm before each `conv_out`, which would subtract every
  image's mean and divide by its spread: each colour channel c travels as the group (c, -c, +K, -K), whose mean
  is 0 by construction and whose variance (mean(c^2) + K^2) / 2 is K^2 / 2 to within 1e-4 for |c| <= 1 and
  K = 64, so the norm becomes a fixed scale that the affine weight undoes. A bias of +24 carries (c, -c) through
  the SiLU that follows, where SiLU(y) = y to 1e-9, and `conv_out` takes the half difference, which cancels it.
- The transformer reads 3-channel latents and has 2 heads of 32 dimensions (the tests' model: 2 of 16), so its
  rotary embedding gives each image axis 6 frequencies instead of 3: positions on the 8x8 token grid are told
  apart, which placing a shape needs.

The text encoders, tokenizers and scheduler are the tiny Flux's own (`make_tiny_models`), copied.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import torch

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
        patch_size=1, in_channels=4 * 3, num_layers=2, num_single_layers=2, attention_head_dim=32,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(8, 12, 12),
    )


def make_demo_model(out: str | Path, tiny: str | Path | None = None) -> Path:
    """Write the demo Flux into `out`, replacing it: the text side of a tiny Flux (`tiny`, a folder written by
    `make_tiny_models`, or one made here), the exact VAE and a new transformer. Written beside `out` and renamed
    into place, so an interrupted build never leaves a folder that looks complete (the Makefile checks for it)."""
    from .tiny import make_tiny_models

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
