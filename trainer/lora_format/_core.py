"""What the readers and writers share: the layouts' names and header keys, `Module` / `LoraFile`, the family's
key map."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..errors import UserError
from .kinds import LORA_KINDS, LoraKind

FORMATS = ("diffusers", "comfy", "kohya")
DIFFUSERS_PREFIX, COMFY_PREFIX, KOHYA_PREFIX = "transformer.", "diffusion_model.", "lora_unet_"
LORA_METADATA_KEY = "lora_adapter_metadata"  # diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY
META_FORMAT, META_BAKED, META_FUSED = "dittrain.lora_format", "dittrain.baked_scale", "dittrain.fused_ranks"

# every kind's file suffixes (trainer/lora_format/kinds.py), longest first: a key's suffix is the longest that matches
_FILE_NAMES = {suffix: canon for k in LORA_KINDS.values() for suffix, canon in k.file_names.items()}
_REFUSED = {suffix: why for k in LORA_KINDS.values() for suffix, why in k.refused.items()}
_SUFFIXES = sorted([*_FILE_NAMES, *_REFUSED, "alpha"], key=len, reverse=True)


@dataclass
class Module:
    """One adapted layer: its factors under canonical names and the scale its update is multiplied by."""

    kind: str  # a key of LORA_KINDS
    t: dict[str, torch.Tensor]
    scale: float = 1.0
    #: peft's r for a LoKr whose factors are full matrices (the tensors do not show it); None: from the tensors
    peft_r: int | None = None

    @property
    def spec(self) -> LoraKind:
        return LORA_KINDS[self.kind]

    @property
    def rank(self) -> int | None:
        """The rank ComfyUI divides alpha by; None for a LoKr with two full factors (ComfyUI applies no alpha)."""
        return self.spec.rank(self.t)

    def baked(self, factor: float | None = None) -> Module:
        """The same update with `factor` (default: the whole scale) multiplied into the weights."""
        f = self.scale if factor is None else factor
        if f == 1.0:
            return self
        t = dict(self.t)
        name = next(n for n in self.spec.bake_into if n in t)
        t[name] = t[name] * f
        return replace(self, t=t, scale=self.scale / f)

    def delta(self) -> torch.Tensor:
        """The weight update (out, in) in fp32 (without DoRA's rescaling, which needs the base weight)."""
        return self.spec.delta({k: v.float() for k, v in self.t.items()}) * self.scale


@dataclass
class LoraFile:
    """A LoRA in diffusers' module names, whatever layout it came from."""

    modules: dict[str, Module]
    meta: dict[str, str] = field(default_factory=dict)  # the source's dittrain.* header keys

    @property
    def kind(self) -> str:
        return next(iter(self.modules.values())).kind

    @property
    def dora(self) -> bool:
        return any("magnitude" in m.t for m in self.modules.values())


def _key_map(family: str | None, path: Path):
    from ..models import ADAPTERS, adapter_class

    if family is None:
        raise UserError(f"{path}: the file does not say which model family it is for; pass --family "
                        f"({', '.join(ADAPTERS)})")
    kmap = adapter_class(family).lora_key_map
    if kmap is None:
        raise UserError(f"{family}: no ComfyUI / kohya key map for this family yet (lora_key_map on its adapter "
                        "class); use the diffusers layout")
    return kmap


def _in_features(m: Module) -> int:
    """The input width of a kind that stacks (`pairs`): its first input-side factor's."""
    return m.t[m.spec.pairs[0][0]].shape[1]


DORA_COMFY_NOTE = ("DoRA: ComfyUI does not read peft's DoRA magnitudes (it loads this diffusers-layout file as a plain "
                   "LoRA without them); for ComfyUI write output.lora_format: comfy, or `dittrain convert-lora IN OUT "
                   "--to comfy --model PATH` (its dora_scale needs the base weights)")
