"""LTX-2 text-to-video: LTX2VideoTransformer3DModel (18.9 B, 48 joint audio-video blocks), Gemma 3 12B with LTX-2's
text connectors, AutoencoderKLLTX2Video (32x in space, 8x in time, 128 channels), `LTX2Pipeline`.

LTX-2 is one transformer for sound and picture: every block runs a video stream (4096 wide) and an audio stream
(2048 wide), each with self-attention, cross-attention to the prompt and a feed-forward, joined by audio-to-video
and video-to-audio cross-attention. The pipeline always denoises both: a random audio latent beside the video one,
decoded by the audio VAE and the vocoder into a waveform.

How it mirrors diffusers' LTX2Pipeline (0.42):

- text: the prompt, stripped, tokenized left-padded to 1024 tokens, through Gemma 3 with its attention mask; every
  hidden state (the embeddings and the 48 layers' outputs, 49 x 3840) stacked per token (`_get_gemma_prompt_embeds`,
  called as is), then the pipeline's `connectors` (LTX2TextConnectors: a masked per-layer norm, a projection to
  3840 and a two-layer transformer per stream whose 128 learned registers take the padding's place, so every one
  of the 1024 rows is valid afterwards) -> `prompt_embeds` (B, 1024, 3840) for the video stream and its mask.
  The connectors are frozen: they load with the text encoder (`Components.extras`), stay in CPU RAM and visit the
  device of Gemma's states for each call; the cache holds their output, 7.9 MB a caption in bf16, not Gemma's
  385 MB of stacked states. They run one prompt at a time (`OnePromptConnectors`): their masked per-layer norm
  makes a masked copy and two fp32 copies of its whole input at once, 5 x 385 MB a prompt, which for the encode
  batch of 4 was the peak that ran the 16 GB preset out of its 15 GB
  (bench/logs/2026-11-27-night/ltx2_text_caching_oom_trace.txt). A sample's prompts go through them when they
  are encoded, beside the text encoder, not in the pipeline's call beside the transformer (`pipeline_embeds`).
  What captions' caching and a sample's prompts hold on the GPU beside the weights (`text_encode_peaks`,
  `sampling_prompt_bytes`) is what the planner counts.
- latents: the VAE's mean (`latent_dist.mode()`, the image-to-video pipeline's `retrieve_latents(..., "argmax")`)
  normalised per channel, (z - latents_mean) * scaling_factor / latents_std, the inverse of the pipeline's
  `_denormalize_latents`. Clips have 8k + 1 frames (an image is one); sides divide by 32.
- predict: the latents go in as tokens (`_pack_latents` with patch 1: (B, F h w, C)) with `num_frames`, `height`,
  `width` and the frame rate, from which the transformer makes its positions (in seconds: `FRAME_RATE`, the
  pipeline's 24 fps default); the timestep is t * 1000 (the scheduler's timesteps, sigma * 1000), passed as
  `timestep` and `sigma` as the pipeline passes it.
- sound (`model.audio`, default true: `trains_sound`): a clip of a video with an audio track trains both streams
  as the pipeline runs them, in the joint call (`isolate_modalities=False`): its sound, read under the clip and
  encoded by the audio VAE when the clip's latent is cached (trainer/models/ltx2_audio.py says how, and where each
  mel setting comes from), is the audio stream's input, noised at the video's t (the pipeline steps both with
  one schedule; Lightricks' trainer draws one sigma for both), with the connectors' audio prompt embeddings, the
  prompt mask for both streams, `audio_timestep` and `sigma` the step's t * 1000 and `audio_num_frames` the
  tokens, from which the transformer makes their positions in seconds; its flow-matching loss is added to the
  video's (`train.audio_loss_weight`, 1: Lightricks' trainer sums them). `predict` then returns (video,
  {"audio_latents": audio}).
- video alone (a clip without sound, a still, or every clip with `model.audio: false`): the transformer runs with
  `isolate_modalities=True` (no audio-to-video or video-to-audio cross-attention, as the pipeline's modality
  guidance pass runs it), so the video prediction does not depend on the audio stream at all, and the audio stream
  gets one zero token and a one-token zero prompt (it must run: the blocks take both streams; one token costs
  nothing). This is how Lightricks' own trainer trains without audio: the audio modality left out, the
  cross-modal attention with it. Feeding made-up sound instead (silence, or noise at the video's noise level)
  would train the cross-attention on a false pairing, "this scene sounds like silence". A call is joint or
  isolated for the whole batch, so clips with sound batch apart from those without (`Entry.audio`).
- LoRA targets: the attention of both streams and between them (`attn1`, `attn2`, `audio_attn1`, `audio_attn2`,
  `audio_to_video_attn`, `video_to_audio_attn`; Lightricks' audio-video LoRA configs target every `to_q` / `to_k`
  / `to_v` / `to_out.0`) and both feed-forwards; with `model.audio: false` the video stream's (`attn1`, `attn2`,
  `ff`), which a video-only loss reaches.
- sampling: the pipeline as it is, both streams joined; the sound it generates is written into the mp4 (AAC, at
  the vocoder's `output_sampling_rate`; `Clip.audio` holds the pipeline's waveform).
- shift: the folder's scheduler (FlowMatchEulerDiscreteScheduler with dynamic shifting, base 0.95 at 1024 tokens
  to 2.05 at 4096); the pipeline computes mu from the video tokens, so training takes the shift of a clip of
  `plan_frames` (121) frames at the bucket's size.
- sampling: `LTX2Pipeline` with the Gemma embeddings and mask of the prompt and of the negative prompt, already
  through the connectors (`pipeline_embeds`, `OnePromptConnectors.connect`: the call's own connectors hand them
  back unchanged, so the call computes what it would from the prompt): its audio
  guidance (`audio_guidance_scale` 7) runs classifier-free guidance at any video `guidance_scale`, so the negative
  pass always runs (`runs_cfg`). Everything else at the pipeline's defaults (its spatio-temporal guidance at block
  28, modality guidance 3, guidance rescale 0.7); `frame_rate` is `FRAME_RATE`.

Full size (`full_config`): diffusers' defaults are the released LTX-2 (19 B) transformer's config except
`rope_type`, "split" in the release (diffusers' scripts/convert_ltx2_to_diffusers.py, `get_ltx2_transformer_config`;
every other key there equals the default): 48 blocks, video 32 heads of 128, audio 32 of 64, caption 3840;
18,876,174,592 parameters, 18,531,581,952 in the blocks (268.6 M of a block's 386.1 M in its video stream). The
VAE is the converter's `get_ltx2_video_vae_config` (1.22 B). LTX-2.3 (gated attention, cross-attention AdaLN,
per-modality connectors) loads from its folder's configs; its full size is not declared here.

Image-to-video (`LTX2ImageToVideoPipeline`: the first latent frame is the image's) is `ltx2-i2v`
(trainer/models/ltx2_i2v.py).

Left out: audio-only clips (a sound file with no picture), the planner's count of the audio tokens (about 2 % of
the video's at 480p x 121) and of the audio VAE while latents are cached.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from diffusers import AutoencoderKLLTX2Audio, LTX2Pipeline, LTX2VideoTransformer3DModel
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from torch import nn

from . import ltx2_audio
from ._diffusers import DiffusersAdapter, tiny_token_ids
from .base import Clip, Components
from .lora_keys import KeyRule, LoraKeyMap, identity_rules

#: the pipeline's default `frame_rate`: the clips' positions are in seconds at this rate (train with data.fps: 24)
FRAME_RATE = 24.0
#: the pipeline's default `max_sequence_length` (Gemma tokens, left-padded)
MAX_SEQUENCE_LENGTH = 1024
#: LTX-2's scheduler (scheduler/scheduler_config.json of the release), used when a folder has none
SCHEDULER = {"use_dynamic_shifting": True, "base_shift": 0.95, "max_shift": 2.05, "base_image_seq_len": 1024,
             "max_image_seq_len": 4096, "shift_terminal": 0.1, "time_shift_type": "exponential"}
#: the released video VAE (diffusers' scripts/convert_ltx2_to_diffusers.py `get_ltx2_video_vae_config`)
VAE_CONFIG = {
    "latent_channels": 128, "block_out_channels": (256, 512, 1024, 2048), "decoder_block_out_channels": (256, 512, 1024),
    "layers_per_block": (4, 6, 6, 2, 2), "decoder_layers_per_block": (5, 5, 5, 5),
    "spatio_temporal_scaling": (True, True, True, True), "decoder_spatio_temporal_scaling": (True, True, True),
    "decoder_inject_noise": (False, False, False, False),
    "downsample_type": ("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    "upsample_residual": (True, True, True), "upsample_factor": (2, 2, 2), "timestep_conditioning": False,
    "patch_size": 4, "patch_size_t": 1, "encoder_causal": True, "decoder_causal": False,
    "encoder_spatial_padding_mode": "zeros", "decoder_spatial_padding_mode": "reflect",
    "spatial_compression_ratio": 32, "temporal_compression_ratio": 8,
}
#: Gemma 3 12B's SigLIP vision tower and its projector: a caption never runs them (`slim_text_encoder` drops them)
GEMMA3_VISION = 416_866_032 + 4_424_832
#: Gemma 3 12B (Gemma3ForConditionalGeneration) outside its 48 decoder layers, as slimmed: the 262k-token embedding
#: (tied to the head) and the final norm
GEMMA3_NONBLOCK = 12_187_325_040 - 10_759_151_616 - GEMMA3_VISION
#: LTX2TextConnectors' parameters at the release's config (its defaults with the "split" RoPE): 2.86 GB in bf16
CONNECTORS_PARAMS = 1_431_475_200
#: the audio VAE's and the vocoder's parameters at the release's config (their defaults): the pipeline decodes the
#: sound with them, on the sampling device from the prompts' encoding on (`pipeline_embeds`)
SOUND_DECODER_PARAMS = 53_248_146 + 55_592_802
#: per token, the values of Gemma 3 12B's hidden states the pipeline stacks: the embeddings' and the 48 layers'
#: outputs, 3840 wide (`_get_gemma_prompt_embeds`): 385 MB a 1024-token prompt in bf16
GEMMA3_STACKED = 49 * 3840
#: per token, Gemma 3 12B's largest live activations inside one decoder layer: the MLP's gate, up and product
#: (15360 wide) and a few 3840-wide tensors (q / k / v / residual), 126 MB a 1024-token prompt in bf16
GEMMA3_LAYER_ACT = 3 * 15360 + 4 * 3840


#: LTX-2's original layout (Lightricks' checkpoints, ComfyUI's `diffusion_model.*`, kohya `lora_unet_*`): the blocks'
#: Linears keep diffusers' names (diffusers' `_convert_non_diffusers_ltx2_lora_to_diffusers` renames only the input
#: projections, the AdaLN embeddings, the per-block cross-modal tables and the q / k norms), so the map is the
#: identity over the block Linears and the output / caption projections, plus the two input projections' names
_ATTNS = ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
LTX2_LORA_KEYS = LoraKeyMap((
    *identity_rules(
        "transformer_blocks",
        (*(f"{a}.{p}" for a in _ATTNS for p in ("to_q", "to_k", "to_v", "to_out.0")),
         "ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2"),
        ("proj_out", "audio_proj_out", "caption_projection.linear_1", "caption_projection.linear_2",
         "audio_caption_projection.linear_1", "audio_caption_projection.linear_2")),
    KeyRule("patchify_proj", ("proj_in",)),
    KeyRule("audio_patchify_proj", ("audio_proj_in",)),
))


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, F, h, w) -> (B, F h w, C): the pipeline's `_pack_latents` with patch size 1."""
    b, c, f, h, w = latents.shape
    return latents.permute(0, 2, 3, 4, 1).reshape(b, f * h * w, c)


