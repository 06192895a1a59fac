"""Stable Diffusion 3 / 3.5: SD3Transformer2DModel (MMDiT), two CLIP encoders with projection + T5-XXL.

How it mirrors diffusers' StableDiffusion3Pipeline (0.42):

- text: each CLIP runs on 77 padded tokens with hidden states; its penultimate hidden state is the sequence part
  and its projected `text_embeds` the pooled part. The two CLIP sequences are concatenated on the feature axis,
  zero-padded (or cut) to T5's width, and put in front of T5's 256 tokens -> `prompt_embeds` (B, 77 + 256, D);
  the two pooled vectors are concatenated -> `pooled_prompt_embeds` (B, 2 * proj).
- latents: VAE mean, then (z - shift_factor) * scaling_factor.
- predict: no packing (the transformer patchifies itself, `patch_size` 2); the timestep is t * 1000 (the
  pipeline passes the scheduler's timesteps, sigma * 1000, unchanged).
- shift: fixed `shift` from the scheduler config (3.0 for SD3 and SD3.5); dynamic shifting is honoured if a
  scheduler config asks for it, with the image token count as the pipeline computes it.
- sampling (`StableDiffusion3Pipeline`): classifier-free guidance with `guidance_scale` when > 1, so the negative
  prompt's `negative_prompt_embeds` + `negative_pooled_prompt_embeds` are encoded too (two forwards per step).
- variants: SD3.5's `qk_norm` and `dual_attention_layers` live in the transformer config; nothing here depends on
  them, and the default LoRA targets also match the second attention (`attn2.to_q`, ...) of dual blocks.

Left out: running without T5 (the pipeline then feeds zeros), clip_skip, skip-layer guidance.
"""

from __future__ import annotations

import torch
from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
from torch import nn

from ._diffusers import NORM_MODULATION, T5_KEEP, DiffusersAdapter
from .base import Components
from .lora_keys import KeyRule, LoraKeyMap

_B, _J = "transformer_blocks.{i}", "joint_blocks.{i}"
#: Stability's MMDiT layout (ComfyUI's SD3 model, kohya's `lora_unet_joint_blocks_*`), as diffusers' single-file
#: converter reads it: q/k/v fused into `qkv`. `norm1_context.linear` is left out: the last block's original
#: stores its two halves swapped.
SD3_LORA_KEYS = LoraKeyMap((
    KeyRule(f"{_J}.x_block.attn.qkv", (f"{_B}.attn.to_q", f"{_B}.attn.to_k", f"{_B}.attn.to_v"), (1, 1, 1)),
    KeyRule(f"{_J}.x_block.attn.proj", (f"{_B}.attn.to_out.0",)),
    KeyRule(f"{_J}.x_block.attn2.qkv", (f"{_B}.attn2.to_q", f"{_B}.attn2.to_k", f"{_B}.attn2.to_v"), (1, 1, 1)),
    KeyRule(f"{_J}.x_block.attn2.proj", (f"{_B}.attn2.to_out.0",)),
    KeyRule(f"{_J}.context_block.attn.qkv", (f"{_B}.attn.add_q_proj", f"{_B}.attn.add_k_proj",
                                             f"{_B}.attn.add_v_proj"), (1, 1, 1)),
    KeyRule(f"{_J}.context_block.attn.proj", (f"{_B}.attn.to_add_out",)),
    KeyRule(f"{_J}.x_block.mlp.fc1", (f"{_B}.ff.net.0.proj",)),
    KeyRule(f"{_J}.x_block.mlp.fc2", (f"{_B}.ff.net.2",)),
    KeyRule(f"{_J}.context_block.mlp.fc1", (f"{_B}.ff_context.net.0.proj",)),
    KeyRule(f"{_J}.context_block.mlp.fc2", (f"{_B}.ff_context.net.2",)),
    KeyRule(f"{_J}.x_block.adaLN_modulation.1", (f"{_B}.norm1.linear",)),
    KeyRule("x_embedder.proj", ("pos_embed.proj",)),
    KeyRule("context_embedder", ("context_embedder",)),
    KeyRule("final_layer.linear", ("proj_out",)),
    KeyRule("t_embedder.mlp.0", ("time_text_embed.timestep_embedder.linear_1",)),
    KeyRule("t_embedder.mlp.2", ("time_text_embed.timestep_embedder.linear_2",)),
    KeyRule("y_embedder.mlp.0", ("time_text_embed.text_embedder.linear_1",)),
    KeyRule("y_embedder.mlp.2", ("time_text_embed.text_embedder.linear_2",)),
))


def tiny_pipeline():
    """A tiny random SD3.5-like model (qk RMS norm, dual-attention blocks) as a StableDiffusion3Pipeline."""
    from .tiny import clip_text, clip_tokenizer, flow_scheduler, kl_vae, t5_text, t5_tokenizer

    clip_tok, t5_tok = clip_tokenizer(), t5_tokenizer()
    torch.manual_seed(11)
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=8, num_attention_heads=4,
        caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64, out_channels=4,
        pos_embed_max_size=64, qk_norm="rms_norm", dual_attention_layers=(0, 1),
    )
    return StableDiffusion3Pipeline(
        scheduler=flow_scheduler(shift=3.0), vae=kl_vae(0.0609, 1.5035),
        text_encoder=clip_text(clip_tok, 16, 32, 1), tokenizer=clip_tok,
        text_encoder_2=clip_text(clip_tok, 16, 32, 2), tokenizer_2=clip_tok,
        text_encoder_3=t5_text(t5_tok, 32), tokenizer_3=t5_tok, transformer=transformer,
    )


