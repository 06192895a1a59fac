"""ERNIE-Image (Baidu; ERNIE-Image and the 8-step distilled ERNIE-Image-Turbo): ErnieImageTransformer2DModel, an
8.0 B single-stream DiT (36 layers 4096 wide, one adaLN modulation shared by every layer), a Ministral-3-3B
(Mistral3Model) text encoder and Flux.2's VAE (AutoencoderKLFlux2: 32 channels, 2x2 patchify, batch-norm stats).

How each piece mirrors diffusers' ErnieImagePipeline (0.42):

- text: each prompt alone, tokenized without padding, through the Mistral-3 model; the caption is the *second to
  last* hidden state (`encode_prompt`, called here on the loaded encoder and tokenizer, so it cannot drift).
  Lengths differ per prompt: `prompt_embeds` zero-padded + `prompt_embeds_mask`, re-padded per batch by
  `collate_text` (no mask when nothing is padded). The transformer takes the padded batch and the lengths
  (`text_lens`), masks the padding out of attention and starts the image's first position id at the length.
- latents: as Flux.2's: the VAE mean patchified 2x2 (128 channels), normalised by the VAE's batch-norm running
  mean and sqrt(running var + 1e-5) (the pipeline un-normalises with 1e-5, not the config's `batch_norm_eps`), and
  un-patchified back to (B, 32, H/8, W/8) for the cache; `predict` patchifies it again (the transformer's
  `patch_size` is 1: one token per 2x2 latent pixels, 16 px a side).
- predict: timestep = 1000 t in the transformer's dtype (the pipeline's `torch.full(..., t.item(), dtype)`), the
  output is the (noise - x0) velocity the scheduler steps with.
- shift: the scheduler config (ERNIE-Image: a fixed shift of 4.0; the pipeline passes its own sigmas, linear from 1,
  which the scheduler shifts).
- sampling (`ErnieImagePipeline`): classifier-free guidance above guidance 1, the negative prompt "" by default,
  batched with the positive one; the presets sample at the pipeline's defaults (50 steps, guidance 4). The prompt
  enhancer (`pe`, an optional Ministral-3 LLM that rewrites prompts) is never loaded: sampling hands the pipeline
  prompt embeddings, which it takes as `use_pe=False` would. ERNIE-Image-Turbo samples at guidance 1, 8 steps.
- modulation and quantization: the blocks hold no modulation Linears (the shared `adaLN_modulation` sits outside
  them), so an 8-bit base quantizes every block Linear and leaves the modulation in the model dtype.
- blocks run sequence-first ((S, B, D) activations): the conductor streams them like any block.

Left out: the prompt enhancer, the Mistral-3 vision tower (dropped when the encoder loads: captions are text).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

import torch
from diffusers import ErnieImagePipeline, ErnieImageTransformer2DModel
from torch import nn

from ._diffusers import DiffusersAdapter, collate_masked_text, tiny_token_ids
from .base import Components
from .lora_keys import LoraKeyMap, identity_rules

#: ERNIE-Image's original layout is diffusers' own names (`convert_ernie_image_transformer_checkpoint_to_diffusers`
#: only strips `model.diffusion_model.`; ErnieImageLoraLoaderMixin reads `diffusion_model.<module>` LoRA files by
#: swapping the prefix)
ERNIE_LORA_KEYS = LoraKeyMap(identity_rules(
    "layers",
    ("self_attention.to_q", "self_attention.to_k", "self_attention.to_v", "self_attention.to_out.0",
     "mlp.gate_proj", "mlp.up_proj", "mlp.linear_fc2"),
    ("text_proj", "time_embedding.linear_1", "time_embedding.linear_2", "adaLN_modulation.1", "final_norm.linear",
     "final_linear"),
))
#: the eps ErnieImagePipeline (0.42) un-normalises latents with (its comment: the hub config's 1e-4 is wrong)
BN_EPS = 1e-5
#: Ministral-3-3B as Mistral3Model: its language model's token embedding (131072 x 3072), the vision tower and
#: projector (sized with transformers' Pixtral defaults: 1024 wide, 24 layers; not checked against the release)
MINISTRAL_EMBED, MINISTRAL_LM = 402_653_184, 3_429_006_336
PIXTRAL_VISION, MINISTRAL_PROJECTOR = 403_305_472, 16_778_240


def tiny_pipeline():
    """A tiny random ERNIE-Image: 2 layers 32 wide (the zero-initialised modulation and output layers given random
    weights, so outputs and LoRA gradients are not zero), a 2-layer Mistral-3 16 wide with a one-layer Pixtral
    tower, and Flux.2's tiny tokenizer and VAE."""
    from transformers import Mistral3Config, Mistral3Model

    from .flux2 import mistral_tokenizer, tiny_vae
    from .tiny import flow_scheduler

    tok = mistral_tokenizer()
    cfg = Mistral3Config(
        text_config={
            "model_type": "mistral", "vocab_size": len(tok), "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
            "max_position_embeddings": 1024, "sliding_window": None, "pad_token_id": tok.pad_token_id,
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        },
        vision_config={"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "head_dim": 8, "image_size": 64, "patch_size": 16},
        image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=1,
    )
    torch.manual_seed(31)
    enc = Mistral3Model(cfg).eval()
    torch.manual_seed(32)
    transformer = ErnieImageTransformer2DModel(
        hidden_size=32, num_attention_heads=2, num_layers=2, ffn_hidden_size=64, in_channels=16, out_channels=16,
        patch_size=1, text_in_dim=16, rope_theta=256, rope_axes_dim=(4, 6, 6),
    )
    g = torch.Generator().manual_seed(33)
    with torch.no_grad():
        for lin in (transformer.adaLN_modulation[-1], transformer.final_linear):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.1)
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=g) * 0.1)
    return ErnieImagePipeline(transformer=transformer, vae=tiny_vae(), text_encoder=enc, tokenizer=tok,
                              scheduler=flow_scheduler(shift=4.0))