def unpack(tokens: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """Inverse of `pack` for a (frames, height, width) latent grid."""
    b, _, c = tokens.shape
    return tokens.reshape(b, *grid, c).permute(0, 4, 1, 2, 3)


class OnePromptConnectors(LTX2TextConnectors):
    """LTX2TextConnectors (frozen, kept in CPU RAM) that visit the device of their input for a call, run one prompt
    (a row of the batch) at a time, and take their own outputs back as input.

    - One prompt at a time: the same embeddings, since every step of theirs is the prompt's own (the masked
      per-layer norm's mean and range over its tokens, the projection, the registers in its padding's place,
      attention among its tokens; bitwise on the CPU: tests/test_ltx2_memory.py), without the whole batch's
      temporaries: diffusers' `per_layer_masked_mean_norm` holds a masked copy and two fp32 copies of its
      (B, 1024, 3840 x 49) input at once.
    - Visiting: moved to the input's device for the call and back after (1.43 B parameters, 2.9 GB in bf16: kept
      on the GPU they would sit beside the training ring for the whole fit).
    - Their outputs as input: `connect` (a sample's prompts, `pipeline_embeds`) runs them while the text encoder
      is placed and packs their three outputs into one tensor (video embeddings, audio embeddings, mask as 0 / 1,
      along the features), which the pipeline's call passes back in as its `prompt_embeds` ([negative, prompt]
      concatenated); `forward` hands such a tensor back as the three outputs, without moving or computing. So a
      sample's call holds 15.7 MB a prompt instead of Gemma's 385 MB of stacked states (and their concatenation),
      and the connectors never visit beside the placed transformer. `load` builds the folder's connectors as
      this class."""

    def _widths(self) -> tuple[int, int]:
        """The video and audio embeddings' widths (the connector transformers' heads x head size)."""
        c = self.config
        return (c.video_connector_num_attention_heads * c.video_connector_attention_head_dim,
                c.audio_connector_num_attention_heads * c.audio_connector_attention_head_dim)

    def connect(self, states: torch.Tensor, mask: torch.Tensor, padding_side: str = "left") -> torch.Tensor:
        """The connectors' outputs for Gemma's stacked `states`, packed as `forward` takes them back."""
        video, audio, binary = self(states, mask, padding_side=padding_side)
        assert (video.shape[-1], audio.shape[-1]) == self._widths() and sum(self._widths()) + 1 != states.shape[-1]
        return torch.cat([video, audio, binary[..., None].to(video.dtype)], dim=-1)

    def forward(self, text_encoder_hidden_states, attention_mask, padding_side="left", scale_factor=8):
        x = text_encoder_hidden_states
        v, a = self._widths()
        if x.shape[-1] == v + a + 1:  # `connect`'s packed outputs (Gemma's states are 3840 x 49 wide)
            return x[..., :v].contiguous(), x[..., v : v + a].contiguous(), x[..., -1].to(torch.int64)
        home = next(self.parameters()).device
        self.to(x.device)  # host-to-device copy of 2.9 GB (full size) per call; back below
        try:
            rows = [super(OnePromptConnectors, self).forward(x[i : i + 1], attention_mask[i : i + 1],
                                                             padding_side=padding_side, scale_factor=scale_factor)
                    for i in range(x.shape[0])]
        finally:
            self.to(home)
        return tuple(torch.cat(parts) for parts in zip(*rows, strict=True))


def _stacked_bytes(prompts: int, itemsize: int) -> int:
    """Gemma's stacked hidden states of `prompts` prompts (the pipeline's `_get_gemma_prompt_embeds`)."""
    return prompts * MAX_SEQUENCE_LENGTH * GEMMA3_STACKED * itemsize


def _norm_bytes(itemsize: int) -> int:
    """What the connectors' masked per-layer norm of one prompt adds to its input at its peak: the masked copy in
    the model dtype and two fp32 copies (`(x - mean) / range`, then `* 8`, then the mask: two live at a time)."""
    return _stacked_bytes(1, itemsize) + 2 * _stacked_bytes(1, 4)


def tiny_pipeline() -> LTX2Pipeline:
    """A tiny random LTX-2: a two-layer Gemma 3 (with a one-layer SigLIP tower, as the real class has) on the tiny
    Gemma tokenizer, connectors with 8 registers, two joint blocks, the video VAE at the real geometry (32x, 8x,
    4 latent channels), a tiny audio VAE and vocoder (the pipeline decodes sound on every call), LTX-2's scheduler."""
    from diffusers import AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from .lumina2 import gemma_tokenizer

    tok = gemma_tokenizer()
    torch.manual_seed(61)
    text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config={"vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "sliding_window": 64,
                     "max_position_embeddings": 2048, "pad_token_id": tok.pad_token_id,
                     "eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id},
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 28, "patch_size": 14, "vision_use_head": False},
        mm_tokens_per_image=4, image_token_index=len(tok) - 1,
    )).eval()
    torch.manual_seed(62)
    connectors = LTX2TextConnectors(
        caption_channels=32, text_proj_in_factor=3, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=16, video_connector_num_layers=1, video_connector_num_learnable_registers=8,
        audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=16, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=8, connector_rope_base_seq_len=64, rope_type="split")
    torch.manual_seed(63)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
        audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=8,
        audio_cross_attention_dim=16, num_layers=2, caption_channels=32, rope_type="split")
    torch.manual_seed(64)
    vae = AutoencoderKLLTX2Video(
        latent_channels=4, block_out_channels=(8, 8, 16, 16), layers_per_block=(1, 1, 1, 1, 1),
        decoder_block_out_channels=(8, 16, 32), decoder_layers_per_block=(1, 1, 1, 1),
        spatial_compression_ratio=32, temporal_compression_ratio=8)
    with torch.no_grad():  # a per-channel normalisation that is not the identity, as the real VAE's
        vae.latents_mean.copy_(torch.tensor([0.1, -0.2, 0.05, 0.0]))
        vae.latents_std.copy_(torch.tensor([1.5, 2.0, 1.2, 1.8]))
    torch.manual_seed(65)
    audio_vae = AutoencoderKLLTX2Audio(  # three levels: 4x in time and mel, as the pipeline assumes (2 x 2 = 4 features)
        base_channels=4, output_channels=2, ch_mult=(1, 1, 1), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8)
    with torch.no_grad():  # per packed feature, not the identity
        audio_vae.latents_mean.copy_(torch.tensor([0.2, -0.1, 0.0, 0.3]))
        audio_vae.latents_std.copy_(torch.tensor([1.3, 0.7, 1.1, 2.0]))
    torch.manual_seed(66)
    vocoder = LTX2Vocoder(
        in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
        resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]], leaky_relu_negative_slope=0.1,
        output_sampling_rate=16000)
    return LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae, audio_vae=audio_vae,
                        text_encoder=text_encoder, tokenizer=tok, connectors=connectors, transformer=transformer,
                        vocoder=vocoder)


