"""Ideogram 4's sampling pipeline: diffusers' Ideogram 4 pipelines take a prompt, never its embeddings, and dittrain's
sampler hands a pipeline embeddings computed once (the text encoder is gone while it denoises). So
`Ideogram4EmbedsPipeline` here puts a classic `DiffusionPipeline` face on diffusers' *modular* Ideogram 4 pipeline
(`diffusers/modular_pipelines/ideogram4`), as Flux.3's and Anima's faces do (trainer/models/ideogram4.py says how the
training side mirrors the same blocks).

- `recipe()`: the modular blocks' own settings (text window, default steps, guidance schedule), read from them.
- `text_features`: one prompt through the text-encoder step itself (`Ideogram4TextEncoderStep`, run as a one-block
  modular pipeline): the chat template, left padding to the window and the 13 Qwen3-VL hidden states side by side.
- `Ideogram4EmbedsPipeline.__call__`: the pipeline's current modules (the transformer may have been swapped by
  reference) handed to a modular pipeline built once from `Ideogram4AutoBlocks` without its prompt-upsampling and
  text-encoder steps, with the stored features and lengths. The packed sequence, the asymmetric guidance over the
  two transformers (conditional `transformer`, text-free `unconditional_transformer`), the resolution-aware
  logit-normal schedule and the batch-norm de-normalised decode are the modular blocks' own.
- with the family's transformers (trainer/models/ideogram4.py: they take projected text), each prompt's features are
  projected once per image and the blocks carry (tokens x 4608) values instead of fp32 (tokens x 53248) ones
  projected at every step (`_projected_once`); the images are the same.
- guidance: `guidance_scale` is a constant weight w at every step (v = w v_cond + (1 - w) v_uncond, the classic
  pipeline's `guidance_scale`); without it, the blocks' default schedule (7 for 45 steps, then 3 for 3: 48 steps).
- LoRAs load through `Ideogram4LoraLoaderMixin` (as `Ideogram4ModularPipeline`'s do): into `transformer` only, the
  unconditional transformer is never adapted.
"""

from __future__ import annotations

import functools
import logging
from contextlib import ExitStack
from typing import Any

import torch
from diffusers import DiffusionPipeline
from diffusers.loaders import Ideogram4LoraLoaderMixin
from diffusers.modular_pipelines.ideogram4.before_denoise import Ideogram4SetTimestepsStep
from diffusers.modular_pipelines.ideogram4.encoders import Ideogram4TextEncoderStep
from diffusers.modular_pipelines.ideogram4.modular_blocks_ideogram4 import Ideogram4AutoBlocks
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput

from ..errors import UserError
from .flux3_pipeline import _progress_config, _quiet_modular_notes


@functools.cache
def recipe() -> dict[str, Any]:
    """The modular pipeline's own settings, read from its blocks: the text window (longest prompt, in tokens),
    default steps and the default guidance schedule."""
    text = {p.name: p.default for p in Ideogram4TextEncoderStep().inputs}
    steps = {p.name: p.default for p in Ideogram4SetTimestepsStep().inputs}
    return {"max_sequence_length": text["max_sequence_length"], "steps": steps["num_inference_steps"],
            "guidance_schedule": tuple(steps["guidance_schedule"])}


def prompt_tokens(tokenizer, prompt: str) -> int:
    """Tokens of `prompt` in the text-encoder step's chat form (a user turn, then the assistant's generation
    prompt), as the step counts them."""
    messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


@functools.cache
def _text_step():
    """The text-encoder step as a one-block modular pipeline (built once; its parts are set per call)."""
    with _quiet_modular_notes():
        return Ideogram4TextEncoderStep().init_pipeline()


class _DropNoneNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "to None (spec unchanged)" not in record.getMessage()


def _let_go(mp, *names: str) -> None:
    """A modular pipeline kept between calls lets go of its components `names`, so that what the caller drops
    after a call is freed: the text encoder after `text_features` (its embeddings on the GPU, 1.2 GB for
    Qwen3-VL-8B, stayed through the latent cache and training: bench/history/2026-11-27.md, 21:58), and the
    transformers and VAE after a sample (the training sampler loads the unconditional transformer for each call)."""
    log, note = logging.getLogger("diffusers.modular_pipelines.modular_pipeline"), _DropNoneNote()
    log.addFilter(note)
    try:
        mp.update_components(**dict.fromkeys(names))
    finally:
        log.removeFilter(note)


@torch.no_grad()
def text_features(encoder, tokenizer, prompt: str, window: int | None = None) -> tuple[torch.Tensor, int]:
    """(features (1, window, 13 x hidden) in fp32, padding rows zero; the prompt's token count): the text-encoder
    step's own output at `window` tokens (None: the pipeline's 2048). A prompt longer than the window is a
    `UserError`."""
    window = window or recipe()["max_sequence_length"]
    n = prompt_tokens(tokenizer, prompt)
    if n > window:
        raise UserError(f"a caption of {n} tokens (in Ideogram 4's chat form) is longer than its text window of "
                        f"{window} tokens: shorten it (\"{prompt[:40]}...\")")
    mp = _text_step()
    with _quiet_modular_notes():
        mp.update_components(text_encoder=encoder, tokenizer=tokenizer)
    try:
        feats, lengths = mp(prompt=prompt, max_sequence_length=window,
                            output=["text_features", "text_lengths"]).values()
    finally:  # the cached step must not keep the encoder alive: its GPU parts (1.2 GB of embeddings) would stay
        _let_go(mp, "text_encoder", "tokenizer")
    assert lengths == [n], (lengths, n)  # the step counted as `prompt_tokens`: the layout below relies on it
    return feats, n


