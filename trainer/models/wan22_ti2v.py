"""Wan 2.2 TI2V-5B, text-to-video: one 5 B transformer on Wan 2.2's own VAE, `WanPipeline` with `expand_timesteps`.

What differs from Wan 2.1 (trainer/models/wan.py), as diffusers' WanPipeline (0.42) runs it:

- the VAE (AutoencoderKLWan with `is_residual`, `patch_size` 2, `z_dim` 48) patchifies the pixels 2x2 before its
  encoder, so a latent pixel covers 16x16 pixels (`scale_factor_spatial` 16) and 4 frames; with the transformer's
  (1, 2, 2) patch a token covers 32x32 pixels (the buckets' divisor). Latents are normalised per channel with its 48
  `latents_mean` / `latents_std`, as for Wan 2.1;
- `expand_timesteps` (model_index.json): the transformer gets one timestep per token, (B, F' * h/2 * w/2), every
  entry the step's t here (the pipeline's mask is all ones for text-to-video);
- image-to-video (`wan2.2-ti2v-5b-i2v`, the same folder sampled with WanImageToVideoPipeline and
  `expand_timesteps`): the image alone is encoded (one latent frame) and replaces the first latent frame of the
  transformer's input at every step, whose tokens get timestep 0; the pipeline overwrites that frame's prediction
  with the image's latents. Training does the same with the clip's first frame (`encode_conditions`: it is the
  clip's own first latent frame, which the causal VAE encodes alone) and leaves that frame out of the loss
  (`frame_loss_weights`: 0 there, so the loss is the mean over all frames with the first at zero);
- defaults (the Wan 2.2 ti2v_5B config): flow shift 5, 50 steps, guidance 5, 121 frames at 24 fps, 704x1280.

The text encoder (UMT5-XXL) and everything else are Wan 2.1's.
"""

from __future__ import annotations

import torch
from diffusers import WanImageToVideoPipeline, WanPipeline

from .wan import WAN_SCHEDULER, WanAdapter, tiny_pipeline
from .wan_i2v import WanI2VAdapter

#: Wan 2.2 VAE's per-channel latent statistics (diffusers' scripts/convert_wan_to_diffusers.py)
VAE22_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891, 0.1570,
    -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502, -0.2055, -0.0322,
    0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520,
    0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
]
VAE22_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165,
    0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659, 0.7069, 0.5338, 0.4889, 0.4917,
    0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600,
    0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
]


def tiny_pipeline_ti2v():
    """Tiny Wan 2.2 TI2V-5B-like: the residual, 2x2-patchifying VAE (8 latent channels, 16x in space, 4x in time),
    an 8-channel two-block transformer, Wan 2.1's tiny text encoder, `expand_timesteps`."""
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    base = tiny_pipeline()
    torch.manual_seed(29)
    vae = AutoencoderKLWan(
        base_dim=8, decoder_base_dim=8, z_dim=8, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
        temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
        scale_factor_spatial=16, scale_factor_temporal=4,
        latents_mean=[0.1, -0.2, 0.05, 0.0, 0.3, -0.1, 0.2, 0.0], latents_std=[1.5, 2.0, 1.2, 1.8, 1.1, 1.3, 0.9, 1.6],
    )
    torch.manual_seed(30)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=8, out_channels=8,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
    )
    return WanPipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=vae, transformer=transformer,
                       scheduler=base.scheduler, expand_timesteps=True)


