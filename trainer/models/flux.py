"""Flux.1 (dev and schnell): FluxTransformer2DModel, CLIP-L (pooled) + T5-XXL (sequence) text, 16-channel VAE.

How each piece mirrors diffusers' FluxPipeline (0.42):

- text: CLIP's `pooler_output` on 77 padded tokens -> `pooled_prompt_embeds`; T5's last hidden state on
  `max_sequence_length` (512) padded tokens -> `prompt_embeds`. Text position ids are zeros (made in `predict`).
- latents: VAE mean, then (z - shift_factor) * scaling_factor; the pipeline undoes exactly this before decoding.
- predict: latents are packed 2x2 into tokens (`_pack_latents`), image ids are (0, row, col) per token, the
  timestep given to the transformer is the flow time t itself (the pipeline passes scheduler timesteps / 1000, and
  scheduler timesteps are sigma * 1000), and the guidance value goes in only when the transformer has a guidance
  embedding (`config.guidance_embeds`: dev yes, schnell no).
- shift: the scheduler config decides: dev uses dynamic shifting with mu linear in the image token count
  (`calculate_shift`), schnell a fixed shift of 1.
- sampling (`FluxPipeline`): `prompt_embeds` + `pooled_prompt_embeds`; `guidance_scale` is the distilled guidance
  value fed to the transformer (dev), ignored by schnell. No negative prompt, one forward per step.

Left out: IP-adapter and ControlNet inputs; the final `proj_out` and the single blocks' `proj_out` are not in the
default LoRA targets, because peft's suffix matching cannot tell them apart (add "proj_out" to lora.targets to
adapt both).
"""

from __future__ import annotations

import torch
from diffusers import FluxPipeline, FluxTransformer2DModel
from torch import nn

from ._diffusers import NORM_MODULATION, T5_KEEP, DiffusersAdapter, pack_2x2, packed_inputs, unpack_2x2
from .base import Components, MeasuredPreset
from .lora_keys import KeyRule, LoraKeyMap

_D, _S = "transformer_blocks.{i}", "single_transformer_blocks.{i}"
#: BFL's layout (ComfyUI's Flux model, kohya's `lora_unet_double_blocks_*`), as diffusers' single-file converter
#: reads it: q/k/v fused into `qkv`, and a single block's q/k/v and MLP input fused into `linear1` (MLP 4x wide).
#: `norm_out.linear` is left out: the original stores its two halves swapped.
FLUX_LORA_KEYS = LoraKeyMap((
    KeyRule("double_blocks.{i}.img_attn.qkv", (f"{_D}.attn.to_q", f"{_D}.attn.to_k", f"{_D}.attn.to_v"), (1, 1, 1)),
    KeyRule("double_blocks.{i}.img_attn.proj", (f"{_D}.attn.to_out.0",)),
    KeyRule("double_blocks.{i}.txt_attn.qkv", (f"{_D}.attn.add_q_proj", f"{_D}.attn.add_k_proj",
                                               f"{_D}.attn.add_v_proj"), (1, 1, 1)),
    KeyRule("double_blocks.{i}.txt_attn.proj", (f"{_D}.attn.to_add_out",)),
    KeyRule("double_blocks.{i}.img_mlp.0", (f"{_D}.ff.net.0.proj",)),
    KeyRule("double_blocks.{i}.img_mlp.2", (f"{_D}.ff.net.2",)),
    KeyRule("double_blocks.{i}.txt_mlp.0", (f"{_D}.ff_context.net.0.proj",)),
    KeyRule("double_blocks.{i}.txt_mlp.2", (f"{_D}.ff_context.net.2",)),
    KeyRule("double_blocks.{i}.img_mod.lin", (f"{_D}.norm1.linear",)),
    KeyRule("double_blocks.{i}.txt_mod.lin", (f"{_D}.norm1_context.linear",)),
    KeyRule("single_blocks.{i}.linear1", (f"{_S}.attn.to_q", f"{_S}.attn.to_k", f"{_S}.attn.to_v", f"{_S}.proj_mlp"),
            (1, 1, 1, 4)),
    KeyRule("single_blocks.{i}.linear2", (f"{_S}.proj_out",)),
    KeyRule("single_blocks.{i}.modulation.lin", (f"{_S}.norm.linear",)),
    KeyRule("img_in", ("x_embedder",)),
    KeyRule("txt_in", ("context_embedder",)),
    KeyRule("final_layer.linear", ("proj_out",)),
    KeyRule("time_in.in_layer", ("time_text_embed.timestep_embedder.linear_1",)),
    KeyRule("time_in.out_layer", ("time_text_embed.timestep_embedder.linear_2",)),
    KeyRule("vector_in.in_layer", ("time_text_embed.text_embedder.linear_1",)),
    KeyRule("vector_in.out_layer", ("time_text_embed.text_embedder.linear_2",)),
    KeyRule("guidance_in.in_layer", ("time_text_embed.guidance_embedder.linear_1",)),
    KeyRule("guidance_in.out_layer", ("time_text_embed.guidance_embedder.linear_2",)),
))


