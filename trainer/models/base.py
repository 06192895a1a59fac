"""The one protocol every model family implements.

The training loop, the data caches, the offload conductor and the sampler never branch on a model's name:
whatever differs between Flux, SD3 and Qwen-Image (which diffusers classes, which blocks stream, how text is
encoded, how latents are packed into tokens, where LoRA goes, what the bucket sides must divide by) is data or
a method here.

Tensors crossing this boundary:

- images: float pixels in [-1, 1], shape (B, 3, H, W), H and W divisible by `resolution_divisor`;
- latents: the VAE's latents already shifted and scaled for the transformer, shape (B, C, H/8, W/8) (for
  Qwen-Image the single-frame video axis is squeezed out); a video family's (`video`) are (B, C, F, H/8, W/8),
  F latent frames (`latent_frames`), an image being one frame;
- text: a dict of tensors with a leading batch axis (`encode_prompts`). One caption's entry (`t[i]` for each
  value) is what the text cache stores; `collate_text` stacks cached entries back into a batch;
- timesteps: t in [0, 1] of shape (B,), the flow-matching time (1 = pure noise); `predict` converts it into
  the transformer's own convention.
"""

from __future__ import annotations

import contextlib
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from ..config import ModelConfig

#: `model.expert` for every expert of a family of experts in one run (trainer/train/experts.py)
BOTH_EXPERTS = "both"


def to_pil(pixels: torch.Tensor):
    """(3, H, W) in [-1, 1] -> RGB PIL image (exact for pixels that came from 8-bit images): a reference image or
    a clip's first frame handed to a pipeline's image processor."""
    import numpy as np
    from PIL import Image

    a = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    return Image.fromarray(np.ascontiguousarray(a))


@dataclass(frozen=True)
class MeasuredPreset:
    """What a GPU run of a preset as shipped measured, and the settings it ran with: the presets generator writes
    `note` into the header only while the preset still sets `transformer` and `gradient_checkpointing`, so a
    regenerated preset never carries figures of another setting (tests/test_presets.py holds every entry to its
    shipped file)."""

    transformer: float  #: offload.transformer of the measured run
    checkpointing: bool | str  #: train.gradient_checkpointing of the measured run (True, False or "auto")
    note: str  #: "measured on <GPU>: ...", as the header's `expects:` line quotes it

    def describes(self, transformer: float, checkpointing: bool | str) -> bool:
        """Whether a preset with these settings is the one measured."""
        return abs(self.transformer - transformer) < 1e-9 and self.checkpointing == checkpointing


@dataclass(frozen=True)
class PresetVariant:
    """Another published size of a family's transformer (a key of the adapter's `full_variants`) with presets of its
    own, `configs/<family>-<key>/` (`ModelAdapter.sized`): the small model users of small cards train
    (Wan2.1-T2V-1.3B, where the 14 B's presets start at 12 GB). Its text encoders, VAE and code are the family's."""

    full_name: str  #: the published name: the presets' titles; a missing model.path that contains it plans this size
    example_path: str  #: the presets' placeholder model.path (it contains `full_name`)
    cards: tuple[int, ...]  #: the card sizes (GB) its presets are written for
    #: its presets' ladder of clips where not the family's (`preset_clips`): a size trained at fewer resolutions
    clips: tuple[tuple[str, int], ...] | None = None
    #: {(method, card GB): MeasuredPreset} of its own presets (`ModelAdapter.measured_presets`)
    measured: dict[tuple[str, int], MeasuredPreset] = field(default_factory=dict)


@dataclass
class Components:
    """What `ModelAdapter.load` returns. Parts not asked for are None / empty."""

    transformer: nn.Module | None = None
    vae: nn.Module | None = None
    text_encoders: list[nn.Module] = field(default_factory=list)
    tokenizers: list[Any] = field(default_factory=list)
    scheduler: Any = None
    #: a family of several experts (`ModelAdapter.experts`), part "experts": the experts other than `transformer`
    #: (the one `model.expert` picks), by pipeline component (Wan 2.2 A14B: {"transformer_2": ...})
    experts: dict[str, nn.Module] = field(default_factory=dict)
    #: further pipeline components a family loads with a part, by pipeline name, kept in CPU RAM (the family moves
    #: them where it runs them): LTX-2's text connectors, loaded with part "text"
    extras: dict[str, nn.Module] = field(default_factory=dict)


class Clip(list):
    """A sampled video: its frames (PIL), and its sound where the family makes one (`audio`: (channels, samples)
    float in [-1, 1] at `sample_rate` Hz), which trainer/data/video.py `write_video` muxes into the mp4."""

    def __init__(self, frames, audio: torch.Tensor | None = None, sample_rate: int | None = None):
        super().__init__(frames)
        self.audio, self.sample_rate = audio, sample_rate


def text_encoder_blocks(encoder: nn.Module) -> list[nn.Module]:
    """A text encoder's streamed units: its largest ModuleList by parameter count (T5's `encoder.block`, CLIP's
    `encoder.layers`, a decoder's `layers`). Text encoders have no adapter-declared block list; the sampling
    placement streams these and the planner sizes its text-caching ring from the same choice."""
    best, size = None, -1
    for m in encoder.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0:
            n = sum(p.numel() for p in m.parameters())
            if n > size:
                best, size = m, n
    return list(best) if best is not None else []


