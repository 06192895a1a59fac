"""Wan 2.1 text-to-video: WanTransformer3DModel (1.3 B: 30 blocks, 14 B: 40 blocks), UMT5-XXL text encoder,
AutoencoderKLWan (8x in space, 4x in time, causal), `WanPipeline`.

The first video family: its latents are (B, C, F, h, w) and its samples are frames (base.py, "video").

How it mirrors diffusers' WanPipeline (0.42):

- text: the prompt is cleaned as the pipeline cleans it (`prompt_clean`: ftfy where installed, HTML unescaping,
  whitespace), tokenized to 512 tokens (the pipeline's `max_sequence_length` default), run through UMT5 with its
  attention mask, and the last hidden state kept at the real tokens and zeroed after them -> `prompt_embeds`
  (B, 512, 4096). The transformer attends to all 512 rows (no mask), as in the pipeline.
- latents: the VAE takes (B, 3, F, H, W) with F = 4k + 1 (an image is F = 1); its mean (`latent_dist.mode()`) is
  normalised per channel, (z - latents_mean) / latents_std, the inverse of the pipeline's decode. AutoencoderKLWan
  encodes time causally by itself: the first frame, then chunks of 4 frames, each through the encoder with a
  feature cache of the previous chunk's last frames (`_encode`), so the activations it holds are a chunk's, not the
  clip's; with tiling (`vae_memory_mode`, frames above 1024x1024 pixels) it tiles in space as well. Nothing here
  chunks again.
- predict: the transformer patchifies (1, 2, 2) and unpatchifies itself, so latents go in and come out as
  (B, C, F, h, w); the timestep is t * 1000 (the scheduler's flow timesteps, sigma * 1000, as the pipeline passes
  them).
- shift: the folder's scheduler `flow_shift` (3.0 for the 480p checkpoints, 5.0 for 720p), fixed; the same shift
  trains (`train.shift: auto`).
- sampling (`WanPipeline`): `prompt_embeds` (+ `negative_prompt_embeds` when guidance > 1: classifier-free
  guidance, two passes), `num_frames`, the folder's own scheduler class (UniPCMultistepScheduler with flow sigmas in
  the published folders: `load` builds the class `scheduler_config.json` names, as `WanPipeline.from_pretrained`
  does); the output is `frames`.

Left out: image-to-video (`WanImageToVideoPipeline`, the CLIP image encoder and `image_dim`), Wan 2.2's two experts
(`transformer_2`, `boundary_ratio`) and TI2V-5B (`expand_timesteps`, the 48-channel VAE).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import WanPipeline, WanTransformer3DModel
from torch import nn

from ._diffusers import DiffusersAdapter
from .base import Components, MeasuredPreset, PresetVariant
from .lora_keys import KeyRule, LoraKeyMap

_B = _W = "blocks.{i}"
#: Wan's original layout (ComfyUI's WanModel, the Wan-AI checkpoints; kohya / musubi-tuner `lora_unet_blocks_0_...`),
#: as diffusers' single-file converter (`convert_wan_transformer_to_diffusers`) renames it: self_attn / cross_attn
#: q, k, v, o and ffn.0 / ffn.2, no fused layers.
WAN_LORA_KEYS = LoraKeyMap((
    *(KeyRule(f"{_W}.{orig}.{o}", (f"{_B}.{attn}.{d}",))
      for orig, attn in (("self_attn", "attn1"), ("cross_attn", "attn2"))
      for o, d in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"))),
    KeyRule(f"{_W}.ffn.0", (f"{_B}.ffn.net.0.proj",)),
    KeyRule(f"{_W}.ffn.2", (f"{_B}.ffn.net.2",)),
    KeyRule("patch_embedding", ("patch_embedding",)),
    KeyRule("text_embedding.0", ("condition_embedder.text_embedder.linear_1",)),
    KeyRule("text_embedding.2", ("condition_embedder.text_embedder.linear_2",)),
    KeyRule("time_embedding.0", ("condition_embedder.time_embedder.linear_1",)),
    KeyRule("time_embedding.2", ("condition_embedder.time_embedder.linear_2",)),
    KeyRule("time_projection.1", ("condition_embedder.time_proj",)),
    KeyRule("head.head", ("proj_out",)),
))

#: UMT5-XXL's parameters outside its 24 encoder blocks: the 256 k-token embedding and the final norm
UMT5_NONBLOCK = 1_050_152_960
#: the published Wan 2.1 folders' scheduler (scheduler/scheduler_config.json), used when a folder has none
WAN_SCHEDULER = {
    "num_train_timesteps": 1000, "prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0,
    "solver_order": 2, "solver_type": "bh2", "predict_x0": True, "lower_order_final": True,
    "final_sigmas_type": "zero", "timestep_spacing": "linspace",
}
MAX_SEQUENCE_LENGTH = 512  # WanPipeline.__call__'s default
#: google/umt5-xxl's encoder (config.json), as the Wan folders' text_encoder holds it: 5.68 B parameters
UMT5_XXL = {"vocab_size": 256384, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
            "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
            "feed_forward_proj": "gated-gelu", "layer_norm_epsilon": 1e-6, "tie_word_embeddings": False}


def umt5_xxl_config(folder: Path):
    """UMT5-XXL's encoder config with the pad / eos ids of `folder`'s tiny text encoder (its tokenizer is the tiny
    one; every id exists in the 256384 rows)."""
    import json

    from transformers import UMT5Config

    tiny = json.loads((Path(folder) / "text_encoder" / "config.json").read_text())
    return UMT5Config(**UMT5_XXL, is_encoder_decoder=False, use_cache=False, decoder_start_token_id=0,
                      **{k: tiny[k] for k in ("pad_token_id", "eos_token_id") if tiny.get(k) is not None})


def tiny_pipeline() -> WanPipeline:
    """A tiny random Wan 2.1-like text-to-video model: a two-layer UMT5 on the shared T5 tokenizer, the causal
    video VAE (4 latent channels, 8x space, 4x time), two transformer blocks, the published UniPC scheduler."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    from .tiny import t5_tokenizer

    tok = t5_tokenizer()
    torch.manual_seed(21)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, decoder_start_token_id=0,
    )).eval()
    torch.manual_seed(22)
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.05, 0.0], latents_std=[1.5, 2.0, 1.2, 1.8],
    )
    torch.manual_seed(23)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
    )
    return WanPipeline(tokenizer=tok, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER))


