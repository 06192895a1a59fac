"""Turning a loaded transformer into the thing being trained: LoRA or full weights.

LoRA (and LoKr, LoHa, DoRA: lora.type, lora.dora) is injected with peft into the diffusers model itself (`inject_adapter_in_model` through diffusers'
`add_adapter`), not wrapped in a `PeftModel`: the transformer keeps its class, so the adapter's `predict`, its
block list, the offload conductor and the family's diffusers pipeline all see the same module. The base weights
keep the config's dtype (bf16 on a GPU) and are frozen; the LoRA weights are fp32, because Adam updates of
1e-4 relative size vanish in bf16. peft casts a LoRA layer's input to the LoRA dtype and the sum back to the
base dtype, so mixed dtypes need nothing else.

Gradient checkpointing is not done here: the offload handle checkpoints each block of `adapter.blocks` (at
every fraction, 0 included; trainer/offload/block.py), so one module owns each block's forward.
"""

from __future__ import annotations

from torch import nn

from ..config import Config
from ..errors import UserError


def peft_config(lc, targets: list[str]):
    """The peft config for `lora` (trainer.config.LoraConfig): LoRA (DoRA with lora.dora), LoKr or LoHa. Every kind
    starts at a zero update (peft's default init: B, or LoKr's w2 / LoHa's second factors, are zero)."""
    # Imported here, not at the top: peft costs ~3 s to import (measured on top of torch), and only LoRA needs it.
    from peft import LoHaConfig, LoKrConfig
    from peft import LoraConfig as PeftLoraConfig

    if lc.type == "lokr":
        return LoKrConfig(r=lc.rank, alpha=lc.alpha, rank_dropout=lc.dropout, target_modules=targets, init_weights=True)
    if lc.type == "loha":
        return LoHaConfig(r=lc.rank, alpha=lc.alpha, rank_dropout=lc.dropout, target_modules=targets, init_weights=True)
    return PeftLoraConfig(r=lc.rank, lora_alpha=lc.alpha, lora_dropout=lc.dropout, target_modules=targets,
                          init_lora_weights=True, use_dora=lc.dora)


def add_lora(transformer: nn.Module, cfg: Config, default_targets: tuple[str, ...]) -> list[nn.Parameter]:
    """Freeze the transformer, add the adapter of lora.type (fp32 weights), return the trainable parameters.

    The adapter's random factors are initialised from torch's global generator: seed it first."""
    lc = cfg.lora
    targets = list(lc.targets) if lc.targets else list(default_targets)
    transformer.requires_grad_(False)
    try:
        transformer.add_adapter(peft_config(lc, targets))
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise UserError(f"lora.targets {targets}: {e}") from None
    params = [p for p in transformer.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    return params


def full_params(transformer: nn.Module) -> list[nn.Parameter]:
    transformer.requires_grad_(True)
    return list(transformer.parameters())


def count(params: list[nn.Parameter]) -> int:
    return sum(p.numel() for p in params)
