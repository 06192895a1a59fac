"""Making images with a family's diffusers pipeline: encode every prompt, free the encoders, denoise.

How. A sampling run has two phases that never need the GPU at the same time. First every prompt (and the
negative prompt, where the family runs classifier-free guidance) is encoded through the pipeline's own
`encode_prompt`; then the text encoders are dropped from the pipeline and their memory released. Only then is
the transformer placed (resident, or streamed by the offload conductor) and each image denoised by calling the
pipeline with the stored embeddings (each family's adapter names the arguments: `pipeline_embeds`,
`pipeline_guidance`, `runs_cfg` in trainer/models/). One pipeline call per image,
each with its own CPU `torch.Generator` seeded with the image's seed, so an image depends only on its prompt,
seed and settings: not on the batch it came in, the device the noise was drawn for, or how many images came
before it.

Why through diffusers' pipeline. Its scheduler, latent packing, guidance and VAE decoding are what users compare
against; `tests/test_sample*.py` checks that our images equal `pipe(prompt=...)` bit for bit on the CPU.

`generate` is also what the training loop calls to sample with the model being trained (see its docstring): it
swaps the given transformer into the pipeline by reference (no copy), switches it to eval mode for the call, and
restores both afterwards. It never touches the global RNG.

Left out: batching several images into one pipeline call (faster on a big GPU, but it makes an image depend on
its batch), negative prompts for Flux's "true CFG". VAE tiling is the callers' (`placement.tile_decode`,
`placement.decode_for_sample`).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from diffusers import DiffusionPipeline
from PIL import Image

from ..models import adapter_class
from ..progress import shown
from .request import SampleSettings

#: pipeline call kwargs holding one prompt's embeddings
Embeds = dict[str, torch.Tensor]


def text_encoder_names(pipe) -> list[str]:
    """The pipeline's text-encoder components (text_encoder, text_encoder_2, ...) that are loaded."""
    return [n for n, m in pipe.components.items() if n.startswith("text_encoder") and m is not None]


def encode_prompts(
    pipe,
    family: str,
    prompts: Sequence[str],
    *,
    guidance: float,
    negative_prompt: str = "",
    device: torch.device | str | None = None,
    image=None,
) -> list[Embeds]:
    """Pipeline call kwargs holding each prompt's embeddings (and the negative prompt's when the guidance runs a
    second pass: `runs_cfg`). Needs the text encoders in `pipe`; identical prompts are encoded once. `image`: the reference
    (PIL) for families whose text encoder sees it (`text_uses_reference`)."""
    fam = adapter_class(family)
    device = torch.device(device) if device is not None else pipe._execution_device
    negative = negative_prompt if fam.runs_cfg(guidance) else None
    cache: dict[str, Embeds] = {}
    with torch.no_grad(), _ClipCuts() as cuts:
        for p in prompts:
            if p not in cache:
                cuts.prompt = p
                ref = {"image": image} if fam.text_uses_reference else {}
                cache[p] = fam.pipeline_embeds(pipe, p, negative, device, **ref)
    if cuts.cut:
        n = len(cuts.cut)
        print(f"note: {n} prompt{'s are' if n > 1 else ' is'} longer than CLIP's 77 tokens; CLIP reads only the start "
              f"(\"{next(iter(cuts.cut))[:40]}...\"), the other text encoder reads further", file=sys.stderr)
    return [cache[p] for p in prompts]


class _ClipCuts:
    """While prompts are encoded, the pipelines' per-prompt CLIP truncation warnings (diffusers' "The following
    part of your input was truncated because CLIP can only handle sequences up to 77 tokens: [...]" and the
    tokenizer's "Token indices sequence length is longer than ...") are held back and the cut prompts noted, so
    `encode_prompts` prints one line of its own instead of a paragraph per prompt and encoder."""

    _MARKS = ("CLIP can only handle sequences up to", "Token indices sequence length is longer than the specified")

    def __init__(self) -> None:
        self.prompt, self.cut = "", {}
        self._handlers: list[logging.Handler] = []

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if any(m in msg for m in self._MARKS):
            self.cut[self.prompt] = True
            return False
        return True

    def __enter__(self) -> _ClipCuts:
        # On the libraries' own handlers: the records are logged by many per-pipeline loggers and propagate there
        self._handlers = [h for name in ("diffusers", "transformers") for h in logging.getLogger(name).handlers]
        for h in self._handlers:
            h.addFilter(self)
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handlers:
            h.removeFilter(self)