class WanAdapter(DiffusersAdapter):
    family = "wan"
    transformer_cls = WanTransformer3DModel
    pipeline_cls = WanPipeline
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
    lora_key_map = WAN_LORA_KEYS
    text_encoder_dirs = ("text_encoder",)
    text_encoder_classes = ("UMT5EncoderModel",)
    tokenizer_dirs = ("tokenizer",)
    vae_cls_name = "AutoencoderKLWan"
    #: Wan 2.1's VAE is AutoencoderKLWan's defaults; the planner runs it on the meta device over one clip
    full_vae_config: dict = {}
    #: 16 px buckets (the divisor), so that Wan's sizes are buckets: 832x480 at resolution 632 (`480p`), 1280x720
    #: at 960 (`720p`); 64 px steps would make 832x512 the 480p bucket, too tall for an 832x480 video
    bucket_step = 16
    packs_2x2 = False
    default_scheduler = WAN_SCHEDULER
    max_sequence_length = MAX_SEQUENCE_LENGTH
    full_name, example_path = "Wan2.1-T2V-14B", "/path/to/Wan2.1-T2V-14B-Diffusers"
    full_config = {  # Wan 2.1 T2V 14 B (WanTransformer3DModel defaults; 1.3 B: 12 heads, ffn_dim 8960, 30 layers)
        "patch_size": [1, 2, 2],
        "num_attention_heads": 40,
        "attention_head_dim": 128,
        "in_channels": 16,
        "out_channels": 16,
        "text_dim": 4096,
        "freq_dim": 256,
        "ffn_dim": 13824,
        "num_layers": 40,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6,
        "rope_max_seq_len": 1024,
    }
    text_tokens = MAX_SEQUENCE_LENGTH  # always padded to 512
    text_encoder_params = (("UMT5-XXL encoder", 5_680_910_336),)
    text_encoder_nonblock_params = (UMT5_NONBLOCK,)
    text_encoder_keep_linears = r"(^|\.)wo\."  # T5's `wo`, as for SD3's T5 (_diffusers.T5_KEEP)
    #: the blocks' scale / shift / gate come from a Parameter (`scale_shift_table`) plus the shared `time_proj`
    #: outside the blocks: no block Linear is a modulation Linear
    modulation_linears = ""
    #: the block's FeedForward (5120 -> 13824 -> 5120 at 14 B: its hidden is the largest tensor a block saves) and
    #: its cross-attention (each video token's query attends to the text alone: its q and output are per token)
    token_wise = ("attn2", "ffn")
    vae_params = 126_892_531  # AutoencoderKLWan (Wan 2.1's VAE)
    sampling_uses_negative = True
    sample_defaults = {"guidance": 5.0, "steps": 50}

    # video (base.py): 4x temporal VAE, clips of 4k + 1 frames; the planner assumes Wan's 81 frames
    video = True
    frame_step = 4
    plan_frames = 81

    #: bench/program/bench_program.py's other full sizes of this family's transformer (`--families wan-1.3b`):
    #: Wan2.1-T2V-1.3B (1.42 B: 12 heads, ffn_dim 8960, 30 layers)
    full_variants = {"1.3b": {**full_config, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}}
    #: the 1.3 B's own presets, configs/wan-1.3b/, for the cards the 14 B does not fit (8 GB: it needs 10.5 GB even
    #: at 480p x 33), on 480p clips only (Wan 2.1's 1.3 B is a 480p model: its 720p is less stable, as its release
    #: says). Not for 12 GB and up: the 8 GB ones already train 480p x 81, predicted 1.06x (LoRA and full)
    #: the step without offloading, which is all a larger card could win (configs/README.md)
    #: Measured: bench/history/2026-11-28.md 22:12 (480p x 81, another job on the same GPU)
    preset_variants = {"1.3b": PresetVariant(
        "Wan2.1-T2V-1.3B", "/path/to/Wan2.1-T2V-1.3B-Diffusers", (8,), clips=(("480p", 81), ("480p", 49), ("480p", 33)),
        measured={("lora", 8): MeasuredPreset(0.0, True, "measured on an H200: fits, 7.0 GB reserved at the cap, "
                                                         "6.2 GB allocated"),
                  ("full", 8): MeasuredPreset(0.85, True, "measured on an H200: fits, 6.1 GB reserved")})}

    @classmethod
    def tiny_builders(cls):
        return {"wan": tiny_pipeline}

    @classmethod
    def full_size_parts(cls, folder: Path):
        """bench/program/bench_program.py's full-size random folders: (the VAE, AutoencoderKLWan's defaults = Wan 2.1's;
        [(sub-folder, class, config, dtype of its matrices on disk)]): UMT5-XXL's encoder whole, its 2-D weights
        written in fp8 (5.7 GB on disk instead of 11.4; transformers casts them to the load dtype, so RAM and VRAM
        are bf16's)."""
        from transformers import UMT5EncoderModel

        return cls._full_vae(), [("text_encoder", UMT5EncoderModel, umt5_xxl_config(folder), torch.float8_e4m3fn)]

    @classmethod
    def _full_vae(cls):
        """The family's VAE at full size (`full_vae_config`; Wan 2.1's: AutoencoderKLWan's defaults)."""
        from diffusers import AutoencoderKLWan

        return AutoencoderKLWan(**cls.full_vae_config)

    # ------------------------------------------------------------------------------------------ folder facts

    @property
    def patch_size(self) -> int:
        """Latent pixels per token side (the transformer's (1, 2, 2) patch)."""
        return int(self.transformer_config.get("patch_size", (1, 2, 2))[-1])

    @property
    def vae_scale_factor(self) -> int:
        return int(self.vae_config.get("scale_factor_spatial") or super().vae_scale_factor)

    def timestep_shift(self, height: int, width: int) -> float:
        s = self.scheduler_config
        return float(s.get("flow_shift", s.get("shift", 1.0)) or 1.0)

    def load(self, cfg, *, parts, dtype, device="cpu") -> Components:
        """As every family loads, but the scheduler is the class the folder's `scheduler_config.json` names (the
        published folders: UniPCMultistepScheduler with flow sigmas), as `WanPipeline.from_pretrained` builds it."""
        parts = set(parts)
        out = super().load(cfg, parts=parts - {"scheduler"}, dtype=dtype, device=device)
        if "scheduler" in parts:
            out.scheduler = self.load_scheduler(Path(cfg.path))
        return out

    def _check(self, cfg, parts) -> None:
        """As every family checks its folder, and: the Wan variants share a pipeline class, so model_index.json's
        `transformer_2` / `boundary_ratio` (two experts) and `expand_timesteps` (TI2V-5B) must be this family's."""
        super()._check(cfg, parts)
        import json

        from ..errors import UserError
        from . import adapter_classes

        p = Path(cfg.path) / "model_index.json"
        try:
            index = json.loads(p.read_text()) if p.is_file() else {}
        except (OSError, ValueError):
            return  # the loaders say what is wrong with it
        facts = ((index.get("transformer_2") or [None])[0] is not None or bool(index.get("boundary_ratio")),
                 bool(index.get("expand_timesteps")))
        if facts == self.folder_facts():
            return
        fits = [c.family for c in adapter_classes() if c.pipeline_cls is self.pipeline_cls
                and getattr(c, "folder_facts", None) and c.folder_facts() == facts]
        what = {(True, False): "two experts (transformer_2, boundary_ratio)", (False, True): "expand_timesteps",
                (False, False): "one transformer, one timestep per step"}.get(facts, "another Wan variant")
        raise UserError(f"{p}: this folder is a Wan model with {what}, not {self.family}: use model.family: "
                        f"{' or '.join(fits) or 'another family'}")

    @classmethod
    def folder_facts(cls) -> tuple[bool, bool]:
        """(two experts, one timestep per token) as model_index.json says them for this family's folders."""
        return bool(cls.experts), cls.per_token_timesteps

    #: the pipeline's `expand_timesteps` (TI2V-5B): one timestep per token
    per_token_timesteps = False

    def load_scheduler(self, root: Path):
        import diffusers

        from ..errors import UserError

        name = self.scheduler_config.get("_class_name", "UniPCMultistepScheduler")
        cls = getattr(diffusers, str(name), None)
        if cls is None or not hasattr(cls, "from_config") or not name.endswith("Scheduler"):
            raise UserError(f"{root / 'scheduler/scheduler_config.json'}: unknown scheduler class {name!r} (expected a "
                            f"diffusers scheduler such as UniPCMultistepScheduler)")
        if (root / "scheduler" / "scheduler_config.json").is_file():
            return cls.from_pretrained(str(root), subfolder="scheduler", local_files_only=True)
        return cls.from_config(dict(self.default_scheduler))

    # ------------------------------------------------------------------------------------------ model

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.blocks)

    @torch.no_grad()
    def encode_prompts(self, components: Components, prompts: list[str]) -> dict[str, torch.Tensor]:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        (enc,), (tok,) = components.text_encoders, components.tokenizers
        dev = enc.get_input_embeddings().weight.device
        n = self.max_sequence_length
        toks = tok([prompt_clean(p) for p in prompts], padding="max_length", max_length=n, truncation=True,
                   add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        ids, mask = toks.input_ids.to(dev), toks.attention_mask.to(dev)
        hidden = enc(ids, mask).last_hidden_state.to(enc.dtype)
        # zero after each prompt's real tokens, as the pipeline pads them (mask is 1 on a prefix)
        return {"prompt_embeds": hidden * mask.gt(0).unsqueeze(-1).to(hidden.dtype)}

    def encode_videos(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        c = vae.config
        lat = vae.encode(pixels.to(vae.dtype)).latent_dist.mode()
        mean = torch.tensor(c.latents_mean, device=lat.device, dtype=lat.dtype).view(1, -1, 1, 1, 1)
        std = torch.tensor(c.latents_std, device=lat.device, dtype=lat.dtype).view(1, -1, 1, 1, 1)
        return (lat - mean) / std

    def encode_images(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """An image is a 1-frame clip: (B, 3, H, W) -> (B, C, 1, h, w)."""
        return self.encode_videos(vae, pixels.unsqueeze(2))

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:
        return transformer(
            hidden_states=noisy_latents,
            timestep=t * 1000.0,
            encoder_hidden_states=text["prompt_embeds"],
            return_dict=False,
        )[0]

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta",
                     frames: int | None = None) -> dict:
        """As `predict` builds them, for a clip of `frames` frames (default `plan_frames`: 81, 21 latent frames)."""
        c, dev = transformer.config, torch.device(device)
        rnd = {"device": dev, "dtype": dtype}
        f = cls.latent_frames(frames or cls.plan_frames)
        return dict(
            hidden_states=torch.randn(batch, c.in_channels, f, height // cls.latent_scale, width // cls.latent_scale,
                                      **rnd),
            encoder_hidden_states=torch.randn(batch, text_tokens, c.text_dim, **rnd),
            timestep=torch.ones(batch, **rnd),
        )

    # ------------------------------------------------------------------------------------------ sampling

    @classmethod
    def pipeline_embeds(cls, pipe, prompt, negative, device) -> dict[str, torch.Tensor]:
        pe, npe = pipe.encode_prompt(prompt=prompt, negative_prompt=negative,
                                     do_classifier_free_guidance=negative is not None,
                                     max_sequence_length=MAX_SEQUENCE_LENGTH, device=device)
        out = {"prompt_embeds": pe}
        if negative is not None:
            out["negative_prompt_embeds"] = npe
        return out

