"""HunyuanVideo 1.5 text-to-video: HunyuanVideo15Transformer3DModel (8.3 B, 54 dual-stream blocks), Qwen2.5-VL-7B's
text model and a ByT5 glyph encoder, AutoencoderKLHunyuanVideo15 (16x in space, 4x in time, 32 channels),
`HunyuanVideo15Pipeline`.

How it mirrors diffusers' HunyuanVideo15Pipeline (0.42):

- text, Qwen: each prompt goes into the pipeline's chat template with its system message (a 5-point "describe the
  video" instruction), padded to 1000 + 108 tokens, through `Qwen2_5_VLTextModel` with its attention mask; the
  hidden state three from the end (`num_hidden_layers_to_skip` 2) is kept and its first 108 rows (the system part of
  the template, `prompt_template_encode_start_idx`) cut off -> `prompt_embeds` (B, 1000, 3584) and its 0/1 mask.
  `encode_prompts` calls the pipeline's own `_get_mllm_prompt_embeds` with the pipeline's settings (`RECIPE`,
  checked against a built pipeline in the tests), then casts as `encode_prompt` does.
- text, glyphs (the ByT5 branch): the quoted parts of the prompt ("..." or “...”) become `Text "a". Text "b". `,
  tokenized by ByT5 to 256 bytes and encoded by `text_encoder_2` -> `prompt_embeds_2` (B, 256, 1472) and its mask; a
  prompt without quotes gets zeros and an all-zero mask (`_get_byt5_prompt_embeds`, called as is).
- latents: the VAE's mean (`latent_dist.mode()`, the I2V pipeline's `retrieve_latents(..., "argmax")`) times
  `scaling_factor` (1.03682), the inverse of the pipeline's decode (`latents / scaling_factor`); no shift. The
  VAE takes (B, 3, F, H, W) with F = 4k + 1, an image is F = 1; diffusers runs every frame at once (44.5 GB at
  480p x 33), so the adapter's encode and the pipeline's decode run it in causal time chunks, the first frame then
  one latent frame at a time, which the planner counts (`vae_time_chunks`, trainer/models/hunyuan_video15_vae.py:
  the same latents within a few fp32 ulps, often bitwise).
- predict: the transformer takes [noisy latents, zero condition latents, zero mask] along the channels (32 + 32 + 1 =
  65 in_channels; the image-to-video model puts the first frame there), `image_embeds` of zeros (B, 729, 1152) (no
  image: the transformer then masks those 729 tokens out), both texts with their masks, and the timestep t * 1000
  in the latents' dtype, as the pipeline casts the scheduler's timestep (`t.expand(B).to(latents.dtype)`: in bf16
  that rounds it, which training then sees as sampling does). Patch size 1: latents in and out are (B, C, F, h, w).
  Inside, the transformer moves each sample's valid text tokens first (image, glyph, Qwen) and the padding after
  them, and the joint attention masks the padding (a (B, 1, S, S) boolean mask per block, S = video tokens + 1985).
  The adapter's transformer (`transformer_cls`) attends over each sample's valid prefix instead, without the mask:
  the same numbers within fp32 rounding (trainer/models/hunyuan_video15_attention.py); its blocks compute the
  token-wise work around attention as two regions that offload.nano_batches runs in token chunks
  (trainer/models/hunyuan_video15_block.py).
- shift: the folder's scheduler `shift` (FlowMatchEulerDiscreteScheduler, 5.0 for 480p, 9.0 for 720p), fixed.
- sampling: `HunyuanVideo15Pipeline` with the embeddings and masks of both encoders (and the negative prompt's:
  the pipeline's guider runs classifier-free guidance for any scale other than 1). The pipeline takes no
  `guidance_scale`: its `guider` (a `ClassifierFreeGuidance`, the folder's `guider/`, 6.0 for the T2V models) is
  replaced by a copy at the sample's scale (`pipeline_guidance`). The output is `frames`.
- LoRA files: diffusers 0.42's HunyuanVideo15Pipeline has no LoRA loader; its modular pipeline
  (`HunyuanVideo15ModularPipeline`) loads them with `HunyuanVideoLoraLoaderMixin`. `HunyuanVideo15Pipeline` below is
  diffusers' pipeline with that same mixin (same name, so folders saved by diffusers' pipeline are this family's),
  which `dittrain sample` and `load_lora_weights` use.

Full size (`full_config`): diffusers' defaults are the released 480p and 720p T2V transformers' config (diffusers'
scripts/convert_hunyuan_video1_5_to_diffusers.py `TRANSFORMER_CONFIGS["480p_t2v"]`: 54 layers, 16 heads of 128,
in 65 / out 32, Qwen 3584, ByT5 1472, SigLIP 1152, rope (16, 56, 56) at theta 256), except `task_type` ("i2v" by
default, "t2v" there; the forward never reads it); 720p differs in `target_size` only (960 for 640), which the
pipeline reads for its default size. 8,326,608,160 parameters, 8,157,072,384 of them in the 54 blocks.

Image-to-video (`HunyuanVideo15ImageToVideoPipeline`: SigLIP image embeddings and the first frame's latents in the
condition channels) is `hunyuan-video-1.5-i2v` (trainer/models/hunyuan_video15_i2v.py).

LoRA key names (`lora_key_map`, output.lora_format comfy / kohya, convert-lora): ComfyUI's names for the layers
(`HV15_LORA_KEYS` says where each comes from). Tencent's checkpoint splits the dual-stream blocks' q, k, v
(`double_blocks.N.img_attn_q`, ...) and calls the MLPs `img_mlp.fc1` and the modulation `img_mod.linear` (diffusers'
scripts/convert_hunyuan_video1_5_to_diffusers.py maps each to one diffusers layer); ComfyUI runs HunyuanVideo 1.5
on its Flux-style HunyuanVideo model, which fuses q, k, v (`img_attn.qkv`) and names those `img_mlp.0` and
`img_mod.lin`: the layout musubi-tuner's converter writes its LoRA files in for ComfyUI
(networks/convert_hunyuan_video_1_5_lora_to_comfy.py). The files dittrain writes use ComfyUI's names; musubi-tuner's
own files (Tencent's names under `lora_unet_`) are read too. docs/lora-files.md says what each name was checked
against. diffusers-keyed files: ComfyUI's HunyuanVideo LoRA branch maps `transformer.*` keys in the original names
only (comfy/lora.py, 2025-10), so for ComfyUI write comfy or kohya.

Left out: the step- and CFG-distilled variants' settings (their folders load as this family; sample them at
`sample.guidance` 1, their guider's scale: the sample's scale replaces the folder's), the 1080p super-resolution
model (`use_meanflow`), a comfy / kohya name for the final layer's modulation (`norm_out.linear`: diffusers' converter
swaps the halves of `final_layer.adaLN_modulation.1`, which a LoRA's rows would need too; writing one is refused,
naming it).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers import ClassifierFreeGuidance
from diffusers.loaders import HunyuanVideoLoraLoaderMixin
from torch import nn

from ._diffusers import NORM_MODULATION, T5_KEEP, DiffusersAdapter, tiny_token_ids
from .base import Components, MeasuredPreset
from .flux3_pipeline import _quiet_modular_notes
from .hunyuan_video15_block import HunyuanVideo15Transformer3DModel
from .hunyuan_video15_vae import time_chunks
from .lora_keys import KeyRule, LoraKeyMap


class HunyuanVideo15Pipeline(diffusers.HunyuanVideo15Pipeline, HunyuanVideoLoraLoaderMixin):
    """diffusers' HunyuanVideo15Pipeline with the LoRA loader of diffusers' HunyuanVideo 1.5 modular pipeline
    (`HunyuanVideoLoraLoaderMixin`: `load_lora_weights`, `set_adapters`), whose VAE decodes in causal time chunks
    (trainer/models/hunyuan_video15_vae.py); everything else is diffusers' own."""

    def __call__(self, *args, **kwargs):
        with time_chunks(self.vae):
            return super().__call__(*args, **kwargs)


