"""Flux.3's sampling pipeline: diffusers ships Flux.3 only as a *modular* pipeline (`diffusers/modular_pipelines/
flux3`), and `Flux3Pipeline` here puts a classic `DiffusionPipeline` face on it, so `dittrain sample`, sampling
during training and the LoRA loader drive it as every other family's pipeline (trainer/models/flux3.py says how the
training side mirrors the same blocks).

- `recipe()`: the modular blocks' own settings (text window multiple, hidden layers read, image RoPE scale, shift,
  default steps and guidance), read from the blocks, so nothing here can drift from them;
  `text_embeds`: one prompt through the text-encoder step's own static function.
- `Flux3Pipeline.__call__`: each call hands the pipeline's current modules (the transformer may have been swapped by
  reference) to a modular pipeline built once from `Flux3AutoBlocks` (`Flux3DistilledAutoBlocks` for a flow-map
  transformer) without its prompt-upsampler and text-encoder steps, with the stored embeddings. Denoising,
  guidance (base checkpoints: `ClassifierFreeGuidance`, on unless the scale is 1), scheduling, decoding, and with
  `image=` the reference images' preprocessing and VAE encoding (the blocks' `vae_encoder` step) and the
  image-conditioned denoising workflow, are the modular blocks' own. A given height / width is used as is (the
  blocks then skip their crop-back of a padded single reference).
- LoRAs load through `Flux3LoraLoaderMixin`, which `Flux3ModularPipeline` inherits too.
"""

from __future__ import annotations

import functools
import logging
from contextlib import contextmanager
from typing import Any

import torch
from diffusers import ClassifierFreeGuidance, DiffusionPipeline, Flux3AutoBlocks, Flux3DistilledAutoBlocks
from diffusers.loaders import Flux3LoraLoaderMixin
from diffusers.modular_pipelines.flux3.before_denoise import Flux3PrepareLatentsStep, Flux3SetTimestepsStep
from diffusers.modular_pipelines.flux3.denoise import Flux3LoopDenoiser
from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput

# ---------------------------------------------------------------------------------------------- the recipe


@functools.cache
def recipe() -> dict[str, Any]:
    """The modular pipeline's own settings, read from its blocks: text window multiple, longest text, hidden layers
    read, image RoPE scale, timestep shift, default steps (base / distilled) and guidance."""
    text = Flux3TextEncoderStep()
    defaults = {p.name: p.default for p in text.inputs}
    return {
        "pad_multiple": text.pad_multiple,
        "max_sequence_length": defaults["max_sequence_length"],
        "layers": tuple(defaults["text_encoder_out_layers"]),
        "image_rope_scale": Flux3PrepareLatentsStep().image_rope_scale,
        "shift": Flux3SetTimestepsStep().shift,
        "steps": Flux3SetTimestepsStep().num_inference_steps,
        "guidance": Flux3LoopDenoiser().guidance_scale,
    }


def text_embeds(encoder, processor, prompt: str, device, pad_multiple: int | None = None) -> torch.Tensor:
    """One prompt's (1, W, D) embeddings exactly as the pipeline's text-encoder step makes them."""
    r = recipe()
    return Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds(
        text_encoder=encoder, tokenizer=processor, prompt=prompt, device=device,
        max_sequence_length=r["max_sequence_length"], pad_multiple=pad_multiple or r["pad_multiple"],
        hidden_states_layers=r["layers"],
    )


# ---------------------------------------------------------------------------------------------- the pipeline


