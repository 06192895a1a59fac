"""Flux.3: Flux3Transformer2DModel (5.5 B: 5 text + 5 image + 5 reference-image per-mode blocks, then 28 joint single
blocks), a Qwen3-VL-4B text encoder read at eight intermediate layers, and Flux.2's VAE (AutoencoderKLFlux2).

diffusers 0.42.1 ships Flux.3 only as a *modular* pipeline (`diffusers/modular_pipelines/flux3`: blocks composed
into a `Flux3ModularPipeline`). How each piece here mirrors those blocks:

- text (`Flux3TextEncoderStep`): one prompt per call, put into the processor's chat template as a user turn with the
  generation prompt, right-padded to a multiple of 80 tokens (at most 8192), run through Qwen3-VL with the padding's
  position ids set to 1; the hidden states after layers 4, 8, ..., 32 are laid side by side per token:
  `prompt_embeds` (1, W, 8 x 2560). The transformer attends to the padding (it takes no text mask), so the window W
  is part of the recipe. `encode_prompts` calls the step's own static `_get_qwen3_vl_prompt_embeds` with the step's
  pad multiple and layers, so the recipe cannot drift.
- batches of captions. Captions of one batch have different windows. A padding row's hidden state does not depend
  on where it sits (it attends to the valid tokens only, at position 1), so a caption encoded at window W, extended
  with copies of its own padding row, is what the pipeline gives at a longer window (up to float rounding of the
  longer masked attention). Each cache entry keeps its window (`prompt_window`) and one padding row (`pad_embed`;
  a caption filling its window exactly gets it from a second call at W + 1); `collate_text` cuts each entry to its
  window and pads to the batch's longest with that row. (Entries are stored at their encode batch's longest
  window, the rows past their own being copies of that row: 3.3 MB per 80 rows in bf16.)
- latents: Flux.2's (the VAE's mode, patchified 2x2 into 128 channels, normalised with the VAE's batch-norm
  statistics, kept un-patchified as (B, 32, H/8, W/8)); the pipeline's tokens are `pack_2x2` of them.
- predict: image ids (0, 0.5 row, 0.5 col, 0) (`Flux3PrepareLatentsStep`, image_rope_scale 0.5), text ids
  (0, 0, 0, l), timestep = the flow time t (the pipeline passes its scheduler's t / 1000). The step-distilled
  checkpoints are flow maps (`flow_map` in the transformer config): each call also takes the time the step jumps
  to. Training on the flow-matching loss gives them target time = t, where a flow map is the model's velocity.
- shift: constant, the scheduler config's `shift` (the pipeline's `Flux3SetTimestepsStep`: 6.93), in training too.
- sampling: `Flux3Pipeline` (trainer/models/flux3_pipeline.py), a classic `DiffusionPipeline` face on the modular
  pipeline (so `dittrain sample`, sampling during training and the LoRA loader drive it as every other family's
  pipeline, with no family code outside these two files): it encodes with the text-encoder step's function, and
  calls the modular blocks without their prompt-upsampler and text-encoder steps, with the stored embeddings. Base
  checkpoints: classifier-free guidance through the pipeline's guider (`ClassifierFreeGuidance`, on unless the
  scale is 1; 50 steps at 3.5 by default); distilled ones (`Flux3DistilledAutoBlocks`): 16 steps, no guidance, the
  guidance value is ignored. LoRAs load through `Flux3LoraLoaderMixin` (both this pipeline and
  `Flux3ModularPipeline` inherit it). The mixin reads diffusers-layout files; it refuses the comfy layout as written
  (its `.alpha` keys hold no "lora", and it reads `lora_A` / `lora_B` only), which `dittrain sample` converts on the
  way in.

Reference images (image-to-image / edit: the `image_cond` mode) train as Flux.2's do, through Kontext's pairs
layout, and they are optional (`reference_optional`): Flux.3 is one model for text-to-image and for editing, so
the data decides. A data set with references (a `control/` folder beside the images, control2/ ... for several, or
a "control" metadata key) trains (references, target, caption) items, one without trains text-to-image. Each
reference is cut to the target's bucket, cached as a latent like any image, and reaches `predict` as
`control_latents` ((B, K, C, h, w) for K of them); `predict` hands them to the transformer as the modular blocks
do (`Flux3PrepareImageCondLatentsStep`): `image_cond_hidden_states`, their tokens joined in order, and
`image_cond_ids` (0, 0.5 row, 0.5 col, l) with l = -1, -2, ... per reference. The transformer itself runs the
reference tokens at timestep 0 (only the target's tokens get t; a flow map's target time reaches every mode) through
the reference-mode blocks (`mode_blocks.image_cond`), then joins them to the joint blocks' sequence; only the
target's tokens come out. `dittrain sample --image` (repeat it for several, in order) passes the reference, cut to
the sample's size, as the modular pipeline's `image=`, whose own `vae_encoder` step prepares and encodes it.
`max_references`: the pipeline's documented limit (10, its prompt upsampler's `MAX_REFERENCES`).

The reference-mode blocks (5 x 123 M parameters) run only with references. The adapter is bound to the run's
reference count (`ModelAdapter.references`: the fit's data, a sample's `--image`s, the planner's data): with
references they are blocks like the others (`blocks`: text mode, image mode, reference mode, joint, the order they
run in), streamed, checkpointed and quantized as the rest, and LoRA targets them too (`lora_targets`: the same six
Linears per block; the LoRA then also learns how the reference is read); the planner counts their tokens
(`reference_inputs`: K times the target's). Without references they sit with the non-block modules (resident,
1.2 GB in bf16, not quantized) and get no LoRA: a text-to-image run streams nothing it never runs (sampling with
`sample.image` during such a run still works, through the resident blocks).

Left out: the prompt upsampler (a Qwen3.5-9B that rewrites short prompts; captions are encoded as written, as the
pipeline does once its `prompt_upsampler` step is popped). A reference of another size than the target's bucket:
the pipeline keeps one reference at its own size (padded to the 16 px grid, at least 64 px a side: a smaller one
is reflect-padded, which training does not do) and fits several under 1 MP each; training cuts each to the target's
bucket, which is the pipeline's input for same-size pairs of at least 64 px (and at most 1 MP with several).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from diffusers import Flux3Transformer2DModel
from diffusers.modular_pipelines.flux3.prompt_upsampler import MAX_REFERENCES
from torch import nn

from ._diffusers import DiffusersAdapter, pack_2x2, packed_inputs, unpack_2x2
from .base import Components, MeasuredPreset
from .flux2 import CONTROL, Flux2Adapter, keep_layers
from .flux3_pipeline import Flux3Pipeline, recipe, text_embeds
from .lora_keys import KeyRule, LoraKeyMap
from .qwen_image import NoLogits

# ---------------------------------------------------------------------------------------------- LoRA key map

#: BFL's Flux.3 layout (diffusers' `convert_flux3_transformer_checkpoint_to_diffusers` and
#: `_convert_non_diffusers_flux3_lora_to_diffusers`): the per-mode blocks are `txt_mode_blocks` and
#: `content_mode_blocks.<mode>`, the joint ones `single_blocks`; inside a block q / k / v are `q_proj` / `k_proj` /
#: `v_proj`, the output `attn_out`, the MLP `mlp_in` / `mlp_out`. No fused layers. `norm_out.linear` is left out
#: (the original stores its halves swapped).
_INNER = (("q_proj", "attn.to_q"), ("k_proj", "attn.to_k"), ("v_proj", "attn.to_v"), ("attn_out", "attn.to_out.0"),
          ("mlp_in", "ff.linear_in"), ("mlp_out", "ff.linear_out"))
_BLOCKS = (("txt_mode_blocks", "txt_mode_blocks"), ("content_mode_blocks.image", "mode_blocks.image"),
           ("content_mode_blocks.image_cond", "mode_blocks.image_cond"), ("single_blocks", "single_transformer_blocks"))
_MODES = ("image", "image_cond", "txt")
FLUX3_LORA_KEYS = LoraKeyMap((
    *(KeyRule(f"{o}.{{i}}.{a}", (f"{d}.{{i}}.{b}",)) for o, d in _BLOCKS for a, b in _INNER),
    *(KeyRule(o, (d,)) for o, d in (
        ("emb_in.image", "x_embedders.image"), ("emb_in.image_cond", "x_embedders.image_cond"),
        ("txt_in", "context_embedder"), ("time_in.in_layer", "timestep_embedder.linear_1"),
        ("time_in.out_layer", "timestep_embedder.linear_2"), ("ref_time_in.in_layer", "target_timestep_embedder.linear_1"),
        ("ref_time_in.out_layer", "target_timestep_embedder.linear_2"), ("final_layer.image.linear", "proj_out"),
        *((f"{s}.{m}.lin", f"{s}.{m}.linear") for s in ("early_stream_modulations", "single_stream_modulations")
          for m in _MODES),
    )),
))

#: the Linears of every streamed block (text mode, image mode, reference mode and joint blocks share the names)
_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.linear_in", "ff.linear_out")
#: LoRA targets of the reference-mode blocks (up to 16), for runs with reference images (`lora_targets`)
REFERENCE_LORA_TARGETS = tuple(f"mode_blocks.image_cond.{i}.{m}" for i in range(16) for m in _LINEARS)

#: Qwen3-VL-4B as Qwen3VLForConditionalGeneration (head tied to the embedding; meta-counted from
#: krea2's `qwen3_vl_4b_config`): all, the vision tower, the embedding, one decoder layer
QWEN3_VL_4B, QWEN3_VL_4B_VISUAL, QWEN3_VL_4B_EMBED, QWEN3_VL_4B_LAYER = 4_437_815_808, 415_347_712, 388_956_160, 100_930_816


class Flux3Adapter(DiffusersAdapter):
    family = "flux3"
    transformer_cls = Flux3Transformer2DModel
    pipeline_cls = Flux3Pipeline
    # by full name: the reference-mode blocks (`mode_blocks.image_cond`, run only with references: `lora_targets`)
    # have the same Linear names; up to 16 per-mode and 64 joint blocks (the model has 5 and 28)
    default_lora_targets = tuple(
        f"{blocks}.{i}.{m}" for blocks, n in (("txt_mode_blocks", 16), ("mode_blocks.image", 16),
                                             ("single_transformer_blocks", 64))
        for i in range(n) for m in _LINEARS)
    lora_key_map = FLUX3_LORA_KEYS
    text_encoder_dirs = ("text_encoder",)
    text_encoder_classes = ("Qwen3VLForConditionalGeneration",)
    tokenizer_dirs = ()
    # the pipeline's `tokenizer` component is the Qwen3-VL processor (its chat template and tokenizer)
    processor_label, processor_dir = "Qwen3-VL", "tokenizer"
    extra_text_dirs = ("tokenizer",)
    text_encoder_keep_linears = r"(^|\.)lm_head\."  # never run (`slim_text_encoder`)
    vae_cls_name = "AutoencoderKLFlux2"
    default_scheduler = {"shift": 6.93}  # Flux3SetTimestepsStep's constant shift, when the folder has no scheduler
    max_sequence_length = 8192  # the text-encoder step's default (longer prompts are cut)
    full_name, example_path = "Flux.3", "/path/to/FLUX.3"
    # the whole `fit` and `sample` under a 7 GB cap, full-size random weights (bench/program/bench_program.py;
    # bench/history/2026-11-25.md, 2026-11-25 19:20 UTC): the largest phase (text caching) and the one steady step
    measured_presets = {("lora", 8): MeasuredPreset(0.85, True, "measured on an H100: fits, 6.1 GB reserved, 0.44 s a step")}
    full_config = {  # Flux3Transformer2DModel defaults (5.54 B parameters)
        "in_channels": 128, "cond_in_channels": 128, "num_layers": 5, "num_single_layers": 28,
        "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 20480, "timestep_channels": 256,
        "mlp_ratio": 3.0, "axes_dims_rope": [32, 32, 32, 32], "rope_theta": 10000, "eps": 1e-6, "flow_map": False,
    }
    #: the windows are multiples of 80 tokens: planned at two (a caption of up to ~150 words)
    text_tokens = 160
    text_encoder_params = (("Qwen3-VL-4B", QWEN3_VL_4B),)
    # `slim_text_encoder` drops the vision tower and the 3 decoder layers after the deepest one read (32 of 36)
    text_encoder_unused_params = (QWEN3_VL_4B_VISUAL + 3 * QWEN3_VL_4B_LAYER,)
    text_encoder_nonblock_params = (QWEN3_VL_4B_EMBED,)
    text_encoder_unloaded_params = (3 * QWEN3_VL_4B_LAYER,)  # `text_encoder_config`: layers 33-35 never built
    vae_params = 84_046_115  # AutoencoderKLFlux2 defaults
    sampling_uses_negative = True
    takes_reference = True  # optional: the data decides (module docstring)
    reference_optional = True
    max_references = MAX_REFERENCES  # the modular pipeline's documented limit (10)
    #: the base checkpoint's pipeline defaults; distilled: steps 16, guidance 1 (ignored by its pipeline)
    sample_defaults = {"steps": 50, "guidance": 3.5}
    latent_scale, token_patch = 8, 2

    @classmethod
    def tiny_builders(cls):
        return {"flux3": lambda: tiny_pipeline(distilled=False), "flux3-distilled": lambda: tiny_pipeline(True)}

    @classmethod
    def full_size_parts(cls, folder):
        """bench/program/bench_program.py's full-size random folders: Flux.2's VAE (built for real) and Qwen3-VL-4B whole (36
        layers, vision tower included), its special token ids those of the folder's tiny tokenizer."""
        import transformers
        from diffusers import AutoencoderKLFlux2

        from .krea2 import qwen3_vl_4b_config
        from .qwen_image_21 import full_text_config

        return AutoencoderKLFlux2(), [("text_encoder", transformers.Qwen3VLForConditionalGeneration,
                                       full_text_config(folder, qwen3_vl_4b_config()))]

    @property
    def is_distilled(self) -> bool:
        """A step-distilled (flow-map) checkpoint: its transformer config says so."""
        return bool(self.transformer_config.get("flow_map", False))

    @staticmethod
    def load_processor(folder):
        from .qwen_image_21 import load_processor

        return load_processor(folder)

    @classmethod
    def runs_cfg(cls, guidance: float) -> bool:
        # the pipeline's guider (ClassifierFreeGuidance) is on at any scale but 1 (distilled pipelines ignore it)
        return not math.isclose(guidance, 1.0)

    def pipeline(self, components: Components) -> Any:
        return Flux3Pipeline(
            transformer=components.transformer, vae=components.vae, scheduler=components.scheduler,
            text_encoder=components.text_encoders[0] if components.text_encoders else None,
            tokenizer=components.tokenizers[0] if components.tokenizers else None,
        )

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        # execution order: text mode, image mode, reference mode (with references only), joint blocks
        refs = list(transformer.mode_blocks["image_cond"]) if self.references else []
        return [*transformer.txt_mode_blocks, *transformer.mode_blocks["image"], *refs,
                *transformer.single_transformer_blocks]

    def lora_targets(self) -> tuple[str, ...]:
        """The text, image and joint blocks' Linears; with references the reference-mode blocks' too."""
        return (*self.default_lora_targets, *(REFERENCE_LORA_TARGETS if self.references else ()))

    def text_encoder_config(self, config):
        """Built with the decoder layers up to the deepest hidden state read (33 of Qwen3-VL-4B's 36)."""
        text = config.get_text_config()
        need = max(recipe()["layers"]) + 1
        if text.num_hidden_layers > need:
            text.num_hidden_layers = need
            if getattr(text, "layer_types", None):
                text.layer_types = text.layer_types[:need]
        return config

    def slim_text_encoder(self, encoder: nn.Module) -> nn.Module:
        """Captions are intermediate hidden states: the head becomes a no-op, the vision tower goes, and so do the
        layers after the deepest one read. Kept outputs are unchanged."""
        if hasattr(encoder, "lm_head"):
            encoder.lm_head = NoLogits()
        inner = getattr(encoder, "model", encoder)
        if getattr(inner, "visual", None) is not None:
            inner.visual = None
        lm = getattr(inner, "language_model", inner)
        lm.layers = keep_layers(lm.layers, recipe()["layers"])
        return encoder

    # ------------------------------------------------------------------------------------------ tensors

    @torch.no_grad()
    def encode_prompts(self, components: Components, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Each prompt alone through the pipeline's text step (see the module essay): `prompt_embeds` (B, W, D)
        padded to the longest window with each prompt's own padding row, `prompt_window` (B,), `pad_embed` (B, D)."""
        (enc,), (proc,) = components.text_encoders, components.tokenizers
        dev = enc.get_input_embeddings().weight.device
        cap = recipe()["max_sequence_length"]
        embeds, pads = [], []
        for p in prompts:
            e = text_embeds(enc, proc, p, dev)[0]
            chat = proc.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                            add_generation_prompt=True)
            real = proc.tokenizer(chat, truncation=True, max_length=cap)["input_ids"]
            w = e.shape[0]
            if len(real) < w:
                pad = e[-1]
            elif w < cap:  # no padding in this window: one more token gives the padding row
                pad = text_embeds(enc, proc, p, dev, pad_multiple=w + 1)[0, -1]
            else:  # the longest window: never padded further
                pad = torch.zeros_like(e[-1])
            embeds.append(e)
            pads.append(pad)
        windows = [e.shape[0] for e in embeds]
        longest = max(windows)
        return {
            "prompt_embeds": torch.stack([_extend(e, pad, longest) for e, pad in zip(embeds, pads, strict=True)]),
            "prompt_window": torch.tensor(windows, dtype=torch.long, device=dev),
            "pad_embed": torch.stack(pads),
        }

    def collate_text(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if not items:
            raise ValueError("collate_text needs at least one entry")
        windows = [int(it["prompt_window"]) for it in items]  # CPU tensors from the cache: no device sync
        longest = max(windows)
        return {"prompt_embeds": torch.stack([_extend(it["prompt_embeds"][:w], it["pad_embed"], longest)
                                              for it, w in zip(items, windows, strict=True)])}

    encode_images = Flux2Adapter.encode_images

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:  # noqa: ARG002
        _, _, h, w = noisy_latents.shape
        dev = noisy_latents.device
        x = pack_2x2(noisy_latents)
        embeds = text["prompt_embeds"]
        ts = t.to(x.dtype)
        refs = {}
        ref = text.get(CONTROL)
        if ref is not None:  # reference images: their own token sequence, told apart by l = -1, -2, ... in order
            each = ref.unbind(1) if ref.dim() == 5 else (ref,)  # (B, K, C, h, w): K references
            refs["image_cond_hidden_states"] = torch.cat([pack_2x2(r.to(x.dtype)) for r in each], dim=1)
            refs["image_cond_ids"] = torch.cat([image_ids(r.shape[-2] // 2, r.shape[-1] // 2, dev, -(k + 1))
                                                for k, r in enumerate(each)])
        out = transformer(
            hidden_states=x,
            encoder_hidden_states=embeds,
            timestep=ts,
            img_ids=image_ids(h // 2, w // 2, dev),
            txt_ids=text_ids(embeds.shape[1], dev),
            # a flow map at target time t is the velocity at t: what the flow-matching loss trains
            target_timestep=ts if transformer.config.flow_map else None,
            return_dict=False,
            **refs,
        )[0]
        return unpack_2x2(out, h, w)

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta") -> dict:
        kw = packed_inputs(transformer, batch, height, width, text_tokens, dtype, device, id_axes=4)
        if transformer.config.flow_map:
            kw["target_timestep"] = torch.ones(batch, device=torch.device(device), dtype=dtype)
        return kw

    @classmethod
    def reference_inputs(cls, inputs: dict[str, Any], references: int) -> dict[str, Any]:
        """Each reference (cut to the target's bucket) is a sequence of the target's token count (Flux.3's
        `cond_in_channels` equals `in_channels`) and ids, through the reference-mode blocks, joined in the joint
        blocks."""
        kw = dict(inputs)
        kw["image_cond_hidden_states"] = torch.cat([inputs["hidden_states"]] * references, dim=1)
        kw["image_cond_ids"] = torch.cat([inputs["img_ids"]] * references, dim=0)
        return kw

    @classmethod
    def pipeline_image(cls, pipe, image: Any) -> dict[str, Any]:
        """The reference (or list of references), already the sample's size, as the modular pipeline's `image=`;
        None: text-to-image."""
        return {} if image is None else {"image": image}

    @classmethod
    def pipeline_embeds(cls, pipe, prompt, negative, device) -> dict[str, torch.Tensor]:
        out = {"prompt_embeds": pipe.encode_prompt(prompt=prompt, device=device)}
        if negative is not None:
            out["negative_prompt_embeds"] = pipe.encode_prompt(prompt=negative, device=device)
        return out


def _extend(e: torch.Tensor, pad: torch.Tensor, n: int) -> torch.Tensor:
    """(W, D) embeddings followed by copies of their padding row, to (n, D)."""
    return e if e.shape[0] >= n else torch.cat([e, pad.to(e.dtype).expand(n - e.shape[0], -1)])


def image_ids(h2: int, w2: int, dev, l_coord: float = 0.0) -> torch.Tensor:
    """(h2 * w2, 4) ids (0, s row, s col, l_coord), s the pipeline's image RoPE scale: its `_prepare_image_ids`
    (l_coord 0: the target; -1, -2, ...: the references in order)."""
    s = recipe()["image_rope_scale"]
    ids = torch.zeros(h2, w2, 4, device=dev)
    ids[..., 3] = l_coord
    ids[..., 1] += torch.arange(h2, device=dev, dtype=torch.float32)[:, None] * s
    ids[..., 2] += torch.arange(w2, device=dev, dtype=torch.float32)[None, :] * s
    return ids.reshape(-1, 4)


def text_ids(n: int, dev) -> torch.Tensor:
    """(n, 4) ids (0, 0, 0, l): `Flux3TextRoPEInputsStep._prepare_text_ids`."""
    ids = torch.zeros(n, 4, device=dev)
    ids[:, 3] = torch.arange(n, device=dev)
    return ids


# ---------------------------------------------------------------------------------------------- tiny model


def tiny_pipeline(distilled: bool) -> Flux3Pipeline:
    """Tiny random Flux.3: a 34-layer, 16-wide Qwen3-VL (the pipeline reads hidden states 4 ... 32) with the tiny
    Qwen tokenizer in a Qwen3-VL processor, Flux.2's tiny VAE (4 latent channels), a transformer of 2 blocks per mode
    and 2 joint blocks, 32 wide; `distilled`: a flow-map transformer (the step-distilled checkpoints)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from .flux2 import tiny_vae
    from .qwen_image_21 import make_processor, tiny_qwen3_vl
    from .tiny import qwen_tokenizer

    tok = qwen_tokenizer()
    encoder = tiny_qwen3_vl(tok, seed=11, layers=34)
    torch.manual_seed(12)
    transformer = Flux3Transformer2DModel(
        in_channels=16, cond_in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=len(recipe()["layers"]) * 16, timestep_channels=32,
        axes_dims_rope=(4, 4, 4, 4), flow_map=distilled,
    )
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, **Flux3Adapter.default_scheduler)
    return Flux3Pipeline(transformer=transformer, vae=tiny_vae(), scheduler=sched, text_encoder=encoder,
                         tokenizer=make_processor(tok))
