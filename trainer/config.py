"""YAML -> one validated, typed `Config`.

Every field is documented where it is declared (the descriptions are what `dittrain fit --help` and the
presets point to). Unknown keys are errors: a misspelt `learning_rate` must never train with the default.
`load_config` reports the first problems as one line each, with the file, the line and the closest valid key,
and raises `ConfigError` (exit code 2) before anything heavy is imported or allocated.

Relative paths in a config are taken relative to the current directory (where `dittrain` runs), like every
other command-line tool.
"""

from __future__ import annotations

import difflib
import gc
import hashlib
import json
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .errors import ConfigError, UserError
from .lora_format.kinds import LORA_KIND_NAMES, LORA_KINDS
from .models import ADAPTERS, canonical_family
from .optim.specs import OPTIMIZER_NAMES, OPTIMIZERS, names_where

#: the folder of a source that holds its images' reference images (edit families' pairs: trainer/data/sources.py)
CONTROL_DIR = "control"


def _or(names: list[str]) -> str:
    """a, b or c"""
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    family: str = Field(description=f"Model family, one of {', '.join(ADAPTERS)} (`dittrain presets` shows each "
                                    "one's model; the edit families are trained on image pairs, one reference each). "
                                    "Words may be joined by _ as well (qwen_image).")
    path: Path = Field(
        description="Local diffusers-format folder (model_index.json, transformer/, vae/, text_encoder*/, "
        "tokenizer*/). Nothing is downloaded."
    )
    transformer_file: Path | None = Field(
        default=None,
        description="Optional single .safetensors file with the transformer weights (bf16, or fp8 float8_e4m3fn "
        "with or without per-tensor scale_weight keys); its config is read from <path>/transformer/config.json. "
        "Keys in diffusers layout (optionally under one prefix such as model.diffusion_model.) stream block by block "
        "from the file; the original checkpoint layout (BFL / Stability names) is converted by diffusers and loads "
        "whole into RAM first.",
    )
    dtype: Literal["bf16", "fp16", "fp32"] = Field(
        default="bf16", description="Dtype of the frozen weights (LoRA weights and optimizer state stay fp32)."
    )
    quantize: Literal["none", "fp8", "int8"] = Field(
        default="none",
        description="Hold the frozen Linear weights inside the transformer's blocks as 8 bits (float8_e4m3fn or "
        "int8, per-output-channel scales) in RAM, over PCIe and on the GPU; dequantized per layer to model.dtype "
        "to compute. LoRA only. An fp8 model.transformer_file is kept as its own 8-bit values with fp8.",
    )
    quantize_modulation: bool = Field(
        default=False,
        description="With model.quantize fp8 / int8, also hold the blocks' modulation Linears (per-sample scale and "
        "shift: Flux / SD3 norm*.linear, Qwen-Image img_mod / txt_mod) as 8 bits. Saves about half their bytes in "
        "pinned RAM, over PCIe and on the GPU (Flux ~3.2 GB of 6.4, Qwen-Image ~6.8 GB of 13.6) at the cost of "
        "their quantization error, which acts on every token (bench/RESULTS.md measures it). Norm weights, "
        "biases, embedders and the final layer stay in model.dtype. Ignored while model.quantize is none "
        "(an error when set explicitly).",
    )
    fp8_matmul: bool = Field(
        default=False,
        description="With model.quantize: fp8, multiply in fp8 (W8A8: the fp8 weight as stored, activations "
        "quantized per row on the fly, torch._scaled_mm) instead of dequantizing each weight to model.dtype; twice "
        "the bf16 tensor-core rate on sm89+ GPUs, at the cost of rounding the activations to e4m3. Needs bf16 "
        "weights (model.dtype); falls back to dequantizing where torch has no fp8 matmul (GPUs before sm89).",
    )
    quantize_text_encoders: Literal["none", "fp8", "int8"] = Field(
        default="none", description="The same for every Linear of the text encoders (they are frozen in any mode)."
    )
    expert: str | None = Field(
        default=None,
        description="A family of expert transformers (Wan 2.2 A14B: high_noise, transformer/, denoises the steps at "
        "or above the pipeline's boundary_ratio; low_noise, transformer_2/, those below): the expert a fit trains, "
        "on its own timesteps only, written as lora-<expert>.safetensors; or both: each step draws its timesteps "
        "over the whole range and trains the expert that owns them, one LoRA per expert, only the running "
        "expert's blocks on the GPU (LoRA; trainer/train/experts.py). Sampling loads every expert either way. null "
        "for families of one transformer.",
    )
    audio: bool = Field(
        default=True,
        description="Families whose transformer makes sound with the picture (LTX-2): clips of videos with an audio "
        "track train the audio branch too (the joint audio-video call, a second loss: train.audio_loss_weight; "
        "their sound cached beside the latents), clips without one train the picture alone (batched apart). false: "
        "every clip trains the picture alone. Ignored by other families.",
    )
    guidance: float = Field(
        default=1.0,
        description="Guidance value fed to a guidance-distilled transformer (Flux dev) while training. "
        "Ignored by models without a guidance embedding.",
    )

    @field_validator("family")
    @classmethod
    def _known_family(cls, v: str) -> str:
        """Any accepted spelling becomes the registry key (trainer/models/__init__.py `ADAPTERS`)."""
        try:
            return canonical_family(v)
        except UserError as e:
            raise ValueError(str(e).removeprefix("model.family: ")) from None

    @model_validator(mode="after")
    def _modulation_needs_quantize(self):
        # Only an explicit setting is refused: the default may become true without breaking quantize: none.
        if self.quantize == "none" and self.quantize_modulation and "quantize_modulation" in self.model_fields_set:
            raise ValueError("model.quantize_modulation: true needs model.quantize: fp8 or int8 (it quantizes the "
                             "modulation Linears of an 8-bit base)")
        if self.fp8_matmul and self.quantize != "fp8":
            raise ValueError(f"model.fp8_matmul: true needs model.quantize: fp8 (it multiplies fp8 weights), not "
                             f"{self.quantize}; set model.quantize: fp8 or model.fp8_matmul: false")
        return self


