"""How each family's diffusers pipeline takes precomputed text embeddings and a guidance value.

The sampler encodes every prompt first, frees the text encoders, and only then denoises (a Flux T5-XXL alone is
9.5 GB in bf16: it must not share the GPU with the transformer). Each pipeline takes the embeddings under its own
argument names, and "guidance" means different things:

- Flux (`FluxPipeline`): `prompt_embeds` + `pooled_prompt_embeds`; `guidance_scale` is the distilled guidance
  value fed to the transformer (Flux dev), ignored by schnell. No negative prompt, one forward per step.
- SD3 (`StableDiffusion3Pipeline`): classifier-free guidance with `guidance_scale` when > 1, so the negative
  prompt's `negative_prompt_embeds` + `negative_pooled_prompt_embeds` are encoded too (two forwards per step).
- Qwen-Image (`QwenImagePipeline`): `prompt_embeds` + `prompt_embeds_mask`; true classifier-free guidance with
  `true_cfg_scale` when > 1 and a negative prompt (`guidance_scale` only for guidance-distilled variants).

Each entry calls the pipeline's own `encode_prompt` with the arguments `pipe(prompt=...)` would use, one prompt at
a time, so an image made from the stored embeddings is bit-identical to `pipe(prompt=...)` (the tests check it).
This table is the only place the sampler knows a family; it is keyed by the adapter's `family`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Embeds = dict[str, torch.Tensor]


@dataclass(frozen=True)
class FamilySampling:
    #: pipe, prompt, negative prompt or None (no guidance pass), device -> pipeline call kwargs
    encode: Callable[[Any, str, str | None, torch.device], Embeds]
    #: does guidance > 1 run a second (negative) pass, so the negative prompt must be encoded?
    uses_negative: bool
    #: pipe, guidance -> pipeline call kwargs
    guidance_kwargs: Callable[[Any, float], dict[str, Any]]


def _flux_encode(pipe, prompt: str, negative: str | None, device: torch.device) -> Embeds:
    pe, pooled, _ = pipe.encode_prompt(prompt=prompt, prompt_2=None, device=device, num_images_per_prompt=1)
    return {"prompt_embeds": pe, "pooled_prompt_embeds": pooled}


def _sd3_encode(pipe, prompt: str, negative: str | None, device: torch.device) -> Embeds:
    pe, npe, pooled, npooled = pipe.encode_prompt(
        prompt=prompt,
        prompt_2=None,
        prompt_3=None,
        device=device,
        num_images_per_prompt=1,
        do_classifier_free_guidance=negative is not None,
        negative_prompt=negative,
    )
    out = {"prompt_embeds": pe, "pooled_prompt_embeds": pooled}
    if negative is not None:
        out |= {"negative_prompt_embeds": npe, "negative_pooled_prompt_embeds": npooled}
    return out


def _qwen_encode(pipe, prompt: str, negative: str | None, device: torch.device) -> Embeds:
    pe, mask = pipe.encode_prompt(prompt=prompt, device=device, num_images_per_prompt=1)
    out = {"prompt_embeds": pe, "prompt_embeds_mask": mask}
    if negative is not None:
        npe, nmask = pipe.encode_prompt(prompt=negative, device=device, num_images_per_prompt=1)
        out |= {"negative_prompt_embeds": npe, "negative_prompt_embeds_mask": nmask}
    return out


def _qwen_guidance(pipe, guidance: float) -> dict[str, Any]:
    distilled = bool(getattr(pipe.transformer.config, "guidance_embeds", False))
    return {"true_cfg_scale": guidance, "guidance_scale": guidance if distilled else None}


FAMILIES: dict[str, FamilySampling] = {
    "flux": FamilySampling(
        _flux_encode, uses_negative=False, guidance_kwargs=lambda p, g: {"guidance_scale": g}
    ),
    "sd3": FamilySampling(
        _sd3_encode, uses_negative=True, guidance_kwargs=lambda p, g: {"guidance_scale": g}
    ),
    "qwen_image": FamilySampling(_qwen_encode, uses_negative=True, guidance_kwargs=_qwen_guidance),
}


def family_sampling(family: str) -> FamilySampling:
    try:
        return FAMILIES[family]
    except KeyError:
        raise NotImplementedError(f"sampling does not know the model family {family!r}") from None
