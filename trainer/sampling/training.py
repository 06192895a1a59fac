"""Sampling during training: the config's prompts, encoded once, denoised by the model being trained.

How. `TrainingSampler(cfg, adapter, device, dtype)` is built once at setup: it loads the VAE, text encoders and
scheduler (not the transformer), encodes `sample.prompts` (and the negative prompt where the family runs
classifier-free guidance), then drops the text encoders, so nothing but the VAE (Flux: 168 MB, kept in CPU RAM
between calls) and the embeddings stays alive. Each call `sampler(transformer)` then makes one image per prompt
with seed `sample.seed + i` through the family's diffusers pipeline, passing the loop's transformer by reference:
no copy of the weights, the LoRA layers as they are at this step, the `training` flag restored afterwards, the
global RNG untouched (noise comes from a private CPU generator), so sampling does not change the run's losses.

Why a separate object rather than `run_sample`: the loop already holds the transformer (possibly with streamed
blocks and LoRA layers mid-training) and must not load a second one; and the text encoders must not be loaded
again every `sample.every` steps.

Memory on a GPU. Nothing but what denoising needs is on the card while sampling: the transformer runs through
the *training* offload handle as it is (the diffusers pipeline calls it under `torch.no_grad()`, and a no-grad
forward under the training plan works without re-planning; `OffloadHandle.set_mode("sample")` would repack every
block twice per call, far more than the backward blocks the training plan loads needlessly); the prompts'
embeddings were computed at setup, so no text encoder is loaded; the VAE (Flux / SD3: 168 MB, Qwen-Image:
254 MB) comes to the GPU for the call only (the pipeline takes its device from its first module, so it cannot
wait in CPU RAM during denoising) and decodes tiled (512-pixel tiles) when the image has more than 512x512
pixels on a GPU (`tile_decode`): an untiled 1024x1024 decode would need about 3 GB. So sampling peaks below
the training step's peak, whose activations it reuses (the planner's `sampling` phase).
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
from PIL import Image

from ..models.stream_load import release_host_memory
from .engine import encode_prompts, generate, release_text_encoders, to_device
from .output import frame_sheet
from .placement import place_text_encoders, place_transformer, tile_decode
from .request import SampleSettings, check_frames, check_guidance_2, check_image


class TrainingSampler:
    """Images for `cfg.sample.prompts` made with an in-memory transformer (see the module essay)."""

    def __init__(self, cfg, adapter, device: torch.device | str, dtype: torch.dtype) -> None:
        s = cfg.sample
        self.adapter = adapter
        self.device = torch.device(device)
        self.prompts = list(s.prompts)
        self.seeds = [s.seed + i for i in range(len(self.prompts))]
        self.settings = SampleSettings.from_config(s)
        #: per prompt, the last call's frames (a video family) or None (an image)
        self.videos: list = []
        check_frames(self.settings.frames, adapter)
        check_guidance_2(self.settings.guidance_2, adapter)
        # several references: readable, and no more than the family takes; image-to-video: the first frame given
        if isinstance(s.image, list) or adapter.first_frame_conditions:
            check_image(s.image, adapter)
        # experts: a family of experts' others than the one training (their base weights, in CPU RAM); none when
        # the run trains every expert (model.expert: both: each call gets them all, `by_component`). A family's
        # other sampling transformers (`sampling_components`) are not kept: each call loads them (`_components`)
        others = {"experts"} if adapter.experts and len(adapter.trained_experts) < 2 else set()
        self.model_cfg, self.dtype = cfg.model, dtype
        comps = adapter.load(cfg.model, parts={"vae", "text", "scheduler"} | others, dtype=dtype, device="cpu")
        self.pipe = adapter.pipeline(comps)
        del comps  # the pipeline holds the only references: releasing the encoders frees them
        if self.prompts:  # a reference the family's pipeline refuses (its size), refused now, not at the first pass
            adapter.pipeline_image(self.pipe, self.settings.reference())
        self.embeds = []
        if self.prompts:
            with place_text_encoders(self.pipe, self.device, cfg.offload.text_encoders):
                embeds = encode_prompts(
                    self.pipe,
                    adapter.family,
                    self.prompts,
                    guidance=s.guidance,
                    negative_prompt=s.negative_prompt,
                    device=self.device,
                    image=self.settings.reference(),
                )
            # Kept in CPU RAM between calls (device-to-host copy once, at setup).
            self.embeds = [{k: to_device(v, "cpu") for k, v in e.items()} for e in embeds]
        release_text_encoders(self.pipe)
        if self.device.type == "cuda":
            tile_decode(self.pipe.vae, s.height, s.width)

    def __call__(self, transformer: torch.nn.Module, progress: bool = False, before_decode=None) -> list[Image.Image]:
        """One image per prompt, with the given transformer (by reference); for a video family the contact sheet of
        each sample's frames (`frame_sheet`; the frames stay in `videos`, which the loop writes as mp4). Empty when
        there are no prompts.
        `before_decode()`: called once, when the VAE's decoder first runs (after the first image's denoising)."""
        if not self.prompts:
            return []
        vae = self.pipe.vae
        vae.to(self.device)  # host-to-device copy of the VAE per call; it goes back below to keep VRAM free
        hook = None
        if before_decode is not None and isinstance(getattr(vae, "decoder", None), torch.nn.Module):
            def first_decode(module, args):
                hook.remove()
                before_decode()

            hook = vae.decoder.register_forward_pre_hook(first_decode)
        # every expert the run trains into its pipeline slot (model.expert: both: the router's `by_component`)
        trained = dict(getattr(transformer, "by_component", None) or {self.adapter.transformer_dir: transformer})
        transformer = trained.pop(self.adapter.transformer_dir)
        slots = {name: (getattr(self.pipe, name), m, m.training) for name, m in trained.items()}
        for name, (_, m, _) in slots.items():
            setattr(self.pipe, name, m)  # a reference swap; the slot of transformer_dir is `generate`'s
            m.eval()
        mine = transformer
        others = [m for m in self.adapter.pipeline_transformers(self.pipe)
                  if m is not None and m is not mine and all(m is not s[1] for s in slots.values())]
        stream = 1.0 if self.device.type == "cuda" else 0.0
        try:
            with ExitStack() as placed:  # the other experts: streamed from CPU RAM on a GPU, only for the call
                for m in others:
                    placed.enter_context(place_transformer(self.adapter, m, self.device, stream))
                self._components(placed, stream)
                out = generate(
                    self.pipe,
                    self.adapter,
                    self.embeds,
                    settings=self.settings,
                    seeds=self.seeds,
                    transformer=transformer,
                    progress=progress,
                )
            # a video family's samples are lists of frames: kept in `videos` (the loop writes each as an mp4), and
            # the run folder and TensorBoard get each one's frame sheet
            self.videos = [x if isinstance(x, list) else None for x in out]
            return [frame_sheet(x) if isinstance(x, list) else x for x in out]
        finally:
            for name, (old, m, was_training) in slots.items():
                setattr(self.pipe, name, old)
                m.train(was_training)
            for name in self.adapter.sampling_components:
                setattr(self.pipe, name, None)  # dropped: its arena and device weights are freed
            if hook is not None:
                hook.remove()
            vae.to("cpu")
            if self.adapter.sampling_components:
                release_host_memory()

    def _components(self, placed: ExitStack, fraction: float) -> None:
        """The family's other sampling transformers (`sampling_components`, Ideogram 4's unconditional one) into
        their pipeline slots for this call: read from the files block by block into the conductor's arena
        (`load_component`, non-block weights straight to the device), streamed at `fraction`, and dropped when
        `placed` closes (the caller empties the slots). Holding one between calls kept 9.3 GB of RAM for the whole
        fit, and placing a copy loaded whole into RAM put a second one beside it (bench/history/2026-11-27.md,
        21:58: 32 GB anonymous RSS in Ideogram 4's sampling)."""
        for name in self.adapter.sampling_components:
            module, loader = self.adapter.load_component(self.model_cfg, name, self.dtype, self.device)
            placed.callback(loader.close)
            placed.enter_context(place_transformer(self.adapter, module, self.device, fraction, fill=loader.fill,
                                                   keep_weights=False))
            setattr(self.pipe, name, module)
            del module