class Flux3Pipeline(DiffusionPipeline, Flux3LoraLoaderMixin):
    """diffusers' Flux.3 modular pipeline behind a classic pipeline's interface (`encode_prompt`, `__call__` with
    `prompt_embeds`, `register_modules`, `load_lora_weights`), which is what trainer/sampling drives.

    Each call hands this pipeline's current modules (the transformer may have been swapped by reference) to a
    modular pipeline built once from `Flux3AutoBlocks` (`Flux3DistilledAutoBlocks` for a flow-map transformer)
    without the prompt-upsampler and text-encoder steps, and returns its images. Denoising, guidance, scheduling,
    decoding and the reference images (`image=`: one PIL image or a list) are the modular blocks' own."""

    model_cpu_offload_seq = "text_encoder->transformer->vae"
    _optional_components = ["text_encoder", "tokenizer"]

    def __init__(self, transformer, vae, scheduler, text_encoder=None, tokenizer=None):
        super().__init__()
        self.register_modules(transformer=transformer, vae=vae, scheduler=scheduler, text_encoder=text_encoder,
                              tokenizer=tokenizer)
        self._modular: dict[bool, Any] = {}

    def modular_pipeline(self, distilled: bool):
        """The modular pipeline (built on first use) for embeddings in, images out."""
        if distilled not in self._modular:
            blocks = (Flux3DistilledAutoBlocks if distilled else Flux3AutoBlocks)()
            for step in ("prompt_upsampler", "text_encoder"):
                blocks.sub_blocks.pop(step)
            with _quiet_modular_notes():  # it creates a default guider and scheduler
                self._modular[distilled] = blocks.init_pipeline()
        return self._modular[distilled]

    @torch.no_grad()
    def encode_prompt(self, prompt: str, device=None, num_images_per_prompt: int = 1) -> torch.Tensor:
        """One prompt's `prompt_embeds` (num_images_per_prompt, W, D), as the modular text-encoder step makes them."""
        device = device if device is not None else self._execution_device
        e = text_embeds(self.text_encoder, self.tokenizer, prompt, device)
        return e.repeat(num_images_per_prompt, 1, 1)

    @torch.no_grad()
    def __call__(self, prompt_embeds: torch.Tensor, negative_prompt_embeds: torch.Tensor | None = None,
                 guidance_scale: float | None = None, height: int = 1024, width: int = 1024,
                 num_inference_steps: int | None = None, generator=None, output_type: str = "pil",
                 return_dict: bool = True, image=None):
        distilled = bool(self.transformer.config.flow_map)
        mp = self.modular_pipeline(distilled)
        parts = {"transformer": self.transformer, "vae": self.vae, "scheduler": self.scheduler}
        kw: dict[str, Any] = {"prompt_embeds": prompt_embeds, "height": height, "width": width,
                              "generator": generator, "output_type": output_type}
        if num_inference_steps is not None:
            kw["num_inference_steps"] = num_inference_steps
        if image is not None:  # the blocks' vae_encoder step and image-conditioned workflow take it from here
            kw["image"] = image
        with _quiet_modular_notes():
            if not distilled:
                g = recipe()["guidance"] if guidance_scale is None else float(guidance_scale)
                parts["guider"] = ClassifierFreeGuidance(guidance_scale=g)
                if parts["guider"].num_conditions > 1:
                    if negative_prompt_embeds is None:
                        raise ValueError(f"guidance_scale {g} runs classifier-free guidance: pass "
                                         f"negative_prompt_embeds")
                    kw["negative_prompt_embeds"] = negative_prompt_embeds
            mp.update_components(**parts)
        _progress_config(mp._blocks, getattr(self, "_progress_bar_config", {}))  # `blocks` is a copy
        images = mp(**kw, output="images")
        return ImagePipelineOutput(images=images) if return_dict else (images,)

    def save_pretrained(self, save_directory, **kwargs):
        super().save_pretrained(save_directory, **kwargs)
        if self.tokenizer is not None and hasattr(self.tokenizer, "image_processor"):
            from .tiny import name_processor_as_transformers_does

            name_processor_as_transformers_does(save_directory, self.tokenizer, "tokenizer")



def _progress_config(blocks, config: dict) -> None:
    """This pipeline's progress-bar settings on every nested block that draws one (the denoising loop sits two
    levels down; `ModularPipeline.set_progress_bar_config` reaches only the top level)."""
    for block in getattr(blocks, "sub_blocks", {}).values():
        if hasattr(block, "set_progress_bar_config"):
            block.set_progress_bar_config(**config)
        _progress_config(block, config)


#: diffusers' notes on every call that hands parts to a modular pipeline (a guider is "experimental"; a part built
#: outside a `ComponentSpec` "defaults to from_config"): noise under a progress bar, once per sample image
_MODULAR_NOTES = ("Guiders are currently an experimental feature", "Component was not created using `ComponentSpec`")


class _DropNotes(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_MODULAR_NOTES)


@contextmanager
def _quiet_modular_notes():
    loggers = [logging.getLogger(n) for n in ("diffusers.guiders.guider_utils",
                                              "diffusers.modular_pipelines.modular_pipeline_utils")]
    note = _DropNotes()
    for lg in loggers:
        lg.addFilter(note)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(note)