#: the pipeline's prompt settings (set in `HunyuanVideo15Pipeline.__init__`; tests/test_hunyuan_video15.py checks them
#: against a built pipeline): the Qwen system message, the template tokens cut (the system part), the Qwen and ByT5
#: token lengths, the image tokens the transformer always gets
RECIPE: dict[str, Any] = {
    "system_message": "You are a helpful assistant. Describe the video by detailing the following aspects: \
        1. The main content and theme of the video. \
        2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects. \
        3. Actions, events, behaviors temporal relationships, physical movement changes of the objects. \
        4. background environment, light, style and atmosphere. \
        5. camera angles, movements, and transitions used in the video.",
    "prompt_template_encode_start_idx": 108,
    "tokenizer_max_length": 1000,
    "tokenizer_2_max_length": 256,
    "vision_num_semantic_tokens": 729,
}
#: the template prefix the pipeline cuts: with Qwen2.5-VL's tokenizer (and the tiny one) exactly 108 tokens
TEMPLATE_PREFIX = f"<|im_start|>system\n{RECIPE['system_message']}<|im_end|>\n<|im_start|>user\n"
#: Qwen2.5-VL's chat template for what the pipeline asks of it (a system and a user turn of text, a generation
#: prompt), written out short for the tiny tokenizer: the real one also handles images, videos and tool turns
QWEN25_VL_TEXT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: the converter's scheduler and guider for the 480p T2V model (used when a folder has no scheduler / guider config)
SCHEDULER = {"shift": 5.0}
GUIDANCE = 6.0
#: Qwen2.5-VL-7B's text model outside its 28 layers (token embedding, final norm); ByT5's outside its 12 blocks
QWEN_NONBLOCK, BYT5_NONBLOCK = 545_000_960, 566_720

