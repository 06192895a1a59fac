"""LoRA files in the three layouts users load: diffusers, ComfyUI's own (`comfy`) and kohya's; reading any, writing any.

    lf = read_lora_file(path, family=None)          # any of the three -> LoraFile (diffusers module names)
    write_lora_file(path, lf, "comfy", family)      # LoraFile -> one layout, atomically
    convert_lora(src, dst, "kohya", family=None)    # `dittrain convert-lora`
    lora_kind(lora_metadata(path))                  # lora, lokr or loha, from the header alone
    LORA_KINDS["lokr"]                              # a kind's spec (kinds.py): every fact of it the code reads

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

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._convert import convert_lora
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
    from .kinds import LORA_KINDS, LoraKind, lora_kind_spec

__all__ = [
    "convert_lora", "COMFY_PREFIX", "DIFFUSERS_PREFIX", "DORA_COMFY_NOTE", "FORMATS", "KOHYA_PREFIX",
    "LORA_METADATA_KEY", "META_BAKED", "META_FORMAT", "META_FUSED", "LoraFile", "Module", "BaseWeights",
    "file_weights", "detect_format", "file_format", "is_dora_file", "lora_file_from", "lora_kind",
    "lora_metadata", "peft_config", "peft_state_dict", "read_lora_file", "check_layout", "check_targets",
    "encode", "write_lora_file", "LORA_KINDS", "LoraKind", "lora_kind_spec",
]
#: the module of this package each public name is defined in, imported when the name is first asked for (PEP 562),
#: so that config.py reads the LoRA-kind registry (kinds.py) without importing torch
_MODULE_OF = {
    "convert_lora": "_convert",
    "COMFY_PREFIX": "_core", "DIFFUSERS_PREFIX": "_core", "DORA_COMFY_NOTE": "_core", "FORMATS": "_core",
    "KOHYA_PREFIX": "_core", "LORA_METADATA_KEY": "_core", "META_BAKED": "_core", "META_FORMAT": "_core",
    "META_FUSED": "_core", "LoraFile": "_core", "Module": "_core",
    "BaseWeights": "_dora", "file_weights": "_dora",
    "detect_format": "_read", "file_format": "_read", "is_dora_file": "_read", "lora_file_from": "_read",
    "lora_kind": "_read", "lora_metadata": "_read", "peft_config": "_read", "peft_state_dict": "_read",
    "read_lora_file": "_read",
    "check_layout": "_write", "check_targets": "_write", "encode": "_write", "write_lora_file": "_write",
    "LORA_KINDS": "kinds", "LoraKind": "kinds", "lora_kind_spec": "kinds",
}


def __getattr__(name: str):
    if name in _MODULE_OF:
        return getattr(import_module(f".{_MODULE_OF[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