class LoraConfig(_Section):
    type: Literal[LORA_KIND_NAMES] = Field(  # the registry's (trainer/lora_format/kinds.py)
        default="lora",
        description="Adapter kind, through peft: " + "; ".join(k.doc for k in LORA_KINDS.values()) + ". A kind "
        "that loads with peft is loaded by `dittrain sample --lora` too (docs/training.md and the log say how).",
    )
    dora: bool = Field(
        default=False,
        description="DoRA (weight-decomposed LoRA: a trained magnitude per output channel on top of the LoRA "
        "direction); type: lora only. Loads with diffusers' load_lora_weights; `dittrain merge` refuses it.",
    )
    rank: int = Field(default=16, ge=1, description="LoRA rank r (lokr: the rank of the factors; loha: of each pair).")
    alpha: float = Field(default=16.0, gt=0, description="LoRA alpha; the update is scaled by alpha / rank.")
    dropout: float = Field(
        default=0.0, ge=0, lt=1,
        description="Dropout on the LoRA input (lokr / loha: peft's rank_dropout, which drops whole ranks).",
    )
    compute_dtype: Literal["auto", "fp32"] = Field(
        default="auto",
        description="auto: LoRA matmuls in the model's dtype (bf16 on a GPU) with fp32 master weights and optimizer "
        "state; fp32: peft's own forward, activations cast to fp32 for the LoRA branch (slower).",
    )
    targets: list[str] | None = Field(
        default=None,
        description="Module names (peft target_modules) to adapt; null uses the family's default list.",
    )
    init_from: Path | None = Field(
        default=None,
        description="Start from this LoRA file (diffusers, comfy or kohya layout, e.g. one trained before or by "
        "another tool) instead of a zero update; its rank, alpha, kind and modules replace lora.rank / alpha / type "
        "/ dora / targets.",
    )

    @model_validator(mode="after")
    def _dora_is_lora(self) -> LoraConfig:
        if self.dora and not LORA_KINDS[self.type].dora:
            with_dora = " or ".join(k.name for k in LORA_KINDS.values() if k.dora)
            raise ValueError(f"lora.dora: true is a variant of lora.type: {with_dora}, not {self.type}; set one of them")
        return self


class OptimizerConfig(_Section):
    name: Literal[OPTIMIZER_NAMES] = Field(  # the registry's (trainer/optim/specs.py)
        default="adamw", description="; ".join(s.doc for s in OPTIMIZERS.values()) + ".",
    )
    lr: float = Field(default=1e-4, gt=0, description="Peak learning rate.")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="Adam betas (adamw, adamw8bit).")
    eps: float = Field(default=1e-8, gt=0, description="Adam epsilon.")
    weight_decay: float = Field(default=0.0, ge=0, description="Decoupled weight decay.")
    scheduler: Literal["constant", "cosine", "linear"] = Field(
        default="constant",
        description="Learning-rate schedule after warmup: constant, or cosine / linear decay towards 0 at train.steps.",
    )
    warmup_steps: int = Field(
        default=0, ge=0, description="Linear warmup: step s < warmup_steps uses lr * (s + 1) / warmup_steps."
    )
    max_grad_norm: float | None = Field(
        default=1.0, description="Clip the global gradient norm to this value; null disables clipping."
    )
    fused_back_pass: bool = Field(
        default=False,
        description="Run each parameter's optimizer step inside backward and free its gradient at once, so "
        "full fine-tuning never holds all gradients. Needed to offload trainable weights.",
    )
    stochastic_rounding: bool = Field(
        default=False, description="Stochastic rounding when writing bf16 weights in full fine-tuning."
    )
    master_weights: bool = Field(
        default=False,
        description="Full fine-tuning of bf16/fp16 weights: keep an fp32 master copy of every trained weight, stepped "
        "in fp32 and rounded to nearest into the model's weight, so updates far below bf16's spacing add up exactly. "
        "Costs 4 bytes per parameter (Flux.1-dev: 47.6 GB) in RAM for streamed weights (1/N per process when each "
        "steps its own), in VRAM for resident ones; saved with the optimizer state. Instead of stochastic_rounding.",
    )


class EmaConfig(_Section):
    decay: float = Field(default=0.999, gt=0, lt=1, description="EMA decay per update: ema = decay * ema + (1 - decay) * w.")
    every: int = Field(default=1, ge=1, description="Update the EMA after every N-th optimizer step.")
    device: Literal["cpu", "gpu"] = Field(
        default="cpu",
        description="Where the fp32 shadow lives: cpu (RAM; each weight is copied over as it steps) or gpu (the "
        "training device). A streamed full fine-tune keeps it in RAM (cpu).",
    )


