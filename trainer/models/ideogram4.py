"""Ideogram 4: Ideogram4Transformer2DModel (9.28 B: 34 single-stream blocks 4608 wide over one packed [text, image]
sequence), a Qwen3-VL-8B text encoder read at 13 layers, Flux.2's VAE (AutoencoderKLFlux2, 32 channels, 2x2
patches) and a second, text-free transformer of the same size for guidance (`unconditional_transformer`).

diffusers 0.42.1 ships a classic `Ideogram4Pipeline` and a modular one (`diffusers/modular_pipelines/ideogram4`);
neither takes prompt embeddings, so sampling goes through `Ideogram4EmbedsPipeline` (trainer/models/
ideogram4_pipeline.py), a face on the modular blocks. How each piece here mirrors them:

- text (`Ideogram4TextEncoderStep`): the prompt as a user turn in the tokenizer's chat template with the generation
  prompt, through Qwen3-VL's decoder layers; the hidden states after layers 0, 3, ..., 33, 35 side by side per token
  (13 x 4096 = 53248 values). Each caption is encoded alone by the step itself at its own length (the pipeline's
  window is 2048 tokens, left-padded; padding is masked out of the encoder, so the valid rows are the same up to
  float rounding, for a seventh of the encoder's work and of the cache: 106 KB a token in bf16). The cache keeps
  the rows right-aligned from the start (`prompt_embeds`, `prompt_embeds_mask`); `collate_text` left-pads a batch
  to its longest caption, as the pipeline left-pads to its window.
- the packed sequence (`Ideogram4PrepareAdditionalInputsStep`): [padding][text][image] per sample; the transformer
  input is zero on the text rows, the text features zero on the image rows; position ids (l, l, l) for the l-th
  text token and 65536 + (0, row, col) for the image; segment ids 1 (pads -1, attending only to each other) and the
  indicator 3 / 2 / 0 for text / image / pads, built on the device from the mask (`sequence_ids`). The image rows'
  output does not depend on how long the padding is, so training at the batch's longest caption is the pipeline's
  call at that window.
- latents (`Ideogram4DecodeStep`, inverted): the VAE's mode, normalised by the VAE's batch-norm statistics laid out
  per 2x2 patch as (patch row, patch column, channel), kept un-patchified as (B, 32, H/8, W/8); tokens are 2x2
  patches with features in that same order (`pack`), 16 px a side.
- predict: model time 1 - t (0 is noise in Ideogram's convention) in the transformer's dtype, as the denoising loop
  passes it; the model predicts x0 - noise, so the (noise - x0) velocity is its negation, as the loop hands the
  scheduler `-v`.
- shift: the pipeline samples a logit-normal schedule whose mean moves by 0.5 log(pixels / 512^2): on sigma that is
  the shift s = sqrt(H W) / 512 (1 at 512 px, 2 at 1024 px), which training uses on its timesteps.
- sampling: guidance runs the conditional `transformer` on the packed sequence and the `unconditional_transformer`
  on the image tokens alone (zero text features), v = w v_cond + (1 - w) v_uncond, with no negative prompt.
  `sample.guidance` is w at every step (the pipeline's default is a schedule, 7 for 45 steps then 3 for the last 3:
  the presets sample 48 steps at a constant 7). LoRA goes into `transformer` only (Ideogram4LoraLoaderMixin's
  single loadable module): the unconditional transformer stays the base model, as diffusers' loader leaves it.
  `dittrain sample` reads it from its folder block by block as it reads the trained one (`load_component`) and
  places it as the conductor places the trained one; sampling during training reads it so for each call (9.3 GB
  pinned in fp8 at its fraction 1.0) and frees it after, so a fit does not hold it between samples
  (it did: 32 GB anonymous RSS in the 16 GB preset's sampling, bench/history/2026-11-27.md, 21:58). The planner
  counts it in the sampling phase's VRAM and RAM (`sampling_components`).
- modulation and quantization: each block's `adaln_modulation` (scale and tanh gate from the 512-wide time
  conditioning) stays in the model dtype in an 8-bit base, as the other families' modulation Linears.

The transformer (`Ideogram4Transformer2DModel` here: diffusers' class, same name and weights) takes the text rows
alone: diffusers' forward projects the features over the whole sequence (zeros on the image rows), about 3 GB of
transients at 1024 px that the planner would not see and 2.3 TFLOP a forward mostly on zeros; the sampling face
projects each prompt once per image for the same reason (trainer/models/ideogram4_pipeline.py).

Step time: the planner counts every Linear and the attention over the 4608 packed tokens exactly (tests/
test_planner_flops.py), but not what its attention kernel costs: with the segment mask SDPA cannot use flash
attention, and at head_dim 256 the memory-efficient kernel's backward is slow. On the H200 (1024 px, LoRA,
resident, compiled; bench/logs/2026-11-28i) the recompute (one forward) cost 0.23 s, as fast a FLOP as
ERNIE-Image's (head_dim 128, also masked), while the step took ~0.55 s more than ERNIE-Image's rate gives, with
every block recomputed (1.46 s) or none (1.24 s): about 27 TFLOP of attention backward at ~40 TFLOP/s.

Left out: prompt upsampling (`Ideogram4PromptEnhancerHead`: captions are used as written; the model was trained on
structured JSON captions, which a data set's captions may already be), training the unconditional transformer,
the classic pipeline's `guidance_schedule` from a config, and attention without the (B, 1, S, S) segment mask
(SDPA off flash attention; 0.28 GB of mask a sample at 2048 px).
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager
from typing import Any, ClassVar

import diffusers
import torch
from diffusers.models.normalization import RMSNorm
from diffusers.models.transformers.transformer_ideogram4 import (
    IMAGE_POSITION_OFFSET,
    LLM_TOKEN_INDICATOR,
    OUTPUT_IMAGE_INDICATOR,
    SEQUENCE_PADDING_INDICATOR,
)
from diffusers.modular_pipelines.ideogram4.before_denoise import _resolution_aware_mu
from diffusers.modular_pipelines.ideogram4.encoders import QWEN3_VL_ACTIVATION_LAYERS
from torch import nn

from ._diffusers import DiffusersAdapter
from .base import Components
from .ideogram4_pipeline import Ideogram4EmbedsPipeline, prompt_tokens, recipe, text_features
from .lora_keys import KeyRule, LoraKeyMap
from .qwen_image_21 import QWEN3_VL_8B, QWEN3_VL_EMBED, QWEN3_VL_LM_HEAD, QWEN3_VL_VISUAL

#: Ideogram's own layout (the released checkpoints, ComfyUI's comfy/ldm/ideogram4/model.py, ai-toolkit's LoRAs, which
#: diffusers' `_convert_non_diffusers_ideogram4_lora_to_diffusers` reads): q / k / v fused into `attention.qkv` (in
#: that order), the output `attention.o`; the MLP, modulation and the modules outside the blocks keep their names
_B = "layers.{i}"
IDEOGRAM4_LORA_KEYS = LoraKeyMap((
    KeyRule(f"{_B}.attention.qkv", (f"{_B}.attention.to_q", f"{_B}.attention.to_k", f"{_B}.attention.to_v"),
            (1, 1, 1)),
    KeyRule(f"{_B}.attention.o", (f"{_B}.attention.to_out.0",)),
    *(KeyRule(f"{_B}.{m}", (f"{_B}.{m}",)) for m in ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
                                                       "adaln_modulation")),
    *(KeyRule(m, (m,)) for m in ("input_proj", "llm_cond_proj", "t_embedding.mlp_in", "t_embedding.mlp_out",
                                 "adaln_proj", "final_layer.linear", "final_layer.adaln_modulation")),
))
#: the text-free transformer every sample also runs (a pipeline component and folder of the model)
UNCONDITIONAL = "unconditional_transformer"


def pack(x: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, 4C): 2x2 patches, features ordered (patch row, patch column, channel), the
    inverse of `Ideogram4AfterDenoiseStep`'s un-patchify."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 3, 5, 1).reshape(b, (h // 2) * (w // 2), 4 * c)


def unpack(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of `pack` (the after-denoise step's view and permute)."""
    b, _, d = x.shape
    return x.view(b, h // 2, w // 2, 2, 2, d // 4).permute(0, 5, 1, 3, 2, 4).reshape(b, d // 4, h, w)


def bn_tiles(vae: nn.Module, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's batch-norm mean and std (running var + its `batch_norm_eps`) as (C, h, w) tiles over un-patchified
    latents shaped `like` (B, C, h, w), exactly as the decode step lays them out."""
    c, h, w = like.shape[1:]
    mean = vae.bn.running_mean.view(2, 2, c).permute(2, 0, 1)
    std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps).view(2, 2, c).permute(2, 0, 1)
    tile = (1, h // 2, w // 2)
    return mean.repeat(*tile).to(like.device, like.dtype), std.repeat(*tile).to(like.device, like.dtype)


def sequence_ids(mask: torch.Tensor, gh: int, gw: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(position_ids (B, S, 3), segment_ids (B, S), indicator (B, S)) of [padding][text][image] sequences from the
    left-padded text mask (B, L) and the image grid: the pipeline's `_prepare_ids`, on the mask's device without a
    host sync."""
    valid = mask.bool()
    b, dev = mask.shape[0], mask.device
    text_pos = (valid.long().cumsum(1) - 1).clamp(min=0) * valid
    rows = torch.arange(gh, device=dev).view(-1, 1).expand(gh, gw).reshape(-1)
    cols = torch.arange(gw, device=dev).view(1, -1).expand(gh, gw).reshape(-1)
    image_pos = torch.stack([torch.zeros_like(rows), rows, cols], 1) + IMAGE_POSITION_OFFSET
    n = gh * gw
    position_ids = torch.cat([text_pos.unsqueeze(-1).expand(-1, -1, 3), image_pos.expand(b, n, 3)], 1)
    one = torch.ones((), dtype=torch.long, device=dev)
    segment_ids = torch.cat([torch.where(valid, one, one * SEQUENCE_PADDING_INDICATOR), one.expand(b, n)], 1)
    indicator = torch.cat([torch.where(valid, one * LLM_TOKEN_INDICATOR, one * 0),
                           (one * OUTPUT_IMAGE_INDICATOR).expand(b, n)], 1)
    return position_ids, segment_ids, indicator


class _PassRMSNorm(RMSNorm):
    """The text RMSNorm, which passes its input through while `passthrough` is set (`Ideogram4Transformer2DModel`)."""

    passthrough = False

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states if self.passthrough else super().forward(hidden_states)


class _PassLinear(nn.Linear):
    """The text projection, which passes its input through while `passthrough` is set."""

    passthrough = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.passthrough else super().forward(x)


class Ideogram4Transformer2DModel(diffusers.Ideogram4Transformer2DModel):
    """diffusers' Ideogram4Transformer2DModel (same name, config and weights) that also takes the text features of
    the text region alone.

    diffusers' forward projects `encoder_hidden_states` (B, S, 53248), zeros on the image rows, over the whole
    sequence: at 1024 px with 512-token captions that is 0.5 GB of input in bf16, a masked copy and the text
    RMSNorm's two fp32 copies, ~3 GB of transients before the first block, and 2.3 TFLOP of projection, nine tenths
    of it on zeros. Given features of the first n < S rows only (`predict`: [padding][text] come first), this forward
    normalises and projects those rows with the model's own modules, pads the (B, n, 4608) result with zeros (what
    the image rows' features give: proj(norm(0)) times the mask 0) and runs diffusers' forward with the text modules
    passing it through. Given all S rows (the pipelines' calls), it is diffusers' forward, unchanged."""

    @functools.wraps(diffusers.Ideogram4Transformer2DModel.__init__)  # diffusers reads the config's keys there
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        norm, proj = self.llm_cond_norm, self.llm_cond_proj
        self.llm_cond_norm = _PassRMSNorm(norm.weight.shape[0], eps=norm.eps, elementwise_affine=True)
        self.llm_cond_proj = _PassLinear(proj.in_features, proj.out_features, bias=True)

    def project_text(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, n, 53248) text features -> (B, n, 4608), as diffusers' forward projects them (`mask`: (B, n, 1), 1 on
        text rows)."""
        return self.llm_cond_proj(self.llm_cond_norm(features * mask))

    @contextmanager
    def projected(self):
        """Within: the text norm and projection pass their input through (the features come projected)."""
        self.llm_cond_norm.passthrough = self.llm_cond_proj.passthrough = True
        try:
            yield
        finally:
            self.llm_cond_norm.passthrough = self.llm_cond_proj.passthrough = False

    def forward(self, hidden_states, timestep, encoder_hidden_states, position_ids, segment_ids, indicator,
                attention_kwargs=None, return_dict=True):
        n, s = encoder_hidden_states.shape[1], hidden_states.shape[1]
        kw = dict(timestep=timestep, position_ids=position_ids, segment_ids=segment_ids, indicator=indicator,
                  attention_kwargs=attention_kwargs, return_dict=return_dict)
        if n == s:
            return super().forward(hidden_states, encoder_hidden_states=encoder_hidden_states, **kw)
        mask = (indicator[:, :n] == LLM_TOKEN_INDICATOR).to(hidden_states.dtype).unsqueeze(-1)
        text = self.project_text(encoder_hidden_states, mask)
        projected = torch.cat([text, text.new_zeros(text.shape[0], s - n, text.shape[-1])], 1)
        with self.projected():
            return super().forward(hidden_states, encoder_hidden_states=projected, **kw)


class Ideogram4Adapter(DiffusersAdapter):
    family = "ideogram4"
    transformer_cls = Ideogram4Transformer2DModel
    pipeline_cls = Ideogram4EmbedsPipeline
    # every block Linear but the modulation (what ai-toolkit and SimpleTuner adapt: qkv, o, w1, w2, w3)
    default_lora_targets = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                            "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
    lora_key_map = IDEOGRAM4_LORA_KEYS
    modulation_linears = r"(^|\.)adaln_modulation\."
    token_wise = ("feed_forward",)  # the SwiGLU MLP (not a diffusers FeedForward)
    text_encoder_dirs = ("text_encoder",)
    text_encoder_classes = ("Qwen3VLModel",)
    tokenizer_dirs = ("tokenizer",)
    vae_cls_name = "AutoencoderKLFlux2"
    #: the pipeline hands the scheduler its own sigmas; a shift here would shift them again
    default_scheduler: ClassVar[dict[str, Any]] = {"shift": 1.0, "use_dynamic_shifting": False}
    max_sequence_length = recipe()["max_sequence_length"]  # 2048: the pipeline's window, the longest caption
    full_name, example_path = "Ideogram 4", "/path/to/ideogram-4"
    #: diffusers' defaults, which are the released transformer/config.json (34 layers, 18 heads x 256, MLP 12288,
    #: adaLN 512, 13 x 4096 text features, rope theta 5e6, mrope (24, 20, 20): as decoded from the release by
    #: third-party loaders; 9.28 B parameters, the "9.3 B" Ideogram states); the unconditional transformer is the
    #: same geometry
    full_config: ClassVar[dict[str, Any]] = {
        "in_channels": 128, "num_layers": 34, "attention_head_dim": 256, "num_attention_heads": 18,
        "intermediate_size": 12288, "adaln_dim": 512, "llm_features_dim": 53248, "rope_theta": 5_000_000,
        "mrope_section": [24, 20, 20], "norm_eps": 1e-5,
    }
    #: captions are unpadded, left-padded per batch; planned at 512 tokens (a structured JSON caption in its chat
    #: form is several hundred tokens)
    text_tokens = 512
    text_encoder_params = (("Qwen3-VL-8B", QWEN3_VL_8B - QWEN3_VL_LM_HEAD),)  # as Qwen3VLModel: no head
    text_encoder_unused_params = (QWEN3_VL_VISUAL,)  # the vision tower (`slim_text_encoder`)
    text_encoder_nonblock_params = (QWEN3_VL_EMBED,)
    text_encoder_layers = (36,)  # the deepest layer read is the last one: all stay
    vae_params = 84_046_115  # AutoencoderKLFlux2 defaults (Flux.2's VAE)
    sampling_uses_negative = False  # guidance runs the unconditional transformer, not a negative prompt
    sampling_components = (UNCONDITIONAL,)
    #: the sampling face's prompt features on the device (`Ideogram4EmbedsPipeline._projected_once`): fp32 over the
    #: 2048-token window, 53248 wide (0.44 GB), held through the call; before the loop their projection makes a
    #: bf16 copy, the masked copy and the text RMSNorm's fp32 copy and square (2 + 2 + 4 + 4 bytes a value, 1.31 GB)
    sampling_prompt = (4 * recipe()["max_sequence_length"] * full_config["llm_features_dim"],
                       12 * recipe()["max_sequence_length"] * full_config["llm_features_dim"])
    #: the pipeline's 48 steps at its main guidance weight (constant here: module essay)
    sample_defaults: ClassVar[dict[str, Any]] = {"steps": recipe()["steps"], "guidance": 7.0}
    latent_scale, token_patch = 8, 2

    _load_dir = "transformer"  # the folder `load` reads as `transformer` (UNCONDITIONAL for the other one)

    @classmethod
    def tiny_builders(cls):
        return {"ideogram4": tiny_pipeline}

    @classmethod
    def full_size_parts(cls, folder):
        """bench/program/bench_program.py's full-size random folders: Flux.2's VAE (built for real) and Qwen3-VL-8B as
        `Qwen3VLModel`, whole (36 layers, vision tower included), its special token ids those of the folder's tiny
        tokenizer."""
        import transformers
        from diffusers import AutoencoderKLFlux2

        from .qwen_image_21 import full_text_config, qwen3_vl_8b_config

        return AutoencoderKLFlux2(), [("text_encoder", transformers.Qwen3VLModel,
                                       full_text_config(folder, qwen3_vl_8b_config()))]

    @property
    def transformer_dir(self) -> str:
        return self._load_dir

    def load(self, cfg, *, parts, dtype, device="cpu") -> Components:
        """As every diffusers family's, and with part "experts" the unconditional transformer whole (the tests'
        reference; sampling reads it block by block: `load_component`), loaded
        from its own folder as the trained one would be (quantized alike; never from model.transformer_file)."""
        parts = set(parts)
        out = super().load(cfg, parts=parts - {"experts"}, dtype=dtype, device=device)
        if "experts" in parts:
            mc = cfg.model_copy(update={"transformer_file": None})
            other = type(self)(mc, self.references)
            other._load_dir = UNCONDITIONAL
            out.experts[UNCONDITIONAL] = other.load(mc, parts={"transformer"}, dtype=dtype, device=device).transformer
        return out

    def load_component(self, cfg, name: str, dtype: torch.dtype, device: torch.device | str):
        """The unconditional transformer with placeholder blocks, read from its own folder as the trained one would
        be (quantized alike; never from model.transformer_file): sampling during training loads it per call."""
        from . import stream_load

        mc = cfg.model_copy(update={"transformer_file": None})
        other = type(self)(mc, self.references)
        other._load_dir = name
        tr, loader = stream_load.load(other, mc, dtype, torch.device(device), True)
        return tr.requires_grad_(False), loader

    @classmethod
    def pipeline_transformers(cls, pipe) -> list:
        return [m for m in (pipe.transformer, pipe.unconditional_transformer) if m is not None]

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.layers)

    def slim_text_encoder(self, encoder: nn.Module) -> nn.Module:
        """Captions never see an image: the vision tower goes before the encoder is placed."""
        if getattr(encoder, "visual", None) is not None:
            encoder.visual = None
        return encoder

    def timestep_shift(self, height: int, width: int) -> float:
        """exp of the pipeline's resolution-aware schedule mean (module essay): sqrt(H W) / 512."""
        return math.exp(_resolution_aware_mu(height=height, width=width, base_mu=0.0))

    @classmethod
    def runs_cfg(cls, guidance: float) -> bool:  # noqa: ARG003 - the protocol
        return False  # no batch of two through one transformer: the unconditional pass is another model's

    # ------------------------------------------------------------------------------------------ tensors

    @torch.no_grad()
    def encode_prompts(self, components: Components, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Each caption alone through the text-encoder step at its own length (module essay): `prompt_embeds`
        (B, L, 53248) valid rows first, zero after, in the encoder's dtype (the step's fp32 holds its bf16 values
        exactly), and `prompt_embeds_mask` (B, L)."""
        (enc,), (tok,) = components.text_encoders, components.tokenizers
        rows = [text_features(enc, tok, p, window=prompt_tokens(tok, p))[0][0] for p in prompts]
        longest = max(r.shape[0] for r in rows)
        embeds = torch.stack([nn.functional.pad(r, (0, 0, 0, longest - r.shape[0])) for r in rows]).to(enc.dtype)
        mask = torch.zeros(len(rows), longest, dtype=torch.long, device=embeds.device)
        for i, r in enumerate(rows):
            mask[i, : r.shape[0]] = 1
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def collate_text(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Cached entries (valid rows first) left-padded to the batch's longest caption, with the left-padded mask."""
        if not items:
            raise ValueError("collate_text needs at least one entry")
        lengths = [int(it["prompt_embeds_mask"].sum()) for it in items]  # CPU tensors from the cache: no sync
        longest = max(lengths)
        embeds = torch.stack([nn.functional.pad(it["prompt_embeds"][:n], (0, 0, longest - n, 0))
                              for it, n in zip(items, lengths, strict=True)])
        mask = torch.zeros(len(items), longest, dtype=torch.long)
        for i, n in enumerate(lengths):
            mask[i, longest - n:] = 1
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def encode_images(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        lat = vae.encode(pixels.to(vae.dtype)).latent_dist.mode()
        mean, std = bn_tiles(vae, lat)
        return (lat - mean) / std

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:  # noqa: ARG002
        b, _, h, w = noisy_latents.shape
        x = pack(noisy_latents)
        feats, mask = text["prompt_embeds"].to(x.dtype), text["prompt_embeds_mask"]
        n_text, n_image = feats.shape[1], x.shape[1]
        positions, segments, indicator = sequence_ids(mask, h // 2, w // 2)
        if not isinstance(transformer, Ideogram4Transformer2DModel):  # diffusers' own class (a pipeline's): all rows
            feats = torch.cat([feats, x.new_zeros(b, n_image, feats.shape[-1])], 1)
        out = transformer(
            hidden_states=torch.cat([x.new_zeros(b, n_text, x.shape[-1]), x], 1),
            timestep=(1.0 - t.float()).to(x.dtype),  # model time: 0 is noise
            encoder_hidden_states=feats,  # the text rows alone: `Ideogram4Transformer2DModel`
            position_ids=positions,
            segment_ids=segments,
            indicator=indicator,
            return_dict=False,
        )[0]
        return -unpack(out[:, n_text:], h, w)  # the model's x0 - noise, as (noise - x0)

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta") -> dict:
        c, dev = transformer.config, torch.device(device)
        gh, gw = height // 16, width // 16
        positions, segments, indicator = sequence_ids(torch.ones(batch, text_tokens, dtype=torch.long, device=dev),
                                                      gh, gw)
        s = text_tokens + gh * gw
        return dict(
            hidden_states=torch.randn(batch, s, c.in_channels, device=dev, dtype=dtype),
            timestep=torch.ones(batch, device=dev, dtype=dtype),
            encoder_hidden_states=torch.randn(batch, text_tokens, c.llm_features_dim, device=dev, dtype=dtype),
            position_ids=positions, segment_ids=segments, indicator=indicator,
        )

    @classmethod
    def pipeline_embeds(cls, pipe, prompt, negative, device) -> dict[str, Any]:  # noqa: ARG003 - no negative
        feats, lengths = pipe.encode_prompt(prompt, device)
        return {"prompt_embeds": feats, "prompt_lengths": lengths}


# ---------------------------------------------------------------------------------------------- tiny model


def tiny_pipeline():
    """Tiny random Ideogram 4, saved as diffusers' own `Ideogram4Pipeline` (a real folder's layout): a 36-layer,
    16-wide Qwen3-VL (the pipeline reads layers 0 ... 35) over the tiny Qwen tokenizer with a Qwen3-VL-style chat
    template, Flux.2's tiny VAE (4 latent channels), and two transformers of 2 blocks 32 wide (conditional and
    unconditional, different seeds)."""
    from .flux2 import tiny_vae
    from .qwen_image_21 import CHAT_TEMPLATE, tiny_qwen3_vl
    from .tiny import flow_scheduler, qwen_tokenizer

    tok = qwen_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    encoder = tiny_qwen3_vl(tok, seed=51, layers=36).model  # Qwen3VLModel: the pipeline's class, no head
    kw = dict(in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2, intermediate_size=64,
              adaln_dim=16, llm_features_dim=len(QWEN3_VL_ACTIVATION_LAYERS) * 16, mrope_section=(4, 2, 2))
    torch.manual_seed(52)
    transformer = diffusers.Ideogram4Transformer2DModel(**kw)  # the library's class: saved as a real folder's
    torch.manual_seed(53)
    unconditional = diffusers.Ideogram4Transformer2DModel(**kw)
    return diffusers.Ideogram4Pipeline(scheduler=flow_scheduler(**Ideogram4Adapter.default_scheduler), vae=tiny_vae(),
                             text_encoder=encoder, tokenizer=tok, transformer=transformer,
                             unconditional_transformer=unconditional)
