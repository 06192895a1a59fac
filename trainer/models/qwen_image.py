"""Qwen-Image: QwenImageTransformer2DModel (MMDiT, 60 blocks), Qwen2.5-VL text encoder, a video VAE used on
single frames.

How it mirrors diffusers' QwenImagePipeline (0.42):

- text: the prompt is put in the pipeline's chat template, run through Qwen2.5-VL, the last hidden state taken
  at the valid tokens, and the template's first 34 tokens (the system prompt) dropped. Lengths differ per prompt,
  so the result is `prompt_embeds` (B, L, D) zero-padded plus `prompt_embeds_mask` (B, L), 1 = real token.
- collate: cached entries are trimmed to their own length and re-padded to the longest in the batch; when no entry
  needs padding the mask is left out, as the pipeline does (and attention then needs no mask at all). This is
  done on the CPU in the data path, so `predict` never syncs with the device to look at a mask.
- latents: the VAE takes (B, 3, 1, H, W) (one frame); its mean is normalised per channel with the config's
  `latents_mean` / `latents_std` and the frame axis squeezed, giving (B, C, H/8, W/8).
- predict: latents packed 2x2 into tokens as for Flux, `img_shapes` = (1, h/2, w/2) per sample for the 3-D rotary
  positions, timestep = t (the transformer scales by 1000 inside its timestep embedding).
- shift: dynamic (mu from the image token count, Qwen's `max_image_seq_len` 8192 and `max_shift` 0.9), read from
  the scheduler config.
- sampling (`QwenImagePipeline`): `prompt_embeds` + `prompt_embeds_mask`; true classifier-free guidance with
  `true_cfg_scale` when > 1 and a negative prompt (`guidance_scale` only for guidance-distilled variants).

Left out: the edit / layered variants (extra image conditioning), true CFG inside training.
"""

from __future__ import annotations

import torch
from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
from torch import nn

from ._diffusers import DiffusersAdapter, collate_masked_text, pack_2x2, unpack_2x2
from .base import Components
from .lora_keys import LoraKeyMap, identity_rules

#: ComfyUI's Qwen-Image model keeps diffusers' module names (its LoRA keys are `diffusion_model.<name>`; musubi-tuner's
#: are `lora_unet_<name with _>`), so the map is the identity over the modules a LoRA may adapt.
QWEN_IMAGE_LORA_KEYS = LoraKeyMap(identity_rules(
    "transformer_blocks",
    ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
     "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
     "txt_mlp.net.2", "img_mod.1", "txt_mod.1"),
    ("img_in", "txt_in", "proj_out", "norm_out.linear", "time_text_embed.timestep_embedder.linear_1",
     "time_text_embed.timestep_embedder.linear_2"),
))

TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
TEMPLATE_DROP = 34  # tokens of the system prompt, as QwenImagePipeline.prompt_template_encode_start_idx
#: Qwen2.5-VL-7B's parameters outside its decoder layers: the language-model head, the vision tower, the embedding
QWEN_VL_LM_HEAD, QWEN_VL_VISUAL, QWEN_VL_EMBED = 544_997_376, 676_550_144, 544_997_376


