"""Anima's sampling pipeline: diffusers 0.42 ships Anima only as a *modular* pipeline (`diffusers/modular_pipelines/
anima`), and `AnimaPipeline` here puts a classic `DiffusionPipeline` face on it, so `dittrain sample`, sampling during
training and the LoRA loader drive it as every other family's pipeline (trainer/models/anima.py says how the training
side mirrors the same blocks).

- `recipe()`: the modular blocks' own settings (longest caption, default steps and guidance), read from the blocks.
- `conditioned_embeds`: one prompt through the text-encoder step's own `encode_prompt` (Qwen3 hidden states and T5
  token ids) and the text-conditioning step's own `_condition_prompt_embeds` (the LLM adapter, `AnimaTextConditioner`),
  so the embeddings the transformer cross-attends to cannot drift from the pipeline's.
- `AnimaPipeline.__call__`: hands the pipeline's current modules (the transformer may have been swapped by reference)
  to an `AnimaModularPipeline` built once from the text-to-image blocks (`AnimaCoreDenoiseStep` without its
  text-conditioning step, then `AnimaDecodeStep`), with the stored conditioned embeddings. Denoising, guidance
  (`ClassifierFreeGuidance`, on unless the scale is 1), scheduling and decoding are the modular blocks' own.
- LoRAs load through `AnimaLoraLoaderMixin` (as `AnimaModularPipeline`'s do): the transformer's, and the LLM
  adapter's where a file has them (its `text_conditioner.*` keys, which dittrain does not train).

Cosmos' transformer resizes its padding mask with torchvision (`transformer_cosmos.transforms`), imported there
only when torchvision is installed; dittrain does not install it (its PyPI wheel pins a CUDA torch). Where it is
missing, `transforms` gets the one call Cosmos makes, `functional.resize(mask, size, NEAREST)` on a tensor, as
torch's nearest interpolation, which is what torchvision runs for it (the mask is all zeros anyway).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch
from diffusers import AnimaModularPipeline, ClassifierFreeGuidance, DiffusionPipeline
from diffusers.loaders import AnimaLoraLoaderMixin
from diffusers.models.transformers import transformer_cosmos
from diffusers.modular_pipelines import SequentialPipelineBlocks
from diffusers.modular_pipelines.anima.before_denoise import AnimaTextConditioningStep
from diffusers.modular_pipelines.anima.denoise import AnimaLoopDenoiser
from diffusers.modular_pipelines.anima.encoders import AnimaTextEncoderStep
from diffusers.modular_pipelines.anima.modular_blocks_anima import AnimaCoreDenoiseStep, AnimaDecodeStep
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput

from .flux3_pipeline import _progress_config, _quiet_modular_notes


def _nearest_resize(img: torch.Tensor, size, interpolation=None) -> torch.Tensor:  # noqa: ARG001 - nearest only
    return torch.nn.functional.interpolate(img, size=list(size), mode="nearest")


if not hasattr(transformer_cosmos, "transforms"):  # torchvision missing (module essay)
    transformer_cosmos.transforms = SimpleNamespace(
        InterpolationMode=SimpleNamespace(NEAREST="nearest"), functional=SimpleNamespace(resize=_nearest_resize))


@functools.cache
def recipe() -> dict[str, Any]:
    """The modular pipeline's own settings, read from its blocks: longest caption (T5 tokens and Qwen tokens),
    default steps and guidance."""
    text = {p.name: p.default for p in AnimaTextEncoderStep().inputs}
    steps = {p.name: p.default for p in AnimaCoreDenoiseStep().inputs}
    guider = next(c for c in AnimaLoopDenoiser().expected_components if c.name == "guider")
    return {"max_sequence_length": text["max_sequence_length"], "steps": steps["num_inference_steps"] or 50,
            "guidance": guider.config["guidance_scale"]}


@torch.no_grad()
def conditioned_embeds(encoder, tokenizer, t5_tokenizer, conditioner, prompt: str, device,
                       dtype: torch.dtype | None = None) -> torch.Tensor:
    """One prompt's (1, L, D) embeddings as the modular pipeline hands them to the transformer: the text-encoder
    step's Qwen3 hidden states and T5 ids, through the text-conditioning step's LLM adapter (its output padded to
    `min_sequence_length`, 512 for Anima). `dtype`: the output's (the pipeline's: the transformer's)."""
    parts = AnimaTextEncoderStep.encode_prompt(
        SimpleNamespace(tokenizer=tokenizer, t5_tokenizer=t5_tokenizer, text_encoder=encoder), prompt,
        prepare_unconditional_embeds=False, max_sequence_length=recipe()["max_sequence_length"], device=device,
        dtype=encoder.dtype)
    conditioner.to(device)  # the adapter is ~0.27 GB in bf16: it runs beside the text encoder
    return AnimaTextConditioningStep._condition_prompt_embeds(
        SimpleNamespace(text_conditioner=conditioner), qwen_prompt_embeds=parts["qwen_prompt_embeds"],
        qwen_attention_mask=parts["qwen_attention_mask"], t5_input_ids=parts["t5_input_ids"],
        t5_attention_mask=parts["t5_attention_mask"], device=device, conditioning_dtype=conditioner.dtype,
        output_dtype=dtype or conditioner.dtype)