class TrainConfig(_Section):
    method: Literal["lora", "full"] = Field(default="lora", description="lora, or full fine-tuning of the transformer.")
    steps: int = Field(default=1000, ge=1, description="Optimizer steps to train.")
    batch_size: int = Field(default=1, ge=1, description="Images per step (one aspect-ratio bucket per batch).")
    grad_accum: int = Field(default=1, ge=1, description="Micro-batches accumulated per optimizer step.")
    seed: int = Field(default=42, description="Seed for weights init, noise, timesteps and data order.")
    gradient_checkpointing: bool | Literal["auto"] = Field(
        default=True,
        description="Recompute each block in backward instead of storing its activations (true), store them all "
        "(false), or auto: the planner keeps the activations of as many blocks as the VRAM budget "
        "(offload.vram_budget_gb, else the GPU's memory) allows, and recomputes the rest (a LoRA's streamed blocks "
        "may keep theirs too; a full fine-tune's streamed blocks are always recomputed). The log and "
        "`dittrain plan` say what it chose and what it costs.",
    )
    timestep_sampling: Literal["uniform", "logit_normal", "mode"] = Field(
        default="logit_normal", description="How training timesteps t in (0, 1) are drawn."
    )
    logit_mean: float = Field(default=0.0, description="Mean of the logit-normal timestep distribution.")
    logit_std: float = Field(default=1.0, gt=0, description="Std of the logit-normal timestep distribution.")
    mode_scale: float = Field(default=1.29, description="Scale of the mode timestep distribution (SD3 paper).")
    shift: float | Literal["auto"] = Field(
        default="auto",
        description="Timestep shift t' = s t / (1 + (s - 1) t); auto uses the family's resolution-dependent shift.",
    )
    loss_weighting: Literal["none", "sigma_sqrt", "cosmap"] = Field(
        default="none", description="Per-timestep loss weighting."
    )
    audio_loss_weight: float = Field(
        default=1.0, ge=0,
        description="Families that train sound with the picture (LTX-2, model.audio): the weight of the sound's "
        "flow-matching loss, added per clip to the picture's (same timestep; Lightricks' trainer sums the two: 1).",
    )
    checkpoint_every: int = Field(default=0, ge=0, description="Save a resumable checkpoint every N steps (0: only at the end).")
    keep_checkpoints: int = Field(default=2, ge=1, description="How many step checkpoints to keep.")
    log_every: int = Field(default=1, ge=1, description="Write metrics every N steps.")
    ema: EmaConfig | None = Field(
        default=None,
        description="Keep an exponential moving average of the trained weights ({decay, every, device}); saved "
        "in checkpoints (ema.safetensors, resumed exactly) and at the end as lora-ema.safetensors or "
        "transformer-ema/ beside the trained weights.",
    )
    validate_every: int = Field(
        default=0, ge=0, description="Score data.validation every N steps (0: never); needs data.validation."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto: cuda when present.")
    distributed: Literal["ddp", "fsdp"] = Field(
        default="ddp",
        description="With several processes (torchrun): ddp, every process holds the whole model and gradients are "
        "averaged; fsdp, the transformer's weights, gradients and optimizer state are sharded across processes "
        "(PyTorch FSDP2, one unit per block), and with offload.transformer > 0 each process keeps only its shard "
        f"in pinned CPU RAM (fsdp: optimizer.name {_or(names_where('sharded'))}, no stochastic rounding; "
        "EMA, the fused back pass, activation offloading and nano-batches work). One process trains as with ddp.",
    )
    compile: bool | Literal["auto"] = Field(
        default="auto",
        description="torch.compile each transformer block class once (regional compilation), in training and in "
        "its samples; auto: on for CUDA, off on the CPU. The first step is slower by the compile time (printed).",
    )
    compile_dynamic: bool | Literal["tokens"] = Field(
        default=False,
        description="false: one compile per aspect-ratio bucket shape (fastest kernels); tokens: the sequence axes "
        "of the blocks' inputs are marked dynamic up front, so one compile serves every bucket while the model "
        "widths stay static; true: every dimension symbolic (slowest to compile).",
    )
    compile_cache: bool = Field(
        default=False,
        description="Keep torch's compile caches (inductor's FX graph and AOTAutograd caches, triton kernels) in "
        "<data.cache_dir>/torch-compile, so that a re-run or --resume loads the compiled blocks instead of "
        "compiling them again. The files are torch's own.",
    )
    attention: Literal["auto", "flash", "efficient", "math", "flex"] = Field(
        default="auto",
        description="Attention backend for scaled_dot_product_attention; auto avoids cuDNN attention, which "
        "fails in backward on some drivers. flash on Chroma: its attention mask as one more head dimension, "
        "which flash attention accepts. flex (Chroma only, CUDA only; what auto picks for Chroma on CUDA of "
        "compute capability 8.0 and up): its masked attention through torch's flex attention, the mask added to "
        "the scores inside the kernel; efficient keeps Chroma on the masked SDPA call.",
    )


class SourceConfig(_Section):
    path: Path = Field(description="Folder of images; captions are same-named .txt files beside them.")
    metadata: Path | None = Field(
        default=None, description='Optional metadata.jsonl of {"file": ..., "caption": ...} lines (file relative to path).'
    )
    repeats: int = Field(default=1, ge=1, description="How many times each image appears per epoch.")
    caption_prefix: str = Field(default="", description="Text put before every caption (a trigger word).")
    caption_dropout: float = Field(default=0.0, ge=0, le=1, description="Probability of training on an empty caption.")
    recursive: bool = Field(default=True, description="Search sub-folders too.")
    several_captions: bool = Field(
        default=False,
        description="Each non-empty line of a .txt caption is a separate caption; each time the image is drawn one "
        "is picked (seeded). In metadata.jsonl a \"caption\" list always means several.",
    )
    trigger_word: str = Field(
        default="", description="Put first in every caption (comma-separated), outside tag shuffling and dropout."
    )
    shuffle_tags: bool = Field(
        default=False,
        description="Shuffle the comma-separated tags after the first keep_tokens; data.caption_variants orders "
        "per image are cached.",
    )
    keep_tokens: int = Field(default=0, ge=0, description="Tags at the front held in place by shuffling and tag dropout.")
    tag_dropout: float = Field(
        default=0.0, ge=0, lt=1, description="Probability of leaving out each tag after the first keep_tokens."
    )
    caption_with: Path | None = Field(
        default=None,
        description="A local vision-language model folder (what `dittrain caption --model` takes): before the scan, "
        "fit and cache caption every image and video of this source that has no .txt caption with it (detailed "
        "style; the folder's own .txt files, as `dittrain caption` writes them). Not with metadata.",
    )

    @model_validator(mode="after")
    def _caption_with_folder(self):
        if self.caption_with is not None and self.metadata is not None:
            raise ValueError("caption_with writes .txt captions beside the images, which a metadata source does not "
                             "read: remove caption_with or metadata")
        return self

    def metadata_file(self) -> Path | None:
        """`metadata` as found: relative to the current directory, else (a bare name) inside `path`; None: unset
        or not found (the scan then says so)."""
        if self.metadata is None:
            return None
        if self.metadata.is_file():
            return self.metadata
        inside = self.path / self.metadata
        return inside if not self.metadata.is_absolute() and inside.is_file() else None

    def references(self) -> int:
        """How many reference images this source pairs each image with: its `control/`, `control2/`, ... folders
        in a row (folder sources), or the longest "control" entry (a name or a list) of its metadata.jsonl; 0: plain
        images. Reads no image; the scan checks every pair (trainer/data/sources.py)."""
        meta = self.metadata_file()
        if meta is None:
            if self.metadata is not None:
                return 0  # not found: the scan says so
            n = 0
            while (self.path / (CONTROL_DIR if n == 0 else f"{CONTROL_DIR}{n + 1}")).is_dir():
                n += 1
            return n
        most = 0
        for line in meta.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                continue  # the scan reports it
            ctrl = rec.get("control") if isinstance(rec, dict) else None
            most = max(most, 1 if isinstance(ctrl, str) else len(ctrl) if isinstance(ctrl, list) else 0)
        return most


class ValidationConfig(_Section):
    sources: list[SourceConfig] = Field(
        default_factory=list,
        description="Image folders of the held-out set (captions as for training); or leave empty and set fraction.",
    )
    fraction: float = Field(
        default=0.0, ge=0, lt=1,
        description="Hold out this share of the training images instead (at least one; picked by train.seed and "
        "each image's content, so the same images at every run and resume); they are not trained on.",
    )
    timesteps: list[float] = Field(
        default=[0.1, 0.3, 0.5, 0.7, 0.9], min_length=1,
        description="Flow times t in (0, 1) every validation image is scored at (no shift, no loss weighting), "
        "with fixed noise per image, so the curve is comparable across steps and runs.",
    )

    @field_validator("timesteps")
    @classmethod
    def _in_range(cls, v: list[float]) -> list[float]:
        if any(not 0 < t < 1 for t in v):
            raise ValueError("every validation timestep must be in (0, 1)")
        return v

    @model_validator(mode="after")
    def _one_kind(self) -> ValidationConfig:
        if bool(self.sources) == (self.fraction > 0):
            raise ValueError("data.validation needs either sources (a held-out set) or fraction > 0 (held out from "
                             "the training images), not both")
        return self


_HEIGHT = re.compile(r"(\d+)p", re.IGNORECASE)


def video_frame(height: int) -> tuple[int, int]:
    """(width, height) of the 16:9 video frame `height` pixels high, the width rounded down to a multiple of 32 as
    Wan publishes its sizes: 480 -> 832x480, 720 -> 1280x720."""
    return int(height * 16 / 9) // 32 * 32, int(height)


def video_resolution(name: str) -> int:
    """`data.resolutions`' `<N>p` as a resolution: the side of the square of that frame's area (480p -> 632,
    720p -> 960), whose buckets hold the frame itself at the video families' 16 px step."""
    w, h = video_frame(int(_HEIGHT.fullmatch(name.strip()).group(1)))
    return round((w * h) ** 0.5)


class DataConfig(_Section):
    sources: list[SourceConfig] = Field(min_length=1, description="One or more image sources.")
    resolutions: list[int] = Field(
        default=[512],
        min_length=1,
        description="Target side lengths; buckets keep ~res^2 pixels (aspect buckets around the res x res square). "
        "Video families may name a video height instead: <N>p is the area of the 16:9 frame N pixels high, its width "
        "rounded down to a multiple of 32 as Wan's sizes are: 480p = 832x480 (632), 720p = 1280x720 (960).",
    )
    crop: Literal["center", "random"] = Field(
        default="center",
        description="Crop after resizing to cover the bucket. random: one seeded random crop per image (from "
        "train.seed and the image content), fixed while the cache lives, not a new one each epoch.",
    )
    strict: bool = Field(
        default=False,
        description="Stop (listing every bad file) if any image is corrupt, unreadable, uncaptioned or too small, "
        "instead of training without them.",
    )
    cache_dir: Path = Field(default=Path("cache"), description="Folder for cached latents and text embeddings.")
    cache: bool = Field(default=True, description="Encode latents and captions once and reuse them.")
    remainder: Literal["smaller", "wrap"] = Field(
        default="smaller",
        description="A bucket's last partial batch: smaller (train it as is) or wrap (fill it with images from the "
        "start of the same bucket). No image is ever dropped.",
    )
    bucket_step: int = Field(
        default=64,
        ge=1,
        description="Bucket sides step by this many pixels (capped at resolution/4, rounded to the family's "
        "divisor); smaller steps fit aspect ratios closer but spread images over more buckets. Unset, a video family "
        "takes its own (Wan: 16, so that 832x480 is a bucket at 480p and 1280x720 at 720p).",
    )
    max_aspect: float = Field(default=4.0, ge=1.0, description="Largest bucket side ratio (long side / short side).")
    max_upscale: float = Field(
        default=1.0,
        ge=1.0,
        description="Largest enlargement allowed to cover a bucket; an image needing more at every resolution is "
        "left out as too small (1.0: never upscale).",
    )
    encode_batch_size: int = Field(default=4, ge=1, description="Images or captions per encoder call when caching.")
    masked_loss: bool = Field(
        default=False,
        description="Weight the loss by a mask per image: <source>/masks/<same name> or a \"mask\" key in "
        "metadata.jsonl (white = train, black = unmasked_weight); resized and cropped with the image and cached with "
        "its latent. Images without a mask train on every pixel; a mask not of its image's size or unreadable is "
        "a bad file.",
    )
    unmasked_weight: float = Field(
        default=0.0, ge=0, le=1, description="With masked_loss: the loss weight where the mask is black (0: ignore)."
    )
    validation: ValidationConfig | None = Field(
        default=None,
        description="Held-out images scored with a validation loss every train.validate_every steps (no gradients; "
        "streamed like training); val_loss in metrics.jsonl and TensorBoard.",
    )
    fps: float | None = Field(
        default=16.0,
        gt=0,
        description="Video families (Wan): videos in the sources are read at this frame rate, frames skipped or "
        "repeated by their timestamps (null: every frame as stored). Unset: the family's rate (Wan 2.1 was trained "
        "at 16 fps; LTX-2 reads 24, its positions are in seconds at 24 fps).",
    )
    clip_frames: int = Field(
        default=81,
        ge=1,
        description="Video families: frames per training clip at data.fps; the family's VAE needs 4k+1 for Wan "
        "(17, 33, 49, 81). A video shorter than one clip is left out with its frame count. Images are 1-frame clips.",
    )
    clips: Literal["first", "uniform", "all"] = Field(
        default="first",
        description="Video families: which clips of a video train: first (its start), uniform (clips_per_video clips "
        "spread evenly over it) or all (every non-overlapping clip from the start). Each clip is cached and drawn "
        "like an image.",
    )
    clips_per_video: int = Field(default=3, ge=1, description="With clips: uniform, the clips taken from each video.")
    caption_variants: int = Field(
        default=8,
        ge=1,
        description="With shuffle_tags or tag_dropout: how many variants of each image's caption are made (seeded) "
        "and cached; each time the image is drawn one is picked. Costs one text embedding per variant in the cache.",
    )

    def references(self) -> int:
        """Reference images per image the data pairs with (the most of any source: `SourceConfig.references`). For
        a family whose reference is optional (Flux.2: `ModelAdapter.reference_optional`) a positive count makes the
        run train pairs (and the planner count the reference tokens); 0 trains plain images."""
        return max(s.references() for s in self.sources)

    def has_references(self) -> bool:
        """Whether the data pairs its images with reference images (`references` > 0)."""
        return self.references() > 0

    @field_validator("resolutions", mode="before")
    @classmethod
    def _video_heights(cls, v: Any) -> Any:
        """`480p` -> 632: the side of the square of the named frame's area (`video_frame`)."""
        if not isinstance(v, list):
            return v
        return [video_resolution(r) if isinstance(r, str) and _HEIGHT.fullmatch(r.strip()) else r for r in v]

    @field_validator("resolutions")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(r < 16 for r in v):
            raise ValueError("every resolution must be at least 16 pixels")
        return v


class OffloadConfig(_Section):
    transformer: float | Literal["auto"] = Field(
        default=0.0,
        description="Share of the transformer's block bytes kept in CPU RAM (0: resident, 1: every block "
        "streamed); auto picks the smallest share that fits vram_budget_gb (`dittrain sample`: its own "
        "denoising peak).",
    )
    text_encoders: float = Field(default=0.0, ge=0, le=1, description="Same, for the text encoders.")
    activations: bool = Field(default=False, description="Move checkpointed block inputs to pinned CPU RAM in forward.")
    nano_batches: int = Field(
        default=1, ge=1,
        description="Run each block's token-wise sub-layers (the family's `token_wise`: feed-forwards, Wan's "
        "cross-attention, all of a HunyuanVideo 1.5 block but its attention kernel) in this many token chunks, each "
        "recomputed in backward: their hidden activations exist one chunk at a time (Wan 14B at 480p x 81: 8 chunks "
        "predict 4 GB less VRAM; HunyuanVideo 1.5 at 720p x 121: 16 chunks predict a block's backward at 4.4 GB "
        "instead of 14.5), for one more forward of those sub-layers in backward. The same numbers up to fp32 "
        "summation order in their weight gradients.",
    )
    vram_budget_gb: float | None = Field(
        default=None, gt=0,
        description="VRAM (GB) to plan for with transformer: auto, and the budget train.gradient_checkpointing: auto "
        "keeps activations in (else the GPU's memory).",
    )
    pinned_budget_gb: float | None = Field(
        default=None, ge=0,
        description="Most host RAM (GB) the streamed blocks' arena may page-lock (null: all of it). A larger arena, "
        "or one the OS refuses to pin (Windows / WSL pin about half of RAM, containers less), stays pageable and "
        "its copies go through two pinned one-block buffers (slower).",
    )
    shared_arena: bool = Field(
        default=True,
        description="With several training processes on one host (torchrun), LoRA: the streamed frozen blocks "
        "live once in a /dev/shm file that every process maps and pins, instead of once per process.",
    )
    park: Literal["ram", "disk", "auto"] = Field(
        default="auto",
        description="model.expert: both (Wan 2.2 A14B): where the expert not running waits. ram: its blocks stay in "
        "CPU RAM (pinned), a switch copies one ring; disk: its blocks hold no RAM and are read again from its "
        "safetensors files (the page cache, or the disk) at a switch, so RAM holds one expert's blocks; auto: disk "
        "exactly where the planner's predicted RAM peak of the whole run (activations included; `dittrain plan` "
        "prints both) with the idle expert in RAM exceeds offload.host_ram_gb (else this machine's RAM) and the peak "
        "with it on disk does not, else ram. Bitwise the same training either way; each switch logs what it did and "
        "its seconds.",
    )
    host_ram_gb: float | None = Field(
        default=None, gt=0,
        description="Host RAM (GB) offload.park: auto plans for (null: this machine's physical RAM).",
    )
    sharded_stream: bool | Literal["auto"] = Field(
        default="auto",
        description="With several training processes on one host and blocks streamed: each process copies "
        "1/N of every streamed block over its PCIe link and the GPUs all-gather the rest over their own links, "
        "instead of every GPU copying whole blocks. A full fine-tune (AdamW, 8-bit AdamW or Adafactor) then also "
        "has each process step 1/N of the weights and keep only their optimizer state. auto: on where every pair of the host's GPUs has peer access "
        "(NVLink, or PCIe peer-to-peer), off otherwise (and on the CPU); true: on wherever it can run (gloo on the "
        "CPU too); false: whole copies per process.",
    )

    @field_validator("transformer")
    @classmethod
    def _fraction(cls, v: float | str) -> float | str:
        if isinstance(v, float) and not 0.0 <= v <= 1.0:
            raise ValueError("offload fraction must be between 0 and 1 (or auto)")
        return v


class SampleConfig(_Section):
    prompts: list[str] = Field(default_factory=list, description="Prompts sampled during training and by default in `sample`.")
    every: int = Field(default=0, ge=0, description="Sample every N training steps (0: never during training).")
    steps: int = Field(default=20, ge=1, description="Denoising steps.")
    guidance: float = Field(default=3.5, description="Guidance scale.")
    guidance_2: float | None = Field(
        default=None,
        description="Families of two experts (Wan 2.2 A14B): the guidance scale of the low-noise expert's steps (the "
        "pipeline's guidance_scale_2). null: sample.guidance for both.",
    )
    width: int = Field(default=512, ge=16, description="Image width in pixels.")
    height: int = Field(default=512, ge=16, description="Image height in pixels.")
    frames: int = Field(
        default=1,
        ge=1,
        description="Video families (Wan): frames per sample, 4k+1 (81 is Wan's 5 s at 16 fps); written as an mp4 "
        "with a contact sheet of frames. 1: a still image.",
    )
    seed: int = Field(default=0, description="Seed of the first image; image i uses seed + i.")
    negative_prompt: str = Field(
        default="",
        description="Negative prompt for families that run classifier-free guidance when guidance > 1 "
        "(SD3, Qwen-Image, Chroma; Z-Image already when guidance > 0); Flux (guidance-distilled) ignores it.",
    )
    image: Path | list[Path] | None = Field(
        default=None,
        description="Edit families: the reference image of the samples made during training (resized and "
        "centre-cropped to width x height), or a list of them for families that take several (Flux.2); "
        "`dittrain sample --image` overrides it. qwen-image-edit(-plus) needs one to "
        "sample; flux-kontext samples without a reference when it is unset.",
    )


class WandbConfig(_Section):
    project: str = Field(default="dittrain", description="Weights & Biases project to log into.")
    mode: Literal["online", "offline"] = Field(
        default="online",
        description="online: stream to W&B as the run goes (`wandb login` first, or WANDB_API_KEY); offline: write "
        "to <output.dir>/wandb only, without a network; upload later with `wandb sync <output.dir>/wandb/offline-run-*`.",
    )
    entity: str | None = Field(default=None, description="W&B team or user; null: your default entity.")
    name: str | None = Field(default=None, description="Display name of the W&B run; null: the dittrain run id.")
    tags: list[str] = Field(default_factory=list, description="W&B tags of the run.")


class OutputConfig(_Section):
    dir: Path = Field(description="Folder for the trained weights, checkpoints, metrics and samples.")
    tensorboard: bool = Field(default=True, description="Write TensorBoard curves and sample images.")
    wandb: WandbConfig | None = Field(
        default=None,
        description="Also log to Weights & Biases (the same curves as TensorBoard, the config and the sample images); "
        "needs `pip install dittrain[wandb]`. The W&B run id is the dittrain run id, so a resumed run continues "
        "the same W&B run. Example: {project: my-lora, mode: offline}.",
    )
    save_every: int = Field(
        default=0,
        ge=0,
        description="LoRA: every N steps also keep that step's LoRA as <name>-step-000500.safetensors in output.dir "
        "(never pruned, unlike checkpoints; a checkpoint is saved at those steps too). 0: only the final LoRA.",
    )
    lora_format: Literal["diffusers", "comfy", "kohya"] = Field(
        default="diffusers",
        description="Layout of the saved LoRA files: diffusers (load_lora_weights; ComfyUI reads it too), comfy "
        "(ComfyUI's own diffusion_model.* keys in the original model's layout, fused q/k/v) or kohya (lora_unet_*). "
        "Each gives the same update at any alpha; checkpoints keep peft's layout. `dittrain convert-lora` converts.",
    )
    name: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="Name in the per-step LoRA files (<name>-step-000500.safetensors); null: lora.",
    )


