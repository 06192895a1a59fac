"""HunyuanVideo 1.5 image-to-video (`hunyuan-video-1.5-i2v`): the 480p / 720p I2V transformers,
`HunyuanVideo15ImageToVideoPipeline`, a SigLIP image encoder.

How the pipeline conditions on the image (diffusers 0.42, `HunyuanVideo15ImageToVideoPipeline`):

- the image is cut to the size the pipeline picks for it (`calculate_default_height_width`: of the buckets of about
  `target_size`^2 pixels, 640 for 480p, the one closest to its aspect ratio), encoded by the VAE alone (one frame,
  its mean times `scaling_factor`: `_get_image_latents`) and put in the condition channels of the first latent frame,
  zeros after it; the mask channel is 1 on the first latent frame, 0 after (`prepare_cond_latents_and_mask`);
- SigLIP's last hidden state of the image (`_get_image_embeds`, 729 x 1152 for so400m-patch14-384) is the
  transformer's `image_embeds`: not zero, so the transformer keeps those 729 tokens in its text sequence;
- the text, the noisy latents of every frame, the timestep and the guidance are text-to-video's; every latent frame
  is predicted (and trains: no frame is left out of the loss).

Training does the same with each clip's first frame (`encode_conditions`, run when the clip's latent is cached and
stored beside it, through the pipeline's own `_get_image_latents` and `_get_image_embeds` on the 8-bit frame; an
image trains as a one-frame clip conditioned on itself). SigLIP and its processor load with the VAE (part "vae"),
kept beside it as `vae.hunyuan_image_encoder` (not a registered submodule), as Wan 2.1 I2V keeps CLIP.

Sampling takes `--image` (`sample.image` during a fit). The pipeline has no height / width arguments: the sample is
the size it picks for the image (`pipeline_image` refuses another size in one line naming it). So `dittrain sample
--image` without --width / --height samples at the size it picks for that image (`image_sample_size`: a portrait
image gives a portrait video, not the config's size with the image cut to it), and the presets ask a size it picks
(`sample_frame`: 816x480 for an 832x480 frame).

Left out: the step-distilled I2V models' settings (their folders load; sample them at their guider's scale).
"""

from __future__ import annotations

from pathlib import Path

import diffusers
import torch
from diffusers.loaders import HunyuanVideoLoraLoaderMixin
from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor
from torch import nn

from ..errors import UserError
from .base import Components, to_pil
from .hunyuan_video15 import HunyuanVideo15Adapter, tiny_pipeline
from .hunyuan_video15_vae import time_chunks


class HunyuanVideo15ImageToVideoPipeline(diffusers.HunyuanVideo15ImageToVideoPipeline, HunyuanVideoLoraLoaderMixin):
    """diffusers' HunyuanVideo15ImageToVideoPipeline with the HunyuanVideo LoRA loader (as for text-to-video:
    trainer/models/hunyuan_video15.py), taking the `height` / `width` every sampler call passes once
    `pipeline_image` has checked they are the size the pipeline picks for the image."""

    def __call__(self, image, *args, height: int | None = None, width: int | None = None, **kwargs):
        with time_chunks(self.vae):  # the VAE in causal time chunks, as text-to-video's pipeline runs it
            return super().__call__(image, *args, **kwargs)

    def encode_image(self, image, batch_size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """SigLIP waits in CPU RAM beside the VAE (the module essay) and the pipeline hands the image to it on its
        own device: on that device for this one pass, back home after (on a GPU it failed with "Input type
        (CUDABFloat16Type) and weight type (CPUBFloat16Type)": bench/history/2026-11-28.md, 15:22)."""
        home = next(self.image_encoder.parameters()).device
        self.image_encoder.to(device)
        try:
            return super().encode_image(image, batch_size, device, dtype)
        finally:
            self.image_encoder.to(home)


#: the attribute of the VAE module that holds (image encoder, its processor)
_ATTR = "hunyuan_image_encoder"


def _picked_size(width: int, height: int, target_size: int, scale: int) -> tuple[int, int]:
    """(width, height) the pipeline picks for an image of width x height: of its buckets of about target_size^2
    pixels (sides divisible by the VAE's `scale`), the one closest in aspect ratio (`calculate_default_height_width`)."""
    h, w = HunyuanVideo15ImageProcessor(vae_scale_factor=scale).calculate_default_height_width(
        height=height, width=width, target_size=target_size)
    return w, h


def tiny_pipeline_i2v() -> diffusers.HunyuanVideo15ImageToVideoPipeline:
    """The tiny T2V model's text encoders, VAE, scheduler and guider, an I2V transformer (task_type i2v) and a tiny
    SigLIP (32 px, 8 px patches: 16 tokens of 16)."""
    from diffusers import HunyuanVideo15Transformer3DModel
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    base = tiny_pipeline()
    torch.manual_seed(45)
    enc = SiglipVisionModel(SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                               num_attention_heads=2, image_size=32, patch_size=8)).eval()
    proc = SiglipImageProcessor(size={"height": 32, "width": 32})
    torch.manual_seed(46)
    transformer = HunyuanVideo15Transformer3DModel.from_config({**base.transformer.config, "task_type": "i2v"})
    return diffusers.HunyuanVideo15ImageToVideoPipeline(
        text_encoder=base.text_encoder, tokenizer=base.tokenizer, transformer=transformer, vae=base.vae,
        scheduler=base.scheduler, text_encoder_2=base.text_encoder_2, tokenizer_2=base.tokenizer_2, guider=base.guider,
        image_encoder=enc, feature_extractor=proc)


