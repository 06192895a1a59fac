"""Model families behind one protocol (`ModelAdapter`), looked up by `model.family`.

The loop, caches, offload conductor and sampler call `get_adapter(cfg.model)` and never branch on a family
name. Adapter modules import diffusers, so they are imported only when asked for.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from ..errors import UserError
from .base import Components, ModelAdapter

if TYPE_CHECKING:
    from ..config import ModelConfig

#: family -> (module, class); the single place a family name maps to code
ADAPTERS: dict[str, tuple[str, str]] = {
    "flux": ("flux", "FluxAdapter"),
    "sd3": ("sd3", "SD3Adapter"),
    "qwen_image": ("qwen_image", "QwenImageAdapter"),
    "flux-kontext": ("flux_kontext", "FluxKontextAdapter"),
    "qwen-image-edit": ("qwen_image_edit", "QwenImageEditAdapter"),
    "qwen-image-edit-plus": ("qwen_image_edit_plus", "QwenImageEditPlusAdapter"),
    "qwen-image-2.1": ("qwen_image_21", "QwenImage21Adapter"),
    "krea2": ("krea2", "Krea2Adapter"),
}

__all__ = ["ADAPTERS", "Components", "ModelAdapter", "adapter_class", "get_adapter"]


def adapter_class(family: str) -> type[ModelAdapter]:
    if family not in ADAPTERS:
        raise UserError(f"model.family: unknown family {family!r} (choose from {', '.join(ADAPTERS)})")
    mod, cls = ADAPTERS[family]
    return getattr(import_module(f"{__name__}.{mod}"), cls)


def get_adapter(model_cfg: ModelConfig) -> ModelAdapter:
    """The adapter for `model_cfg.family`, bound to the model folder (it reads small JSON configs from it lazily,
    never weights, so creating one is cheap and touches no disk)."""
    return adapter_class(model_cfg.family)(model_cfg)