def tiny_qwen2_5_vl(tokenizer, layers: int = 2, seed: int = 4) -> nn.Module:
    """A `layers`-layer Qwen2.5-VL 16 wide (vision tower of one block) over the tiny Qwen tokenizer
    (trainer/models/tiny.py): Qwen-Image's tiny text encoder, and `dittrain caption`'s tests' model."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from .tiny import QWEN_SPECIAL

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    cfg = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": layers,
            "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1000000.0},
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        vocab_size=len(tokenizer), hidden_size=16, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(cfg).eval()


def tiny_parts() -> dict:
    """A tiny random Qwen-Image's pipeline parts (scheduler, vae, text_encoder, tokenizer, transformer): the
    Qwen2.5-VL text encoder with a one-layer vision tower, the video VAE (4 latent channels), two blocks."""
    from diffusers import AutoencoderKLQwenImage

    from .tiny import flow_scheduler, qwen_tokenizer

    tok = qwen_tokenizer()
    text_encoder = tiny_qwen2_5_vl(tok)
    torch.manual_seed(5)
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.05, 0.0], latents_std=[1.5, 2.0, 1.2, 1.8],
    )
    torch.manual_seed(12)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=4,
        joint_attention_dim=16, axes_dims_rope=(8, 4, 4),
    )
    sched = flow_scheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )
    return {"scheduler": sched, "vae": vae, "text_encoder": text_encoder, "tokenizer": tok, "transformer": transformer}


#: activation bytes per pixel at the peak of AutoencoderKLQwenImage's encode of one image in bf16: about twelve live
#: full-resolution tensors of its 96 channels (its causal 3-D convolutions pad and cache each frame). Sized to what
#: the latent caching of every family on this VAE measured at 1024 px, 3.62 GB reserved (Qwen-Image 8 and 24 GB
#: presets, bench/logs/2026-11-23e/f; Krea 2 16 GB, 2026-11-25i; Anima 8 GB, 2026-11-27-night), which Flux's
#: figure (6 x 128 x 2, trainer/planner/phases.py) put at 2.68 GB; this one gives 3.77 GB
QWEN_VAE_ENCODE_PER_PIXEL = 12 * 96 * 2


class NoLogits(nn.Module):
    """Stands in for a language-model head whose logits nobody reads: returns an empty last dimension."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[..., :0]


