"""Turning a loaded transformer into the thing being trained: LoRA or full weights.

LoRA (and LoKr, LoHa, DoRA: lora.type, lora.dora) is injected with peft into the diffusers model itself (`inject_adapter_in_model` through diffusers'
`add_adapter`), not wrapped in a `PeftModel`: the transformer keeps its class, so the adapter's `predict`, its
block list, the offload conductor and the family's diffusers pipeline all see the same module. The base weights
keep the config's dtype (bf16 on a GPU) and are frozen; the LoRA weights are fp32, because Adam updates of
1e-4 relative size vanish in bf16.

LoRA math in the compute dtype (`lora.compute_dtype: auto`, the default). peft's `lora.Linear` casts the layer's
input to the LoRA weights' dtype: with fp32 weights every targeted activation (4096 tokens x 3072 for Flux at
1024 px) is copied to fp32 and both LoRA matmuls run in fp32, then the sum is cast back; that cast and the fp32
matmuls cost more than the bf16 base matmul they sit beside. Instead each peft LoRA Linear becomes a
`ComputeDtypeLora` (a class swap, as the offload conductor does for blocks: names, state-dict keys, isinstance
and peft's save/load are unchanged) whose forward casts the two small LoRA matrices to the input's dtype at use
and runs `x @ A^T @ B^T * scale` in it. The fp32 weights stay the masters: the cast is differentiable, so their
gradients arrive in fp32 (rounded through bf16), and the optimizer state is fp32. What changes is only bf16
rounding of the LoRA branch (tests/test_lora_math.py: the loss matches the fp32 branch within bf16 tolerance;
in an fp32 model the cast is a no-op and the result is bitwise the same). `lora.compute_dtype: fp32` keeps
peft's own forward. Merged, disabled, mixed-batch and variant (DoRA) adapters fall back to peft's forward.

Gradient checkpointing is not done here: the offload handle checkpoints each block of `adapter.blocks` (at
every fraction, 0 included; trainer/offload/block.py), so one module owns each block's forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Config
from ..errors import UserError
from ..lora_format.kinds import LORA_KINDS


def peft_config(lc, targets: list[str]):
    """The peft config for `lora` (trainer.config.LoraConfig): its kind's (trainer/lora_format/kinds.py `build`),
    LoRA (DoRA with lora.dora), LoKr or LoHa. Every kind starts at a zero update (peft's default init: B, or LoKr's
    w2 / LoHa's second factors, are zero). peft is imported there, not at the top: it costs ~3 s to import
    (measured on top of torch), and only LoRA needs it."""
    return LORA_KINDS[lc.type].build(lc, targets)


def add_lora(transformer: nn.Module, cfg: Config, default_targets: tuple[str, ...]) -> list[nn.Parameter]:
    """Freeze the transformer, add the adapter of lora.type (fp32 weights), return the trainable parameters.

    The adapter's random factors are initialised from torch's global generator: seed it first."""
    lc = cfg.lora
    targets = list(lc.targets) if lc.targets else list(default_targets)
    transformer.requires_grad_(False)
    try:
        transformer.add_adapter(peft_config(lc, targets))
    except (ValueError, TypeError) as e:  # peft: "Target modules {...} not found in the base model", or a name
        # that ends on a container: "Target module ModuleList(...) is not supported" (ValueError or TypeError by path)
        msg = str(e)
        if "is not supported" in msg:
            kind = msg.removeprefix("Target module ").split("(", 1)[0]
            raise UserError(f"lora.targets {targets}: a name matches a {kind}, not a layer peft can adapt; name "
                            "the Linears inside it (e.g. attn.to_out.0 instead of attn.to_out)") from None
        raise UserError(f"lora.targets {targets}: {msg.splitlines()[0]}") from None
    params = [p for p in transformer.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    if lc.compute_dtype == "auto" and LORA_KINDS[lc.type].compute_dtype_forward:
        lora_in_compute_dtype(transformer)
    return params


class ComputeDtypeLora:
    """Mixin swapped onto peft's `lora.Linear`: the LoRA branch in the input's dtype (see the module essay)."""

    _plain_class: type

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if (self.disable_adapters or self.merged or kwargs.get("adapter_names") is not None
                or any(a in self.lora_variant for a in self.active_adapters)):
            return super().forward(x, *args, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        out_dtype = result.dtype
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            a, b = self.lora_A[name].weight, self.lora_B[name].weight  # fp32 masters, cast at use (small)
            h = F.linear(self.lora_dropout[name](x), a.to(x.dtype))
            result = result + F.linear(h, b.to(x.dtype)) * self.scaling[name]
        return result.to(out_dtype)


_LORA_CLASSES: dict[type, type] = {}


def lora_in_compute_dtype(transformer: nn.Module) -> int:
    """Make every peft LoRA Linear of `transformer` a `ComputeDtypeLora` (one subclass per class); returns how
    many. `undo_lora_compute_dtype` restores peft's classes."""
    from peft.tuners.lora import Linear as LoraLinear

    n = 0
    for m in transformer.modules():
        if isinstance(m, LoraLinear) and not isinstance(m, ComputeDtypeLora):
            cls = type(m)
            sub = _LORA_CLASSES.get(cls)
            if sub is None:
                sub = _LORA_CLASSES[cls] = type(f"ComputeDtype{cls.__name__}", (ComputeDtypeLora, cls),
                                                {"_plain_class": cls})
            m.__class__ = sub
            n += 1
    return n


def undo_lora_compute_dtype(transformer: nn.Module) -> None:
    for m in transformer.modules():
        if isinstance(m, ComputeDtypeLora):
            m.__class__ = m._plain_class


def full_params(transformer: nn.Module) -> list[nn.Parameter]:
    transformer.requires_grad_(True)
    return list(transformer.parameters())


def count(params: list[nn.Parameter]) -> int:
    return sum(p.numel() for p in params)