_D, _R = "transformer_blocks.{i}", "context_embedder.token_refiner.refiner_blocks.{i}"
_DB, _RB = "double_blocks.{i}", "txt_in.individual_token_refiner.blocks.{i}"
_QKV, _ADD_QKV = tuple(f"{_D}.attn.to_{p}" for p in "qkv"), tuple(f"{_D}.attn.add_{p}_proj" for p in "qkv")
#: HunyuanVideo 1.5's layers in ComfyUI's names (`diffusion_model.*`, kohya `lora_unet_*`), each checked against the
#: Tencent name diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py (`convert_hyvideo15_transformer_to_
#: diffusers`, 2025-12) maps to that diffusers layer, turned into ComfyUI's by: the dual-stream blocks, musubi-tuner's
#: converter to ComfyUI's layout (networks/convert_hunyuan_video_1_5_lora_to_comfy.py: q, k, v fused into `qkv`,
#: `mlp_fc1` -> `mlp_0`, `mod_linear` -> `mod_lin`); the rest, ComfyUI's HunyuanVideo model (comfy/ldm/hunyuan_video,
#: its `process_unet_state_dict`: `self_attn_qkv` -> `self_attn.qkv`, `mlp.fc1` -> `mlp.0`, the embedders' `mlp.0` /
#: `linear_1` -> `in_layer`) and the SigLIP projection ComfyUI takes from Wan (`MLPProj`: `proj.1`, `proj.3`).
#: Fused layers stack q, k, v in that order (ComfyUI's and Tencent's `qkv` both). After them, read only (`place`
#: takes the first rule naming a module): musubi-tuner's own names, Tencent's, for its `lora_unet_*` files.
HV15_LORA_KEYS = LoraKeyMap((
    KeyRule(f"{_DB}.img_attn.qkv", _QKV, (1, 1, 1)),
    KeyRule(f"{_DB}.img_attn.proj", (f"{_D}.attn.to_out.0",)),
    KeyRule(f"{_DB}.txt_attn.qkv", _ADD_QKV, (1, 1, 1)),
    KeyRule(f"{_DB}.txt_attn.proj", (f"{_D}.attn.to_add_out",)),
    *(KeyRule(f"{_DB}.{s}_mlp.{o}", (f"{_D}.{ff}.net.{d}",))
      for s, ff in (("img", "ff"), ("txt", "ff_context")) for o, d in (("0", "0.proj"), ("2", "2"))),
    KeyRule(f"{_DB}.img_mod.lin", (f"{_D}.norm1.linear",)),
    KeyRule(f"{_DB}.txt_mod.lin", (f"{_D}.norm1_context.linear",)),
    KeyRule(f"{_RB}.self_attn.qkv", tuple(f"{_R}.attn.to_{p}" for p in "qkv"), (1, 1, 1)),
    KeyRule(f"{_RB}.self_attn.proj", (f"{_R}.attn.to_out.0",)),
    KeyRule(f"{_RB}.mlp.0", (f"{_R}.ff.net.0.proj",)),
    KeyRule(f"{_RB}.mlp.2", (f"{_R}.ff.net.2",)),
    KeyRule(f"{_RB}.adaLN_modulation.1", (f"{_R}.norm_out.linear",)),
    KeyRule("txt_in.input_embedder", ("context_embedder.proj_in",)),
    *(KeyRule(f"txt_in.{o}_embedder.{layer}", (f"context_embedder.time_text_embed.{d}_embedder.linear_{n}",))
      for o, d in (("t", "timestep"), ("c", "text")) for layer, n in (("in_layer", 1), ("out_layer", 2))),
    *(KeyRule(f"byt5_in.fc{n}", (f"context_embedder_2.linear_{n}",)) for n in (1, 2, 3)),
    KeyRule("vision_in.proj.1", ("image_embedder.linear_1",)),
    KeyRule("vision_in.proj.3", ("image_embedder.linear_2",)),
    KeyRule("time_in.in_layer", ("time_embed.timestep_embedder.linear_1",)),
    KeyRule("time_in.out_layer", ("time_embed.timestep_embedder.linear_2",)),
    KeyRule("final_layer.linear", ("proj_out",)),
    # musubi-tuner's names (read only)
    *(KeyRule(f"{_DB}.{s}_attn_{p}", (n,))
      for s, names in (("img", _QKV), ("txt", _ADD_QKV)) for p, n in zip("qkv", names, strict=True)),
    *(KeyRule(f"{_DB}.{s}_attn_proj", (f"{_D}.attn.{d}",)) for s, d in (("img", "to_out.0"), ("txt", "to_add_out"))),
    *(KeyRule(f"{_DB}.{s}_mlp.fc{o}", (f"{_D}.{ff}.net.{d}",))
      for s, ff in (("img", "ff"), ("txt", "ff_context")) for o, d in (("1", "0.proj"), ("2", "2"))),
    KeyRule(f"{_DB}.img_mod.linear", (f"{_D}.norm1.linear",)),
    KeyRule(f"{_DB}.txt_mod.linear", (f"{_D}.norm1_context.linear",)),
))


