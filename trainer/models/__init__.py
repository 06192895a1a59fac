"""Model families behind one protocol (`ModelAdapter`), looked up by `model.family`.

The registry. `ADAPTERS` below is the one place a family key maps to code: one line per family, the key and the
adapter class's module and name. Everything else that needs the list of families (the config's validation,
`dittrain make-tiny`, the top-level `--help`, the planner, the quantizer's defaults, the presets generator, the
tests' family parameters) reads it, and every fact about a family is an attribute of its adapter class
(trainer/models/base.py says what each one means). So adding a family is one module here, one line below, its
generated presets and its tests.

Spelling. Family keys join words with "-" (`qwen-image`, `flux-kontext`); the same words joined by "_"
(`qwen_image`, the key Qwen-Image had first) are accepted as well, in configs and on the command line, and mean
the same family (`canonical_family`).

The loop, caches, offload conductor and sampler call `get_adapter(cfg.model)` and never branch on a family
name. Adapter modules import torch and diffusers, so they are imported only when asked for: importing this
package (the registry, `canonical_family`) is cheap, which keeps `dittrain --help` and config validation fast.
"""

from __future__ import annotations

import difflib
import logging
from importlib import import_module
from typing import TYPE_CHECKING

from ..errors import UserError


class _QuietPilFallback(logging.Filter):
    """transformers 5 says once per image-processor class that, torchvision being absent (the CPU install), it
    falls back to the class's PIL version; diffusers' pipelines import CLIP / Siglip processors when they are
    imported, so `make demo`, `fit` and `sample` printed two such lines. The PIL versions are what these
    processors were before transformers 5: nothing for a user to do."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed)" not in record.getMessage()


# the logger transformers.utils.import_utils creates (std logging returns the same object to it later)
logging.getLogger("transformers.utils.import_utils").addFilter(_QuietPilFallback())

if TYPE_CHECKING:
    from ..config import ModelConfig
    from .base import Components, ModelAdapter

#: family -> (module, class); the single place a family name maps to code
ADAPTERS: dict[str, tuple[str, str]] = {
    "flux": ("flux", "FluxAdapter"),
    "sd3": ("sd3", "SD3Adapter"),
    "qwen-image": ("qwen_image", "QwenImageAdapter"),
    "flux-kontext": ("flux_kontext", "FluxKontextAdapter"),
    "qwen-image-edit": ("qwen_image_edit", "QwenImageEditAdapter"),
    "qwen-image-edit-plus": ("qwen_image_edit_plus", "QwenImageEditPlusAdapter"),
    "flux2": ("flux2", "Flux2Adapter"),
    "flux2-klein": ("flux2_klein", "Flux2KleinAdapter"),
    "z-image": ("z_image", "ZImageAdapter"),
    "chroma": ("chroma", "ChromaAdapter"),
    "qwen-image-2.1": ("qwen_image_21", "QwenImage21Adapter"),
    "krea2": ("krea2", "Krea2Adapter"),
    "flux3": ("flux3", "Flux3Adapter"),
    "wan": ("wan", "WanAdapter"),
    "wan2.2-a14b": ("wan22", "Wan22A14BAdapter"),
    "wan-i2v": ("wan_i2v", "WanI2VAdapter"),
    "wan2.2-a14b-i2v": ("wan_i2v", "Wan22A14BI2VAdapter"),
    "wan2.2-ti2v-5b": ("wan22_ti2v", "Wan22TI2VAdapter"),
    "wan2.2-ti2v-5b-i2v": ("wan22_ti2v", "Wan22TI2VI2VAdapter"),
    "lumina2": ("lumina2", "Lumina2Adapter"),
    "ernie-image": ("ernie_image", "ErnieImageAdapter"),
    "anima": ("anima", "AnimaAdapter"),
    "ideogram4": ("ideogram4", "Ideogram4Adapter"),
    "hidream": ("hidream", "HiDreamAdapter"),
    "hidream-e1": ("hidream_e1", "HiDreamE1Adapter"),
    "hunyuan-video-1.5": ("hunyuan_video15", "HunyuanVideo15Adapter"),
    "hunyuan-video-1.5-i2v": ("hunyuan_video15_i2v", "HunyuanVideo15I2VAdapter"),
    "ltx2": ("ltx2", "LTX2Adapter"),
    "ltx2-i2v": ("ltx2_i2v", "LTX2I2VAdapter"),
}

__all__ = [
    "ADAPTERS", "Components", "ModelAdapter", "adapter_class", "adapter_classes", "canonical_family", "families",
    "get_adapter", "preset_class", "preset_folder",
]


def __getattr__(name: str):
    # `from trainer.models import ModelAdapter` without importing torch for every user of the registry
    if name in ("Components", "ModelAdapter"):
        from . import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def families() -> list[str]:
    """Every family key, in registry order."""
    return list(ADAPTERS)


def canonical_family(name: str, where: str = "model.family") -> str:
    """The registry key that `name` spells: the key itself, or its words joined by "_" instead of "-" (any
    case). Anything else is a `UserError` naming `where`, the closest family and the list."""
    if name in ADAPTERS:
        return name
    norm = str(name).strip().lower().replace("_", "-")
    if norm in ADAPTERS:
        return norm
    close = difflib.get_close_matches(norm, list(ADAPTERS), n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise UserError(f"{where}: unknown family {name!r} ({hint}choose from {', '.join(ADAPTERS)})")


def preset_folder(name: str, where: str = "--families") -> tuple[str, str | None]:
    """A presets folder's name (`configs/<name>/`) -> (registry family, size or None): a family in any spelling,
    or a family and one of its sizes joined by "-" (`wan-1.3b`: wan at 1.3 B, its `preset_variants`). The size is
    not checked here (that imports the family's module: `preset_class`); anything else is `canonical_family`'s
    `UserError`."""
    norm = str(name).strip().lower().replace("_", "-")
    if norm in ADAPTERS or name in ADAPTERS:
        return canonical_family(name, where), None
    family = max((k for k in ADAPTERS if norm.startswith(k + "-")), key=len, default=None)
    if family is None:
        canonical_family(name, where)  # raises, naming the closest family
    return family, norm[len(family) + 1:]


def preset_class(name: str, where: str = "--families") -> type[ModelAdapter]:
    """The adapter class a presets folder `configs/<name>/` is written for (`preset_folder`): the family's, or that
    family at one of its sizes (`ModelAdapter.sized`)."""
    family, size = preset_folder(name, where)
    cls = adapter_class(family)
    if size is None:
        return cls
    if size not in cls.sizes():
        raise UserError(f"{where}: {name!r} is not a family nor a size of {family} with presets ("
                        f"{', '.join(f'{family}-{k}' for k in cls.sizes()) or 'it has none'})")
    return cls.sized(size)


def adapter_class(family: str) -> type[ModelAdapter]:
    """The adapter class of `family` (any accepted spelling); imports its module."""
    mod, cls = ADAPTERS[canonical_family(family)]
    return getattr(import_module(f"{__name__}.{mod}"), cls)


def adapter_classes() -> list[type[ModelAdapter]]:
    """Every family's adapter class, in registry order (imports each family's module, and so diffusers)."""
    return [adapter_class(f) for f in ADAPTERS]


def get_adapter(model_cfg: ModelConfig, references: int = 0) -> ModelAdapter:
    """The adapter for `model_cfg.family`, bound to the model folder (it reads small JSON configs from it lazily,
    never weights, so creating one is cheap and touches no disk) and to the run's reference images per target
    (`ModelAdapter.references`; 0: text-to-image)."""
    return adapter_class(model_cfg.family)(model_cfg, references)