class AnimaPipeline(DiffusionPipeline, AnimaLoraLoaderMixin):
    """diffusers' Anima modular pipeline behind a classic pipeline's interface (`encode_prompt`, `__call__` with
    `prompt_embeds`, `register_modules`, `load_lora_weights`), which is what trainer/sampling drives (module essay)."""

    model_cpu_offload_seq = "text_encoder->text_conditioner->transformer->vae"
    _optional_components = ["text_encoder", "tokenizer", "t5_tokenizer", "text_conditioner"]

    def __init__(self, transformer, vae, scheduler, text_encoder=None, tokenizer=None, t5_tokenizer=None,
                 text_conditioner=None):
        super().__init__()
        self.register_modules(transformer=transformer, vae=vae, scheduler=scheduler, text_encoder=text_encoder,
                              tokenizer=tokenizer, t5_tokenizer=t5_tokenizer, text_conditioner=text_conditioner)
        self._modular = None

    def modular_pipeline(self) -> AnimaModularPipeline:
        """The text-to-image modular pipeline (built on first use) for conditioned embeddings in, images out."""
        if self._modular is None:
            core = AnimaCoreDenoiseStep()
            core.sub_blocks.pop("text_conditioning")  # the embeddings come conditioned (`encode_prompt`)
            blocks = SequentialPipelineBlocks.from_blocks_dict({"denoise": core, "decode": AnimaDecodeStep()})
            with _quiet_modular_notes():  # it creates a default guider and image processor
                self._modular = AnimaModularPipeline(blocks=blocks)
        return self._modular

    @torch.no_grad()
    def encode_prompt(self, prompt: str, device=None) -> torch.Tensor:
        """One prompt's conditioned `prompt_embeds` (1, L, D), as the modular text steps make them, in the
        transformer's dtype; without a transformer (the training sampler encodes its prompts before the fit's
        transformer joins) in the LLM adapter's, which the loader gave the run's dtype as it gives the transformer."""
        device = device if device is not None else self._execution_device
        dtype = self.transformer.dtype if self.transformer is not None else None
        return conditioned_embeds(self.text_encoder, self.tokenizer, self.t5_tokenizer, self.text_conditioner,
                                  prompt, device, dtype)

    @torch.no_grad()
    def __call__(self, prompt_embeds: torch.Tensor, negative_prompt_embeds: torch.Tensor | None = None,
                 guidance_scale: float | None = None, height: int = 1024, width: int = 1024,
                 num_inference_steps: int | None = None, generator=None, output_type: str = "pil",
                 return_dict: bool = True):
        mp = self.modular_pipeline()
        g = recipe()["guidance"] if guidance_scale is None else float(guidance_scale)
        guider = ClassifierFreeGuidance(guidance_scale=g)
        kw: dict[str, Any] = {"prompt_embeds": prompt_embeds, "height": height, "width": width,
                              "generator": generator, "output_type": output_type,
                              "num_inference_steps": num_inference_steps or recipe()["steps"]}
        if guider.num_conditions > 1:
            if negative_prompt_embeds is None:
                raise ValueError(f"guidance_scale {g} runs classifier-free guidance: pass negative_prompt_embeds")
            kw["negative_prompt_embeds"] = negative_prompt_embeds
        with _quiet_modular_notes():
            mp.update_components(transformer=self.transformer, vae=self.vae, scheduler=self.scheduler, guider=guider)
        _progress_config(mp._blocks, getattr(self, "_progress_bar_config", {}))
        images = mp(**kw, output="images")
        return ImagePipelineOutput(images=images) if return_dict else (images,)
