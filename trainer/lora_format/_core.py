"""What the readers and writers share: the layouts' names and header keys, `Module` / `LoraFile`, the family's
key map."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..errors import UserError

FORMATS = ("diffusers", "comfy", "kohya")
DIFFUSERS_PREFIX, COMFY_PREFIX, KOHYA_PREFIX = "transformer.", "diffusion_model.", "lora_unet_"
LORA_METADATA_KEY = "lora_adapter_metadata"  # diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY
META_FORMAT, META_BAKED, META_FUSED = "dittrain.lora_format", "dittrain.baked_scale", "dittrain.fused_ranks"

# file suffix -> canonical name (peft's for LoRA, LyCORIS' for LoKr / LoHa, which peft shares)
_LORA_SUFFIXES = {"lora_A.weight": "down", "lora_down.weight": "down", "lora_B.weight": "up", "lora_up.weight": "up",
                  "lora_magnitude_vector": "magnitude"}
_LYCORIS = ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b",
            "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
_REFUSED = {"dora_scale": "ComfyUI's DoRA (dora_scale) is read by ComfyUI only: turning it back into peft's magnitudes "
                          "needs the base weights (read the diffusers-layout file of the same run instead)",
            "lokr_t2": "Tucker (conv) LoKr factors are not supported", "hada_t1": "Tucker (conv) LoHa factors are not "
            "supported", "hada_t2": "Tucker (conv) LoHa factors are not supported",
            "lora_B.bias": "LoRA biases are not supported", "lora_mid.weight": "conv LoRA (lora_mid) is not supported"}
_SUFFIXES = sorted([*_LORA_SUFFIXES, *_LYCORIS, *_REFUSED, "alpha"], key=len, reverse=True)
# where a module's scale goes when it is multiplied into the weights
_BAKE_INTO = {"lora": ("up",), "loha": ("hada_w1_a",), "lokr": ("lokr_w1", "lokr_w1_a")}


@dataclass
@dataclass
class Module:
    """One adapted layer: its factors under canonical names and the scale its update is multiplied by."""

    kind: str  # lora | lokr | loha
    t: dict[str, torch.Tensor]
    scale: float = 1.0
    #: peft's r for a LoKr whose factors are full matrices (the tensors do not show it); None: from the tensors
    peft_r: int | None = None

    @property
    def rank(self) -> int | None:
        """The rank ComfyUI divides alpha by; None for a LoKr with two full factors (ComfyUI applies no alpha)."""
        if self.kind == "lora":
            return self.t["down"].shape[0]
        if self.kind == "loha":
            return self.t["hada_w1_b"].shape[0]
        for name in ("lokr_w2_b", "lokr_w1_b"):  # ComfyUI's order: w2's rank wins
            if name in self.t:
                return self.t[name].shape[0]
        return None

    def baked(self, factor: float | None = None) -> Module:
        """The same update with `factor` (default: the whole scale) multiplied into the weights."""
        f = self.scale if factor is None else factor
        if f == 1.0:
            return self
        t = dict(self.t)
        name = next(n for n in _BAKE_INTO[self.kind] if n in t)
        t[name] = t[name] * f
        return replace(self, t=t, scale=self.scale / f)

    def delta(self) -> torch.Tensor:
        """The weight update (out, in) in fp32 (without DoRA's rescaling, which needs the base weight)."""
        t = {k: v.float() for k, v in self.t.items()}
        if self.kind == "lora":
            d = t["up"] @ t["down"]
        elif self.kind == "loha":
            d = (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])
        else:
            w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
            w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]
            d = torch.kron(w1, w2)
        return d * self.scale


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
    return m.t["down"].shape[1] if m.kind == "lora" else m.t["hada_w1_b"].shape[1]


DORA_COMFY_NOTE = ("DoRA: ComfyUI does not read peft's DoRA magnitudes (it loads this diffusers-layout file as a plain "
                   "LoRA without them); for ComfyUI write output.lora_format: comfy, or `dittrain convert-lora IN OUT "
                   "--to comfy --model PATH` (its dora_scale needs the base weights)")
