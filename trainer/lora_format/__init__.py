"""LoRA files in the three layouts users load: diffusers, ComfyUI's own (`comfy`) and kohya's; reading any, writing any.

    lf = read_lora_file(path, family=None)          # any of the three -> LoraFile (diffusers module names)
    write_lora_file(path, lf, "comfy", family)      # LoraFile -> one layout, atomically
    convert_lora(src, dst, "kohya", family=None)    # `dittrain convert-lora`
    lora_kind(lora_metadata(path))                  # lora, lokr or loha, from the header alone

The one thing every loader must agree on is the strength. peft and diffusers scale an update by alpha / r, with
alpha in the file's header (`lora_adapter_metadata`); ComfyUI and kohya-style loaders read alpha only from a
per-module `<module>.alpha` tensor and use scale 1 without it; and diffusers refuses `.alpha` tensors beside a
header (Flux: "both network_alphas and metadata"), SD3's loader refuses any key without "lora" in it, and Qwen-Image's
scales by them *and* by the header. So each layout carries the scale in the one way all its readers share:

- diffusers: the scale is multiplied into the weights (LoRA's `lora_B`, LoHa's `hada_w1_a`, LoKr's `lokr_w1`) and the
  header says alpha = r, so diffusers, peft and ComfyUI (which maps diffusers keys for Flux, SD3 and Qwen-Image) all
  apply the same delta. diffusers does the same to LoKr files it converts. The header keeps the training alpha
  (`dittrain.alpha`) and the factor (`dittrain.baked_scale`), so reading the file back (init_from, conversion) divides
  it out again and training goes on at the trained alpha.
- comfy (`diffusion_model.<original name>`) and kohya (`lora_unet_<original name with _>`): the weights as trained,
  `lora_down` / `lora_up` (LyCORIS names for LoKr / LoHa), and a `.alpha` tensor per module. ComfyUI applies no alpha
  to a LoKr whose factors are both full matrices, so such a module has the scale multiplied into `lokr_w1` and no
  `.alpha`.

Fused layers. Where the original layout fuses several diffusers layers (Flux's and SD3's q/k/v, Flux's single-block
`linear1`), a LoRA's parts are stacked so the fused delta is exactly the separate ones: the `lora_down`s concatenated,
the `lora_up`s block-diagonal (rank = the sum of the parts' ranks, alpha = scale x that rank); LoHa's two factor pairs
the same way. A part the LoRA does not adapt is a zero block. Reading splits them back: with our own
`dittrain.fused_ranks` header exactly, else (another tool's fused LoRA) each part keeps the whole `lora_down` and its
rows of `lora_up`, which is the same delta. A LoKr cannot be stacked (a stack of Kronecker products is not one):
refused for fused layers, and the diffusers layout, which ComfyUI reads for these families, is the answer.

DoRA. peft's DoRA rescales each output row by a trained magnitude over the row norm of W + dW; ComfyUI's
`dora_scale` (one value per output row, since its PR #7727) is divided by the row norm of the base W. So the comfy /
kohya layouts write dora_scale = m * (||W||_row + eps) / ||W + dW||_row, computed from the base weights (`base`:
fit reads them from the model's files, convert-lora from `--model`), which ComfyUI merges to peft's W'
(trainer/lora_format/_dora.py). The diffusers layout keeps peft's magnitudes (diffusers loads them exactly).

Left out: Tucker / conv factors (`lokr_t2`, `hada_t1`), LoRA biases, text-encoder LoRAs, modules a family's map does
not name (`norm_out.linear` and others stored differently in the original: the error names the module).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from ._core import (
    COMFY_PREFIX,
    DIFFUSERS_PREFIX,
    DORA_COMFY_NOTE,
    FORMATS,
    KOHYA_PREFIX,
    LORA_METADATA_KEY,
    META_BAKED,
    META_FORMAT,
    META_FUSED,
    LoraFile,
    Module,
)
from ._dora import BaseWeights, file_weights
from ._read import (
    detect_format,
    file_format,
    is_dora_file,
    lora_file_from,
    lora_kind,
    lora_metadata,
    peft_config,
    peft_state_dict,
    read_lora_file,
)
from ._write import check_layout, check_targets, encode, write_lora_file

__all__ = ["COMFY_PREFIX", "DIFFUSERS_PREFIX", "DORA_COMFY_NOTE", "FORMATS", "KOHYA_PREFIX", "LORA_METADATA_KEY",
           "META_BAKED", "META_FORMAT", "META_FUSED", "BaseWeights", "LoraFile", "Module", "check_layout",
           "check_targets", "convert_lora", "detect_format", "encode", "file_format", "file_weights", "is_dora_file",
           "lora_file_from", "lora_kind", "lora_metadata", "peft_config", "peft_state_dict", "read_lora_file",
           "write_lora_file"]


def convert_lora(src: Path, dst: Path, to: str, family: str | None = None, overwrite: bool = False,
                 base: BaseWeights | None = None) -> LoraFile:
    """`dittrain convert-lora`: read any layout, write `to`. An existing `dst` is replaced only with `overwrite`,
    and never when it is `src` (the input would be gone if the conversion were not what was wanted). `base`: the
    base weights, which a DoRA needs in the comfy / kohya layout."""
    if to not in FORMATS:
        raise UserError(f"--to {to}: choose one of {', '.join(FORMATS)}")
    src, dst = Path(src), Path(dst)
    if dst.exists() and src.exists() and dst.resolve() == src.resolve():
        raise UserError(f"{dst} is the input file: write the converted LoRA to another file (e.g. "
                        f"{dst.with_name(f'{dst.stem}-{to}{dst.suffix}')})")
    if dst.exists() and not overwrite:
        raise UserError(f"{dst} already exists: add --overwrite to replace it, or choose another output file")
    lf = read_lora_file(src, family)
    write_lora_file(dst, lf, to, family, base)
    return lf