def release_text_encoders(pipe) -> None:
    """Drop the text encoders from the pipeline and give their memory back.

    Their weights are freed only if the pipeline held the last reference (`run_sample` makes sure of that); a
    caller that keeps its own reference keeps the memory."""
    for name in text_encoder_names(pipe):
        pipe.register_modules(**{name: None})
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class _DropMaskNotice(logging.Filter):
    """Qwen-Image's pipeline warns when `prompt_embeds_mask` is None, but its own `encode_prompt` returns None for
    an unpadded prompt (every token valid), which is what we pass back: the warning would be noise on each image."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "_mask` is not provided" not in record.getMessage()


def to_device(value: Any, device: torch.device | str) -> Any:
    """An embeddings value (a tensor, or a list of tensors) on `device`; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [to_device(v, device) for v in value]
    return value


def _to(embeds: Embeds, device: torch.device) -> Embeds:
    return {k: to_device(v, device) for k, v in embeds.items()}


def generate(
    pipe_or_components: Any,
    adapter: Any,
    prompts: Sequence[str | Embeds],
    *,
    settings: SampleSettings,
    seeds: Sequence[int],
    transformer: torch.nn.Module | None = None,
    progress: bool = False,
    output_type: str = "pil",
) -> list[Image.Image]:
    """Images for `prompts[i]` with `seeds[i]`, one pipeline call each.

    `pipe_or_components`: a pipeline from `adapter.pipeline(...)`, or the adapter's `Components` (a pipeline is
    then built around them with a private copy of the scheduler, so the caller's scheduler state is untouched).
    `prompts`: strings (encoded now: the text encoders must be loaded) or the kwargs dicts `encode_prompts`
    returned earlier (the text encoders may be gone).
    `transformer`: use this module for denoising instead of the pipeline's, by reference. The training loop
    passes the diffusers transformer it is training (not a peft `PeftModel` wrapper: the pipeline calls it with
    diffusers' keyword arguments); its LoRA layers act as they are, its `training` flag is restored afterwards.

    For the training loop, once at setup while the text encoders are loaded::

        embeds = encode_prompts(pipe, adapter.family, cfg.sample.prompts, guidance=s.guidance)

    then every `sample.every` steps::

        images = generate(components, adapter, embeds, settings=s, seeds=[cfg.sample.seed + i ...],
                          transformer=model)

    `output_type`: "pil" (default), or "np" / "pt" for float images in [0, 1] (exactness tests compare those).
    A video family (`adapter.video`) gives each sample as its list of `settings.frames` frames instead
    (`adapter.pipeline_result`).

    The model's blocks must be reachable on the pipeline's device while it runs (resident, or streamed by an
    offload handle in a mode that allows forward-only passes).
    """
    if len(prompts) != len(seeds):
        raise ValueError(f"generate: {len(prompts)} prompts but {len(seeds)} seeds")
    pipe = _as_pipeline(pipe_or_components, adapter)
    with _ready_to_denoise(pipe, adapter, transformer, progress) as model:
        ref_image = settings.reference()
        encoded = _encode_texts(pipe, adapter, prompts, settings, ref_image)
        device = pipe._execution_device
        reference = _reference_kwargs(pipe, adapter, ref_image)
        images = []
        with adapter.sampling_hooks(model):  # the family's (Qwen-Image 2.1: its KV cache kept compact)
            for prompt, seed in zip(prompts, seeds, strict=True):
                embeds = next(encoded) if isinstance(prompt, str) else prompt
                images.append(_denoise(pipe, adapter, embeds, seed, settings, device, reference, output_type))
        return images


