"""Wan image-to-video: Wan 2.1 I2V 14B (`wan-i2v`) and Wan 2.2 I2V A14B (`wan2.2-a14b-i2v`), `WanImageToVideoPipeline`.

How the pipeline conditions on the first frame (diffusers 0.42, `WanImageToVideoPipeline.prepare_latents`):

- the image, resized to the video's size, followed by F - 1 zero frames (grey in [-1, 1]) is encoded by the VAE
  (its mean) and normalised like any latent: `image_latents` (B, C, F', h, w). Not the clip's own latents with the
  rest zeroed: the causal VAE carries the first frame into every later latent frame, so it is a second encode;
- a mask of `frame_step` (4) channels, 1 on the first latent frame and 0 after it;
- the transformer takes [noisy latents, mask, image latents] along the channels (16 + 4 + 16 = 36 in_channels)
  and predicts the 16 channels of the velocity;
- Wan 2.1 only (`transformer.config.image_dim`): a CLIP ViT-H image encoder's second-to-last hidden states of the
  image (`image_processor` -> `image_encoder(..., output_hidden_states=True).hidden_states[-2]`, 257 x 1280) reach
  the blocks' image cross-attention as `encoder_hidden_states_image`. Wan 2.2 I2V has no image encoder.

Training does the same with the clip's first frame (`encode_conditions`, run when the clip's latent is cached and
stored beside it; an image trains as a one-frame clip conditioned on itself). The CLIP image encoder and its
processor load with the VAE (part "vae"), kept beside it as `vae.wan_image_encoder` (not a registered submodule):
the latent cache's stage loads the VAE alone and the conditioning is computed there, once per clip; the pipeline
gets them as its `image_encoder` / `image_processor`. Sampling takes `--image` (`sample.image` during a fit): the
picture is cut to the sample's size as for an edit family and handed to the pipeline as `image`.

The planner counts the image encoder (CLIP ViT-H, 0.63 B parameters) beside the VAE in the latent-caching phase
(`cache_encoder_params`).

Left out: the last-frame conditioning (`last_image`, Wan 2.1 FLF2V), `image_embeds` passed precomputed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import WanImageToVideoPipeline
from torch import nn

from ..errors import UserError
from .base import Components, MeasuredPreset, to_pil
from .lora_keys import KeyRule, LoraKeyMap
from .wan import WAN_LORA_KEYS, WAN_SCHEDULER, WanAdapter, tiny_pipeline
from .wan22 import Wan22A14BAdapter

#: Wan 2.1 I2V's original names beyond T2V's: the image cross-attention's k_img / v_img and the image embedder's MLP
#: (as diffusers' single-file converter renames them)
WAN_I2V_LORA_KEYS = LoraKeyMap((
    *WAN_LORA_KEYS.rules,
    KeyRule("blocks.{i}.cross_attn.k_img", ("blocks.{i}.attn2.add_k_proj",)),
    KeyRule("blocks.{i}.cross_attn.v_img", ("blocks.{i}.attn2.add_v_proj",)),
    KeyRule("img_emb.proj.1", ("condition_embedder.image_embedder.ff.net.0.proj",)),
    KeyRule("img_emb.proj.3", ("condition_embedder.image_embedder.ff.net.2",)),
))

#: the attribute of the VAE module that holds (image encoder, image processor) for Wan 2.1 I2V
_ATTR = "wan_image_encoder"


def _tiny_transformer(seed: int, image_dim: int | None):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=12, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64, image_dim=image_dim, added_kv_proj_dim=32 if image_dim else None,
    )


def tiny_pipeline_i2v() -> WanImageToVideoPipeline:
    """Tiny Wan 2.1 I2V-like: Wan 2.1's tiny text encoder, VAE and scheduler, a 12-channel transformer with image
    cross-attention, a tiny CLIP vision encoder (32 px, 8 px patches: 17 tokens of 32)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    base = tiny_pipeline()
    torch.manual_seed(25)
    enc = CLIPVisionModel(CLIPVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=32, patch_size=8, projection_dim=32)).eval()
    proc = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return WanImageToVideoPipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae,
                                   scheduler=base.scheduler, image_processor=proc, image_encoder=enc,
                                   transformer=_tiny_transformer(26, image_dim=32))


