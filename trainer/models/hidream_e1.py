"""HiDream-E1 (HiDream-E1-Full, HiDream-E1.1; HiDream.ai, MIT): HiDream-I1's transformer trained to edit an image
by instruction. Text encoders, VAE, scheduler, blocks, experts and LoRA layout are HiDream-I1's (`HiDreamAdapter`);
only the image the transformer sees differs. diffusers 0.42.1 ships no E1 pipeline: the reference is HiDream-ai's
own `pipeline_hidream_image_editing.py` (github.com/HiDream-ai/HiDream-E1), which this module mirrors without
importing it.

How it mirrors that pipeline:

- the source image is VAE-encoded like the target (mean, (z - shift) * scale) and joined to the noisy target
  latents along the width: the transformer runs on one (B, C, h, 2w) image, and the prediction is the left
  (target) half of the negated output; the source half is discarded;
- padding: the double-width image is never square (unless h = 2w), so diffusers' transformer pads it to its
  `max_seq` tokens; the official scripts set that count by hand (inference_e1_1.py: 8192, twice the released
  `max_resolution`'s 4096; inference.py for E1-Full: 4608, exactly its 768 x 768 pairs, no padding). Here it is
  twice the transformer's own `max_seq` (8192 at the release's config, E1.1's), done by `transformer_prediction`
  (trainer/models/hidream.py) without touching the transformer; more tokens than that run unpadded;
- sampling (`HiDreamE1Pipeline`, our own loop): at guidance above 1 three passes in one batch: with
  `clip_cfg_norm` (the default) [prompt + zero source latents, negative + source, prompt + source], the text
  guidance `image + g (full - image)` rescaled per pixel so its channel norm is at most the full pass's, then
  `uncond + image_guidance (text - uncond)`; without it [negative + zeros, negative + source, prompt + source]
  and `uncond + ig (image - uncond) + g (full - image)`. At guidance 1 one conditional pass. The scheduler's
  timesteps as the pipeline sets them (UniPC: `set_timesteps(steps)`, no shift argument).

Prompts: E1-Full expects "Editing Instruction: ... Target Image Description: ..." (its README); E1.1 takes plain
instructions. Captions are used as written.

Training data: pairs (data/sources.py: `control/` beside the targets or a `control` metadata column). The source
image is resized and cropped to the target's bucket (as flux-kontext), so the pair always shares height and width,
which the width-wise join needs. `dittrain sample --image` cuts the source to the sample's width x height the same
way; the output is that size.

Left out: the refinement stage (`refine_strength` > 0: the last steps run HiDream-I1 on the target prompt without
the source, swapping weights inside the loop); image guidance is the pipeline's default 2.0 (no config key);
the pipeline's separate prompts per encoder. Checked against the official pipeline once, on the tiny model, outside
this repository (docs/families.md says what ran); not run on a GPU or on the released weights.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers import HiDreamImagePipeline, UniPCMultistepScheduler
from diffusers.pipelines.hidream_image.pipeline_hidream_image import calculate_shift, retrieve_timesteps
from diffusers.pipelines.hidream_image.pipeline_output import HiDreamImagePipelineOutput

from .hidream import HiDreamAdapter, tiny_pipeline, transformer_prediction, unpadded_tokens

CONTROL = "control_latents"


def edit_prediction(transformer, latents: torch.Tensor, source: torch.Tensor, timesteps: torch.Tensor, t5, llama,
                    pooled) -> torch.Tensor:
    """The target's velocity: the transformer on [latents | source] joined along the width, padded to twice its
    `max_seq` tokens, the left half of its negated output."""
    w = latents.shape[-1]
    x = torch.cat([latents, source.to(latents.dtype)], dim=-1)
    return transformer_prediction(transformer, x, timesteps, t5, llama, pooled, pad_to=2 * transformer.max_seq)[..., :w]


class HiDreamE1Pipeline(HiDreamImagePipeline):
    """HiDream-E1's editing loop (module essay) on HiDreamImagePipeline's components and prompt encoding, at
    `refine_strength` 0. `image`: the source (PIL), made `height` x `width` (multiples of 16)."""

    @torch.no_grad()
    def __call__(self, prompt: str | list[str] | None = None, image: Any = None, height: int | None = None,
                 width: int | None = None, num_inference_steps: int = 50, guidance_scale: float = 5.0,
                 image_guidance_scale: float = 2.0, clip_cfg_norm: bool = True, negative_prompt: str | None = None,
                 generator: torch.Generator | None = None, latents: torch.Tensor | None = None,
                 prompt_embeds_t5=None, prompt_embeds_llama3=None, pooled_prompt_embeds=None,
                 negative_prompt_embeds_t5=None, negative_prompt_embeds_llama3=None,
                 negative_pooled_prompt_embeds=None, max_sequence_length: int = 128, output_type: str = "pil",
                 return_dict: bool = True):
        if image is None:
            raise ValueError("HiDreamE1Pipeline needs the source image (`image`)")
        self._guidance_scale = guidance_scale
        cfg, device = guidance_scale > 1, self._execution_device
        t5, nt5, llama, nllama, pooled, npooled = self.encode_prompt(
            prompt=prompt, device=device, do_classifier_free_guidance=cfg, negative_prompt=negative_prompt,
            prompt_embeds_t5=prompt_embeds_t5, prompt_embeds_llama3=prompt_embeds_llama3,
            pooled_prompt_embeds=pooled_prompt_embeds, negative_prompt_embeds_t5=negative_prompt_embeds_t5,
            negative_prompt_embeds_llama3=negative_prompt_embeds_llama3,
            negative_pooled_prompt_embeds=negative_pooled_prompt_embeds, max_sequence_length=max_sequence_length)
        source = self._source_latents(image, height, width, pooled.dtype, device)
        batch = pooled.shape[0]
        source = source.expand(batch, -1, -1, -1) if source.shape[0] == 1 else source
        if cfg:  # the three passes (module essay): text of each, then source latents of each
            first = (t5, llama, pooled) if clip_cfg_norm else (nt5, nllama, npooled)
            t5 = torch.cat([first[0], nt5, t5])
            llama = torch.cat([first[1], nllama, llama], dim=1)
            pooled = torch.cat([first[2], npooled, pooled])
            source = torch.cat([torch.zeros_like(source), source, source])
        h, w = source.shape[-2] * self.vae_scale_factor, source.shape[-1] * self.vae_scale_factor
        latents = self.prepare_latents(batch, self.transformer.config.in_channels, h, w, pooled.dtype, device,
                                       generator, latents)
        timesteps = self._timesteps(num_inference_steps, device)
        for t in self.progress_bar(timesteps):
            x = torch.cat([latents] * 3) if cfg else latents
            v = edit_prediction(self.transformer, x, source, t.expand(x.shape[0]), t5, llama, pooled)
            if cfg:
                v = _guided(*v.chunk(3), guidance_scale, image_guidance_scale, clip_cfg_norm)
            latents = self.scheduler.step(v, t, latents, return_dict=False)[0]
        if output_type == "latent":
            image = latents
        else:
            z = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
            image = self.image_processor.postprocess(self.vae.decode(z, return_dict=False)[0], output_type=output_type)
        self.maybe_free_model_hooks()
        return HiDreamImagePipelineOutput(images=image) if return_dict else (image,)

    def _source_latents(self, image, height, width, dtype, device) -> torch.Tensor:
        """The source as the official `prepare_image_latents`: the VAE's mean, (z - shift) * scale."""
        pixels = self.image_processor.preprocess(image, height, width).to(device=device, dtype=dtype)
        z = self.vae.encode(pixels).latent_dist.mode()
        return (z - self.vae.config.shift_factor) * self.vae.config.scaling_factor

    def _timesteps(self, steps: int, device) -> torch.Tensor:
        """UniPC (the release's): its own `set_timesteps`; another scheduler: with the official pipeline's `mu`
        (from the padded token count it sets on the transformer)."""
        if isinstance(self.scheduler, UniPCMultistepScheduler):
            self.scheduler.set_timesteps(steps, device=device)
            return self.scheduler.timesteps
        return retrieve_timesteps(self.scheduler, steps, device, mu=calculate_shift(2 * self.transformer.max_seq))[0]


