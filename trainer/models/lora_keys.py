"""A family's LoRA module names in the original layout: what ComfyUI and kohya-style trainers call each layer.

dittrain trains on diffusers' modules (`transformer_blocks.0.attn.to_q`); ComfyUI's models, BFL's and
Stability's checkpoints and kohya's `lora_unet_*` files name the same weights after the original code
(`double_blocks.0.img_attn.qkv`), and sometimes one original layer holds several diffusers layers stacked along
its outputs (Flux's and SD3's fused q/k/v, Flux's single-block `linear1` = q, k, v and the MLP input).

Each family declares its map on its adapter class (`lora_key_map`) as a list of `KeyRule`s: an original name
pattern and the diffusers name pattern(s) it holds, in output order, with `{i}` standing for a block index. A fused
rule also gives each part's output width as a multiple of the layer's input width, so a LoRA that adapts only
some parts of a fused layer can be padded to the whole layer. The tensors are converted in `trainer/lora_format/`;
this module only maps names, so it needs no model. A module named by several rules is written under the first
(`place`); the later ones are names read only, for another tool's files (HunyuanVideo 1.5: musubi-tuner's own names
beside ComfyUI's).

Kohya names are the original name with every `.` as `_` under `lora_unet_` (sd-scripts, musubi-tuner). Going back
is ambiguous in general (`img_attn` holds an underscore), so it is done by matching the map's original patterns.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KOHYA_PREFIX = "lora_unet_"


@dataclass(frozen=True)
class KeyRule:
    #: original-layout module name, e.g. "double_blocks.{i}.img_attn.qkv"
    original: str
    #: the diffusers module(s) it holds, stacked along the output in this order
    parts: tuple[str, ...]
    #: fused rules: each part's output features as a multiple of the layer's input features (a fraction for
    #: grouped-query attention's k / v, e.g. Lumina 2's 1 / 3)
    widths: tuple[float, ...] = ()

    @property
    def fused(self) -> bool:
        return len(self.parts) > 1


def _regex(template: str, sep: str = ".") -> re.Pattern:
    pieces = [re.escape(p.replace(".", sep)) for p in template.split("{i}")]
    return re.compile(r"(\d+)".join(pieces) + r"\Z")


@dataclass(frozen=True)
class Placement:
    """Where one diffusers module sits in the original layout."""

    original: str  # original module name (block index filled in)
    rule: KeyRule
    index: int  # which part of the fused layer (0 when not fused)


class LoraKeyMap:
    """Name translation between diffusers modules and one family's original layout (see the module essay)."""

    def __init__(self, rules: tuple[KeyRule, ...]):
        self.rules = rules
        self._parts = [(_regex(p), r, j) for r in rules for j, p in enumerate(r.parts)]
        self._orig = [(_regex(r.original), r) for r in rules]
        self._kohya = [(_regex(r.original, "_"), r) for r in rules]

    def place(self, module: str) -> Placement | None:
        """The original layer holding diffusers module `module`, or None when the map has no name for it."""
        for rx, rule, j in self._parts:
            m = rx.match(module)
            if m:
                return Placement(rule.original.replace("{i}", m.group(1)) if m.groups() else rule.original, rule, j)
        return None

    def parts(self, original: str) -> tuple[KeyRule, list[str]] | None:
        """The rule and the diffusers modules (in output order) of original layer `original`, or None."""
        for rx, rule in self._orig:
            m = rx.match(original)
            if m:
                i = m.group(1) if m.groups() else None
                return rule, [p.replace("{i}", i) if i is not None else p for p in rule.parts]
        return None

    @staticmethod
    def kohya(original: str) -> str:
        return KOHYA_PREFIX + original.replace(".", "_")

    def from_kohya(self, flat: str) -> str | None:
        """The original name of kohya module `flat` (without the `lora_unet_` prefix), or None."""
        for rx, rule in self._kohya:
            m = rx.match(flat)
            if m:
                return rule.original.replace("{i}", m.group(1)) if m.groups() else rule.original
        return None


def identity_rules(block: str, names: tuple[str, ...], top: tuple[str, ...]) -> tuple[KeyRule, ...]:
    """Rules for a family whose original layout uses diffusers' own names (Qwen-Image in ComfyUI): `block` is the
    block list's name, `names` the module names inside a block, `top` the modules outside the blocks."""
    return (*(KeyRule(f"{block}.{{i}}.{n}", (f"{block}.{{i}}.{n}",)) for n in names),
            *(KeyRule(n, (n,)) for n in top))