class QwenImageAdapter(DiffusersAdapter):
    family = "qwen-image"
    #: its key was `qwen_image` until the keys were unified (still accepted as a spelling): caches keep that name
    cache_name = "qwen_image"
    transformer_cls = QwenImageTransformer2DModel
    pipeline_cls = QwenImagePipeline
    default_lora_targets = (
        "to_q", "to_k", "to_v", "to_out.0",
        "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
    )
    lora_key_map = QWEN_IMAGE_LORA_KEYS
    comfy_reads_diffusers_lora = True  # comfy/lora.py model_lora_keys_unet
    text_encoder_dirs = ("text_encoder",)
    text_encoder_classes = ("Qwen2_5_VLForConditionalGeneration",)
    tokenizer_dirs = ("tokenizer",)
    vae_cls_name = "AutoencoderKLQwenImage"
    default_scheduler = {"shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 0.9,
                         "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02,
                         "time_shift_type": "exponential"}
    max_sequence_length = 1024  # QwenImagePipeline.tokenizer_max_length
    full_name, example_path = "Qwen-Image", "/path/to/Qwen-Image"
    full_config = {  # Qwen-Image: QwenImageTransformer2DModel defaults (20.4 B)
        "patch_size": 2,
        "in_channels": 64,
        "out_channels": 16,
        "num_layers": 60,
        "attention_head_dim": 128,
        "num_attention_heads": 24,
        "joint_attention_dim": 3584,
        "guidance_embeds": False,
        "axes_dims_rope": [16, 56, 56],
    }
    text_tokens = 256  # padded to the longest caption in the batch: assumed 256 for planning
    text_encoder_params = (("Qwen2.5-VL-7B", 8_292_166_656),)
    # Qwen2.5-VL-7B: the language-model head and the vision tower are never run for text-to-image captions
    # (`slim_text_encoder`); the token embedding stays beside the streamed decoder layers
    text_encoder_unused_params = (QWEN_VL_LM_HEAD + QWEN_VL_VISUAL,)
    text_encoder_nonblock_params = (QWEN_VL_EMBED,)
    #: Qwen2.5-VL's language-model head (unused for encoding) stays in the model dtype
    text_encoder_keep_linears = r"(^|\.)lm_head\."
    #: `img_mod.1`, `txt_mod.1`: the per-sample scale / shift / gate of both streams
    modulation_linears = r"(^|\.)[^.]*_mod\."
    vae_params = 126_892_531  # AutoencoderKLQwenImage (a 3-D video VAE used on single frames)
    vae_encode_bytes_per_pixel = QWEN_VAE_ENCODE_PER_PIXEL
    sampling_uses_negative = True

    @classmethod
    def tiny_builders(cls):
        return {"qwen-image": lambda: QwenImagePipeline(**tiny_parts())}

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.transformer_blocks)

    def slim_text_encoder(self, encoder: nn.Module) -> nn.Module:
        """Captions are the last layer's hidden states, never logits: the 152 k-token head (1.1 GB) becomes a
        no-op, and without reference images the vision tower (1.4 GB) goes too. The hidden states are unchanged."""
        if hasattr(encoder, "lm_head"):
            encoder.lm_head = NoLogits()
        inner = getattr(encoder, "model", None)
        if not self.text_uses_reference and getattr(inner, "visual", None) is not None:
            inner.visual = None
        return encoder

    @torch.no_grad()
    def encode_prompts(self, components: Components, prompts: list[str]) -> dict[str, torch.Tensor]:
        (enc,), (tok,) = components.text_encoders, components.tokenizers
        dev = enc.get_input_embeddings().weight.device
        toks = tok([TEMPLATE.format(p) for p in prompts], max_length=self.max_sequence_length + TEMPLATE_DROP,
                   padding=True, truncation=True, return_tensors="pt").to(dev)
        hidden = enc(input_ids=toks.input_ids, attention_mask=toks.attention_mask, output_hidden_states=True)
        hidden = hidden.hidden_states[-1]
        # Host-device sync (lengths), fine here: text encoding is off the training hot path.
        lengths = toks.attention_mask.sum(1).tolist()
        valid = toks.attention_mask.bool()
        parts = [h[m][TEMPLATE_DROP:] for h, m in zip(hidden, valid, strict=True)]
        longest = max(p.shape[0] for p in parts)
        embeds = torch.stack([nn.functional.pad(p, (0, 0, 0, longest - p.shape[0])) for p in parts]).to(enc.dtype)
        mask = torch.zeros(len(parts), longest, dtype=torch.long, device=dev)
        for i, n in enumerate(lengths):
            mask[i, : n - TEMPLATE_DROP] = 1
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def collate_text(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return collate_masked_text(items)

    def encode_images(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        c = vae.config
        lat = vae.encode(pixels.to(vae.dtype).unsqueeze(2)).latent_dist.mode()[:, :, 0]
        mean = torch.tensor(c.latents_mean, device=lat.device, dtype=lat.dtype).view(1, -1, 1, 1)
        std = torch.tensor(c.latents_std, device=lat.device, dtype=lat.dtype).view(1, -1, 1, 1)
        return (lat - mean) / std

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:
        b, _, h, w = noisy_latents.shape
        x = pack_2x2(noisy_latents)
        g = None
        if transformer.config.guidance_embeds:
            g = torch.full((b,), float(guidance), device=x.device, dtype=torch.float32)
        out = transformer(
            hidden_states=x,
            timestep=t.to(x.dtype),
            guidance=g,
            encoder_hidden_states=text["prompt_embeds"],
            encoder_hidden_states_mask=text.get("prompt_embeds_mask"),
            img_shapes=[[(1, h // 2, w // 2)]] * b,
            return_dict=False,
        )[0]
        return unpack_2x2(out, h, w)

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta") -> dict:
        c, dev = transformer.config, torch.device(device)
        rnd = {"device": dev, "dtype": dtype}
        ph, pw = height // 16, width // 16  # 8x VAE, then 2x2 packing
        return dict(
            hidden_states=torch.randn(batch, ph * pw, c.in_channels, **rnd),
            encoder_hidden_states=torch.randn(batch, text_tokens, c.joint_attention_dim, **rnd),
            encoder_hidden_states_mask=torch.ones(batch, text_tokens, dtype=torch.long, device=dev),
            timestep=torch.ones(batch, **rnd),
            img_shapes=[[(1, ph, pw)]] * batch,
        )

    @classmethod
    def pipeline_embeds(cls, pipe, prompt, negative, device) -> dict[str, torch.Tensor]:
        pe, mask = pipe.encode_prompt(prompt=prompt, device=device, num_images_per_prompt=1)
        out = {"prompt_embeds": pe, "prompt_embeds_mask": mask}
        if negative is not None:
            npe, nmask = pipe.encode_prompt(prompt=negative, device=device, num_images_per_prompt=1)
            out |= {"negative_prompt_embeds": npe, "negative_prompt_embeds_mask": nmask}
        return out

    @classmethod
    def pipeline_guidance(cls, pipe, guidance: float) -> dict:
        distilled = bool(getattr(pipe.transformer.config, "guidance_embeds", False))
        return {"true_cfg_scale": guidance, "guidance_scale": guidance if distilled else None}