class Config(_Section):
    model: ModelConfig
    train: TrainConfig = Field(default_factory=TrainConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    data: DataConfig | None = Field(default=None, description="Training data; needed by fit and cache.")
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    sample: SampleConfig = Field(default_factory=SampleConfig)
    output: OutputConfig

    @model_validator(mode="after")
    def _combinations(self, info: ValidationInfo) -> Config:
        o, t, opt = self.offload, self.train, self.optimizer
        # the checks below that read the family adapter's facts import its module (torch, diffusers): skipped for
        # a reader of a config a command has validated (load_config's family_checks=False)
        family = (info.context or {}).get("family_checks", True)
        if o.transformer == "auto" and o.vram_budget_gb is None:
            raise ValueError("offload.transformer: auto needs offload.vram_budget_gb (the VRAM to fit in, in GB)")
        streams = o.transformer == "auto" or o.transformer > 0
        if t.distributed == "fsdp":
            _fsdp_combinations(self)
        elif streams and t.method == "full" and not opt.fused_back_pass:
            raise ValueError(
                "offload.transformer > 0 in full fine-tuning needs optimizer.fused_back_pass: true "
                "(each block's weights are stepped while the block is on the GPU)"
            )
        if streams and not t.gradient_checkpointing and t.method == "full":
            raise ValueError(
                "offload.transformer > 0 in full fine-tuning needs train.gradient_checkpointing: true or auto "
                "(a streamed trainable block is reloaded, recomputed and stepped in its backward)"
            )
        if o.activations and not t.gradient_checkpointing:
            raise ValueError("offload.activations needs train.gradient_checkpointing: true")
        if opt.fused_back_pass and t.grad_accum > 1:
            raise ValueError(
                "optimizer.fused_back_pass steps inside backward, so train.grad_accum must be 1 "
                "(raise train.batch_size instead)"
            )
        if opt.fused_back_pass and opt.max_grad_norm is not None:
            raise ValueError(
                "optimizer.fused_back_pass cannot clip the global gradient norm (each parameter steps before "
                "the norm is known): set optimizer.max_grad_norm: null"
            )
        if self.model.quantize != "none" and t.method == "full":
            raise ValueError(
                f"model.quantize: {self.model.quantize} is for a frozen base (train.method: lora); full fine-tuning "
                "needs model.quantize: none"
            )
        has_val = self.data is not None and self.data.validation is not None
        if has_val != (t.validate_every > 0):
            raise ValueError("data.validation and train.validate_every > 0 go together: set both (or neither)")
        if t.ema is not None and t.ema.device == "gpu" and streams and t.method == "full":
            raise ValueError("train.ema.device: gpu would hold a full-size fp32 copy beside streamed weights; a "
                             "streamed full fine-tune keeps its EMA in RAM: set train.ema.device: cpu")
        if self.model.quantize != "none" and self.lora.dora:
            raise ValueError(f"lora.dora needs the full-precision base weight for its norm; set model.quantize: none "
                             f"(or lora.dora: false with model.quantize: {self.model.quantize})")
        # a LoKr the layout cannot hold: said before caching
        if family and t.method == "lora" and self.lora.init_from is None:
            from .lora_format import check_targets
            from .models import adapter_class

            targets = self.lora.targets or list(adapter_class(self.model.family).default_lora_targets)
            misfit = check_targets(targets, self.lora.type, self.output.lora_format, self.model.family)
            if misfit:
                raise ValueError(misfit)
        if OPTIMIZERS[opt.name].whole_step and (opt.scheduler != "constant" or opt.fused_back_pass):
            raise ValueError(
                f"optimizer.name: {opt.name} replaces the decay schedule and steps all weights at once: set "
                "optimizer.scheduler: constant and optimizer.fused_back_pass: false"
            )
        if opt.stochastic_rounding and t.method != "full":
            raise ValueError("optimizer.stochastic_rounding applies to full fine-tuning only (train.method: full)")
        if opt.master_weights and opt.stochastic_rounding:
            raise ValueError("optimizer.master_weights keeps the exact fp32 weights, so optimizer.stochastic_rounding "
                             "would only add noise to their bf16 copy: set one of them false")
        if opt.master_weights and (t.method != "full" or self.model.dtype == "fp32"):
            raise ValueError("optimizer.master_weights applies to full fine-tuning of bf16/fp16 weights only "
                             "(train.method: full, model.dtype: bf16 or fp16)")
        # the family's bucket step, unless set
        if family and self.data is not None and "bucket_step" not in self.data.model_fields_set:
            from .models import adapter_class

            step = adapter_class(self.model.family).bucket_step
            if step != self.data.bucket_step:
                self.data.bucket_step = step
        # the family's frame rate, unless set; the only one where the family's is fixed
        if family and self.data is not None:
            from .models import adapter_class

            fam = adapter_class(self.model.family)
            if "fps" not in self.data.model_fields_set:
                if self.data.fps != fam.default_fps:  # as bucket_step: an unchanged default stays unset
                    self.data.fps = fam.default_fps
            elif fam.fixed_fps and self.data.fps != fam.default_fps:
                raise ValueError(f"data.fps: {self.data.fps}: {fam.family} is told {fam.default_fps:g} fps whatever "
                                 f"the clips' rate (its positions are in seconds); read clips at {fam.default_fps:g} "
                                 "(or leave data.fps unset)")
        return self

    def digest(self) -> str:
        """Short hash of the whole config, stored in checkpoints and weight headers."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------- loading


_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser where PyYAML has it: ~5x faster


def _read_yaml(text: str) -> tuple[Any, dict[tuple, int]]:
    """The document's data (what `yaml.safe_load` gives) and the line of every mapping key and list item, by path,
    from one parse: the node tree is composed once (with marks) and constructed from."""
    lines: dict[tuple, int] = {}

    def walk(node: yaml.Node, path: tuple) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                p = (*path, k.value)
                lines[p] = k.start_mark.line + 1
                walk(v, p)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                lines[(*path, i)] = v.start_mark.line + 1
                walk(v, (*path, i))

    loader = _LOADER(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None, lines
        walk(root, ())
        return loader.construct_document(root), lines
    finally:
        loader.dispose()


def _parse_override(item: str) -> tuple[list[str], Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. --set train.steps=500")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else None


def _apply_override(data: dict, keys: list[str], value: Any, item: str) -> None:
    node = data
    for k in keys[:-1]:
        nxt = node.get(k)
        if nxt is None:
            nxt = node[k] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {item}: {k!r} is not a section")
        node = nxt
    node[keys[-1]] = value


def _fields_at(loc: tuple) -> list[str]:
    """Valid field names of the model found by following `loc` (a pydantic error location) from Config."""
    model: Any = Config
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        ann = field.annotation
        for cand in _unwrap(ann):
            if isinstance(cand, type) and issubclass(cand, BaseModel):
                model = cand
                break
        else:
            return []
    return list(model.model_fields)


def _unwrap(ann: Any) -> list[Any]:
    args = getattr(ann, "__args__", None)
    if not args:
        return [ann]
    out = []
    for a in args:
        out.extend(_unwrap(a))
    return out


# Keys of other trainers (kohya sd-scripts, diffusers' example scripts, ai-toolkit, SimpleTuner, OneTrainer) and
# where dittrain keeps the same setting. Suggested when such a key appears anywhere in a config.
OTHER_TRAINERS = {
    "learning_rate": "optimizer.lr", "unet_lr": "optimizer.lr", "lr_scheduler": "optimizer.scheduler",
    "lr_warmup_steps": "optimizer.warmup_steps", "warmup_steps": "optimizer.warmup_steps",
    "optimizer_type": "optimizer.name", "optimizer": "optimizer.name", "optim": "optimizer.name",
    "max_grad_norm": "optimizer.max_grad_norm", "adam_weight_decay": "optimizer.weight_decay",
    "weight_decay": "optimizer.weight_decay", "adam_epsilon": "optimizer.eps",
    "network_dim": "lora.rank", "lora_rank": "lora.rank", "rank": "lora.rank", "linear": "lora.rank",
    "network_alpha": "lora.alpha", "lora_alpha": "lora.alpha", "linear_alpha": "lora.alpha",
    "network_dropout": "lora.dropout", "lora_dropout": "lora.dropout", "target_modules": "lora.targets",
    "max_train_steps": "train.steps", "num_train_steps": "train.steps", "steps": "train.steps",
    "train_batch_size": "train.batch_size", "batch_size": "train.batch_size",
    "gradient_accumulation_steps": "train.grad_accum", "gradient_accumulation": "train.grad_accum",
    "seed": "train.seed", "checkpointing_steps": "train.checkpoint_every",
    "save_every_n_steps": "output.save_every", "save_every": "output.save_every",
    "checkpoints_total_limit": "train.keep_checkpoints", "save_last_n_steps": "train.keep_checkpoints",
    "max_step_saves_to_keep": "train.keep_checkpoints", "output_dir": "output.dir", "output_name": "output.name",
    "logging_dir": "output.tensorboard", "mixed_precision": "model.dtype", "save_precision": "model.dtype",
    "pretrained_model_name_or_path": "model.path", "name_or_path": "model.path",
    "train_data_dir": "data.sources", "instance_data_dir": "data.sources", "folder_path": "data.sources",
    "resolution": "data.resolutions", "cache_latents": "data.cache", "caption_dropout_rate": "caption_dropout",
    "weighting_scheme": "train.timestep_sampling", "timestep_sampling": "train.timestep_sampling",
    "guidance_scale": "model.guidance", "gradient_checkpointing": "train.gradient_checkpointing",
    "sample_every_n_steps": "sample.every", "sample_prompts": "sample.prompts", "validation_prompt": "sample.prompts",
}


def _other_trainer_hint(key: str, section: tuple) -> str | None:
    """`did you mean` for a key spelt as another trainer spells it; the target may be in another section."""
    target = OTHER_TRAINERS.get(key.lower())
    if target is None:
        return None
    if "." not in target:  # a per-source key: keep the list position
        return ".".join(str(p) for p in (*section, target))
    if ".".join(str(p) for p in section) + "." + key == target:
        return None  # it is the valid key itself (e.g. train.steps): nothing to suggest
    return target


def _describe(err: dict, lines: dict[tuple, int], source: str) -> str:
    loc = tuple(err["loc"])
    dotted = ".".join(str(p) for p in loc) or "(top level)"
    # Errors from a model validator carry the location of the section, or none.
    line = lines.get(loc) or next((lines[loc[:i]] for i in range(len(loc), 0, -1) if loc[:i] in lines), None)
    where = f"{source}:{line}" if line and not source.startswith("--set") else source
    if err["type"] == "extra_forbidden":
        valid = _fields_at(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
        other = _other_trainer_hint(str(loc[-1]), loc[:-1])
        if other:
            hint = f"; did you mean {other!r}? (dittrain's name for it)"
        else:
            hint = f"; did you mean {'.'.join(str(p) for p in (*loc[:-1], close[0]))!r}?" if close else ""
        section = ".".join(str(p) for p in loc[:-1]) or "the top level"
        return f"{where}: unknown key {dotted!r}{hint} (valid keys in {section}: {', '.join(valid)})"
    if err["type"] == "missing":
        return f"{where}: {dotted} is required"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] in ("value_error", "assertion_error") and not loc:
        return f"{where}: {msg}"
    got = err.get("input")
    shown = "" if isinstance(got, dict | list) or got is None else f" (got {got!r})"
    return f"{where}: {dotted}: {msg}{shown}"


@contextmanager
def _libraries_loading():
    """The first validation in a process imports torch, diffusers, transformers and peft (the checks read the
    family adapter's facts, and its module imports them): ~0.7 M objects, during which the cyclic collector
    ran about 1,100 times, seven of them full passes over everything imported so far (2.7-3.0 s in all of an
    18.7-19.7 s import at load 8 on 2 cores; `dittrain plan`, `sample` and `fit` all start here). Paused
    meanwhile, and what the imports built then frozen: the libraries live as long as the process, so no later
    collection walks them again (the trainer's, the sampler's and the one at interpreter exit each walked them
    all). The imports' cyclic garbage (~10 k objects, RSS within 2 MB measured) is frozen with them. A no-op
    once torch is imported (a second load, the tests) or when the caller has the collector off."""
    if "torch" in sys.modules or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def load_config(
    path: str | Path, overrides: list[str] | tuple[str, ...] = (), *, family_checks: bool = True
) -> Config:
    """Read, override and validate a config. Raises `ConfigError` with one line per problem.

    `family_checks=False` leaves out the checks that read the family adapter's facts (the LoRA targets' layout,
    data.bucket_step and data.fps set to the family's), and so the import of torch and diffusers they need: for a
    reader of a config that a command has validated and that uses none of those (the demo's report)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found (presets are listed by `dittrain presets`)")
    text = path.read_text()
    try:
        data, lines = _read_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{at}: not valid YAML: {getattr(e, 'problem', e)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (model:, train:, ...), got {type(data).__name__}")
    from_set: dict[tuple, str] = {}
    for item in overrides:
        keys, value = _parse_override(item)
        _apply_override(data, keys, value, item)
        from_set[tuple(keys)] = item
    try:
        with _libraries_loading():
            return Config.model_validate(data, context={"family_checks": family_checks})
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            loc = tuple(err["loc"])
            # An unknown key's location ends at the first key that does not exist (--set foo.bar=1 fails at
            # 'foo'), so a location that is a prefix of an override's keys is that override's too.
            src = "--set" if any(loc[: len(k)] == k or k[: len(loc)] == loc for k in from_set if loc) else str(path)
            if not loc:  # a cross-field check: blame the --set whose key its message names, if one does
                named = [item for k, item in from_set.items() if re.search(rf"\b{re.escape('.'.join(k))}\b",
                                                                           err["msg"])]
                src = " ".join(f"--set {n}" for n in named) if named else src
            msgs.append(_describe(err, lines, src))
        raise ConfigError("\n".join(msgs[:5]) + (f"\n(and {len(msgs) - 5} more)" if len(msgs) > 5 else "")) from None


def _fsdp_combinations(cfg: Config) -> None:
    """What train.distributed: fsdp does not do (yet), refused before anything loads (trainer/train/sharded.py
    says why each is so)."""
    o, opt = cfg.offload, cfg.optimizer
    refused = [
        (not OPTIMIZERS[opt.name].sharded, f"optimizer.name: {_or(names_where('sharded'))} (the optimizers tested "
         "on sharded weights; trainer/train/sharded.py says why not the others)"),
        (opt.stochastic_rounding, "optimizer.stochastic_rounding: false"),
        (opt.master_weights, "optimizer.master_weights: false (its shards are fp32 masters already)"),
        (o.transformer == "auto", "a number for offload.transformer (0: shards on the GPUs; > 0: in CPU RAM)"),
    ]
    bad = [fix for on, fix in refused if on]
    if bad:
        raise ValueError("train.distributed: fsdp needs " + "; ".join(bad))