def tiny_pipeline() -> diffusers.HunyuanVideo15Pipeline:
    """A tiny random HunyuanVideo 1.5 T2V: a three-layer Qwen2.5-VL text model on the tiny Qwen tokenizer (trained
    with the pipeline's template prefix, so it is 108 tokens as with the real one), a two-layer ByT5 on the byte
    tokenizer, the 16x / 4x causal VAE with 4 latent channels, two dual-stream blocks, the 480p scheduler and guider."""
    from diffusers import AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler
    from transformers import (
        ByT5Tokenizer,
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        T5Config,
        T5EncoderModel,
    )

    from .tiny import QWEN_SPECIAL, qwen_tokenizer

    tok = qwen_tokenizer(extra_lines=(TEMPLATE_PREFIX,) * 8)
    tok.chat_template = QWEN25_VL_TEXT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    torch.manual_seed(41)
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )).eval()
    tok2 = ByT5Tokenizer()
    torch.manual_seed(42)
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tok2), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False, pad_token_id=tok2.pad_token_id,
        eos_token_id=tok2.eos_token_id, decoder_start_token_id=0,
    )).eval()
    torch.manual_seed(43)
    vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 8, 16, 16, 16), layers_per_block=1)
    torch.manual_seed(44)
    transformer = diffusers.HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2, num_refiner_layers=1,
        mlp_ratio=2.0, text_embed_dim=32, text_embed_2_dim=32, image_embed_dim=16, rope_axes_dim=(4, 6, 6),
        target_size=64, task_type="t2v",
    )
    with _quiet_modular_notes():
        guider = ClassifierFreeGuidance(guidance_scale=GUIDANCE)
    return diffusers.HunyuanVideo15Pipeline(
        text_encoder=text_encoder, tokenizer=tok, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), text_encoder_2=text_encoder_2, tokenizer_2=tok2,
        guider=guider)