def tiny_pipeline_a14b_i2v() -> WanImageToVideoPipeline:
    """Tiny Wan 2.2 I2V-A14B-like: two 12-channel experts without image cross-attention, boundary 0.9."""
    base = tiny_pipeline()
    return WanImageToVideoPipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae,
                                   scheduler=base.scheduler, transformer=_tiny_transformer(27, None),
                                   transformer_2=_tiny_transformer(28, None), boundary_ratio=0.9)


class WanI2VAdapter(WanAdapter):
    family = "wan-i2v"
    pipeline_cls = WanImageToVideoPipeline
    full_name, example_path = "Wan2.1-I2V-14B-480P", "/path/to/Wan2.1-I2V-14B-480P-Diffusers"
    # bench/history/2026-11-28.md 22:12 (fp8 base, 480p x 49; another job on the same GPU; each step with a page-lock)
    measured_presets = {
        ("lora", 16): MeasuredPreset(0.7, True, "measured on an H200: fits, 14.5 GB reserved, 11-13 s a step")}
    full_config = {**WanAdapter.full_config, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120}
    first_frame_conditions = True
    #: Wan 2.1's image cross-attention trains too (an I2V LoRA has add_k_proj / add_v_proj: diffusers then loads it as
    #: it is, rather than padding a T2V LoRA with zeros there)
    default_lora_targets = (*WanAdapter.default_lora_targets, "add_k_proj", "add_v_proj")
    lora_key_map = WAN_I2V_LORA_KEYS
    #: the folders of the CLIP image encoder and its processor (Wan 2.1); None: the family has none (Wan 2.2)
    image_encoder_dir: str | None = "image_encoder"
    image_processor_dir = "image_processor"
    #: that image encoder (open-clip ViT-H/14 as a CLIPVisionModel: 32 layers of 1280) beside the VAE while latents
    #: are cached (the planner's latent-caching phase)
    cache_encoder_params = 630_766_080
    full_variants = {}  # Wan 2.1 I2V is 14 B only

    @classmethod
    def tiny_builders(cls):
        return {"wan-i2v": tiny_pipeline_i2v}

    @classmethod
    def full_size_parts(cls, folder: Path):
        """bench/program/bench_program.py's full-size random folders: Wan's VAE and UMT5-XXL (WanAdapter.full_size_parts),
        and where the family has one the CLIP image encoder as the Wan 2.1 I2V folders hold it (open-clip ViT-H/14
        as a CLIPVisionModel: 0.63 B) with its image processor (CLIPImageProcessor's defaults: 224 px, OpenAI
        CLIP's mean and std), written over the tiny folder's."""
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

        vae, parts = super().full_size_parts(folder)
        if cls.image_encoder_dir:
            CLIPImageProcessor().save_pretrained(Path(folder) / cls.image_processor_dir)
            parts.append((cls.image_encoder_dir, CLIPVisionModel, CLIPVisionConfig(
                hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16, patch_size=14,
                image_size=224, projection_dim=1024, hidden_act="gelu", layer_norm_eps=1e-5)))
        return vae, parts

    def _check(self, cfg, parts) -> None:
        super()._check(cfg, parts)
        if "vae" in parts and self.image_encoder_dir:
            for d in (self.image_encoder_dir, self.image_processor_dir):
                if not (Path(cfg.path) / d).is_dir():
                    raise UserError(f"{Path(cfg.path) / d} not found: expected the CLIP image "
                                    f"{d.split('_')[-1]} of a diffusers-format {self.family} folder ("
                                    f"{self._expected()}, {self.image_encoder_dir}/, {self.image_processor_dir}/)")

    def load(self, cfg, *, parts, dtype, device="cpu") -> Components:
        """As Wan loads; with the VAE, Wan 2.1's CLIP image encoder and processor ride along (module essay)."""
        out = super().load(cfg, parts=parts, dtype=dtype, device=device)
        if "vae" in parts and self.image_encoder_dir:
            from transformers import CLIPImageProcessor, CLIPVisionModel

            root = str(cfg.path)
            enc = CLIPVisionModel.from_pretrained(root, subfolder=self.image_encoder_dir, dtype=dtype,
                                                  local_files_only=True).to(device).eval().requires_grad_(False)
            proc = CLIPImageProcessor.from_pretrained(root, subfolder=self.image_processor_dir, local_files_only=True)
            object.__setattr__(out.vae, _ATTR, (enc, proc))  # not a submodule: the VAE's own state stays as it is
        return out

    def pipeline(self, components: Components):
        pipe = super().pipeline(components)
        enc, proc = getattr(components.vae, _ATTR, (None, None))
        pipe.register_modules(image_encoder=enc, image_processor=proc)
        return pipe

    def encode_conditions(self, vae: nn.Module, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """The first frame as the pipeline conditions on it: the latents of [frame, F - 1 zero frames], and (Wan
        2.1) the CLIP embedding of the 8-bit frame through the image processor, as `encode_image` computes it."""
        first = pixels[:, :, :1]
        video = torch.cat([first, torch.zeros_like(pixels[:, :, 1:])], dim=2)
        out = {"image_latents": self.encode_videos(vae, video)}
        if self.image_encoder_dir:
            enc, proc = getattr(vae, _ATTR)
            dev = next(enc.parameters()).device
            enc.to(pixels.device)  # beside the VAE while latents are cached; back afterwards
            try:
                px = proc(images=[to_pil(f) for f in first[:, :, 0]], return_tensors="pt").to(pixels.device)
                out["image_embeds"] = enc(**px, output_hidden_states=True).hidden_states[-2]
            finally:
                enc.to(dev)
        return out

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:
        cond = text["image_latents"].to(noisy_latents.dtype)
        b, _, f, h, w = cond.shape
        mask = cond.new_zeros(b, self.frame_step, f, h, w)  # the pipeline's mask: 1 on the first latent frame
        mask[:, :, 0] = 1
        image = {"encoder_hidden_states_image": text["image_embeds"]} if "image_embeds" in text else {}
        return transformer(
            hidden_states=torch.cat([noisy_latents, mask, cond], dim=1),
            timestep=t * 1000.0,
            encoder_hidden_states=text["prompt_embeds"],
            return_dict=False,
            **image,
        )[0]

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta",
                     frames: int | None = None) -> dict:
        kw = super().dummy_inputs(transformer, batch, height, width, text_tokens, dtype, device, frames)
        if transformer.config.image_dim:  # Wan 2.1: CLIP ViT-H's 257 tokens
            kw["encoder_hidden_states_image"] = torch.randn(batch, 257, transformer.config.image_dim,
                                                            device=torch.device(device), dtype=dtype)
        return kw

    @classmethod
    def pipeline_embeds(cls, pipe, prompt, negative, device) -> dict[str, torch.Tensor]:
        """As WanPipeline encodes prompts (`_get_t5_prompt_embeds`, the same code): diffusers 0.42's I2V copy calls
        `ftfy.fix_text` whether or not ftfy is installed (a NameError without it), WanPipeline's only where it is."""
        from diffusers import WanPipeline

        def enc(text: str) -> torch.Tensor:
            return WanPipeline._get_t5_prompt_embeds(pipe, prompt=text, max_sequence_length=cls.max_sequence_length,
                                                     device=device)

        out = {"prompt_embeds": enc(prompt)}
        if negative is not None:
            out["negative_prompt_embeds"] = enc(negative)
        return out

    @classmethod
    def pipeline_image(cls, pipe, image) -> dict:
        return {} if image is None else {"image": image}


class Wan22A14BI2VAdapter(Wan22A14BAdapter, WanI2VAdapter):
    """Wan 2.2 I2V A14B: the two experts of `wan2.2-a14b` (model.expert, boundary 0.9) conditioned on the first
    frame as `wan-i2v`, without an image encoder."""

    family = "wan2.2-a14b-i2v"
    pipeline_cls = WanImageToVideoPipeline
    full_name, example_path = "Wan2.2-I2V-A14B", "/path/to/Wan2.2-I2V-A14B-Diffusers"
    full_config = {**WanAdapter.full_config, "in_channels": 36}
    image_encoder_dir = None
    cache_encoder_params = 0
    default_lora_targets = WanAdapter.default_lora_targets  # no image cross-attention in Wan 2.2
    lora_key_map = WAN_LORA_KEYS
    default_boundary = 0.9  # Wan 2.2's wan_i2v_A14B config
    default_scheduler = {**WAN_SCHEDULER, "flow_shift": 5.0}
    sample_defaults = {"guidance": 3.5, "steps": 40}

    @classmethod
    def tiny_builders(cls):
        return {"wan22-a14b-i2v": tiny_pipeline_a14b_i2v}