class Ideogram4EmbedsPipeline(DiffusionPipeline, Ideogram4LoraLoaderMixin):
    """diffusers' Ideogram 4 modular pipeline behind a classic pipeline's interface (`encode_prompt`, `__call__`
    with `prompt_embeds`, `register_modules`, `load_lora_weights`), which is what trainer/sampling drives (module
    essay)."""

    model_cpu_offload_seq = "text_encoder->transformer->unconditional_transformer->vae"
    _optional_components = ["text_encoder", "tokenizer", "unconditional_transformer"]

    def __init__(self, transformer, vae, scheduler, unconditional_transformer=None, text_encoder=None,
                 tokenizer=None):
        super().__init__()
        self.register_modules(transformer=transformer, unconditional_transformer=unconditional_transformer, vae=vae,
                              scheduler=scheduler, text_encoder=text_encoder, tokenizer=tokenizer)
        self._modular = None

    def modular_pipeline(self):
        """The text-to-image modular pipeline (built on first use): text features in, images out."""
        if self._modular is None:
            blocks = Ideogram4AutoBlocks()
            for step in ("prompt_upsample", "text_encoder"):
                blocks.sub_blocks.pop(step)
            with _quiet_modular_notes():  # it creates a default image processor
                self._modular = blocks.init_pipeline()
        return self._modular

    @torch.no_grad()
    def encode_prompt(self, prompt: str, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One prompt's (features (1, 2048, D), lengths (1,)) as the modular text-encoder step makes them."""
        feats, n = text_features(self.text_encoder, self.tokenizer, prompt)
        device = device if device is not None else self._execution_device
        return feats.to(device), torch.tensor([n])

    @torch.no_grad()
    def __call__(self, prompt_embeds: torch.Tensor, prompt_lengths: torch.Tensor, guidance_scale: float | None = None,
                 height: int = 1024, width: int = 1024, num_inference_steps: int | None = None, generator=None,
                 output_type: str = "pil", return_dict: bool = True):
        if self.unconditional_transformer is None:
            raise ValueError("Ideogram 4 samples with both transformers: load unconditional_transformer too")
        mp = self.modular_pipeline()
        steps = num_inference_steps or recipe()["steps"]
        schedule = (list(recipe()["guidance_schedule"]) if guidance_scale is None
                    else [float(guidance_scale)] * steps)
        with _quiet_modular_notes():
            mp.update_components(transformer=self.transformer, unconditional_transformer=self.unconditional_transformer,
                                 vae=self.vae, scheduler=self.scheduler)
        _progress_config(mp._blocks, getattr(self, "_progress_bar_config", {}))
        lengths = [int(n) for n in prompt_lengths.tolist()]
        with ExitStack() as stack:
            stack.callback(_let_go, mp, "transformer", "unconditional_transformer", "vae", "scheduler")
            prompt_embeds = self._projected_once(prompt_embeds, lengths, stack)
            images = mp(text_features=prompt_embeds, text_lengths=lengths, height=height, width=width,
                        num_inference_steps=steps, guidance_schedule=schedule, generator=generator,
                        output_type=output_type, output="images")
        return ImagePipelineOutput(images=images) if return_dict else (images,)

    def _projected_once(self, features: torch.Tensor, lengths: list[int], stack: ExitStack) -> torch.Tensor:
        """The text features projected to the transformer's width once for the whole call, with both transformers
        passing projected features through (`Ideogram4Transformer2DModel.projected`, trainer/models/ideogram4.py).

        The blocks hand the transformers the features over the whole sequence, image rows (zeros) included, in fp32:
        at 1024 px 1.3 GB kept through the loop (0.9 GB more of zeros for the unconditional pass) and about 4 GB of
        casts and the text RMSNorm's fp32 copies at every step, and the projection (2.8 TFLOP a step) on them. Projected
        once, the blocks keep (tokens x 4608) instead; the text rows are the projection the transformer would make
        (proj(norm(x m)), m the text mask, as in its forward; it multiplies by m again, which changes nothing) and the
        image rows and the unconditional pass get zeros, which is what the projection times the mask 0 gives. Where a
        transformer is diffusers' own class (no `projected`), the features go as they are."""
        models = (self.transformer, self.unconditional_transformer)
        if not all(hasattr(m, "projected") for m in models):
            return features
        window = features.shape[1]
        mask = torch.zeros(len(lengths), window, 1, device=features.device, dtype=self.transformer.dtype)
        for i, n in enumerate(lengths):
            mask[i, window - n:] = 1  # the text step left-pads
        projected = self.transformer.project_text(features.to(self.transformer.dtype), mask)
        for m in models:
            stack.enter_context(m.projected())
        return projected
