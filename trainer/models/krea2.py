"""Krea 2: Krea2Transformer2DModel (single-stream MMDiT, 28 blocks, 12.8 B, text fused from 12 Qwen3-VL layers),
a Qwen3-VL-4B text encoder (`Qwen3VLModel`, no head) and Qwen-Image's VAE (8x, 16 channels).

How it mirrors diffusers' Krea2Pipeline (0.42.1):

- text: the prompt is put after Qwen-Image's system-prompt prefix, tokenized padded / truncated to a fixed length
  (`max_sequence_length` 512 + 34 prefix - 5), the 5 suffix tokens of the assistant turn are appended *after* the
  padding, and Qwen3-VL runs with position ids counted over the valid tokens only (cumsum of the mask - 1). The
  hidden states of the `text_encoder_select_layers` (pipeline config; default every third from 2 to 35) are
  stacked per token and the 34 prefix tokens dropped: `prompt_embeds` (B, 512, layers, D) + a bool
  `prompt_embeds_mask` (B, 512). The length is fixed, so entries stack as they are (`collate_text`).
- latents: Qwen-Image's (one frame, per-channel mean / std), packed 2x2 into tokens as the pipeline's
  `_pack_latents`; `position_ids` = zeros for the text rows, (0, row, column) of the token grid for the image.
- predict: timestep = t (the pipeline passes its scheduler's t / 1000 = sigma).
- shift: dynamic (mu from the token count, the scheduler's base / max shift, `max_image_seq_len` 6400); the
  distilled (turbo) checkpoints (`is_distilled` in the pipeline config) use the fixed mu 1.15 instead, as the
  pipeline does, and training uses the same shift.
- sampling: Krea's guidance convention, `cond + g (cond - uncond)`, enabled for any g > 0 (the negative prompt
  defaults to ""); the base checkpoint samples at g 4.5 and 28 steps, the turbo at g 0 and 8 steps.

Left out: compact text entries. The pipeline's text is always 512 tokens x 12 layers x 2560 (31 MB per caption in
bf16); the padded rows are never read back (the transformer masks them as keys), so the cache could keep the valid
rows only, but the entries are stored as the pipeline makes them.
"""

from __future__ import annotations

import json
import math
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from diffusers import Krea2Pipeline, Krea2Transformer2DModel
from torch import nn

from ..errors import UserError
from ._diffusers import DiffusersAdapter, pack_2x2, unpack_2x2
from .base import Components
from .lora_keys import KeyRule, LoraKeyMap
from .qwen_image import QWEN_VAE_ENCODE_PER_PIXEL, QwenImageAdapter
from .qwen_image_21 import qwen3_vl_8b_config

#: Krea's original layout (ComfyUI's model; diffusers' `convert_krea2_transformer_checkpoint_to_diffusers`): renames
#: only, no fused layers. Blocks are `blocks.{i}` (the text-fusion blocks keep their list names under `txtfusion`),
#: attention `wq` / `wk` / `wv` / `wo` / `gate`, the MLP `mlp.*`; the embedders are short names (`first`, `tmlp.0`...).
_ATTN = (("wq", "to_q"), ("wk", "to_k"), ("wv", "to_v"), ("wo", "to_out.0"), ("gate", "to_gate"))
_BLOCKS = (("blocks", "transformer_blocks"), ("txtfusion.layerwise_blocks", "text_fusion.layerwise_blocks"),
           ("txtfusion.refiner_blocks", "text_fusion.refiner_blocks"))
KREA2_LORA_KEYS = LoraKeyMap((
    *(KeyRule(f"{o}.{{i}}.attn.{a}", (f"{d}.{{i}}.attn.{b}",)) for o, d in _BLOCKS for a, b in _ATTN),
    *(KeyRule(f"{o}.{{i}}.mlp.{m}", (f"{d}.{{i}}.ff.{m}",)) for o, d in _BLOCKS for m in ("gate", "up", "down")),
    *(KeyRule(o, (d,)) for o, d in (("first", "img_in"), ("tmlp.0", "time_embed.linear_1"),
                                    ("tmlp.2", "time_embed.linear_2"), ("tproj.1", "time_mod_proj"),
                                    ("txtmlp.1", "txt_in.linear_1"), ("txtmlp.3", "txt_in.linear_2"),
                                    ("last.linear", "final_layer.linear"),
                                    ("txtfusion.projector", "text_fusion.projector"))),
))

PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
PREFIX_TOKENS, SUFFIX_TOKENS = 34, 5  # Krea2Pipeline.prompt_template_encode_start_idx / _num_suffix_tokens
SELECT_LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)  # the pipeline's default text_encoder_select_layers
DISTILLED_MU = 1.15


def qwen3_vl_4b_config(num_hidden_layers: int = 36) -> dict[str, Any]:
    """Qwen3-VL-4B-Instruct's config (text 2560 wide, 36 layers; vision 24 blocks), for full-size random folders."""
    cfg = qwen3_vl_8b_config(num_hidden_layers)
    cfg["text_config"].update(hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True)
    cfg["vision_config"].update(depth=24, hidden_size=1024, intermediate_size=4096, out_hidden_size=2560,
                                deepstack_visual_indexes=[5, 11, 17])
    cfg["tie_word_embeddings"] = True
    return cfg


#: Qwen3-VL-4B as `Qwen3VLModel` (meta-counted from `qwen3_vl_4b_config`): all, the vision tower, the embedding
QWEN3_VL_4B, QWEN3_VL_4B_VISUAL, QWEN3_VL_4B_EMBED = 4_437_815_808, 415_347_712, 388_956_160


class Krea2Adapter(DiffusersAdapter):
    family = "krea2"
    transformer_cls = Krea2Transformer2DModel
    pipeline_cls = Krea2Pipeline
    # the main blocks' Linears by full name: the text-fusion blocks (outside the streamed blocks, resident) have
    # the same Linear names, and LoRA there would keep their activations over 512 x 12 text rows for backward
    # (about 2.7 GB at 512 px); up to 64 blocks (the model has 28)
    default_lora_targets = tuple(f"transformer_blocks.{i}.{m}" for i in range(64) for m in (
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_gate", "attn.to_out.0", "ff.gate", "ff.up", "ff.down"))
    lora_key_map = KREA2_LORA_KEYS
    comfy_reads_diffusers_lora = True  # comfy/lora.py model_lora_keys_unet, in recent releases only:
    comfy_diffusers_lora_since = "its June 2026 releases"  # its key-map branch run on tiny files (docs/lora-files.md)
    text_encoder_dirs = ("text_encoder",)
    text_encoder_classes = ("Qwen3VLModel",)
    tokenizer_dirs = ("tokenizer",)
    vae_cls_name = "AutoencoderKLQwenImage"
    default_scheduler = {"shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
                         "base_image_seq_len": 256, "max_image_seq_len": 6400}
    max_sequence_length = 512  # Krea2Pipeline's fixed text length
    full_name, example_path = "Krea 2", "/path/to/Krea-2"
    full_config = {  # Krea2Transformer2DModel defaults (12.8 B)
        "in_channels": 64, "num_layers": 28, "attention_head_dim": 128, "num_attention_heads": 48,
        "num_key_value_heads": 12, "intermediate_size": 16384, "timestep_embed_dim": 256, "text_hidden_dim": 2560,
        "num_text_layers": 12, "text_num_attention_heads": 20, "text_num_key_value_heads": 20,
        "text_intermediate_size": 6912, "num_layerwise_text_blocks": 2, "num_refiner_text_blocks": 2,
        "axes_dims_rope": [32, 48, 48], "rope_theta": 1000.0,
    }
    text_tokens = 512
    text_encoder_params = (("Qwen3-VL-4B", QWEN3_VL_4B),)
    text_encoder_unused_params = (QWEN3_VL_4B_VISUAL,)  # the vision tower (`slim_text_encoder`)
    text_encoder_nonblock_params = (QWEN3_VL_4B_EMBED,)
    vae_params = 126_892_531  # Qwen-Image's VAE
    vae_encode_bytes_per_pixel = QWEN_VAE_ENCODE_PER_PIXEL
    sampling_uses_negative = True
    sample_defaults = {"steps": 28, "guidance": 4.5}  # the base checkpoint's; turbo: steps 8, guidance 0
    latent_scale, token_patch = 8, 2

    @classmethod
    def full_size_parts(cls, folder):
        """bench/program/bench_program.py's full-size random folders: Qwen-Image's VAE (built for real) and Qwen3-VL-4B as
        `Qwen3VLModel`, whole (36 layers, vision tower included), with the tiny tokenizer's special token ids; the
        pipeline's `text_encoder_select_layers` set to the 12 the full transformer reads."""
        import transformers
        from diffusers import AutoencoderKLQwenImage

        from .qwen_image_21 import full_text_config

        index = folder / "model_index.json"  # the tiny pipeline's 2 selected layers -> the full model's 12
        index.write_text(json.dumps({**json.loads(index.read_text()), "text_encoder_select_layers": SELECT_LAYERS},
                                    indent=2))
        return AutoencoderKLQwenImage(), [("text_encoder", transformers.Qwen3VLModel,
                                           full_text_config(folder, qwen3_vl_4b_config()))]

    @classmethod
    def tiny_builders(cls):
        from .tiny import qwen_tokenizer

        return {"krea2": lambda: tiny_pipeline(qwen_tokenizer()),
                "krea2-turbo": lambda: tiny_pipeline(qwen_tokenizer(), distilled=True)}

    @cached_property
    def pipeline_config(self) -> dict:
        return self._json("model_index.json", required=False)

    @property
    def is_distilled(self) -> bool:
        return bool(self.pipeline_config.get("is_distilled", False))

    @property
    def select_layers(self) -> tuple[int, ...]:
        """The text encoder's hidden states the transformer fuses: as many as its `num_text_layers` (else its
        text fusion fails deep in the first forward: said here, before the captions are encoded)."""
        layers = tuple(self.pipeline_config.get("text_encoder_select_layers") or SELECT_LAYERS)
        want = self._json("transformer/config.json", required=False).get("num_text_layers")
        if want is not None and want != len(layers):
            raise UserError(f"{Path(self.cfg.path) / 'model_index.json'}: text_encoder_select_layers names "
                            f"{len(layers)} layers, but transformer/config.json's num_text_layers is {want}: the "
                            "folder's pipeline and transformer do not belong together (set the list to the layers "
                            "the transformer was trained on)")
        return layers

    def timestep_shift(self, height: int, width: int) -> float:
        return math.exp(DISTILLED_MU) if self.is_distilled else super().timestep_shift(height, width)

    def load(self, cfg, *, parts, dtype, device="cpu") -> Components:
        self.__dict__.pop("pipeline_config", None)
        return super().load(cfg, parts=parts, dtype=dtype, device=device)

    def pipeline(self, components: Components) -> Any:
        pc = self.pipeline_config
        kw = {k: pc[k] for k in ("text_encoder_select_layers", "is_distilled", "patch_size") if k in pc}
        return self.pipeline_cls(
            transformer=components.transformer, vae=components.vae, scheduler=components.scheduler,
            text_encoder=components.text_encoders[0] if components.text_encoders else None,
            tokenizer=components.tokenizers[0] if components.tokenizers else None, **kw,
        )

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.transformer_blocks)

    def slim_text_encoder(self, encoder: nn.Module) -> nn.Module:
        """The vision tower (0.4 B) never runs for captions. (The last decoder layer and the final norm are not
        read either, but dropping them would shift which entry transformers reports as the last hidden state.)"""
        if getattr(encoder, "visual", None) is not None:
            encoder.visual = None
        return encoder

    @torch.no_grad()
    def encode_prompts(self, components: Components, prompts: list[str]) -> dict[str, torch.Tensor]:
        (enc,), (tok,) = components.text_encoders, components.tokenizers
        dev = enc.get_input_embeddings().weight.device
        n = len(prompts)
        text = tok([PREFIX + p for p in prompts], truncation=True, padding="max_length",
                   max_length=self.max_sequence_length + PREFIX_TOKENS - SUFFIX_TOKENS, return_tensors="pt").to(dev)
        suffix = tok([SUFFIX] * n, return_tensors="pt").to(dev)
        ids = torch.cat([text.input_ids, suffix.input_ids], dim=1)
        mask = torch.cat([text.attention_mask, suffix.attention_mask], dim=1).bool()
        pos = (mask.long().cumsum(dim=-1) - 1).clamp(min=0).unsqueeze(0).expand(3, -1, -1)
        out = enc(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True)
        hidden = torch.stack([out.hidden_states[i] for i in self.select_layers], dim=2)
        return {"prompt_embeds": hidden[:, PREFIX_TOKENS:], "prompt_embeds_mask": mask[:, PREFIX_TOKENS:]}

    encode_images = QwenImageAdapter.encode_images

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:
        b, _, h, w = noisy_latents.shape
        x = pack_2x2(noisy_latents)
        embeds = text["prompt_embeds"]
        out = transformer(
            hidden_states=x,
            encoder_hidden_states=embeds,
            timestep=t.to(x.dtype),
            position_ids=position_ids(embeds.shape[1], h // 2, w // 2, x.device),
            encoder_attention_mask=text.get("prompt_embeds_mask"),
            return_dict=False,
        )[0]
        return unpack_2x2(out, h, w)

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta") -> dict:
        c, dev = transformer.config, torch.device(device)
        rnd = {"device": dev, "dtype": dtype}
        ph, pw = height // 16, width // 16
        return dict(
            hidden_states=torch.randn(batch, ph * pw, c.in_channels, **rnd),
            encoder_hidden_states=torch.randn(batch, text_tokens, c.num_text_layers, c.text_hidden_dim, **rnd),
            timestep=torch.ones(batch, **rnd),
            position_ids=position_ids(text_tokens, ph, pw, dev),
            encoder_attention_mask=torch.ones(batch, text_tokens, dtype=torch.bool, device=dev),
        )

    @classmethod
    def pipeline_embeds(cls, pipe, prompt, negative, device) -> dict[str, torch.Tensor]:
        pe, mask = pipe.encode_prompt(prompt=prompt, device=device, num_images_per_prompt=1)
        out = {"prompt_embeds": pe, "prompt_embeds_mask": mask}
        if negative is not None:
            npe, nmask = pipe.encode_prompt(prompt=negative, device=device, num_images_per_prompt=1)
            out |= {"negative_prompt_embeds": npe, "negative_prompt_embeds_mask": nmask}
        return out


def position_ids(text_len: int, grid_h: int, grid_w: int, device) -> torch.Tensor:
    """Krea2Pipeline.prepare_position_ids: (text_len + grid_h * grid_w, 3); text rows zero, image rows (0, r, c)."""
    img = torch.zeros(grid_h, grid_w, 3, device=device)
    img[..., 1] = torch.arange(grid_h, device=device)[:, None]
    img[..., 2] = torch.arange(grid_w, device=device)[None, :]
    return torch.cat([torch.zeros(text_len, 3, device=device), img.reshape(grid_h * grid_w, 3)], dim=0)


# ---------------------------------------------------------------------------------------------- tiny model


def tiny_pipeline(tokenizer, distilled: bool = False) -> Krea2Pipeline:
    """Tiny random Krea 2: 2 blocks 32 wide, text fused from both layers of a 16-wide Qwen3-VL, Qwen-Image's VAE
    with 4 channels. `distilled`: the turbo variant's pipeline config (fixed shift)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler

    from .qwen_image_21 import tiny_qwen3_vl

    encoder = tiny_qwen3_vl(tokenizer, seed=6).model  # Qwen3VLModel: the pipeline's class, no head
    torch.manual_seed(5)
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.05, 0.0], latents_std=[1.5, 2.0, 1.2, 1.8],
    )
    torch.manual_seed(14)
    transformer = Krea2Transformer2DModel(
        in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, timestep_embed_dim=16, text_hidden_dim=16, num_text_layers=2,
        text_num_attention_heads=2, text_num_key_value_heads=2, text_intermediate_size=32,
        num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(4, 6, 6),
    )
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, **Krea2Adapter.default_scheduler)
    return Krea2Pipeline(scheduler=sched, vae=vae, text_encoder=encoder, tokenizer=tokenizer,
                         transformer=transformer, text_encoder_select_layers=(1, 2), is_distilled=distilled)
