"""Anima (CircleStone Labs; built on NVIDIA's Cosmos-Predict2-2B): CosmosTransformer3DModel (1.96 B, 28 blocks 2048
wide, each self-attention, cross-attention to the text and an MLP under AdaLN-LoRA modulation), a Qwen3-0.6B text
encoder (Qwen3Model), Anima's LLM adapter (`AnimaTextConditioner`, 6 blocks, 135 M: T5 token ids cross-attending to
the Qwen3 states) and Qwen-Image's VAE (AutoencoderKLQwenImage, 16 channels, 8x).

diffusers 0.42 ships Anima only as a *modular* pipeline (`diffusers/modular_pipelines/anima`); sampling goes through
`AnimaPipeline` (trainer/models/anima_pipeline.py), a classic face on those blocks, as Flux.3's does. How each piece
here mirrors the blocks:

- text (`AnimaTextEncoderStep` + `AnimaTextConditioningStep`): each prompt alone, tokenized for Qwen3 (no template)
  and for T5 (its ids are the adapter's queries), Qwen3's last hidden state (zeroed at padding), then the LLM
  adapter, whose output is zero-padded to 512 tokens: `prompt_embeds` (512, 1024) a caption, what the transformer
  cross-attends to (no mask: it attends to the padding rows, as in the pipeline). `anima_pipeline.conditioned_embeds`
  calls the steps' own functions. The adapter is frozen (not trained: `AnimaLoraLoaderMixin` would load a LoRA of
  it, which dittrain does not write) and runs once per caption while captions are cached: it is loaded with the
  text encoder and carried as its `text_conditioner` sub-module (`slim_text_encoder`), so it is placed, counted
  (planner) and freed with it.
- latents: Qwen-Image's (the VAE's mode of the one-frame video, normalised by `latents_mean` / `latents_std`: the
  decoder step un-normalises with the same), cached as (B, 16, H/8, W/8); `predict` adds the frame axis back.
- predict: the transformer on (B, C, 1, h, w) at timestep (1000 t in the transformer's dtype) / 1000, as the
  denoising loop passes it, with an all-zero padding mask (the pipeline's, at pixel size, which the transformer
  resizes to the latent's: passed here at the latent's size, the same zeros); the output is the (noise - x0)
  velocity the scheduler steps with. 2x2 patches inside the transformer: buckets divide by 16.
- shift: the scheduler config's (the modular `AnimaSetTimestepsStep` hands its linear sigmas to the scheduler, which
  shifts them); without one, `default_scheduler`.
- sampling: classifier-free guidance through the blocks' guider (on unless the scale is 1); 50 steps at 4.0 by
  default, the blocks' own defaults.

Left out: image-to-image (the blocks' img2img workflow), LoRA on the LLM adapter, the comfy / kohya LoRA names of the
LLM adapter (`llm_adapter.*`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers import AnimaTextConditioner, CosmosTransformer3DModel
from torch import nn

from ..errors import UserError
from ._diffusers import NORM_MODULATION, DiffusersAdapter, tiny_token_ids
from .anima_pipeline import AnimaPipeline, conditioned_embeds, recipe
from .base import Components
from .lora_keys import KeyRule, LoraKeyMap
from .qwen_image import QwenImageAdapter

# ---------------------------------------------------------------------------------------------- LoRA key map

#: Cosmos-Predict2's original names (MiniTrainDIT, ComfyUI's Anima model), as diffusers' single-file converter
#: (`convert_cosmos_transformer_checkpoint_to_diffusers`, Cosmos 2.0) and its Anima LoRA converter
#: (`_convert_non_diffusers_anima_lora_to_diffusers`) rename them. No fused layers.
_BLOCK = (
    ("self_attn.q_proj", "attn1.to_q"), ("self_attn.k_proj", "attn1.to_k"), ("self_attn.v_proj", "attn1.to_v"),
    ("self_attn.output_proj", "attn1.to_out.0"), ("cross_attn.q_proj", "attn2.to_q"),
    ("cross_attn.k_proj", "attn2.to_k"), ("cross_attn.v_proj", "attn2.to_v"),
    ("cross_attn.output_proj", "attn2.to_out.0"), ("mlp.layer1", "ff.net.0.proj"), ("mlp.layer2", "ff.net.2"),
    *((f"adaln_modulation_{o}.{k}", f"norm{n}.linear_{k}") for o, n in (("self_attn", 1), ("cross_attn", 2),
                                                                          ("mlp", 3)) for k in (1, 2)),
)
ANIMA_LORA_KEYS = LoraKeyMap((
    *(KeyRule(f"blocks.{{i}}.{o}", (f"transformer_blocks.{{i}}.{d}",)) for o, d in _BLOCK),
    *(KeyRule(o, (d,)) for o, d in (
        ("x_embedder.proj.1", "patch_embed.proj"), ("t_embedder.1.linear_1", "time_embed.t_embedder.linear_1"),
        ("t_embedder.1.linear_2", "time_embed.t_embedder.linear_2"),
        ("final_layer.adaln_modulation.1", "norm_out.linear_1"),
        ("final_layer.adaln_modulation.2", "norm_out.linear_2"), ("final_layer.linear", "proj_out"),
    )),
))

#: Qwen3-0.6B as Qwen3Model (no head: the embedding is the tied one), one decoder layer; the LLM adapter at its
#: diffusers defaults (meta-counted)
QWEN3_06B, QWEN3_06B_EMBED, QWEN3_06B_LAYER = 596_049_920, 155_582_464, 15_730_944
ANIMA_ADAPTER, ANIMA_ADAPTER_BLOCKS = 134_663_680, 100_713_984


class AnimaAdapter(DiffusersAdapter):
    family = "anima"
    transformer_cls = CosmosTransformer3DModel
    pipeline_cls = AnimaPipeline
    # the block Linears: self- and cross-attention, the MLP (the modulation Linears are left out, as elsewhere)
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2")
    lora_key_map = ANIMA_LORA_KEYS
    modulation_linears = NORM_MODULATION  # norm1 / norm2 / norm3 `.linear_1` / `.linear_2`: AdaLN-LoRA
    text_encoder_dirs = ("text_encoder",)
    text_encoder_classes = ("Qwen3Model",)
    tokenizer_dirs = ("tokenizer", "t5_tokenizer")
    #: the LLM adapter and the T5 tokenizer change the embeddings: part of the text cache's identity
    extra_text_dirs = ("text_conditioner", "t5_tokenizer")
    vae_cls_name = "AutoencoderKLQwenImage"
    #: without a scheduler config: ComfyUI's sampling shift for Anima (not checked here against a release)
    default_scheduler = {"shift": 3.0, "use_dynamic_shifting": False}
    max_sequence_length = recipe()["max_sequence_length"]
    full_name, example_path = "Anima", "/path/to/Anima-Base-v1.0-Diffusers"
    #: Cosmos-Predict2-2B-Text2Image's transformer (diffusers' conversion config `Cosmos-2.0-Diffusion-2B-Text2Image`,
    #: the same sizes sd-scripts' Anima loader hard-codes: 2048 wide, 28 blocks, 16 heads, RoPE h / w x4, no
    #: learnable position embedding); the released Anima folder's own config.json not checked (offline)
    full_config = {
        "in_channels": 16, "out_channels": 16, "num_attention_heads": 16, "attention_head_dim": 128, "num_layers": 28,
        "mlp_ratio": 4.0, "text_embed_dim": 1024, "adaln_lora_dim": 256, "max_size": [128, 240, 240],
        "patch_size": [1, 2, 2], "rope_scale": [1.0, 4.0, 4.0], "concat_padding_mask": True,
        "extra_pos_embed_type": None,
    }
    text_tokens = 512  # the LLM adapter pads its output to 512 tokens
    # the LLM adapter rides with the text encoder (module essay): counted with it, outside its streamed layers
    text_encoder_params = (("Qwen3-0.6B + LLM adapter", QWEN3_06B + ANIMA_ADAPTER),)
    text_encoder_nonblock_params = (QWEN3_06B_EMBED + ANIMA_ADAPTER,)
    text_encoder_layers = (28,)
    vae_params = QwenImageAdapter.vae_params
    vae_encode_bytes_per_pixel = QwenImageAdapter.vae_encode_bytes_per_pixel
    sampling_uses_negative = True
    #: the modular blocks' defaults (`anima_pipeline.recipe`)
    sample_defaults: ClassVar[dict[str, Any]] = {"steps": 50, "guidance": 4.0}

    @classmethod
    def tiny_builders(cls):
        return {"anima": tiny_pipeline}

    @classmethod
    def full_size_parts(cls, folder):
        """bench/program/bench_program.py's full-size random folders: Qwen-Image's VAE (AutoencoderKLQwenImage's
        defaults), Qwen3-0.6B as Qwen3Model whole (28 layers 1024 wide, tied embedding; bf16, 1.2 GB) with the tiny
        tokenizer's special ids, and the LLM adapter (`text_conditioner/`: AnimaTextConditioner's defaults, 6 blocks,
        queries over T5's 32128 tokens; a diffusers model, which the bench builds for real as it does the VAE)."""
        from diffusers import AutoencoderKLQwenImage
        from transformers import Qwen3Config, Qwen3Model

        qwen = Qwen3Config(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                           rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                           tie_word_embeddings=True, **tiny_token_ids(folder))
        return AutoencoderKLQwenImage(), [("text_encoder", Qwen3Model, qwen),
                                          ("text_conditioner", AnimaTextConditioner, {})]

    @property
    def patch_size(self) -> int:
        return int(self.transformer_config.get("patch_size", [1, 2, 2])[-1])

    @classmethod
    def runs_cfg(cls, guidance: float) -> bool:
        return abs(float(guidance) - 1.0) > 1e-9  # the blocks' guider is on at any scale but 1

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.transformer_blocks)

    def _check(self, cfg, parts: set[str]) -> None:
        super()._check(cfg, parts)
        if "text" in parts and not (Path(cfg.path) / "text_conditioner" / "config.json").is_file():
            raise UserError(f"{Path(cfg.path) / 'text_conditioner'} not found: expected Anima's LLM adapter "
                            f"(AnimaTextConditioner) of a diffusers-format anima folder ({self._expected()}, "
                            f"text_conditioner/)")

    def slim_text_encoder(self, encoder: nn.Module) -> nn.Module:
        """Not a slimming: the LLM adapter joins the text encoder here, as its `text_conditioner` (module essay).
        This is the hook both the loader and the planner's meta-device build call, so the planner counts the adapter
        with the encoder (and `model.quantize_text_encoders` quantizes it with it)."""
        folder = Path(self.cfg.path) / "text_conditioner"
        if next(encoder.parameters()).is_meta:
            with torch.device("meta"):
                cond = AnimaTextConditioner.from_config(AnimaTextConditioner.load_config(folder))
        else:
            cond = AnimaTextConditioner.from_pretrained(folder, torch_dtype=encoder.dtype, local_files_only=True)
        encoder.text_conditioner = cond.eval().requires_grad_(False)
        return encoder

    def pipeline(self, components: Components) -> Any:
        enc = components.text_encoders[0] if components.text_encoders else None
        toks = list(components.tokenizers) + [None, None]
        return AnimaPipeline(transformer=components.transformer, vae=components.vae, scheduler=components.scheduler,
                             text_encoder=enc, tokenizer=toks[0], t5_tokenizer=toks[1],
                             text_conditioner=getattr(enc, "text_conditioner", None))

    @torch.no_grad()
    def encode_prompts(self, components: Components, prompts: list[str]) -> dict[str, torch.Tensor]:
        (enc,), (tok, t5_tok) = components.text_encoders, components.tokenizers
        dev = enc.get_input_embeddings().weight.device
        return {"prompt_embeds": torch.cat([conditioned_embeds(enc, tok, t5_tok, enc.text_conditioner, p, dev)
                                            for p in prompts])}

    encode_images = QwenImageAdapter.encode_images

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:  # noqa: ARG002
        x = noisy_latents.unsqueeze(2)
        dtype, (h, w) = x.dtype, x.shape[-2:]
        out = transformer(
            hidden_states=x,
            timestep=(t.float() * 1000).to(dtype) / 1000,  # AnimaLoopBeforeDenoiser: t.to(dtype) / 1000
            encoder_hidden_states=text["prompt_embeds"].to(dtype),
            padding_mask=x.new_zeros(1, 1, h, w),
            return_dict=False,
        )[0]
        return out[:, :, 0]

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta") -> dict:
        c, dev = transformer.config, torch.device(device)
        rnd = {"device": dev, "dtype": dtype}
        return dict(
            hidden_states=torch.randn(batch, c.in_channels, 1, height // 8, width // 8, **rnd),
            timestep=torch.ones(batch, **rnd),
            encoder_hidden_states=torch.randn(batch, text_tokens, c.text_embed_dim, **rnd),
            padding_mask=torch.zeros(1, 1, height // 8, width // 8, **rnd),
        )

    @classmethod
    def pipeline_embeds(cls, pipe, prompt, negative, device) -> dict[str, Any]:
        out: dict[str, Any] = {"prompt_embeds": pipe.encode_prompt(prompt, device)}
        if negative is not None:
            out["negative_prompt_embeds"] = pipe.encode_prompt(negative, device)
        return out


# ---------------------------------------------------------------------------------------------- tiny model


def tiny_pipeline() -> AnimaPipeline:
    """Tiny random Anima: a 2-layer Qwen3 16 wide with the tiny Qwen tokenizer (its pad token added, as Qwen3's has
    one), the tiny T5 tokenizer, a one-block LLM adapter 16 wide padding to 512 tokens as the real one, Qwen-Image's
    tiny VAE (4 latent channels) and a transformer of 2 blocks 32 wide."""
    from diffusers import AutoencoderKLQwenImage
    from transformers import Qwen3Config, Qwen3Model

    from .tiny import flow_scheduler, qwen_tokenizer, t5_tokenizer

    tok = qwen_tokenizer()
    tok.add_special_tokens({"pad_token": "<|endoftext|>"})
    t5 = t5_tokenizer()
    torch.manual_seed(41)
    enc = Qwen3Model(Qwen3Config(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=1024, pad_token_id=tok.pad_token_id)).eval()
    torch.manual_seed(42)
    cond = AnimaTextConditioner(source_dim=16, target_dim=16, model_dim=16, num_layers=1, num_attention_heads=2,
                                mlp_ratio=2.0, target_vocab_size=len(t5), min_sequence_length=512)
    torch.manual_seed(43)
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.05, 0.0], latents_std=[1.5, 2.0, 1.2, 1.8],
    )
    torch.manual_seed(44)
    transformer = CosmosTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2, mlp_ratio=2.0,
        text_embed_dim=16, adaln_lora_dim=8, max_size=(128, 240, 240), patch_size=(1, 2, 2),
        rope_scale=(1.0, 4.0, 4.0), concat_padding_mask=True, extra_pos_embed_type=None,
    )
    return AnimaPipeline(transformer=transformer, vae=vae, scheduler=flow_scheduler(**AnimaAdapter.default_scheduler),
                         text_encoder=enc, tokenizer=tok, t5_tokenizer=t5, text_conditioner=cond)
