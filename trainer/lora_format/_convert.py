"""`dittrain convert-lora`: one file from any layout into another."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from ._core import FORMATS, LoraFile
from ._dora import BaseWeights
from ._read import read_lora_file
from ._write import write_lora_file


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