def tiny_pipeline(pipeline_cls: type, schnell: bool = False):
    """A tiny random Flux.1 (dev-like: guidance embedding, dynamic shift; or schnell-like: neither) as a
    `pipeline_cls` (FluxPipeline, or FluxKontextPipeline: Kontext has Flux's architecture)."""
    from .tiny import clip_text, clip_tokenizer, flow_scheduler, kl_vae, t5_text, t5_tokenizer

    clip_tok, t5_tok = clip_tokenizer(), t5_tokenizer()
    torch.manual_seed(10)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=not schnell, axes_dims_rope=(4, 4, 8),
    )
    sched = (
        flow_scheduler(shift=1.0, use_dynamic_shifting=False)
        if schnell
        else flow_scheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                            base_image_seq_len=256, max_image_seq_len=4096)
    )
    return pipeline_cls(
        scheduler=sched, vae=kl_vae(0.1159, 0.3611), text_encoder=clip_text(clip_tok, 32, None, 1),
        tokenizer=clip_tok, text_encoder_2=t5_text(t5_tok, 32), tokenizer_2=t5_tok, transformer=transformer,
    )


def image_ids(h: int, w: int, device) -> torch.Tensor:
    """Flux's (0, row, col) position id per 2x2 token of (h, w) latents, (h/2, w/2, 3). Hot path: a small tensor built
    per call (h/2 * w/2 rows); the rotary tables are computed from it inside the transformer anyway."""
    ids = torch.zeros(h // 2, w // 2, 3, device=device)
    ids[..., 1] += torch.arange(h // 2, device=device)[:, None]
    ids[..., 2] += torch.arange(w // 2, device=device)[None, :]
    return ids


class FluxAdapter(DiffusersAdapter):
    family = "flux"
    transformer_cls = FluxTransformer2DModel
    pipeline_cls = FluxPipeline
    default_lora_targets = (
        "to_q", "to_k", "to_v", "to_out.0",
        "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
        "proj_mlp",
    )
    lora_key_map = FLUX_LORA_KEYS
    comfy_reads_diffusers_lora = True  # comfy/lora.py model_lora_keys_unet
    text_encoder_dirs = ("text_encoder", "text_encoder_2")
    text_encoder_classes = ("CLIPTextModel", "T5EncoderModel")
    tokenizer_dirs = ("tokenizer", "tokenizer_2")
    default_scheduler = {"shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
                         "base_image_seq_len": 256, "max_image_seq_len": 4096}
    max_sequence_length = 512  # FluxPipeline's default
    full_name, example_path = "Flux.1-dev", "/path/to/FLUX.1-dev"
    full_config = {  # FLUX.1-dev: FluxTransformer2DModel defaults + guidance embedding (11.9 B parameters)
        "patch_size": 1,
        "in_channels": 64,
        "num_layers": 19,
        "num_single_layers": 38,
        "attention_head_dim": 128,
        "num_attention_heads": 24,
        "joint_attention_dim": 4096,
        "pooled_projection_dim": 768,
        "guidance_embeds": True,
        "axes_dims_rope": [16, 56, 56],
    }
    text_tokens = 512  # T5 padded to max_sequence_length
    text_encoder_params = (("CLIP-L", 123_060_480), ("T5-XXL encoder", 4_762_310_656))
    #: T5's `wo`: transformers casts its input to `wo.weight.dtype`, which would be fp8
    text_encoder_keep_linears = T5_KEEP
    #: `norm1.linear`, `norm1_context.linear` (double blocks), `norm.linear` (single blocks)
    modulation_linears = NORM_MODULATION
    vae_params = 83_819_683  # diffusers AutoencoderKL, 16 latent channels
    sampling_uses_negative = False
    # Presets run on a GPU with full-size random weights under a VRAM cap of card - 1 GB (bench/speed/bench_plan.py;
    # numbers and command in bench/history/2026-11-22.md, 2026-11-22 02:27 UTC, the planner with the 1.35 allocator factor).
    measured_presets = {
        ("lora", 8): MeasuredPreset(0.9, True, "measured on an H200: fits, 6.3 GB reserved, 1.08 s a step"),
        ("lora", 16): MeasuredPreset(0.55, True, "measured on an H200: fits, 14.5 GB reserved, 0.95 s a step"),
        # bench/logs/2026-11-28e/flux-48gb-*.log: the preset as shipped under a 47 GB cap, 6 steps (median of the 4
        # steady ones; 43.2 GB allocated, fit RSS 13.9 GB) against the same run recomputing every block at fraction 0
        ("lora", 48): MeasuredPreset(0.2, "auto", "measured on an H200: fits, 44.1 GB reserved, 0.45 s a step "
                                                  "against 0.73 s recomputing every block at fraction 0"),
        # bench/speed/bench_fullft.py --fractions 0.9,0.75 --no-act (02:39 UTC): the fraction and settings of these
        # presets, uncapped; same process as the resident full fine-tune (1.339 s, 28.2 GB)
        ("full", 8): MeasuredPreset(
            0.9, True, "measured on an H200: 6.4 GB reserved, 1.62 s a step = 1.21x resident"),
        ("full", 12): MeasuredPreset(
            0.75, True, "measured on an H200: 9.5 GB reserved, 1.46 s a step = 1.09x resident"),
    }

    @classmethod
    def tiny_builders(cls):
        return {"flux": lambda: tiny_pipeline(FluxPipeline, schnell=False),
                "flux-schnell": lambda: tiny_pipeline(FluxPipeline, schnell=True)}

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]

    @torch.no_grad()
    def encode_prompts(self, components: Components, prompts: list[str]) -> dict[str, torch.Tensor]:
        clip, t5 = components.text_encoders
        clip_tok, t5_tok = components.tokenizers
        dev = next(clip.parameters()).device
        ids = clip_tok(prompts, padding="max_length", max_length=clip_tok.model_max_length, truncation=True,
                       return_tensors="pt").input_ids
        pooled = clip(ids.to(dev), output_hidden_states=False).pooler_output.to(clip.dtype)
        dev = next(t5.parameters()).device
        ids = t5_tok(prompts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                     return_tensors="pt").input_ids
        embeds = t5(ids.to(dev), output_hidden_states=False)[0].to(t5.dtype)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def encode_images(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return self._kl_encode(vae, pixels)

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:
        b, _, h, w = noisy_latents.shape
        dev = noisy_latents.device
        x = pack_2x2(noisy_latents)
        img_ids = image_ids(h, w, dev)
        embeds = text["prompt_embeds"]
        txt_ids = torch.zeros(embeds.shape[1], 3, device=dev)
        g = None
        if transformer.config.guidance_embeds:
            g = torch.full((b,), float(guidance), device=dev, dtype=torch.float32)
        out = transformer(
            hidden_states=x,
            timestep=t.to(x.dtype),
            guidance=g,
            pooled_projections=text["pooled_prompt_embeds"],
            encoder_hidden_states=embeds,
            txt_ids=txt_ids,
            img_ids=img_ids.reshape(-1, 3),
            return_dict=False,
        )[0]
        return unpack_2x2(out, h, w)

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta") -> dict:
        c, rnd = transformer.config, {"device": torch.device(device), "dtype": dtype}
        kw = packed_inputs(transformer, batch, height, width, text_tokens, dtype, device)
        kw["pooled_projections"] = torch.randn(batch, c.pooled_projection_dim, **rnd)
        if c.guidance_embeds:
            kw["guidance"] = torch.ones(batch, **rnd)
        return kw

    @classmethod
    def pipeline_embeds(cls, pipe, prompt, negative, device) -> dict[str, torch.Tensor]:
        pe, pooled, _ = pipe.encode_prompt(prompt=prompt, prompt_2=None, device=device, num_images_per_prompt=1)
        return {"prompt_embeds": pe, "pooled_prompt_embeds": pooled}