class LTX2Adapter(DiffusersAdapter):
    family = "ltx2"
    transformer_cls = LTX2VideoTransformer3DModel
    pipeline_cls = LTX2Pipeline
    #: both streams' attention, the attention between them and both feed-forwards (module essay); `lora_targets`
    #: keeps the video stream's with model.audio false (".attn1" does not match `audio_attn1`, "ff." not `audio_ff`)
    default_lora_targets = (
        *(f"{a}.{p}" for a in _ATTNS for p in ("to_q", "to_k", "to_v", "to_out.0")),
        "ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2",
    )
    sound = True
    noised_streams = ("audio_latents",)
    lora_key_map = LTX2_LORA_KEYS
    text_encoder_dirs = ("text_encoder",)
    text_encoder_classes = ("Gemma3ForConditionalGeneration",)
    tokenizer_dirs = ("tokenizer",)
    #: the connectors turn Gemma's states into the embeddings the cache holds: part of the text cache's identity
    extra_text_dirs = ("connectors",)
    max_sequence_length = MAX_SEQUENCE_LENGTH
    vae_cls_name = "AutoencoderKLLTX2Video"
    full_vae_config = VAE_CONFIG
    vae_params = 1_222_479_601
    latent_scale, token_patch = 32, 1
    packs_2x2 = False  # patch size 1: one token per latent pixel
    bucket_step = 32  # the VAE's divisor: 832x480 is no bucket (480 = 15 x 32), 768x512 and 1280x704 are
    default_scheduler = SCHEDULER
    full_name, example_path = "LTX-2 (19B)", "/path/to/LTX-2-Diffusers"
    full_config = {"rope_type": "split"}  # diffusers' defaults otherwise (module essay)
    text_tokens = MAX_SEQUENCE_LENGTH  # always 1024 rows: the registers fill the padding
    text_encoder_params = (("Gemma 3 12B (with LTX-2's text connectors)", 12_187_325_040 + CONNECTORS_PARAMS),)
    text_encoder_nonblock_params = (GEMMA3_NONBLOCK,)
    #: the vision tower the loader drops, and the connectors: loaded with Gemma (its RAM) but never placed with it;
    #: they visit the GPU for their own call, which `text_encode_peaks` counts
    text_encoder_unused_params = (GEMMA3_VISION + CONNECTORS_PARAMS,)
    text_encoder_layers = (48,)
    #: the blocks' scale / shift / gate are Parameters (`scale_shift_table`, ...) plus the time embeddings outside
    #: the blocks: no block Linear is a modulation Linear
    modulation_linears = ""
    #: the video stream's feed-forward (4096 -> 16384 -> 4096); the audio stream's runs on one token here
    token_wise = ("ff",)
    sampling_uses_negative = True
    sample_defaults = {"guidance": 3.0, "steps": 30}  # the pipeline's defaults
    #: presets: the pipeline's 121 frames (5 s at 24 fps) at 720p and 480p, then shorter 480p clips
    preset_clips = (("720p", 121), ("480p", 121), ("480p", 81), ("480p", 49), ("480p", 33))

    # video (base.py): 8x temporal VAE, clips of 8k + 1 frames; the planner assumes the pipeline's 121 frames
    video = True
    frame_step = 8
    plan_frames = 121
    default_fps = FRAME_RATE  # data.fps where a config sets none
    fixed_fps = True  # `predict` tells the transformer FRAME_RATE: another data.fps is refused

    @classmethod
    def tiny_builders(cls):
        return {"ltx2": tiny_pipeline}

    @classmethod
    def full_size_parts(cls, folder: Path):
        """bench/program/bench_program.py's full-size random folders: (the video VAE, `VAE_CONFIG`; [(sub-folder,
        class, config[, dtype of its matrices on disk])]): Gemma 3 12B as Gemma3ForConditionalGeneration whole (48
        layers 3840 wide, 262k tokens, the SigLIP tower and projector the loader drops: `slim_text_encoder`), its
        2-D weights written in fp8 (12.2 GB on disk instead of 24.4; transformers casts them to the load dtype, so
        RAM and VRAM are bf16's), with the tiny tokenizer's special ids. Nothing is cut: the pipeline stacks every
        hidden state. Then three diffusers models the bench builds for real, as it does the VAE: the text
        connectors (LTX2TextConnectors' defaults, 1.43 B, with the transformer's "split" RoPE), the audio VAE and
        the vocoder (their defaults: the release's, trainer/models/ltx2_audio.py)."""
        from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
        from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration

        gemma = Gemma3Config(
            text_config={"vocab_size": 262_208, "hidden_size": 3840, "intermediate_size": 15360,
                         "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8,
                         "head_dim": 256, "sliding_window": 1024, "query_pre_attn_scalar": 256,
                         "max_position_embeddings": 131_072, **tiny_token_ids(folder)},
            vision_config={"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                           "num_attention_heads": 16, "patch_size": 14, "image_size": 896, "vision_use_head": False},
            mm_tokens_per_image=256, image_token_index=262_144)
        return AutoencoderKLLTX2Video(**VAE_CONFIG), [
            ("text_encoder", Gemma3ForConditionalGeneration, gemma, torch.float8_e4m3fn),
            ("connectors", LTX2TextConnectors, {"rope_type": "split"}),
            ("audio_vae", AutoencoderKLLTX2Audio, {}),
            ("vocoder", LTX2Vocoder, {})]

    @classmethod
    def vae_latent_geometry(cls, config) -> tuple[int, int, int]:
        """AutoencoderKLLTX2Video's config names (its defaults leave the ratios None: the release sets 32 and 8)."""
        return (int(config.latent_channels), int(config.spatial_compression_ratio or 32),
                int(config.temporal_compression_ratio or 8))

    # ------------------------------------------------------------------------------------------ folder facts

    @property
    def vae_scale_factor(self) -> int:
        return int(self.vae_config.get("spatial_compression_ratio") or 32)

    @property
    def latent_channels(self) -> int:
        return int(self.vae_config.get("latent_channels", 128))

    def lora_targets(self) -> tuple[str, ...]:
        """Both streams' (module essay); the video stream's alone when this run trains no sound."""
        if self.trains_sound:
            return tuple(self.default_lora_targets)
        return tuple(t for t in self.default_lora_targets if t.split(".")[0] in ("attn1", "attn2", "ff"))

    def cache_dirs(self, part: str) -> tuple[str, ...]:
        """With sound, latents are named by the audio VAE's files too (their entries hold the sound)."""
        return super().cache_dirs(part) + (("audio_vae",) if part == "vae" and self.trains_sound else ())

    def cache_variant(self, part: str) -> str:
        """With sound the caption entries hold the connectors' audio embeddings too, the latents the sound."""
        return "|sound" if self.trains_sound else ""

    def shift_seq_len(self, height: int, width: int) -> int:
        """The pipeline's mu counts the video tokens: those of a `plan_frames` clip at this size (module essay)."""
        return self.latent_frames(self.plan_frames) * self.image_seq_len(height, width)

    # ------------------------------------------------------------------------------------------ loading

    def load(self, cfg, *, parts, dtype, device="cpu") -> Components:
        """As every family loads, and with the text encoder its connectors (`extras["connectors"]`,
        `OnePromptConnectors`), kept in CPU RAM: they visit the device of Gemma's states for each call, one prompt
        at a time; with the VAE, where this run
        trains sound, the audio VAE (`extras["sound_encoder"]`, fp32 on `device`: Lightricks' trainer encodes
        sound in fp32 "for quality")."""
        out = super().load(cfg, parts=parts, dtype=dtype, device=device)
        if "vae" in parts and self.trains_sound:
            import diffusers

            out.extras["sound_encoder"] = diffusers.AutoencoderKLLTX2Audio.from_pretrained(
                str(cfg.path), subfolder="audio_vae", torch_dtype=torch.float32, local_files_only=True,
            ).to(device).eval().requires_grad_(False)
        if "text" in parts:
            from ..errors import UserError

            root = Path(cfg.path)
            if not (root / "connectors" / "config.json").is_file():
                raise UserError(f"{root / 'connectors'} not found: expected LTX-2's text connectors of a "
                                f"diffusers-format {self.family} folder ({self._expected()}, connectors/)")
            conn = OnePromptConnectors.from_pretrained(str(root), subfolder="connectors", torch_dtype=dtype,
                                                       local_files_only=True)
            out.extras["connectors"] = conn.eval().requires_grad_(False)
        return out

    def slim_text_encoder(self, encoder: nn.Module) -> nn.Module:
        """Without Gemma's vision tower and projector (0.42 B parameters): captions are text only, and neither the
        pipeline's `encode_prompt` nor `encode_prompts` reaches them without `pixel_values`."""
        encoder.model.vision_tower = None
        encoder.model.multi_modal_projector = None
        return encoder

    def pipeline(self, components: Components) -> LTX2Pipeline:
        """The pipeline from the loaded parts, and the folder's audio VAE and vocoder (it decodes sound on every
        call; loaded here, in the VAE's dtype)."""
        import diffusers
        from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

        root, dtype = str(self.cfg.path), components.vae.dtype
        audio_vae = diffusers.AutoencoderKLLTX2Audio.from_pretrained(root, subfolder="audio_vae", torch_dtype=dtype,
                                                                     local_files_only=True)
        vocoder = LTX2Vocoder.from_pretrained(root, subfolder="vocoder", torch_dtype=dtype, local_files_only=True)
        encs, toks = components.text_encoders, components.tokenizers
        return LTX2Pipeline(
            scheduler=components.scheduler, vae=components.vae, audio_vae=audio_vae.eval(), vocoder=vocoder.eval(),
            text_encoder=encs[0] if encs else None, connectors=components.extras.get("connectors"),
            tokenizer=toks[0] if toks else None, transformer=components.transformer)

    # ------------------------------------------------------------------------------------------ model

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.transformer_blocks)

    @torch.no_grad()
    def encode_prompts(self, components: Components, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Gemma's stacked states through the pipeline's own `_get_gemma_prompt_embeds` (on the encoder's language
        model: the logits over 262k tokens are never read), then the connectors' video embeddings and mask, one
        prompt at a time (`OnePromptConnectors`). Gemma runs the batch at once: one pass of its streamed layers per
        batch, its stacked states `data.encode_batch_size` x 385 MB (`text_encode_peaks`)."""
        (enc,), (tok,), conn = components.text_encoders, components.tokenizers, components.extras["connectors"]
        dev = enc.get_input_embeddings().weight.device
        host = SimpleNamespace(tokenizer=tok, text_encoder=enc.model)
        states, mask = LTX2Pipeline._get_gemma_prompt_embeds(host, list(prompts), max_sequence_length=MAX_SEQUENCE_LENGTH,
                                                             device=dev, dtype=enc.dtype)
        video, audio, video_mask = conn(states, mask, padding_side=tok.padding_side)  # on `dev` for this call
        out = {"prompt_embeds": video.to(enc.dtype), "prompt_attention_mask": video_mask}
        if self.trains_sound:  # the audio stream's prompt (the pipeline's `connector_audio_prompt_embeds`)
            out["audio_prompt_embeds"] = audio.to(enc.dtype)
        return out

    @classmethod
    def text_encode_peaks(cls, batch: int, itemsize: int, stage: str = "cache") -> list[tuple[int, int]]:
        """(weights, activations) on the GPU beside Gemma's placed weights (its ring and its embedding) at each peak
        of encoding prompts in the model dtype's `itemsize` (the planner's text phases take the largest, the
        activations with its allocator overhead). `stage` "cache": captions' caching (`encode_prompts`), `batch`
        captions through Gemma at once: the model's tuple of hidden states and the pipeline's stack of it (both
        live until `_get_gemma_prompt_embeds` returns) and one layer's activations; then the connectors' weights
        visiting, the batch's stacked states and one prompt's norm (`OnePromptConnectors`). For 4 captions in bf16:
        3.6 GB, then 2.86 + 3.47 GB. "sample": a sample's prompt and negative prompt (`pipeline_embeds`), each
        through Gemma alone (the prompt's states held during the negative's pass), then connected one at a time
        with both states held. Checked against the trace of the batch of 4 before the connectors ran one prompt at
        a time (bench/logs/2026-11-27-night/ltx2_text_caching_oom_trace.txt): at the OOM 2.863 GB of connectors,
        1.541 of stacked states and 1.541 of the norm's masked copy were live beside Gemma's 6.05 GB, as this count
        has them (tests/test_ltx2_memory.py)."""
        one = MAX_SEQUENCE_LENGTH * GEMMA3_LAYER_ACT * itemsize
        weights = CONNECTORS_PARAMS * itemsize
        if stage == "sample":
            return [(0, 3 * _stacked_bytes(1, itemsize) + one), (weights, 2 * _stacked_bytes(1, itemsize)
                                                                  + _norm_bytes(itemsize))]
        return [(0, 2 * _stacked_bytes(batch, itemsize) + batch * one),
                (weights, _stacked_bytes(batch, itemsize) + _norm_bytes(itemsize))]

    @classmethod
    def sampling_prompt_bytes(cls, batch: int, itemsize: int) -> int:
        """What a sample's pipeline call holds on the GPU for its prompts beside the transformer and the video VAE,
        for a denoising batch of `batch` (2: the negative prompt's pass), from start to end: the connectors'
        packed outputs `pipeline_embeds` gives it and the pipeline's concatenation of them (its local
        `prompt_embeds`; 15.7 MB a prompt in bf16), and the audio VAE and vocoder (moved there with the prompts'
        encoding). The connectors ran with the text encoder, before the transformer was placed."""
        widths = 2 * 3840 + 1  # the release's video and audio embeddings (30 heads of 128 each) and the mask
        packed = batch * MAX_SEQUENCE_LENGTH * widths * itemsize
        return packed * (2 if batch > 1 else 1) + SOUND_DECODER_PARAMS * itemsize

    def sound_rate(self, encoder: nn.Module) -> int:
        return int(encoder.config.sample_rate)

    def encode_sound(self, encoder, wave, frames, fps) -> dict[str, torch.Tensor]:
        """The clips' sound as the audio tokens the pipeline denoises (trainer/models/ltx2_audio.py)."""
        return {"audio_latents": ltx2_audio.encode_sound(encoder, wave, frames, fps)}

    def encode_videos(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        lat = vae.encode(pixels.to(vae.dtype)).latent_dist.mode()
        return LTX2Pipeline._normalize_latents(lat, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)

    def encode_images(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """An image is a 1-frame clip: (B, 3, H, W) -> (B, C, 1, h, w)."""
        return self.encode_videos(vae, pixels.unsqueeze(2))

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0):
        """The video prediction; with the clips' noisy sound in `text` ("audio_latents"), the joint call's (video,
        {"audio_latents": audio}) (module essay)."""
        x = noisy_latents
        f, h, w = x.shape[2:]
        return self._call(transformer, pack(x), t * 1000.0, text, (f, h, w))

    def _call(self, transformer, tokens, timestep, text, grid, sigma=None):
        """The transformer on video tokens (and the sound where `text` has it), unpacked as `predict` returns it."""
        video, audio = transformer(**self._inputs(transformer, tokens, timestep, text, grid, sigma),
                                   return_dict=False)
        video = unpack(video, grid)
        return (video, {"audio_latents": audio}) if "audio_latents" in text else video

    @staticmethod
    def _inputs(transformer, tokens, timestep, text, grid: tuple[int, int, int],
                sigma: torch.Tensor | None = None) -> dict[str, Any]:
        """The transformer's call (module essay) on the video tokens of a (frames, height, width) latent grid at
        `timestep` ((B,), or (B, tokens) for image-to-video; `sigma`: the step's (B,), else `timestep`, which the
        audio stream gets too). With `text["audio_latents"]` (the noisy audio tokens) the joint call, as the pipeline
        makes it; without, the video-only one: the cross-modal attention off, the audio stream one zero token with a
        one-token zero prompt."""
        c, b = transformer.config, tokens.shape[0]
        f, h, w = grid
        step = timestep if sigma is None else sigma
        embeds, mask = text["prompt_embeds"], text["prompt_attention_mask"]
        common = dict(hidden_states=tokens, encoder_hidden_states=embeds, timestep=timestep, sigma=step,
                      audio_timestep=step, encoder_attention_mask=mask, num_frames=f, height=h, width=w,
                      fps=FRAME_RATE)
        sound = text.get("audio_latents")
        if sound is not None:
            return dict(common, audio_hidden_states=sound.to(tokens.dtype),
                        audio_encoder_hidden_states=text["audio_prompt_embeds"], audio_encoder_attention_mask=mask,
                        audio_num_frames=sound.shape[1], isolate_modalities=False)
        return dict(common, audio_hidden_states=tokens.new_zeros(b, 1, c.audio_in_channels),
                    audio_encoder_hidden_states=embeds.new_zeros(b, 1, c.caption_channels), audio_num_frames=1,
                    isolate_modalities=True)

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta",
                     frames: int | None = None, sound: bool = False) -> dict:
        """As `predict` builds them, for a clip of `frames` frames (default `plan_frames`: 121, 16 latent frames);
        `sound`: the joint call of a clip with an audio track, as long as the clip at the released audio VAE's
        rate (diffusers' `AutoencoderKLLTX2Audio` defaults: 126 audio tokens for 121 frames), else video only."""
        c, dev = transformer.config, torch.device(device)
        rnd = {"device": dev, "dtype": dtype}
        frames = frames or cls.plan_frames
        grid = (cls.latent_frames(frames), height // cls.latent_scale, width // cls.latent_scale)
        tokens = torch.randn(batch, grid[0] * grid[1] * grid[2], c.in_channels, **rnd)
        text = {"prompt_embeds": torch.randn(batch, text_tokens, c.caption_channels, **rnd),
                "prompt_attention_mask": torch.ones(batch, text_tokens, device=dev, dtype=torch.long)}
        if sound:
            vae = inspect.signature(AutoencoderKLLTX2Audio.__init__).parameters
            n = ltx2_audio.latent_frames(frames, FRAME_RATE, vae["sample_rate"].default, vae["mel_hop_length"].default)
            text |= {"audio_latents": torch.randn(batch, n, c.audio_in_channels, **rnd),
                     "audio_prompt_embeds": torch.randn(batch, text_tokens, c.caption_channels, **rnd)}
        return cls._inputs(transformer, tokens, torch.ones(batch, **rnd), text, grid)

    # ------------------------------------------------------------------------------------------ sampling

    @classmethod
    def runs_cfg(cls, guidance: float) -> bool:
        """The pipeline's audio guidance (7) runs classifier-free guidance whatever the video scale."""
        return True

    @classmethod
    def pipeline_embeds(cls, pipe, prompt, negative, device) -> dict[str, torch.Tensor]:
        """The prompt's (and the negative prompt's) Gemma states and masks from the pipeline's `encode_prompt`, put
        through the connectors now, while the text encoder is placed, and passed as `prompt_embeds` packed
        (`OnePromptConnectors.connect`: the pipeline's call hands them back to itself unchanged, so its
        embeddings are those it would compute); the audio VAE and vocoder, which decode the sound after every
        call, go to `device` (0.11 B parameters at full size)."""
        for name in ("audio_vae", "vocoder"):
            getattr(pipe, name).to(device)
        pe, pm, npe, npm = pipe.encode_prompt(prompt=prompt, negative_prompt=negative,
                                              do_classifier_free_guidance=negative is not None, device=device)
        side = getattr(pipe.tokenizer, "padding_side", "left")  # as the pipeline's call reads it
        out = {"prompt_embeds": pipe.connectors.connect(pe, pm, side), "prompt_attention_mask": pm}
        if negative is not None:
            out |= {"negative_prompt_embeds": pipe.connectors.connect(npe, npm, side),
                    "negative_prompt_attention_mask": npm}
        return out

    @classmethod
    def pipeline_frames(cls, pipe, frames: int) -> dict[str, Any]:
        return {"num_frames": int(frames), "frame_rate": FRAME_RATE}

    @classmethod
    def pipeline_result(cls, out, pipe=None):
        """The frames with the sound the pipeline made (`Clip`: `write_video` muxes it into the mp4), at the
        vocoder's `output_sampling_rate`."""
        rate = pipe.vocoder.config.output_sampling_rate if pipe is not None else None
        return Clip(out.frames[0], out.audio[0].float().cpu(), rate) if rate else out.frames[0]