class SD3Adapter(DiffusersAdapter):
    family = "sd3"
    transformer_cls = SD3Transformer2DModel
    pipeline_cls = StableDiffusion3Pipeline
    default_lora_targets = (
        "to_q", "to_k", "to_v", "to_out.0",
        "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
    )
    lora_key_map = SD3_LORA_KEYS
    comfy_reads_diffusers_lora = True  # comfy/lora.py model_lora_keys_unet
    text_encoder_dirs = ("text_encoder", "text_encoder_2", "text_encoder_3")
    text_encoder_classes = ("CLIPTextModelWithProjection", "CLIPTextModelWithProjection", "T5EncoderModel")
    tokenizer_dirs = ("tokenizer", "tokenizer_2", "tokenizer_3")
    default_scheduler = {"shift": 3.0}
    packs_2x2 = False
    max_sequence_length = 256  # StableDiffusion3Pipeline's default
    full_name, example_path = "SD3.5-large", "/path/to/stable-diffusion-3.5-large"
    full_config = {  # SD3.5-large (8.1 B)
        "sample_size": 128,
        "patch_size": 2,
        "in_channels": 16,
        "num_layers": 38,
        "attention_head_dim": 64,
        "num_attention_heads": 38,
        "joint_attention_dim": 4096,
        "caption_projection_dim": 2432,
        "pooled_projection_dim": 2048,
        "out_channels": 16,
        "pos_embed_max_size": 192,
        "qk_norm": "rms_norm",
    }
    text_tokens = 77 + 256  # CLIP's 77 in front of T5's max_sequence_length
    text_encoder_params = (
        ("CLIP-L", 123_650_304),
        ("CLIP-G", 694_659_840),
        ("T5-XXL encoder", 4_762_310_656),
    )
    text_encoder_keep_linears = T5_KEEP
    #: `norm1.linear`, `norm1_context.linear` (AdaLayerNormZero of the joint blocks)
    modulation_linears = NORM_MODULATION
    vae_params = 83_819_683  # diffusers AutoencoderKL of SD3.5, 16 latent channels
    sampling_uses_negative = True

    @classmethod
    def tiny_builders(cls):
        return {"sd3": tiny_pipeline}

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.transformer_blocks)

    @torch.no_grad()
    def encode_prompts(self, components: Components, prompts: list[str]) -> dict[str, torch.Tensor]:
        clips, t5 = components.text_encoders[:2], components.text_encoders[2]
        toks, t5_tok = components.tokenizers[:2], components.tokenizers[2]
        seqs, pooled = [], []
        for enc, tok in zip(clips, toks, strict=True):
            ids = tok(prompts, padding="max_length", max_length=toks[0].model_max_length, truncation=True,
                      return_tensors="pt").input_ids
            out = enc(ids.to(next(enc.parameters()).device), output_hidden_states=True)
            pooled.append(out[0])
            seqs.append(out.hidden_states[-2].to(clips[0].dtype))
        ids = t5_tok(prompts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                     add_special_tokens=True, return_tensors="pt").input_ids
        t5_embeds = t5(ids.to(next(t5.parameters()).device))[0].to(t5.dtype)
        clip_seq = torch.cat(seqs, dim=-1)
        clip_seq = nn.functional.pad(clip_seq, (0, t5_embeds.shape[-1] - clip_seq.shape[-1]))
        return {
            "prompt_embeds": torch.cat([clip_seq.to(t5_embeds.device), t5_embeds], dim=-2),
            "pooled_prompt_embeds": torch.cat(pooled, dim=-1),
        }

    def encode_images(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return self._kl_encode(vae, pixels)

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:
        return transformer(
            hidden_states=noisy_latents,
            timestep=t * 1000.0,
            encoder_hidden_states=text["prompt_embeds"],
            pooled_projections=text["pooled_prompt_embeds"],
            return_dict=False,
        )[0]

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta") -> dict:
        c = transformer.config
        rnd = {"device": torch.device(device), "dtype": dtype}
        return dict(
            hidden_states=torch.randn(batch, c.in_channels, height // 8, width // 8, **rnd),
            encoder_hidden_states=torch.randn(batch, text_tokens, c.joint_attention_dim, **rnd),
            pooled_projections=torch.randn(batch, c.pooled_projection_dim, **rnd),
            timestep=torch.ones(batch, **rnd),
        )

    @classmethod
    def pipeline_embeds(cls, pipe, prompt, negative, device) -> dict[str, torch.Tensor]:
        pe, npe, pooled, npooled = pipe.encode_prompt(
            prompt=prompt,
            prompt_2=None,
            prompt_3=None,
            device=device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=negative is not None,
            negative_prompt=negative,
        )
        out = {"prompt_embeds": pe, "pooled_prompt_embeds": pooled}
        if negative is not None:
            out |= {"negative_prompt_embeds": npe, "negative_pooled_prompt_embeds": npooled}
        return out