def _guided(uncond, image, full, g: float, ig: float, clip_cfg_norm: bool) -> torch.Tensor:
    """The official pipeline's three-way guidance (module essay)."""
    if not clip_cfg_norm:
        return uncond + ig * (image - uncond) + g * (full - image)
    text = image + g * (full - image)
    scale = (full.norm(dim=1, keepdim=True) / (text.norm(dim=1, keepdim=True) + 1e-8)).clamp(min=0.0, max=1.0)
    return uncond + ig * (text * scale - uncond)


class HiDreamE1Adapter(HiDreamAdapter):
    family = "hidream-e1"
    pipeline_cls = HiDreamE1Pipeline
    takes_reference = True
    sample_needs_reference = True  # the official pipeline has no text-only path
    guided_batch = 3  # the three passes (module essay)
    full_name, example_path = "HiDream-E1.1", "/path/to/HiDream-E1.1"
    # HiDream-E1's transformer has HiDream-I1-Full's config (17.1 B): HiDreamAdapter.full_config
    #: the release's settings (README: 28 steps; E1-Full's example guidance 5, the pipeline's image guidance 2)
    sample_defaults: ClassVar[dict[str, Any]] = {"steps": 28, "guidance": 5.0}

    @classmethod
    def tiny_builders(cls):
        return {"hidream-e1": tiny_pipeline}  # an I1-shaped folder, as the E1 releases are

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:  # noqa: ARG002
        return edit_prediction(transformer, noisy_latents, text[CONTROL], t * 1000.0, text["t5"],
                               text["llama"].transpose(0, 1), text["pooled"])

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta") -> dict:
        kw = super().dummy_inputs(transformer, batch, height, width, text_tokens, dtype, device)
        # the source's latents (same bucket) beside the target's, padded as `edit_prediction` pads them
        x = torch.cat([kw.pop("hidden_states")] * 2, dim=-1)
        return kw | unpadded_tokens(x, transformer.config.patch_size, 2 * transformer.max_seq)

    @classmethod
    def pipeline_size(cls, pipe, width: int, height: int) -> dict[str, Any]:  # noqa: ARG003 - the protocol
        return {}  # the pipeline makes the source's size, which the sampler cut to width x height

    @classmethod
    def pipeline_image(cls, pipe, image: Any) -> dict[str, Any]:
        if image is None:
            from ..errors import UserError

            raise UserError(f"{cls.family} samples need a reference image: pass --image (or set sample.image)")
        return {"image": image}