class ErnieImageAdapter(DiffusersAdapter):
    family = "ernie-image"
    transformer_cls = ErnieImageTransformer2DModel
    pipeline_cls = ErnieImagePipeline
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "mlp.gate_proj", "mlp.up_proj", "mlp.linear_fc2")
    lora_key_map = ERNIE_LORA_KEYS
    text_encoder_dirs = ("text_encoder",)
    text_encoder_classes = ("Mistral3Model",)
    tokenizer_dirs = ("tokenizer",)
    vae_cls_name = "AutoencoderKLFlux2"
    #: ERNIE-Image's scheduler config (seen in a duplicate of baidu/ERNIE-Image: shift 4.0, no dynamic shifting)
    default_scheduler = {"shift": 4.0, "use_dynamic_shifting": False}
    full_name, example_path = "ERNIE-Image", "/path/to/ERNIE-Image"
    full_config = {  # ERNIE-Image's transformer/config.json (8.03 B; diffusers' defaults are a smaller 3072-wide one)
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_layers": 36,
        "ffn_hidden_size": 12288,
        "in_channels": 128,
        "out_channels": 128,
        "patch_size": 1,
        "text_in_dim": 3072,
        "rope_theta": 256,
        "rope_axes_dim": [32, 48, 48],
        "eps": 1e-6,
        "qk_layernorm": True,
    }
    text_tokens = 256  # unpadded captions, padded to the batch's longest: assumed 256 for planning
    text_encoder_params = (("Ministral-3-3B", MINISTRAL_LM + PIXTRAL_VISION + MINISTRAL_PROJECTOR),)
    text_encoder_unused_params = (PIXTRAL_VISION + MINISTRAL_PROJECTOR,)  # `slim_text_encoder` drops them
    text_encoder_nonblock_params = (MINISTRAL_EMBED,)
    text_encoder_layers = (26,)
    vae_params = 84_046_115  # AutoencoderKLFlux2 defaults (Flux.2's VAE)
    sampling_uses_negative = True
    #: what the presets sample with: ErnieImagePipeline's defaults (ERNIE-Image; the Turbo: guidance 1, 8 steps)
    sample_defaults: ClassVar[dict[str, Any]] = {"steps": 50, "guidance": 4.0}
    modulation_linears = ""  # none inside blocks: the shared adaLN_modulation is outside them

    @classmethod
    def tiny_builders(cls):
        return {"ernie-image": tiny_pipeline}

    @classmethod
    def full_size_parts(cls, folder):
        """bench/program/bench_program.py's full-size random folders: Flux.2's VAE (AutoencoderKLFlux2's defaults)
        and Ministral-3-3B as Mistral3Model whole, bf16 (7.7 GB): its language model 26 layers 3072 wide (128k
        tokens, 32 heads of 128, 8 key-value heads), the Pixtral tower at transformers' defaults and a projector
        without biases over 2x2 merged patches (the sizes `MINISTRAL_LM`, `PIXTRAL_VISION` and
        `MINISTRAL_PROJECTOR` count; the loader drops the last two: `slim_text_encoder`). The pipeline reads the
        second to last hidden state: no layer is cut. The text model is written as the tiny one is (`mistral`
        layers; the release's `ministral3` has the same weights), with the tiny tokenizer's special ids."""
        from diffusers import AutoencoderKLFlux2
        from transformers import Mistral3Config, Mistral3Model

        cfg = Mistral3Config(
            text_config={"model_type": "mistral", "vocab_size": 131_072, "hidden_size": 3072,
                         "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 32,
                         "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 262_144,
                         "sliding_window": None, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                         **tiny_token_ids(folder)},
            multimodal_projector_bias=False, spatial_merge_size=2,
            **tiny_token_ids(folder, keys=("image_token_index",)))
        return AutoencoderKLFlux2(), [("text_encoder", Mistral3Model, cfg)]

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.layers)

    def slim_text_encoder(self, encoder: nn.Module) -> nn.Module:
        """Captions never see an image: the vision tower and its projector go before the encoder is placed."""
        for name in ("vision_tower", "multi_modal_projector"):
            if getattr(encoder, name, None) is not None:
                setattr(encoder, name, None)
        return encoder

    @torch.no_grad()
    def encode_prompts(self, components: Components, prompts: list[str]) -> dict[str, torch.Tensor]:
        (enc,), (tok,) = components.text_encoders, components.tokenizers
        dev = enc.get_input_embeddings().weight.device
        # the pipeline's own encode_prompt on the loaded parts (it reads only these two attributes)
        parts = ErnieImagePipeline.encode_prompt(SimpleNamespace(tokenizer=tok, text_encoder=enc), list(prompts), dev)
        longest = max(p.shape[0] for p in parts)
        embeds = torch.stack([nn.functional.pad(p, (0, 0, 0, longest - p.shape[0])) for p in parts]).to(enc.dtype)
        mask = torch.zeros(len(parts), longest, dtype=torch.long, device=dev)
        for i, p in enumerate(parts):
            mask[i, : p.shape[0]] = 1
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def collate_text(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return collate_masked_text(items)

    def encode_images(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        lat = vae.encode(pixels.to(vae.dtype)).latent_dist.mode()
        p = ErnieImagePipeline._patchify_latents(lat)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(p.device, p.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + BN_EPS).to(p.device, p.dtype)
        return ErnieImagePipeline._unpatchify_latents((p - mean) / std)

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:
        x = ErnieImagePipeline._patchify_latents(noisy_latents)
        embeds, mask = text["prompt_embeds"], text.get("prompt_embeds_mask")
        lens = (mask.sum(1) if mask is not None else
                torch.full((x.shape[0],), embeds.shape[1], dtype=torch.long, device=x.device))
        out = transformer(hidden_states=x, timestep=(t.float() * 1000).to(x.dtype), text_bth=embeds.to(x.dtype),
                          text_lens=lens, return_dict=False)[0]
        return ErnieImagePipeline._unpatchify_latents(out)

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta") -> dict:
        c, dev = transformer.config, torch.device(device)
        rnd = {"device": dev, "dtype": dtype}
        return dict(
            hidden_states=torch.randn(batch, c.in_channels, height // 16, width // 16, **rnd),
            timestep=torch.ones(batch, **rnd),
            text_bth=torch.randn(batch, text_tokens, c.text_in_dim, **rnd),
            text_lens=torch.full((batch,), text_tokens, dtype=torch.long, device=dev),
        )

    @classmethod
    def pipeline_embeds(cls, pipe, prompt, negative, device) -> dict[str, Any]:
        out: dict[str, Any] = {"prompt_embeds": pipe.encode_prompt(prompt, device)}
        if negative is not None:
            out["negative_prompt_embeds"] = pipe.encode_prompt(negative, device)
        return out