class Wan22TI2VAdapter(WanAdapter):
    family = "wan2.2-ti2v-5b"
    full_name, example_path = "Wan2.2-TI2V-5B", "/path/to/Wan2.2-TI2V-5B-Diffusers"
    full_config = {  # Wan 2.2 TI2V-5B (5.0 B parameters)
        **WanAdapter.full_config, "num_attention_heads": 24, "ffn_dim": 14336, "num_layers": 30,
        "in_channels": 48, "out_channels": 48,
    }
    #: Wan 2.2's VAE as the TI2V-5B folder's vae/config.json has it (the latent statistics aside: `_full_vae`), which
    #: the planner runs on the meta device over one clip; buckets step by 32 px (data.bucket_step 16, rounded to the
    #: divisor), so 720p is 1280x704, the size Wan 2.2 samples TI2V-5B at
    full_vae_config = {"base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "is_residual": True, "in_channels": 12,
                       "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16, "scale_factor_temporal": 4}
    #: Wan 2.2's VAE: 2x2 patchify, then 8x (base_dim 160, decoder_base_dim 256, z_dim 48, residual), counted on the
    #: meta device from that config
    vae_params = 704_688_668
    latent_scale = 16
    default_scheduler = {**WAN_SCHEDULER, "flow_shift": 5.0}
    sample_defaults = {"guidance": 5.0, "steps": 50}
    plan_frames = 121
    per_token_timesteps = True
    full_variants = {}

    @classmethod
    def tiny_builders(cls):
        return {"wan22-ti2v": tiny_pipeline_ti2v}

    @classmethod
    def _full_vae(cls):
        """Wan 2.2's VAE as the Wan2.2-TI2V-5B-Diffusers folder's vae/config.json has it (diffusers'
        scripts/convert_wan_to_diffusers.py, `vae22_diffusers_config`): `full_vae_config` and the latent statistics."""
        from diffusers import AutoencoderKLWan

        return AutoencoderKLWan(**cls.full_vae_config, latents_mean=VAE22_MEAN, latents_std=VAE22_STD)

    @property
    def expand_timesteps(self) -> bool:
        """One timestep per token (model_index.json; the published TI2V-5B folder sets it)."""
        return bool(self._json("model_index.json", required=False).get("expand_timesteps", True))

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:
        if not self.expand_timesteps:
            return super().predict(transformer, noisy_latents, t, text, guidance)
        b, _, f, h, w = noisy_latents.shape
        p = self.patch_size
        # (B, tokens), every token at its sample's t: the pipeline's (mask[:, ::2, ::2] * t).flatten(), mask all ones
        timestep = (t * 1000.0)[:, None].expand(b, f * (h // p) * (w // p))
        return transformer(hidden_states=noisy_latents, timestep=timestep,
                           encoder_hidden_states=text["prompt_embeds"], return_dict=False)[0]

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta",
                     frames: int | None = None) -> dict:
        kw = super().dummy_inputs(transformer, batch, height, width, text_tokens, dtype, device, frames)
        x = kw["hidden_states"]
        kw["timestep"] = torch.ones(batch, x.shape[2] * (x.shape[3] // 2) * (x.shape[4] // 2), device=x.device,
                                    dtype=dtype)
        return kw

    def pipeline(self, components):
        pipe = super().pipeline(components)
        pipe.register_to_config(expand_timesteps=self.expand_timesteps)  # as WanPipeline.from_pretrained sets it
        return pipe


class Wan22TI2VI2VAdapter(Wan22TI2VAdapter, WanI2VAdapter):
    """Wan 2.2 TI2V-5B's image-to-video mode: the TI2V-5B folder (model_index.json: WanPipeline) sampled with
    WanImageToVideoPipeline and `expand_timesteps`; the first latent frame is the image's (module essay)."""

    family = "wan2.2-ti2v-5b-i2v"
    #: the folder's pipeline (the published folder is saved as WanPipeline: folder checks and planning read it);
    #: sampling builds WanImageToVideoPipeline from the same components (`pipeline`)
    pipeline_cls = WanPipeline
    full_name, example_path = "Wan2.2-TI2V-5B (image-to-video)", "/path/to/Wan2.2-TI2V-5B-Diffusers"
    image_encoder_dir = None
    cache_encoder_params = 0
    default_lora_targets = WanAdapter.default_lora_targets
    lora_key_map = WanAdapter.lora_key_map
    first_frame_given = True  # the pipeline replaces the first frame's prediction with the image's latent

    @classmethod
    def tiny_builders(cls):
        return {"wan22-ti2v-i2v": tiny_pipeline_ti2v}

    def encode_conditions(self, vae, pixels) -> dict[str, torch.Tensor]:
        """The first frame alone through the VAE (as the pipeline encodes `image` with expand_timesteps): one latent
        frame (B, C, 1, h, w)."""
        return {"image_latents": self.encode_videos(vae, pixels[:, :, :1])}

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:
        b, _, f, h, w = noisy_latents.shape
        mask = torch.ones(1, 1, f, h, w, dtype=noisy_latents.dtype, device=noisy_latents.device)
        mask[:, :, 0] = 0  # the pipeline's first_frame_mask
        cond = text["image_latents"].to(noisy_latents.dtype)
        x = (1 - mask) * cond + mask * noisy_latents
        p = self.patch_size
        timestep = (t * 1000.0)[:, None] * mask[0, 0][:, ::p, ::p].flatten()[None].float()  # first frame's at 0
        return transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=text["prompt_embeds"],
                           return_dict=False)[0]

    def pipeline(self, components):
        """WanImageToVideoPipeline with `expand_timesteps`, from the TI2V folder's components (no image encoder)."""
        c = components
        return WanImageToVideoPipeline(tokenizer=c.tokenizers[0] if c.tokenizers else None,
                                       text_encoder=c.text_encoders[0] if c.text_encoders else None,
                                       vae=c.vae, scheduler=c.scheduler, transformer=c.transformer,
                                       expand_timesteps=True)