class HunyuanVideo15I2VAdapter(HunyuanVideo15Adapter):
    family = "hunyuan-video-1.5-i2v"
    pipeline_cls = HunyuanVideo15ImageToVideoPipeline
    full_name, example_path = "HunyuanVideo-1.5 (480p I2V)", "/path/to/HunyuanVideo-1.5-Diffusers-480p_i2v"
    #: the converter's 480p_i2v config: text-to-video's but task_type (which the forward never reads)
    full_config = {**HunyuanVideo15Adapter.full_config, "task_type": "i2v"}
    full_variants = {"720p": {**full_config, "target_size": 960}}  # 720p_i2v: as text-to-video's 720p
    first_frame_conditions = True
    conditions_copy_clip = False  # the first frame alone through the VAE and SigLIP (`encode_conditions`)
    image_encoder_dir, image_processor_dir = "image_encoder", "feature_extractor"
    #: SigLIP so400m-patch14-384's vision model (27 layers of 1152, its pooling head too, as `SiglipVisionModel`
    #: builds it) beside the VAE while latents are cached (the planner's latent-caching phase)
    cache_encoder_params = 428_225_600
    sample_encoder_on_device = True  # `encode_image` moves SigLIP to the GPU for its pass

    @classmethod
    def tiny_builders(cls):
        return {"hunyuan-video-1.5-i2v": tiny_pipeline_i2v}

    @classmethod
    def full_size_parts(cls, folder: Path):
        """bench/program/bench_program.py's full-size random folders: text-to-video's VAE and text encoders
        (HunyuanVideo15Adapter.full_size_parts), and SigLIP so400m-patch14-384's vision model as the I2V folders
        hold it (`SiglipVisionModel`, 27 layers of 1152, 384 px in 14 px patches = 729 tokens, its pooling head:
        0.43 B, `cache_encoder_params`; bf16) with a 384 px SiglipImageProcessor (its defaults otherwise: mean and
        std 0.5), written over the tiny folder's 32 px one."""
        from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

        vae, parts = super().full_size_parts(folder)
        SiglipImageProcessor(size={"height": 384, "width": 384}).save_pretrained(Path(folder) / cls.image_processor_dir)
        parts.append((cls.image_encoder_dir, SiglipVisionModel, SiglipVisionConfig(
            hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, image_size=384,
            patch_size=14)))
        return vae, parts

    def _check(self, cfg, parts) -> None:
        super()._check(cfg, parts)
        if "vae" in parts:
            for d in (self.image_encoder_dir, self.image_processor_dir):
                if not (Path(cfg.path) / d).is_dir():
                    raise UserError(f"{Path(cfg.path) / d} not found: expected the SigLIP image "
                                    f"{'encoder' if d == self.image_encoder_dir else 'processor'} of a diffusers-format "
                                    f"{self.family} folder ({self._expected()}, {self.image_encoder_dir}/, "
                                    f"{self.image_processor_dir}/)")

    def load(self, cfg, *, parts, dtype, device="cpu") -> Components:
        """As text-to-video loads; with the VAE, SigLIP and its processor ride along (module essay)."""
        out = super().load(cfg, parts=parts, dtype=dtype, device=device)
        if "vae" in parts:
            from transformers import SiglipImageProcessor, SiglipVisionModel

            root = str(cfg.path)
            enc = SiglipVisionModel.from_pretrained(root, subfolder=self.image_encoder_dir, dtype=dtype,
                                                    local_files_only=True).to(device).eval().requires_grad_(False)
            proc = SiglipImageProcessor.from_pretrained(root, subfolder=self.image_processor_dir, local_files_only=True)
            object.__setattr__(out.vae, _ATTR, (enc, proc))  # not a submodule: the VAE's own state stays as it is
        return out

    def pipeline_parts(self, components: Components) -> dict:
        enc, proc = getattr(components.vae, _ATTR, (None, None))
        return {**super().pipeline_parts(components), "image_encoder": enc, "feature_extractor": proc}

    def encode_conditions(self, vae: nn.Module, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """The clip's first frame as the pipeline conditions on its image (module essay): its latents (B, C, 1, h,
        w) and SigLIP's embeddings, through the pipeline's own functions on the 8-bit frame."""
        enc, proc = getattr(vae, _ATTR)
        P = diffusers.HunyuanVideo15ImageToVideoPipeline
        frames = [to_pil(f) for f in pixels[:, :, 0]]
        h, w = pixels.shape[-2:]
        video_processor = HunyuanVideo15ImageProcessor(vae_scale_factor=self.vae_scale_factor, do_resize=False,
                                                       do_convert_rgb=True)  # the pipeline's
        latents = torch.cat([P._get_image_latents(vae, video_processor, im, h, w, pixels.device) for im in frames])
        home = next(enc.parameters()).device
        enc.to(pixels.device)  # beside the VAE while latents are cached; back afterwards
        try:
            embeds = P._get_image_embeds(enc, proc, frames, pixels.device)
        finally:
            enc.to(home)
        return {"image_latents": latents, "image_embeds": embeds}

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:
        x = noisy_latents
        b, _, f, h, w = x.shape
        cond = torch.zeros_like(x)
        cond[:, :, :1] = text["image_latents"].to(x.dtype)
        mask = x.new_zeros(b, 1, f, h, w)
        mask[:, :, 0] = 1
        return transformer(
            hidden_states=torch.cat([x, cond, mask], dim=1),
            timestep=(t * 1000.0).to(x.dtype),
            encoder_hidden_states=text["prompt_embeds"],
            encoder_attention_mask=text["prompt_embeds_mask"],
            encoder_hidden_states_2=text["prompt_embeds_2"],
            encoder_attention_mask_2=text["prompt_embeds_mask_2"],
            image_embeds=text["image_embeds"].to(x.dtype),
            return_dict=False,
        )[0]

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta",
                     frames: int | None = None) -> dict:
        """Text-to-video's, with SigLIP's 729 image tokens not zero (the transformer keeps them)."""
        kw = super().dummy_inputs(transformer, batch, height, width, text_tokens, dtype, device, frames)
        kw["image_embeds"] = torch.ones_like(kw["image_embeds"])
        return kw

    @classmethod
    def sample_frame(cls, width: int, height: int) -> tuple[int, int]:
        """The size the released 480p I2V model's pipeline picks for an image of width x height (the presets name
        it): 832x480 comes out 816x480."""
        return _picked_size(width, height, cls.full_config["target_size"], cls.latent_scale)

    def image_sample_size(self, width: int, height: int) -> tuple[int, int]:
        """The size this folder's pipeline picks for an image of width x height (its transformer's `target_size`:
        640 for the 480p model, 960 for the 720p one)."""
        return _picked_size(width, height, self.transformer_config.get("target_size", 640), self.latent_scale)

    @classmethod
    def pipeline_image(cls, pipe, image) -> dict:
        """The image, which the sampler cut to the sample's size: the size the pipeline picks for it, or refused."""
        if image is None:
            return {}
        h, w = pipe.video_processor.calculate_default_height_width(height=image.height, width=image.width,
                                                                  target_size=pipe.target_size)
        if (w, h) != image.size:
            raise UserError(f"{cls.family} samples at the size its pipeline picks for the image's aspect ratio "
                            f"(about {pipe.target_size}^2 pixels): {w}x{h}, not {image.width}x{image.height}; set "
                            f"--width {w} --height {h} (sample.width / sample.height)")
        return {"image": image}