class ModelAdapter(ABC):
    """One model family: its code (the methods below) and every fact about it (the class attributes below), in one
    file of trainer/models/ plus one line of the registry (`trainer/models/__init__.py` `ADAPTERS`).

    Nothing outside trainer/models/ names a family or keeps a table keyed by one (tests/test_layout.py checks it):
    the config's family list, `make-tiny`, the planner, the quantizer, the presets generator and the tests' family
    parameters all read the registry and these attributes. Attributes with a default here are optional; the others
    every family declares (`tests/test_layout.py::test_every_adapter_provides_the_family_facts`).

    An instance is bound to one `ModelConfig` (`get_adapter(cfg.model)`) and may read that model folder's small
    JSON configs lazily (never weights), so sizes such as `resolution_divisor` come from the actual model, and to
    the reference images per target of the run it serves (`references`: a fit's `DataConfig.references`, a
    sample's `--image` count, the planner's data), which a family whose blocks run only with references reads
    (`blocks`, `lora_targets`: Flux.3's reference-mode blocks). Apart from that it holds no state; in particular no
    tensors. The class attributes describe the full-size model and are what the planner and the presets use when
    no model folder is at hand.

    The diffusers-based adapters also offer, read from the folder, `latent_channels`, `vae_scale_factor`,
    `patch_size`, `guidance_embeds` and `image_seq_len(height, width)` (see `_diffusers.py`)."""

    def __init__(self, model_cfg: ModelConfig | None = None, references: int = 0) -> None:
        self.cfg = model_cfg
        expert = getattr(model_cfg, "expert", None)
        if expert is not None and (expert not in self.experts and not (expert == BOTH_EXPERTS and self.experts)):
            from ..errors import UserError

            raise UserError(f"model.expert: {expert!r}: " + (
                f"{self.family} has one transformer (model.expert is for a family of experts; leave it null)"
                if not self.experts else f"{self.family}'s experts are {', '.join(self.experts)} (or "
                f"{BOTH_EXPERTS}: every one in one run)"))
        #: reference images per target of the run (0: text-to-image; only an edit family keeps a positive count)
        self.references = int(references) if self.takes_reference else 0

    # ------------------------------------------------------------------------------------------ identity

    # Facts that name this family rather than describe its architecture (`cache_name`, `measured_presets`,
    # `tiny_builders`) are read from the class's own namespace, never inherited: a family
    # that subclasses another's adapter (flux-kontext, qwen-image-edit) does not take over its names, folders or
    # measurements.

    #: the family key (`model.family`, `make-tiny --family`, `configs/<family>/`); words joined by "-" (the same
    #: words joined by "_" are accepted too: trainer/models/__init__.py `canonical_family`)
    family: ClassVar[str]
    #: the family's name inside cache keys (trainer/data/cache.py `model_identity`); None: `family`. Set when a
    #: family is renamed, so caches written under the old name stay valid. Not inherited (`cache_family`)
    cache_name: ClassVar[str | None] = None
    #: the full-size model's name and a placeholder folder for it (the presets' headers and `model.path`)
    full_name: ClassVar[str]
    example_path: ClassVar[str]

    # ------------------------------------------------------------------------------------------ transformer

    #: diffusers transformer class, e.g. FluxTransformer2DModel
    transformer_cls: ClassVar[type]
    #: the full-size transformer's config (`transformer_cls.from_config` keys)
    full_config: ClassVar[dict[str, Any]]
    #: peft target_modules used when the config gives none
    default_lora_targets: ClassVar[tuple[str, ...]]
    #: the family's LoRA module names in the original layout (ComfyUI, kohya; trainer/models/lora_keys.py `LoraKeyMap`),
    #: inherited by a family that shares the architecture; None: none yet, and output.lora_format comfy / kohya say so
    lora_key_map: ClassVar[Any] = None
    #: ComfyUI maps this family's diffusers-keyed LoRAs (`transformer.<module>`) onto its model (comfy/lora.py
    #: `model_lora_keys_unet`); when not, the end of a fit with output.lora_format: diffusers says to convert
    comfy_reads_diffusers_lora: ClassVar[bool] = False
    #: where ComfyUI maps them only in recent releases: from which one ("its January 2026 releases", "v0.37"); None:
    #: for long (or not at all)
    comfy_diffusers_lora_since: ClassVar[str | None] = None
    #: regular expression (`re.search` on a block Linear's name relative to its block, with a "." appended) of the
    #: modulation Linears: they set per-sample scale / shift / gate and stay in the model dtype in an fp8 / int8
    #: base unless `model.quantize_modulation` (trainer/quant.py). "" : none
    modulation_linears: ClassVar[str] = ""
    #: `train.attention` values this family computes with its own attention processors (`use_attention`) beyond
    #: SDPA's backends (auto, flash, efficient, math): Chroma's `flash` and `flex`. The trainer refuses the others
    #: (trainer/train/trainer.py `check_attention`)
    own_attention: ClassVar[tuple[str, ...]] = ()
    #: names, relative to a block (`block.get_submodule`), of the block's token-wise sub-layers, called with the
    #: tokens first, (B, S, D), where each token's output depends on that token alone (feed-forwards; a
    #: cross-attention whose queries are the tokens): `offload.nano_batches: N` runs them in N token chunks, each
    #: recomputed in backward (trainer/offload/nano.py), and the planner counts one chunk's hidden activations
    #: instead of the whole sequence's. None: every diffusers `FeedForward` inside the block
    token_wise: ClassVar[tuple[str, ...] | None] = None
    #: the blocks' training forward and backward wait on the GPU inside the block (a host sync: HiDream's
    #: boolean-mask routing of its experts), so the host cannot launch ahead of the kernels: the planner adds the
    #: block's launch time to its kernel time instead of overlapping them (trainer/planner/replay.py)
    blocks_sync_host: ClassVar[bool] = False

    # ------------------------------------------------------------------------------------------ text encoders

    #: sub-folders of the diffusers model folder holding the text encoders, in pipeline order
    text_encoder_dirs: ClassVar[tuple[str, ...]]
    #: transformers classes of the text encoders, in `text_encoder_dirs` order
    text_encoder_classes: ClassVar[tuple[str, ...]] = ()
    #: sub-folders holding the tokenizers, in pipeline order
    tokenizer_dirs: ClassVar[tuple[str, ...]] = ()
    #: further sub-folders whose files change the text embeddings (a processor): part of the text cache's identity
    extra_text_dirs: ClassVar[tuple[str, ...]] = ()
    #: the longest (padded) token sequence of the main text encoder, as the pipeline's default; part of the text
    #: cache's identity. None: the family has no such setting
    max_sequence_length: ClassVar[int | None] = None
    #: regular expression (as `modulation_linears`, on names inside a text encoder) of the text encoders' Linears
    #: that stay in the model dtype when `model.quantize_text_encoders` is set (trainer/quant.py)
    text_encoder_keep_linears: ClassVar[str] = ""
    #: text tokens per caption the transformer sees in training (the adapter's padding), for planning
    text_tokens: ClassVar[int]
    #: (name, parameter count) of each full-size text encoder, in pipeline order
    text_encoder_params: ClassVar[tuple[tuple[str, int], ...]]
    #: per text encoder (pipeline order; empty: none / the planner's default share): parameters `slim_text_encoder`
    #: drops, and parameters outside its streamed blocks that sit on the GPU while it encodes (trainer/planner)
    text_encoder_unused_params: ClassVar[tuple[int, ...]] = ()
    text_encoder_nonblock_params: ClassVar[tuple[int, ...]] = ()
    #: per text encoder: parameters never read from the files, because `text_encoder_config` builds the encoder
    #: without them (Flux.2: the decoder layers after the deepest hidden state read); part of the unused ones.
    #: The planner's text-caching RAM leaves them out (the rest of the unused ones are loaded, then dropped)
    text_encoder_unloaded_params: ClassVar[tuple[int, ...]] = ()
    #: per text encoder: the streamed blocks (its layers) it keeps as loaded and slimmed; empty: 24. The planner's
    #: text-caching ring holds whole blocks, so without a folder to build the encoder from it rounds the kept
    #: share to this many equal blocks, as the conductor rounds the real ones (trainer/planner/meta.py)
    text_encoder_layers: ClassVar[tuple[int, ...]] = ()

    # ------------------------------------------------------------------------------------------ VAE and latents

    #: diffusers class name of the VAE
    vae_cls_name: ClassVar[str] = "AutoencoderKL"
    #: the full-size VAE's parameter count (the planner's caching and sampling phases)
    vae_params: ClassVar[int]
    #: the full-size model's latent geometry: pixels per latent side (the VAE's downscale) and latent pixels per
    #: transformer token side (2x2 packing or patchify); `full_image_tokens` multiplies them out
    latent_scale: ClassVar[int] = 8
    token_patch: ClassVar[int] = 2

    # ------------------------------------------------------------------------------------------ video

    # A video family (`video`) trains clips: its latents are (C, F, h, w) with F latent frames (`latent_frames`),
    # its sources may hold videos beside images (an image is a 1-frame clip: trainer/data/video.py), and its
    # pipeline returns frames (`pipeline_result`). Every default below is the image families' behaviour, so they
    # declare none of it.

    #: the family trains clips of frames: data sources read videos too, latents are (C, F, h, w), samples are
    #: videos (mp4 plus a contact sheet of frames)
    video: ClassVar[bool] = False
    #: pixel frames per latent frame after the first (the VAE's temporal downscale: 4 for Wan); a clip has
    #: frame_step * k + 1 frames, so the first frame is a latent frame of its own, as the causal video VAEs encode
    frame_step: ClassVar[int] = 1
    #: frames per clip the planner assumes where a config names none (no `data` section: `data.clip_frames` decides
    #: otherwise); `dummy_inputs` of a video family takes `frames=` (default this) (1: images)
    plan_frames: ClassVar[int] = 1
    #: `data.bucket_step` where a config sets none: 64 px for images (coarse steps fill batches); a video family's
    #: clips train at batch 1 and its published sizes must be buckets (Wan's 832x480 at resolution 632 needs 16)
    bucket_step: ClassVar[int] = 64
    #: the full-size VAE's diffusers config (`vae_cls_name`'s constructor arguments; {}: its defaults), which the
    #: planner builds on the meta device and runs on one clip to find the VAE's peak while it encodes or decodes a
    #: clip (trainer/planner/vae.py); None: the per-pixel estimates of one image (trainer/planner/phases.py)
    full_vae_config: ClassVar[dict[str, Any] | None] = None
    #: output-sized tensors a tiled decode of the family's video VAE holds at its end beside its decoded tiles (the
    #: planner's tiled count, trainer/planner/vae.py `_tiled_peak`): AutoencoderKLWan's three (the blended rows, their
    #: concatenation, `decode`'s clamped copy)
    vae_tiled_decode_copies: ClassVar[int] = 3
    #: parameters of an image encoder that sits beside the VAE while latents are cached (Wan 2.1 I2V's CLIP ViT-H:
    #: `encode_conditions` moves it to the VAE's device), counted in the planner's latent-caching phase
    cache_encoder_params: ClassVar[int] = 0
    #: that image encoder also visits the GPU for each sample's image (HunyuanVideo 1.5 I2V's SigLIP: its
    #: `encode_image`); the planner's sampling phase counts its weights, whose freed blocks stay reserved in the
    #: CUDA cache through the denoising (Wan 2.1 I2V's pipeline runs CLIP where it waits, on the CPU)
    sample_encoder_on_device: ClassVar[bool] = False
    #: the frame rate clips are read at where a config sets no `data.fps` (trainer/config.py), and samples are
    #: written at without a data section (trainer/sampling/output.py `video_fps`): 16, Wan's; LTX-2's positions
    #: are in seconds at its pipeline's 24
    default_fps: ClassVar[float] = 16.0
    #: the family's transformer is told `default_fps` whatever `data.fps` says (LTX-2's positions, in seconds): a
    #: config reading clips at another rate (or as stored, null) is refused (trainer/config.py)
    fixed_fps: ClassVar[bool] = False

    @classmethod
    def vae_latent_geometry(cls, config: Any) -> tuple[int, int, int]:
        """(latent channels, pixels per latent side, pixel frames per latent frame) from the family's VAE config
        (the planner's meta clip, trainer/planner/vae.py): AutoencoderKLWan's names by default."""
        return int(config.z_dim), int(config.scale_factor_spatial), int(config.scale_factor_temporal)

    @classmethod
    def vae_tiles(cls, vae: Any) -> tuple[int, int, int, int]:
        """The VAE's spatial tiles in pixels, (tile height, tile width, stride height, stride width), as its tiled
        encode and decode step over a frame (the planner's tiled model, trainer/planner/vae.py):
        AutoencoderKLWan's `tile_sample_min_*` and `tile_sample_stride_*` by default."""
        return (int(vae.tile_sample_min_height), int(vae.tile_sample_min_width),
                int(vae.tile_sample_stride_height), int(vae.tile_sample_stride_width))

    @classmethod
    def vae_time_chunks(cls, vae: Any) -> contextlib.AbstractContextManager:
        """A context in which the VAE encodes and decodes as the family runs it (the planner's meta clip runs in it,
        trainer/planner/vae.py): HunyuanVideo 1.5's in causal time chunks; diffusers' own by default."""
        return contextlib.nullcontext()

    @classmethod
    def comfy_diffusers_lora_note(cls) -> str:
        """What ComfyUI does with this family's diffusers-layout LoRA files, in a clause for the fit's log and its
        refusals (from `comfy_reads_diffusers_lora` / `comfy_diffusers_lora_since`)."""
        if not cls.comfy_reads_diffusers_lora:
            return (f"ComfyUI does not map diffusers-keyed {cls.family} LoRAs (transformer.*): for ComfyUI, "
                    "`dittrain convert-lora IN OUT --to comfy` or output.lora_format: comfy")
        if cls.comfy_diffusers_lora_since:
            return (f"ComfyUI maps diffusers-keyed {cls.family} LoRAs (transformer.*) since "
                    f"{cls.comfy_diffusers_lora_since}; for an older ComfyUI, `dittrain convert-lora IN OUT --to "
                    "comfy` or output.lora_format: comfy")
        return f"ComfyUI maps diffusers-keyed {cls.family} LoRAs (transformer.*)"

    @classmethod
    def latent_frames(cls, frames: int) -> int:
        """Latent frames of a clip of `frames` pixel frames (1 for an image)."""
        return (int(frames) - 1) // cls.frame_step + 1

    @classmethod
    def valid_frames(cls, frames: int) -> bool:
        """Whether a clip of this many frames is one the VAE encodes whole (frame_step * k + 1)."""
        return frames >= 1 and (frames - 1) % cls.frame_step == 0

    def encode_videos(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """Video families: pixels in [-1, 1] (B, 3, F, H, W) (F = 1 for an image) -> transformer-ready latents
        (B, C, latent_frames(F), H/8, W/8)."""
        raise NotImplementedError(f"{self.family} trains images only (video = False)")

    @classmethod
    def pipeline_frames(cls, pipe: Any, frames: int) -> dict[str, Any]:  # noqa: ARG003 - the protocol
        """Pipeline call kwargs asking for `frames` frames (video families: `num_frames`; images: none)."""
        return {"num_frames": int(frames)} if cls.video else {}

    @classmethod
    def pipeline_result(cls, out: Any, pipe: Any = None) -> Any:  # noqa: ARG003 - the protocol
        """The one sample of a pipeline call's output: a PIL image (image families: `out.images[0]`), or a list of
        PIL frames (video families: `out.frames[0]`; a family with sound: a `Clip` of them with its sound)."""
        return out.frames[0] if cls.video else out.images[0]

    #: image-to-video: the clip's first frame conditions every step as the pipeline's `image` does (Wan I2V: its
    #: latents, and a CLIP embedding, beside the noisy ones). `encode_conditions` caches it with the clip's latent,
    #: the batch carries it in the text dict to `predict`, and sampling needs `--image` (`sample.image` in a fit)
    first_frame_conditions: ClassVar[bool] = False
    #: those conditions hold a second clip-sized tensor on the GPU while latents are cached (Wan's [first frame,
    #: zeros] clip through the VAE), which the planner's latent-caching phase counts; False: the first frame alone
    conditions_copy_clip: ClassVar[bool] = True

    def encode_conditions(self, vae: nn.Module, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-clip conditioning computed from the clip's pixels (B, 3, F, H, W) when its latent is cached, stored
        beside it and stacked into the batch's text dict under these keys (default: none)."""
        return {}

    #: the first latent frame is the given image, not the model's to predict (Wan 2.2 TI2V-5B's and LTX-2's
    #: image-to-video: the pipeline replaces or drops its prediction): `frame_loss_weights` leaves it out
    first_frame_given: ClassVar[bool] = False

    @classmethod
    def frame_loss_weights(cls, latent_frames: int) -> torch.Tensor | None:
        """Per latent frame loss weights (F,) where some frames are not the model's to predict; the batch's loss mask
        carries them (trainer/data/pipeline.py). None: every frame counts. With `first_frame_given` the first
        latent frame weighs 0."""
        if not cls.first_frame_given:
            return None
        w = torch.ones(latent_frames)
        w[0] = 0.0
        return w

    # ------------------------------------------------------------------------------------------ sound

    # A family whose transformer denoises sound beside the picture (LTX-2: one model, an audio stream in every block)
    # trains it on clips with an audio track (`trains_sound`): the cache reads the clip's stretch of the track
    # (trainer/data/video.py `read_audio`, at `sound_rate`) and stores `encode_sound`'s output beside the clip's
    # latent; clips with sound batch apart from those without (`Entry.audio`); the batch carries the clean sound
    # latents in its text dict under `noised_streams`, which the objective noises with the picture's t and scores
    # with a second loss (trainer/train/objective.py), and `predict` returns (picture, {key: prediction}).

    #: the transformer makes sound too (LTX-2); `trains_sound` says whether this run trains it (model.audio)
    sound: ClassVar[bool] = False
    #: keys of the batch's text dict holding clean latents of another modality, noised with the latents' t and
    #: scored by their own loss (LTX-2: "audio_latents"); `predict` returns (prediction, {key: prediction}) when
    #: the text dict holds any of them
    noised_streams: ClassVar[tuple[str, ...]] = ()

    @property
    def trains_sound(self) -> bool:
        """Clips with an audio track train the sound too: a family with `sound`, unless model.audio is false."""
        return self.sound and bool(getattr(self.cfg, "audio", True))

    def sound_rate(self, encoder: nn.Module) -> int:
        """The sample rate the sound encoder takes (the cache reads audio tracks at it)."""
        raise NotImplementedError(f"{self.family} makes no sound")

    def encode_sound(self, encoder: nn.Module, wave: torch.Tensor, frames: int, fps: float) -> dict[str, torch.Tensor]:
        """(B, 2, samples) stereo at `sound_rate` under clips of `frames` frames at `fps` -> per-clip tensors cached
        beside the clip's latent (batched, keys of `noised_streams`)."""
        raise NotImplementedError(f"{self.family} makes no sound")

    def cache_dirs(self, part: str) -> tuple[str, ...]:
        """The folders whose files name the cache's entries of `part` ("vae": latents, "text": captions): the VAE's,
        or the text encoders', their tokenizers' and `extra_text_dirs`."""
        if part == "vae":
            return ("vae",)
        te = tuple(self.text_encoder_dirs or ("text_encoder",))
        return te + tuple(d.replace("text_encoder", "tokenizer") for d in te) + tuple(self.extra_text_dirs)

    def cache_variant(self, part: str) -> str:  # noqa: ARG002 - the protocol
        """What else names the entries of `part` (LTX-2 with sound: its entries hold the sound too); "": nothing."""
        return ""

    # ------------------------------------------------------------------------------------------ experts

    # A family of expert transformers (Wan 2.2 A14B: `transformer/` denoises the high-noise steps, `transformer_2/`
    # the low-noise ones, split at the pipeline's `boundary_ratio`) trains one expert per run, or every one
    # (`model.expert: both`, trainer/train/experts.py): `model.expert` picks its folder (`transformer_dir`), the flow
    # times it trains (`train_timesteps`) and its LoRA file's name; `for_expert` binds an adapter to one expert of a
    # `both` run, `expert_for` says which expert owns a timestep. Sampling loads every expert (part "experts") and
    # routes each LoRA file to its expert (`lora_load_kwargs`).

    #: {model.expert: the expert's folder, which is also its pipeline component}; empty: one transformer
    experts: ClassVar[dict[str, str]] = {}

    @property
    def expert(self) -> str | None:
        """The expert `model.expert` picks (None: the family's one transformer, or no expert chosen)."""
        return getattr(self.cfg, "expert", None)

    @property
    def transformer_dir(self) -> str:
        """The folder (and pipeline component) of the transformer this adapter trains and loads as `transformer`
        (`both`: the first expert's; trainer/train/experts.py loads each through `for_expert`)."""
        return self.experts[self.expert] if self.expert and self.expert != BOTH_EXPERTS else "transformer"

    @property
    def trained_experts(self) -> tuple[str, ...]:
        """The experts a fit trains: model.expert's one, every expert for `both`, none for one transformer."""
        if self.expert == BOTH_EXPERTS:
            return tuple(self.experts)
        return (self.expert,) if self.expert else ()

    def for_expert(self, name: str) -> ModelAdapter:
        """This adapter bound to expert `name` (its folder, timesteps and LoRA name), as a run of that expert
        alone would hold it."""
        return type(self)(self.cfg.model_copy(update={"expert": name}), self.references)

    def expert_for(self, timestep: torch.Tensor) -> str:
        """The expert that denoises the pipeline timestep(s) `timestep` (0..1000: `predict`'s t * 1000), as the
        family's pipeline picks it; every entry must fall to the same one (ValueError otherwise)."""
        raise NotImplementedError(f"{self.family} has one transformer")

    def train_timesteps(self) -> tuple[float, float]:
        """The flow times t in [0, 1] a fit trains, as (low, high): the whole range, or the chosen expert's. A
        family of experts refuses a fit without `model.expert` here (the trainer asks before anything loads)."""
        return (0.0, 1.0)

    @classmethod
    def lora_load_kwargs(cls, path: Any) -> dict[str, Any]:  # noqa: ARG003 - the protocol
        """`load_lora_weights` kwargs that send the LoRA file `path` to its expert (default: none)."""
        return {}

    @classmethod
    def pipeline_transformers(cls, pipe: Any) -> list[nn.Module]:
        """The transformers a pipeline denoises with (placed, frozen and LoRA-loaded for sampling): its
        `transformer`, and a family of experts' others."""
        return [pipe.transformer]

    # ------------------------------------------------------------------------------------------ edit families

    #: edit / reference-image families: training items are (reference, target, instruction) pairs (always, or
    #: on data with references where `reference_optional`), the reference's latents reach `predict` as
    #: `text["control_latents"]` (B, C, h, w), and sampling takes `--image` (`pipeline_image`)
    takes_reference: ClassVar[bool] = False
    #: the text encoder sees the reference image too: text-cache entries are per (caption, reference), captions
    #: are encoded one at a time in the presets, validation sets are not supported, and sampling needs `--image`
    text_uses_reference: ClassVar[bool] = False
    #: sampling needs `--image` / `sample.image` though the text encoder does not see it (HiDream-E1: its pipeline
    #: has no text-only path): `dittrain sample` refuses before loading, the presets name one; `text_uses_reference`
    #: implies it (sampling during training refuses at setup through `pipeline_image`)
    sample_needs_reference: ClassVar[bool] = False
    #: with `takes_reference`: the family also trains plain text-to-image data (Flux.2: the reference tokens are an
    #: optional addition to the sequence). A run trains pairs when its data has references (a `control/` folder or
    #: a "control" metadata key: `DataConfig.has_references`), else plain images; the planner counts the reference
    #: tokens only then (`reference_inputs`). False: every item of an edit family is a pair
    reference_optional: ClassVar[bool] = False
    #: reference images per target `predict` joins (`control_latents` (B, K, C, h, w) when more than one): data with
    #: more per image (control2/, ... or a "control" list: trainer/data/sources.py) is refused
    max_references: ClassVar[int] = 1

    # ------------------------------------------------------------------------------------------ sampling

    #: diffusers pipeline class, e.g. FluxPipeline
    pipeline_cls: ClassVar[type]
    #: the scheduler settings when the folder has no scheduler config (FlowMatchEulerDiscreteScheduler kwargs)
    default_scheduler: ClassVar[dict[str, Any]] = {}
    #: sampling: does the pipeline run a second, negative-prompt pass when guidance > 1 (so the negative prompt
    #: must be encoded too, and the planner counts a batch of two)? `runs_cfg` says at which guidance values.
    sampling_uses_negative: ClassVar[bool]
    #: the batch the pipeline denoises per image under guidance (the planner's sampling phase): 2, the prompt's
    #: and the negative's passes; HiDream-E1's 3 (without the source image, with it, with it and the prompt)
    guided_batch: ClassVar[int] = 2
    #: sample settings the presets write (`sample.steps`, `sample.guidance`) where the family's pipeline wants
    #: others than the presets' 28 steps and the config's default guidance (a distilled model's few steps)
    sample_defaults: ClassVar[dict[str, Any]] = {}
    #: the pipeline keeps a KV cache through its denoising loop: every block's keys and values of the prompt (the
    #: step-independent prefix) from the first step, for the later ones (Qwen-Image 2.1's `use_kv_cache`, on by
    #: default); the planner's sampling phase counts it (trainer/planner/sampling.py). Compiled blocks hand the
    #: cache views of their whole first-step keys and values (inductor leaves out the copy of a slice of a
    #: block-internal tensor): `sampling_hooks` copies them down to the prompt's rows
    sampling_kv_cache: ClassVar[bool] = False
    #: pipeline components beyond the trained transformer that every sample runs (Ideogram 4's text-free
    #: `unconditional_transformer`), placed beside the trained one while sampling (`pipeline_transformers`), each
    #: read block by block from its folder into the conductor's arena (`load_component`): by `dittrain sample` as it
    #: reads the trained one, and by sampling during training for each call, freed after. The planner's sampling prediction places them at the trained one's fraction (trainer/planner/
    #: sampling.py), and the fit's sampling phase counts their pinned blocks in RAM (trainer/planner/phases.py)
    sampling_components: ClassVar[tuple[str, ...]] = ()
    #: the pipeline's prompt inputs on the device during one sample, (bytes held through the call, bytes its own
    #: preparation of them adds once before the loop), at the family's full size: Ideogram 4's fp32 text features over
    #: its 2048-token window and their projection (`sampling_prompt_bytes`); (0, 0): small beside the forward
    sampling_prompt: ClassVar[tuple[int, int]] = (0, 0)

    @classmethod
    def sampling_prompt_bytes(cls, batch: int, itemsize: int) -> int:
        """What a sample's pipeline call holds on the device for its prompts from start to end, for a denoising batch
        of `batch`, in the model dtype's `itemsize` (trainer/planner/sampling.py); 0: small beside the forward
        (LTX-2: its text connectors' packed outputs and its sound decoders)."""
        return 0

    @classmethod
    def text_encode_peaks(cls, batch: int, itemsize: int, stage: str = "cache") -> list[tuple[int, int]] | None:
        """(weights, activations) beside the placed text encoders at each peak of encoding `batch` prompts (`stage`
        "cache": captions' caching; "sample": a sample's prompt and negative), for the planner's text phases
        (trainer/planner/phases.py); None: the planner's generic estimate (LTX-2 counts its Gemma states and
        connectors)."""
        return None
    #: activation bytes per image pixel at the peak of the VAE's encode of one image (the planner's latent caching,
    #: trainer/planner/phases.py); None: the planner's figure for Flux's AutoencoderKL (`VAE_ACT_ENCODE`)
    vae_encode_bytes_per_pixel: ClassVar[int | None] = None

    def load_component(self, cfg, name: str, dtype: torch.dtype, device: torch.device | str) -> tuple[nn.Module, Any]:
        """One of `sampling_components` as trainer/models/stream_load.py loads a transformer: non-block weights on
        `device`, blocks as placeholders the conductor fills from the files (`place_transformer(fill=loader.fill)`),
        frozen. Returns (module, loader)."""
        raise NotImplementedError(f"{self.family} declares no sampling components")

    # ------------------------------------------------------------------------------------------ presets

    #: card sizes (GB) `python -m trainer.planner.presets` writes configs/<family>/<method>-<N>gb.yaml for
    preset_cards: ClassVar[tuple[int, ...]] = (8, 12, 16, 24, 48, 80)
    #: a video family's preset ladder, (video height as "<N>p", frames), most preferred first; None: Wan's
    #: (trainer/planner/presets.py `VIDEO_CLIPS`: 720p and 480p x 81, then 480p x 49 and x 33)
    preset_clips: ClassVar[tuple[tuple[str, int], ...] | None] = None
    #: the presets' `sample:` settings where the family's pipeline samples otherwise than the generic 28 steps at
    #: `sample.guidance`'s default (e.g. Qwen-Image 2.1: 40 steps without guidance)
    sample_defaults: ClassVar[dict[str, Any]] = {}
    #: {(method, card GB): MeasuredPreset}: what a GPU run of that preset measured, for its header while the preset
    #: keeps the measured settings (declared on the class itself: a subclass family does not inherit another model's
    #: measurements)
    measured_presets: ClassVar[dict[tuple[str, int], MeasuredPreset]] = {}
    #: other full sizes of the transformer, key -> config as `full_config` (bench/program/bench_program.py writes
    #: their folders: `--families wan-1.3b`)
    full_variants: ClassVar[dict[str, dict[str, Any]]] = {}
    #: the sizes of `full_variants` with presets of their own, `configs/<family>-<key>/` (`PresetVariant`, `sized`;
    #: declared on the class itself, read through `sizes`: a subclass family does not inherit another model's sizes)
    preset_variants: ClassVar[dict[str, PresetVariant]] = {}

    @classmethod
    def sizes(cls) -> dict[str, PresetVariant]:
        """This family's own `preset_variants` (never a parent family's)."""
        return cls.__dict__.get("preset_variants", {})

    @classmethod
    def sized(cls, key: str) -> type[ModelAdapter]:
        """This family at its size `key` (`preset_variants`), as the presets generator and the planner see it: a
        subclass whose full-size config, name, placeholder folder, preset cards and measurements are that size's."""
        return _sized(cls, key)

    @classmethod
    def size_named(cls, folder: str) -> str | None:
        """The key of the `preset_variants` size whose published name the folder name `folder` contains (any case):
        the size a plan without the folder counts (`Wan2.1-T2V-1.3B-Diffusers`: 1.3b); None: the full size."""
        return next((k for k, v in cls.sizes().items() if v.full_name.lower() in folder.lower()), None)

    @classmethod
    def cache_family(cls) -> str:
        """The family's name in cache keys: its own `cache_name`, else `family`."""
        return cls.__dict__.get("cache_name") or cls.family

    @classmethod
    def measured(cls, method: str, card: int, transformer: float, checkpointing: bool | str) -> str:
        """The measured note of the preset `method` x `card` GB of this family with these settings ("not yet
        measured": none, or one measured at other settings)."""
        m = cls.__dict__.get("measured_presets", {}).get((method, card))
        return m.note if m is not None and m.describes(transformer, checkpointing) else "not yet measured"

    @classmethod
    def full_image_tokens(cls, height: int, width: int) -> int:
        """Image tokens the full-size transformer sees for one target image of this size (an edit family's
        reference tokens not included)."""
        d = cls.latent_scale * cls.token_patch
        return (height // d) * (width // d)

    @classmethod
    def full_tokens(cls, height: int, width: int, frames: int = 1) -> int:
        """Tokens of one training item of the full-size model: `full_image_tokens` per latent frame (a clip of
        `frames` frames has `latent_frames(frames)`; an image has one)."""
        return cls.latent_frames(frames) * cls.full_image_tokens(height, width)

    @classmethod
    def tiny_builders(cls) -> dict[str, Callable[[], Any]]:
        """{folder name: function returning a tiny random-weight diffusers pipeline of this family} that
        `dittrain make-tiny` saves (tests and the demo use them). Each family overrides it on its own class
        (`own_tiny_builders` ignores an inherited one; tests/test_layout.py requires one). Shared tokenizers, text
        encoders, VAEs and the corpus are in trainer/models/tiny.py."""
        return {}

    @classmethod
    def own_tiny_builders(cls) -> dict[str, Callable[[], Any]]:
        """`tiny_builders` if this class declares it itself, else {}."""
        return cls.tiny_builders() if "tiny_builders" in cls.__dict__ else {}

    @property
    @abstractmethod
    def resolution_divisor(self) -> int:
        """Pixel sides must be multiples of this (VAE downscale x patch/packing size)."""

    @abstractmethod
    def load(
        self,
        cfg: ModelConfig,
        *,
        parts: set[str],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> Components:
        """Load the named parts ({"transformer", "vae", "text", "scheduler"}) from local files only.

        A missing folder or file raises `UserError` naming the path and what was expected there, before any
        weights are allocated."""

    @abstractmethod
    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        """The transformer's blocks in execution order: the units offloading and checkpointing wrap. A family with
        blocks that run only on reference images lists them when `self.references` (a block left out sits with the
        non-block modules, resident, and still runs if called)."""

    @classmethod
    def token_wise_of(cls, block: nn.Module) -> list[nn.Module]:
        """The token-wise feed-forward modules of one block (`token_wise`)."""
        if cls.token_wise is None:
            return [m for m in block.modules() if type(m).__name__ == "FeedForward" and m is not block]
        return [block.get_submodule(n) for n in cls.token_wise]

    def lora_targets(self) -> tuple[str, ...]:
        """The peft targets when lora.targets is null: `default_lora_targets`, plus what a family trains only with
        reference images when `self.references` (Flux.3's reference-mode blocks)."""
        return tuple(self.default_lora_targets)

    def use_attention(self, transformer: nn.Module, choice: str, device: torch.device) -> str | None:
        """The family's own form of its attention for `train.attention` (`choice`) on `device` (where training
        runs; the transformer may still be in RAM), set on the loaded transformer before training; returns a line
        naming the form where one was set (default: nothing; Chroma's `flash` computes its masked attention in a
        form flash attention accepts, its `flex` (and `auto` on CUDA of compute capability 8.0 and up) through flex
        attention)."""
        return None

    def sampling_hooks(self, transformer: nn.Module) -> contextlib.AbstractContextManager:
        """What the family's transformer needs while its pipeline samples with it, entered around the pipeline calls
        (trainer/sampling/engine.py `generate`; default: nothing). Qwen-Image 2.1 keeps its KV cache compact."""
        return contextlib.nullcontext()

    def slim_text_encoder(self, encoder: nn.Module) -> nn.Module:
        """Drop what this family never runs of a loaded text encoder (default: nothing), before it is placed on
        the GPU: the parts it does not use then cost neither VRAM nor RAM while captions are encoded."""
        return encoder

    @abstractmethod
    def encode_prompts(self, components: Components, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Text-encoder outputs for a batch of prompts (no grad), keyed as `predict` expects."""

    @abstractmethod
    def collate_text(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Stack per-caption entries (each without batch axis) into one batch dict."""

    @abstractmethod
    def encode_images(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] (B, 3, H, W) -> transformer-ready latents (B, C, H/8, W/8)."""

    @abstractmethod
    def predict(
        self,
        transformer: nn.Module,
        noisy_latents: torch.Tensor,
        t: torch.Tensor,
        text: dict[str, torch.Tensor],
        guidance: float = 1.0,
    ) -> torch.Tensor:
        """Run the transformer on (B, C, h, w) latents at flow time t (B,); returns the velocity prediction
        (noise - x0 direction) in the same (B, C, h, w) layout. Packing and positions are done here."""

    @abstractmethod
    def timestep_shift(self, height: int, width: int) -> float:
        """The family's resolution-dependent shift s for an image of this many pixels (t' = s t / (1 + (s-1) t))."""

    @abstractmethod
    def pipeline(self, components: Components) -> Any:
        """The family's diffusers pipeline built from loaded components (used by `sample`)."""

    @classmethod
    @abstractmethod
    def dummy_inputs(
        cls,
        transformer: nn.Module,
        batch: int,
        height: int,
        width: int,
        text_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str = "meta",
    ) -> dict[str, Any]:
        """Transformer call arguments for one bucket (pixels height x width) with random values, shaped as
        `predict` builds them (the planner traces activations with them on the meta device). The image tokens do
        not require grad (latents); the hidden states start requiring grad at the first trained layer. A video
        family's also take `frames=` (pixel frames of the clip; the planner passes `data.clip_frames`)."""

    @classmethod
    def reference_inputs(cls, inputs: dict[str, Any], references: int) -> dict[str, Any]:
        """`dummy_inputs` with `references` reference images of the same bucket joined as `predict` joins them
        (families with `reference_optional`: the planner calls it when the data has pairs; a family whose every item
        is a pair joins its reference in `dummy_inputs` itself)."""
        if references:
            raise NotImplementedError(f"{cls.family}: reference_inputs (reference_optional families declare it)")
        return inputs

    @classmethod
    @abstractmethod
    def pipeline_embeds(
        cls, pipe: Any, prompt: str, negative: str | None, device: torch.device
    ) -> dict[str, torch.Tensor]:
        """Pipeline call kwargs holding one prompt's embeddings (and the negative prompt's when `negative` is not
        None), from the pipeline's own `encode_prompt` called as `pipe(prompt=...)` would call it. Values are
        tensors or lists of tensors (Z-Image's pipeline takes one tensor per prompt)."""

    @classmethod
    def runs_cfg(cls, guidance: float) -> bool:
        """Whether the family's pipeline runs classifier-free guidance (a negative pass, a batch of two) at this
        guidance value; most pipelines do above 1 (Z-Image's above 0)."""
        return cls.sampling_uses_negative and guidance > 1

    @classmethod
    def pipeline_image(cls, pipe: Any, image: Any) -> dict[str, Any]:
        """Pipeline call kwargs carrying the reference image (a PIL image of the sample's size; None: none)."""
        return {}

    def image_sample_size(self, width: int, height: int) -> tuple[int, int] | None:
        """Where the family's pipeline picks the sample's size from the image (HunyuanVideo 1.5 I2V), the (width,
        height) it picks for an image of width x height with this folder's transformer: `dittrain sample --image`
        without --width / --height samples at it. None elsewhere (the image is cut to the sample's size)."""
        return None

    @classmethod
    def sample_frame(cls, width: int, height: int) -> tuple[int, int]:
        """The (width, height) a sample asked at width x height comes out at, for the presets' `sample` size: the
        same, unless the family's pipeline picks its own size (HunyuanVideo 1.5 I2V picks it from the image's
        aspect ratio, and a preset asking another would stop at its first sampling pass)."""
        return width, height

    @classmethod
    def pipeline_size(cls, pipe: Any, width: int, height: int) -> dict[str, Any]:  # noqa: ARG003 - the protocol
        """Pipeline call kwargs beyond `width` / `height` that make the image exactly that size (a pipeline that
        rescales to an area of its own, as Kontext's does, is told the area asked for)."""
        return {}

    @classmethod
    def pipeline_guidance(cls, pipe: Any, guidance: float) -> dict[str, Any]:
        """Pipeline call kwargs carrying the guidance value."""
        return {"guidance_scale": guidance}


@functools.cache
def _sized(cls: type[ModelAdapter], key: str) -> type[ModelAdapter]:
    """`ModelAdapter.sized`, one class per family and size (so that planner caches keyed on it see one)."""
    v = cls.sizes()[key]
    return type(cls)(f"{cls.__name__}_{key.replace('.', '_')}", (cls,), {
        "__module__": cls.__module__, "__doc__": f"{cls.family} at {v.full_name}'s size ({key})",
        "full_config": cls.full_variants[key], "full_name": v.full_name, "example_path": v.example_path,
        "preset_cards": v.cards, "preset_clips": v.clips or cls.preset_clips, "measured_presets": v.measured,
        "preset_variants": {}})
