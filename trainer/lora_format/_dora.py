"""DoRA in the comfy / kohya layouts: peft's magnitudes turned into ComfyUI's `dora_scale`, which needs the base.

peft's DoRA merges a layer to W' = m * (W + dW) / ||W + dW||_row: m is `lora_magnitude_vector` (one value per output
row), dW = scale x B @ A, the norm is each output row's. ComfyUI's loader (comfy/weight_adapter/base.py
`weight_decompose`, since its PR #7727) takes a `<module>.dora_scale` whose first axis matches the weight's outputs
as one value per output row and merges to W' = (W + dW) * dora_scale / (||W||_row + eps): the row norm of the *base*
weight W, not of W + dW, and eps = the machine epsilon of the weight's dtype (ComfyUI patches a float32 copy of the
weight, so float32's). So a file with

    dora_scale = m * (||W||_row + eps) / ||W + dW||_row        shape (out, 1)

merges in ComfyUI to peft's W' (at strength s, ComfyUI's W + s (W' - W), as for a plain LoRA). The division is by
the base that the user loads, so W is read from the model's own files in their stored precision (the training copy
may be a bf16 cast, and streamed blocks hold placeholders between steps); DoRA trains only on an unquantized base
(`model.quantize: none`), and an fp8 single file with per-tensor scales is read as the scaled values. A fused
original layer (Flux's q/k/v) stacks the parts' rows; a part the LoRA does not adapt gets ||W||_row + eps, which
leaves its rows unchanged. ComfyUI's own loader (0.3.64 and 0.19.3, `load_lora_for_models` + `calculate_weight`)
merges such files to peft's weight within 1.2e-7 on tiny models of 12 families (docs/lora-files.md).

Left out: older ComfyUI (before #7727) and other loaders that copy its old rule read dora_scale per input column and
merge such a file wrongly; ComfyUI's low-VRAM path patches the weight in its compute dtype (bf16: eps = 2^-7 instead
of float32's), off by eps / ||W||_row relative. Reading a dora_scale file back into peft's magnitudes is not done
(the diffusers-layout file is the one to resume or sample from).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: diffusers module name -> its base weight (out, in), any dtype
BaseWeights = Callable[[str], torch.Tensor]

EPS = torch.finfo(torch.float32).eps  # ComfyUI's `torch.finfo(weight.dtype).eps` of its float32 working copy


def _row_norm(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(w.shape[0], -1).norm(dim=1, keepdim=True)


def comfy_dora_scale(magnitude: torch.Tensor, base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """ComfyUI's dora_scale (out, 1) for peft's magnitude `magnitude` (out,), base weight `base` and update `delta`
    (both (out, in)), in fp32."""
    w = base.float()
    return magnitude.float().reshape(-1, 1) * (_row_norm(w) + EPS) / _row_norm(w + delta.float())


def unchanged_scale(base: torch.Tensor) -> torch.Tensor:
    """dora_scale of rows with no update: ComfyUI then multiplies them by exactly 1."""
    return _row_norm(base.float()) + EPS


def file_weights(files) -> BaseWeights:
    """Base weights from a transformer's safetensors files (trainer/models/stream_load.py `open_files`), as stored,
    an fp8 weight times its per-tensor scale."""
    def read(module: str) -> torch.Tensor:
        key = f"{module}.weight"
        w = files.read(key).float()  # allocation: one weight
        scale = files.scale(key)
        return w * scale if scale is not None else w

    return read


def missing_base_message(what: str) -> str:
    return (f"{what}: DoRA in the comfy / kohya layout needs the base model's weights (ComfyUI divides its dora_scale "
            "by the base weight's row norms); pass the model it was trained on (convert-lora --model PATH), or keep "
            "the diffusers layout")