class HunyuanVideo15Adapter(DiffusersAdapter):
    family = "hunyuan-video-1.5"
    transformer_cls = HunyuanVideo15Transformer3DModel
    pipeline_cls = HunyuanVideo15Pipeline
    #: the dual-stream blocks' attention (image and text projections) and both MLPs; the names also match the text
    #: token refiner's attention and MLP (two blocks outside the streamed ones, resident), as for Lumina 2's refiners
    default_lora_targets = (
        "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
    )
    lora_key_map = HV15_LORA_KEYS  # ComfyUI's names (module essay); image-to-video's too (the same transformer)
    text_encoder_dirs = ("text_encoder", "text_encoder_2")
    text_encoder_classes = ("Qwen2_5_VLTextModel", "T5EncoderModel")
    tokenizer_dirs = ("tokenizer", "tokenizer_2")
    text_encoder_keep_linears = T5_KEEP  # ByT5's `wo` (a T5); Qwen has none of that name
    vae_cls_name = "AutoencoderKLHunyuanVideo15"
    #: 16 px buckets (the VAE's 16x divisor), as Wan's: 832x480 is a bucket at 480p (resolution 632), not 832x512
    bucket_step = 16
    packs_2x2 = False  # the transformer patchifies (1, 1, 1) itself
    default_scheduler = SCHEDULER
    max_sequence_length = RECIPE["tokenizer_max_length"]
    full_name, example_path = "HunyuanVideo-1.5 (480p T2V)", "/path/to/HunyuanVideo-1.5-Diffusers-480p_t2v"
    # bench/history/2026-11-28.md 10:10 (before the token-region block of hunyuan_video15_block.py, sampling off)
    measured_presets = {
        ("lora", 16): MeasuredPreset(0.85, True, "measured on an H200: fits, 14.0 GB reserved, 20.7 s a step")}
    full_config = {  # the module essay says where these come from
        "in_channels": 65,
        "out_channels": 32,
        "num_attention_heads": 16,
        "attention_head_dim": 128,
        "num_layers": 54,
        "num_refiner_layers": 2,
        "mlp_ratio": 4.0,
        "patch_size": 1,
        "patch_size_t": 1,
        "qk_norm": "rms_norm",
        "text_embed_dim": 3584,
        "text_embed_2_dim": 1472,
        "image_embed_dim": 1152,
        "rope_theta": 256.0,
        "rope_axes_dim": (16, 56, 56),
        "target_size": 640,
        "task_type": "t2v",
        "use_meanflow": False,
    }
    #: the released 720p transformer: the same weights' shapes, `target_size` 960 (the size the pipelines pick by
    #: default, and the one the image-to-video pipeline picks for an image: 1280x720 at 960, 848x480 / 816x480 at
    #: 640), for bench_program's `--families hunyuan-video-1.5-720p` (its scheduler stays the tiny folder's 480p
    #: shift: sizes and times are the 480p model's)
    full_variants = {"720p": {**full_config, "target_size": 960}}
    #: Qwen tokens per caption, always padded to 1000 (`dummy_inputs` adds the 256 ByT5 and 729 image tokens the
    #: transformer always gets)
    text_tokens = RECIPE["tokenizer_max_length"]
    text_encoder_params = (("Qwen2.5-VL-7B text model", 7_070_619_136),
                           ("ByT5 glyph encoder (Glyph-SDXL-v2)", 217_657_472))
    text_encoder_nonblock_params = (QWEN_NONBLOCK, BYT5_NONBLOCK)
    text_encoder_layers = (28, 12)
    #: the blocks' AdaLayerNormZero Linears (`norm1.linear`, `norm1_context.linear`)
    modulation_linears = NORM_MODULATION
    #: offload.nano_batches splits all of a block but its attention kernel: the video tokens' work before attention
    #: (norm, modulation, q / k / v, q / k norms, rotary) and after it (output projection through the feed-forward's
    #: residual), and the text's feed-forward (trainer/models/hunyuan_video15_block.py)
    token_wise = ("token_pre", "token_post", "ff_context")
    latent_scale, token_patch = 16, 1
    vae_params = 1_260_634_115  # AutoencoderKLHunyuanVideo15 (diffusers' defaults: the released VAE)
    full_vae_config = {}  # diffusers' defaults are the released VAE: the planner builds it on meta
    #: its `tiled_decode` holds the blended rows and their concatenation beside the tiles (its `decode` clamps nothing)
    vae_tiled_decode_copies = 2
    #: presets: the pipeline's 121 frames at 720p and 480p, then shorter 480p clips
    preset_clips = (("720p", 121), ("480p", 121), ("480p", 81), ("480p", 49), ("480p", 33))
    sampling_uses_negative = True
    sample_defaults = {"guidance": GUIDANCE, "steps": 50}  # the pipeline's 50 steps, the T2V guider's 6.0

    # video (base.py): 4x temporal VAE, clips of 4k + 1 frames; the planner assumes the pipeline's 121 frames
    video = True
    frame_step = 4
    plan_frames = 121

    @classmethod
    def tiny_builders(cls):
        return {"hunyuan-video-1.5": tiny_pipeline}

    @classmethod
    def vae_latent_geometry(cls, config) -> tuple[int, int, int]:
        """AutoencoderKLHunyuanVideo15's config names."""
        return (int(config.latent_channels), int(config.spatial_compression_ratio),
                int(config.temporal_compression_ratio))

    @classmethod
    def vae_tiles(cls, vae) -> tuple[int, int, int, int]:
        """AutoencoderKLHunyuanVideo15 tiles by an overlap factor (`tile_overlap_factor`, 0.25): 256 px tiles every
        int(256 x 0.75) = 192 px when it encodes, every int(16 x 0.75) = 12 latent pixels (192 px) when it
        decodes (its `tiled_encode` / `tiled_decode`); no `tile_sample_stride_*`."""
        f, r = vae.tile_overlap_factor, int(vae.config.spatial_compression_ratio)
        th, tw = int(vae.tile_sample_min_height), int(vae.tile_sample_min_width)
        return th, tw, int(th // r * (1 - f)) * r, int(tw // r * (1 - f)) * r

    @classmethod
    def full_size_parts(cls, folder: Path):
        """bench/program/bench_program.py's full-size random folders: (AutoencoderKLHunyuanVideo15 at
        `full_vae_config`, diffusers' defaults = the released VAE, 1.26 B; [(sub-folder, class, config[, dtype of
        its matrices on disk])]) as the converter (diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py)
        saves the pipeline: `text_encoder` Qwen2.5-VL-7B-Instruct's language model alone (`Qwen2_5_VLTextModel`,
        28 layers of 3584, 152064 tokens, no head: 7.07 B), its 2-D weights written in fp8 (7.1 GB on disk
        instead of 14.1; transformers casts them to the load dtype, so RAM and VRAM are bf16's), nothing cut (the
        pipeline reads the third hidden state from the end, and the loader keeps every layer); `text_encoder_2`
        the Glyph-SDXL-v2 ByT5 encoder at google/byt5-small's encoder config (12 layers of 1472, 6 heads of 64,
        gated-GELU 3584, 384 byte tokens: 0.22 B, bf16). Both with the tiny tokenizers' special ids. The released
        ByT5 also has Glyph's added color / font tokens (`add_special_token` in the converter resizes the
        embedding): not counted here, as `text_encoder_params` does not count them (a few MB)."""
        from diffusers import AutoencoderKLHunyuanVideo15
        from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

        qwen = Qwen2_5_VLTextConfig(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1000000.0},
            **tiny_token_ids(folder))
        byt5 = T5Config(
            vocab_size=384, d_model=1472, d_kv=64, d_ff=3584, num_layers=12, num_heads=6,
            relative_attention_num_buckets=32, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
            use_cache=False, tie_word_embeddings=False, decoder_start_token_id=0,
            **tiny_token_ids(folder, "text_encoder_2", ("pad_token_id", "eos_token_id")))
        return AutoencoderKLHunyuanVideo15(**cls.full_vae_config), [
            ("text_encoder", Qwen2_5_VLTextModel, qwen, torch.float8_e4m3fn),
            ("text_encoder_2", T5EncoderModel, byt5)]

    # ------------------------------------------------------------------------------------------ folder facts

    @property
    def vae_scale_factor(self) -> int:
        return int(self.vae_config.get("spatial_compression_ratio", 16))

    def guider(self) -> ClassifierFreeGuidance:
        """The folder's guider (`guider/`), as `from_pretrained` builds the pipeline's; the converter's T2V one where
        a folder has none. Only the default formulation (CFG off exactly at scale 1) is taken: `runs_cfg` assumes it."""
        from ..errors import UserError

        root = Path(self.cfg.path)
        with _quiet_modular_notes():
            if not (root / "guider").is_dir():
                return ClassifierFreeGuidance(guidance_scale=GUIDANCE)
            g = diffusers.ClassifierFreeGuidance.from_pretrained(str(root), subfolder="guider")
        if type(g) is not ClassifierFreeGuidance or g.config.use_original_formulation or not g.config.enabled:
            raise UserError(f"{root / 'guider'}: {type(g).__name__} {dict(g.config)}: {self.family} samples with "
                            "ClassifierFreeGuidance in its default formulation (enabled, "
                            "use_original_formulation: false)")
        return g

    # ------------------------------------------------------------------------------------------ model

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.transformer_blocks)

    def pipeline(self, components: Components) -> HunyuanVideo15Pipeline:
        pipe = self.pipeline_cls(**self.pipeline_parts(components))
        # read from the transformer when the pipeline is built, else the full-size values (1152, 640): a fit's
        # samples build it before the trained transformer is swapped in, so they come from the folder's config
        c = self.transformer_config
        pipe.vision_states_dim, pipe.target_size = c.get("image_embed_dim", 1152), c.get("target_size", 640)
        return pipe

    def pipeline_parts(self, components: Components) -> dict[str, Any]:
        """The pipeline's components: the loaded ones and the folder's guider."""
        kw = {"transformer": components.transformer, "vae": components.vae, "scheduler": components.scheduler,
              "guider": self.guider()}
        for i, d in enumerate(self.text_encoder_dirs):
            kw[d] = components.text_encoders[i] if i < len(components.text_encoders) else None
        for i, d in enumerate(self.tokenizer_dirs):
            kw[d] = components.tokenizers[i] if i < len(components.tokenizers) else None
        return kw

    @torch.no_grad()
    def encode_prompts(self, components: Components, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Both encoders through the pipeline's own functions with its settings, cast as its `encode_prompt` casts
        (every tensor in the Qwen encoder's dtype, masks included)."""
        (enc, enc2), (tok, tok2) = components.text_encoders, components.tokenizers
        dev, dev2 = (e.get_input_embeddings().weight.device for e in (enc, enc2))
        pe, mask = HunyuanVideo15Pipeline._get_mllm_prompt_embeds(
            text_encoder=enc, tokenizer=tok, prompt=list(prompts), device=dev,
            tokenizer_max_length=RECIPE["tokenizer_max_length"], system_message=RECIPE["system_message"],
            crop_start=RECIPE["prompt_template_encode_start_idx"])
        pe2, mask2 = HunyuanVideo15Pipeline._get_byt5_prompt_embeds(
            tokenizer=tok2, text_encoder=enc2, prompt=list(prompts), device=dev2,
            tokenizer_max_length=RECIPE["tokenizer_2_max_length"])
        out = {"prompt_embeds": pe, "prompt_embeds_mask": mask, "prompt_embeds_2": pe2, "prompt_embeds_mask_2": mask2}
        return {k: v.to(device=dev, dtype=enc.dtype) for k, v in out.items()}

    @classmethod
    def vae_time_chunks(cls, vae: nn.Module):
        """The VAE's encoder and decoder run in causal time chunks (module essay)."""
        return time_chunks(vae)

    def encode_videos(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        with time_chunks(vae):
            return vae.encode(pixels.to(vae.dtype)).latent_dist.mode() * vae.config.scaling_factor

    def encode_images(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """An image is a 1-frame clip: (B, 3, H, W) -> (B, C, 1, h, w)."""
        return self.encode_videos(vae, pixels.unsqueeze(2))

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:
        x = noisy_latents
        b, _, f, h, w = x.shape
        # text-to-video: zero condition latents and mask channels, zero image embeddings (the pipeline's)
        cond = torch.cat([torch.zeros_like(x), x.new_zeros(b, 1, f, h, w)], dim=1)
        image = x.new_zeros(b, RECIPE["vision_num_semantic_tokens"], transformer.config.image_embed_dim)
        return transformer(
            hidden_states=torch.cat([x, cond], dim=1),
            timestep=(t * 1000.0).to(x.dtype),  # as the pipeline casts its timestep (module essay)
            encoder_hidden_states=text["prompt_embeds"],
            encoder_attention_mask=text["prompt_embeds_mask"],
            encoder_hidden_states_2=text["prompt_embeds_2"],
            encoder_attention_mask_2=text["prompt_embeds_mask_2"],
            image_embeds=image,
            return_dict=False,
        )[0]

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta",
                     frames: int | None = None) -> dict:
        """As `predict` builds them, for a clip of `frames` frames (default `plan_frames`: 121, 31 latent frames):
        every Qwen token valid, no glyph text. The masks and the image embeddings are read on the host (the
        transformer moves valid tokens first by boolean indexing, and tests the image embeddings for zero): CPU
        tensors even when tracing on the meta device."""
        c, dev = transformer.config, torch.device(device)
        host = torch.device("cpu") if dev.type == "meta" else dev
        rnd = {"device": dev, "dtype": dtype}
        f = cls.latent_frames(frames or cls.plan_frames)
        s = cls.latent_scale
        return dict(
            hidden_states=torch.randn(batch, c.in_channels, f, height // s, width // s, **rnd),
            timestep=torch.ones(batch, **rnd),
            encoder_hidden_states=torch.randn(batch, text_tokens, c.text_embed_dim, **rnd),
            encoder_attention_mask=torch.ones(batch, text_tokens, device=host, dtype=dtype),
            encoder_hidden_states_2=torch.randn(batch, RECIPE["tokenizer_2_max_length"], c.text_embed_2_dim, **rnd),
            encoder_attention_mask_2=torch.zeros(batch, RECIPE["tokenizer_2_max_length"], device=host, dtype=dtype),
            image_embeds=torch.zeros(batch, RECIPE["vision_num_semantic_tokens"], c.image_embed_dim, device=host,
                                     dtype=dtype),
        )

    # ------------------------------------------------------------------------------------------ sampling

    @classmethod
    def runs_cfg(cls, guidance: float) -> bool:
        """ClassifierFreeGuidance (default formulation) runs the negative pass at every scale but 1."""
        return not math.isclose(float(guidance), 1.0)

    @classmethod
    def pipeline_embeds(cls, pipe, prompt, negative, device) -> dict[str, torch.Tensor]:
        keys = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")
        out = dict(zip(keys, pipe.encode_prompt(prompt=prompt, device=device), strict=True))
        if negative is not None:
            out |= {f"negative_{k}": v for k, v in zip(keys, pipe.encode_prompt(prompt=negative, device=device),
                                                       strict=True)}
        return out

    @classmethod
    def pipeline_guidance(cls, pipe, guidance: float) -> dict:
        """The pipeline takes no guidance argument: its guider is replaced by a copy at this scale (no call
        arguments)."""
        guider = getattr(pipe, "guider", None)
        if guider is not None:
            with _quiet_modular_notes():
                pipe.guider = guider.new(guidance_scale=float(guidance))
        return {}