@contextlib.contextmanager
def _ready_to_denoise(pipe, adapter: Any, transformer: torch.nn.Module | None, progress: bool):
    """The pipeline made ready for `generate` and given back as it was: `transformer` (when given) swapped into
    the family's slot by reference, the model denoising in eval mode, the progress bar set, Qwen-Image's mask
    notice filtered (`_DropMaskNotice`). Yields the model that denoises."""
    slot = getattr(adapter, "transformer_dir", "transformer")  # a family of experts: the trained expert's component
    old = getattr(pipe, slot)
    model = transformer if transformer is not None else old
    was_training = model.training
    if transformer is not None:
        setattr(pipe, slot, transformer)  # a reference swap: no weights are copied
    model.eval()
    pipe.set_progress_bar_config(disable=not shown(progress), leave=False, desc="steps")
    pipe_logger, quiet = logging.getLogger(type(pipe).__module__), _DropMaskNotice()
    pipe_logger.addFilter(quiet)
    try:
        yield model
    finally:
        pipe_logger.removeFilter(quiet)
        model.train(was_training)
        if transformer is not None:
            setattr(pipe, slot, old)


def _encode_texts(pipe, adapter: Any, prompts: Sequence[str | Embeds], settings: SampleSettings,
                  ref_image) -> Iterator[Embeds]:
    """The embeddings of the prompts given as text, in their order, all encoded now (the text encoders must be
    loaded; identical prompts are encoded once); prompts given as embeddings are skipped."""
    texts = [p for p in prompts if isinstance(p, str)]
    if not texts:
        return iter(())
    return iter(encode_prompts(pipe, adapter.family, texts, guidance=settings.guidance,
                               negative_prompt=settings.negative_prompt, image=ref_image))


def _reference_kwargs(pipe, adapter: Any, ref_image) -> dict[str, Any]:
    """The pipeline arguments of the reference image (the family's `pipeline_image`; none without one), and
    `negative_prompt=None` where the pipeline takes a text negative prompt: the negative prompt travels as
    embeddings and must not be encoded again (Flux.2's pipelines take none)."""
    reference = adapter.pipeline_image(pipe, ref_image)
    if "negative_prompt" in inspect.signature(pipe.__call__).parameters:
        reference = {**reference, "negative_prompt": None}
    return reference


def _denoise(pipe, adapter: Any, embeds: Embeds, seed: int, settings: SampleSettings, device: torch.device,
             reference: dict[str, Any], output_type: str):
    """One pipeline call: one prompt's embeddings with the family's guidance, size and frame arguments, its noise
    drawn from a CPU generator seeded with `seed`. Returns the family's result: an image, or a video's frames."""
    generator = torch.Generator("cpu").manual_seed(int(seed))
    out = pipe(
        **_to(embeds, device),
        **adapter.pipeline_guidance(pipe, settings.guidance),
        # a family of two experts: the low-noise steps' own guidance (sample.guidance_2)
        **({"guidance_scale_2": settings.guidance_2} if settings.guidance_2 is not None else {}),
        **reference,
        **adapter.pipeline_size(pipe, settings.width, settings.height),
        **adapter.pipeline_frames(pipe, settings.frames),
        height=settings.height,
        width=settings.width,
        num_inference_steps=settings.steps,
        generator=generator,
        output_type=output_type,
    )
    return adapter.pipeline_result(out, pipe)


def _as_pipeline(pipe_or_components: Any, adapter: Any):
    if isinstance(pipe_or_components, DiffusionPipeline):
        return pipe_or_components
    comps = pipe_or_components
    sched = comps.scheduler
    pipe = adapter.pipeline(comps)
    if sched is not None:
        pipe.register_modules(scheduler=type(sched).from_config(sched.config))
    return pipe
