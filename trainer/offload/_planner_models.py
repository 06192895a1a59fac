"""The model facts the planner needs without a model folder: full-size configs of the three families, text
token counts, text-encoder sizes, default LoRA targets, and building a transformer (with LoRA) on the meta device.

Real runs read the folder's `transformer/config.json` and the text encoders' safetensors headers instead
(trainer/offload/planner.py); these tables serve presets and `dittrain plan` on a config whose model folder is
not at hand.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from ..errors import UserError

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Full-size transformer configs for presets and `plan` without a model folder (real runs read the folder).
FULL_CONFIGS: dict[str, dict] = {
    "flux": {  # FLUX.1-dev: FluxTransformer2DModel defaults + guidance embedding (11.9 B parameters)
        "patch_size": 1,
        "in_channels": 64,
        "num_layers": 19,
        "num_single_layers": 38,
        "attention_head_dim": 128,
        "num_attention_heads": 24,
        "joint_attention_dim": 4096,
        "pooled_projection_dim": 768,
        "guidance_embeds": True,
        "axes_dims_rope": [16, 56, 56],
    },
    "sd3": {  # SD3.5-large (8.1 B)
        "sample_size": 128,
        "patch_size": 2,
        "in_channels": 16,
        "num_layers": 38,
        "attention_head_dim": 64,
        "num_attention_heads": 38,
        "joint_attention_dim": 4096,
        "caption_projection_dim": 2432,
        "pooled_projection_dim": 2048,
        "out_channels": 16,
        "pos_embed_max_size": 192,
        "qk_norm": "rms_norm",
    },
    "qwen_image": {  # Qwen-Image: QwenImageTransformer2DModel defaults (20.4 B)
        "patch_size": 2,
        "in_channels": 64,
        "out_channels": 16,
        "num_layers": 60,
        "attention_head_dim": 128,
        "num_attention_heads": 24,
        "joint_attention_dim": 3584,
        "guidance_embeds": False,
        "axes_dims_rope": [16, 56, 56],
    },
}

# Text tokens per caption the transformer sees (the adapters' padding): Flux pads T5 to 512; SD3 joins CLIP's
# 77 and T5's 256; Qwen-Image pads to the longest caption in the batch, assumed 256 here.
TEXT_TOKENS = {"flux": 512, "sd3": 77 + 256, "qwen_image": 256}

# Text encoders in bf16 (parameters, from the public configs): used when no model folder is at hand.
TEXT_ENCODERS: dict[str, list[tuple[str, int]]] = {
    "flux": [("CLIP-L", 123_060_480), ("T5-XXL encoder", 4_762_310_656)],
    "sd3": [("CLIP-L", 123_650_304), ("CLIP-G", 694_659_840), ("T5-XXL encoder", 4_762_310_656)],
    "qwen_image": [("Qwen2.5-VL-7B", 8_292_166_656)],
}


def transformer_class(family: str) -> type:
    """The family's diffusers transformer class, from its model adapter (the single place that names it)."""
    from ..models import adapter_class

    return adapter_class(family).transformer_cls


def default_lora_targets(family: str) -> tuple[str, ...]:
    """The family's default LoRA targets, from its model adapter."""
    from ..models import adapter_class

    return tuple(adapter_class(family).default_lora_targets)


def meta_transformer(family: str, config: dict, dtype: torch.dtype) -> nn.Module:
    """The transformer on the meta device (no memory), parameters in `dtype`."""
    cls = transformer_class(family)
    known = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.device("meta"):
        model = cls.from_config(known)
    return model.to(dtype)


def blocks_of(family: str, transformer: nn.Module) -> list[nn.Module]:
    """Blocks in execution order, from the family's adapter (the units offloading streams)."""
    from ..models import adapter_class

    return adapter_class(family)().blocks(transformer)


def add_meta_lora(transformer: nn.Module, targets: tuple[str, ...], rank: int, alpha: float) -> int:
    """Inject LoRA as the trainer does (peft, fp32 weights) on the meta model; returns its parameter count."""
    from peft import LoraConfig, inject_adapter_in_model

    with torch.device("meta"):
        inject_adapter_in_model(
            LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets)), transformer
        )
    n = 0
    for name, p in transformer.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
            n += p.numel()
    return n


def optimizer_state_bytes(name: str, params, pinned: bool = False) -> int:
    """Bytes of optimizer state for `params`, fp32 as trainer/optim keeps it: AdamW two moments; 8-bit AdamW two
    uint8 moments (block-wise scales left out); Adafactor (beta1=None) factored row and column second moments
    for matrices and a full one for vectors. `pinned`: each tensor rounded up to a power of two, as torch's
    caching host allocator does for `pin_memory=True` tensors (trainer/optim StateOffload)."""

    def size(n: int) -> int:
        return 1 << (n - 1).bit_length() if pinned and n > 0 else n

    total = 0
    for p in params:
        if name == "adamw":
            total += 2 * size(4 * p.numel())
        elif name == "adamw8bit":
            total += 2 * size(p.numel())
        elif p.dim() >= 2:
            total += size(4 * p.shape[:-1].numel()) + size(4 * p.shape[:-2].numel() * p.shape[-1])
        else:
            total += size(4 * p.numel())
    return total


def packed_state_layout(name: str):
    """p -> {state name: (shape, dtype)} of the optimizer state the trainer packs beside each streamed weight
    (trainer/optim FusedBackPass.state_layout, the same shapes as `optimizer_state_bytes`), or None when the
    trainer keeps that optimizer's state in RAM instead (8-bit AdamW: its layout is not known before a step)."""
    from .fused import PACKED_STATE_OPTIMIZERS

    f32 = torch.float32
    if name not in PACKED_STATE_OPTIMIZERS:
        return None
    if name == "adamw":
        return lambda p: {"exp_avg": (p.shape, f32), "exp_avg_sq": (p.shape, f32)}
    if name == "adafactor":

        def factored(p):
            if p.dim() < 2:
                return {"v": (p.shape, f32)}
            return {"row": (p.shape[:-1], f32), "col": (p.shape[:-2] + p.shape[-1:], f32)}

        return factored
    raise AssertionError(f"no planner layout for {name}")


def transformer_config(cfg) -> tuple[dict, str]:
    path = Path(cfg.model.path) / "transformer" / "config.json"
    if path.is_file():
        try:
            return json.loads(path.read_text()), str(path)
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"{path}: cannot read the transformer config ({e})") from None
    return dict(
        FULL_CONFIGS[cfg.model.family]
    ), f"built-in full-size {cfg.model.family} config ({path} not found)"


def text_encoder_bytes(cfg) -> list[tuple[str, int]]:
    """(name, bytes in the model dtype): from safetensors headers when the folder has them, else built in."""
    nbytes = torch.tensor([], dtype=_DTYPES[cfg.model.dtype]).element_size()
    root = Path(cfg.model.path)
    found = []
    for d in sorted(root.glob("text_encoder*")):
        numel = 0
        for f in d.glob("*.safetensors"):
            with open(f, "rb") as fh:
                header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
            numel += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
        if numel:
            found.append((d.name, numel * nbytes))
    if found:
        return found
    return [(name, n * nbytes) for name, n in TEXT_ENCODERS[cfg.model.family]]
