"""Z-Image (Tongyi-MAI; Z-Image-Turbo and the undistilled Z-Image): ZImageTransformer2DModel, a single-stream
DiT (30 layers after two noise-refiner and two caption-refiner blocks, 6.2 B), a Qwen3-4B text encoder and
Flux's 16-channel VAE.

How each piece mirrors diffusers' ZImagePipeline (0.42):

- text: each prompt goes through the tokenizer's chat template as one user message (`add_generation_prompt`,
  `enable_thinking=True`), is padded to `max_sequence_length` (512) tokens and run through Qwen3 with its
  attention mask; the caption is the *second to last* hidden state at the valid tokens only (no padding, no
  final norm). Lengths differ per prompt: `prompt_embeds` (B, L, D) zero-padded + `prompt_embeds_mask` (B, L),
  and `collate_text` re-pads cached entries to the batch's longest, leaving the mask out when none is needed
  (as Qwen-Image's adapter does).
- latents: VAE mean, then (z - shift_factor) * scaling_factor, as the pipeline undoes before decoding.
- predict: the transformer takes *lists*: one (C, 1, h, w) latent and one (L_i, D) caption per sample, and
  patchifies, pads (to multiples of 32 tokens) and positions them itself (caption positions first, the image's
  after them). Its time runs the other way: the pipeline passes (1000 - timestep) / 1000 = 1 - t, and it returns
  the *negated* velocity (x0 - noise), which the pipeline negates before the scheduler step. So `predict`
  passes 1 - t and returns -output: the (noise - x0) velocity every other family returns.
- shift: the scheduler config decides (Z-Image-Turbo: a fixed shift of 3.0; dynamic shifting with mu from the
  image token count is honoured if a config asks for it).
- sampling (`ZImagePipeline`): `prompt_embeds` as a list of per-prompt tensors. Classifier-free guidance runs
  when `guidance_scale > 0` (not > 1): pred = pos + g (pos - neg), so the negative prompt is encoded for any
  guidance above 0 (`runs_cfg`). Z-Image-Turbo (distilled) samples with guidance 0 and 9 steps (8 transformer
  passes), which is what the presets set; the undistilled Z-Image wants guidance ~4 and 28-50 steps.
- quantization: a block's modulation Linear is `adaLN_modulation.0` (the time embedding to 4 x dim scale /
  gate vectors); it stays in the model dtype unless `model.quantize_modulation` (trainer/quant.py), like Flux's.

Left out: the omni (image-conditioned, SigLIP) mode, ControlNet inputs, `cfg_normalization` / `cfg_truncation`
(the pipeline's defaults, off, are what sampling uses); the caption refiner blocks run under the conductor like
every other block.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers import ZImagePipeline, ZImageTransformer2DModel
from torch import nn

from ._diffusers import DiffusersAdapter, collate_masked_text
from .base import Components
from .lora_keys import KeyRule, LoraKeyMap

#: Tongyi's original layout (ComfyUI's Lumina2 / NextDiT model; diffusers' single-file converter,
#: `convert_z_image_transformer_checkpoint_to_diffusers`): each attention's q/k/v fused into `attention.qkv`, its
#: output named `attention.out`, the patch embedder and final layer without diffusers' `all_` / `.2-1` naming;
#: everything else keeps diffusers' names.
#: ComfyUI also reads diffusers-keyed Z-Image LoRAs (its Lumina2 branch of `model_lora_keys_unet`).
Z_IMAGE_LORA_KEYS = LoraKeyMap((
    *(rule for blk in ("layers", "noise_refiner", "context_refiner") for rule in (
        KeyRule(f"{blk}.{{i}}.attention.qkv", tuple(f"{blk}.{{i}}.attention.to_{p}" for p in "qkv"), (1, 1, 1)),
        KeyRule(f"{blk}.{{i}}.attention.out", (f"{blk}.{{i}}.attention.to_out.0",)),
        *(KeyRule(f"{blk}.{{i}}.{n}", (f"{blk}.{{i}}.{n}",))
          for n in ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "adaLN_modulation.0")))),
    KeyRule("x_embedder", ("all_x_embedder.2-1",)),
    KeyRule("final_layer.linear", ("all_final_layer.2-1.linear",)),
    KeyRule("final_layer.adaLN_modulation.1", ("all_final_layer.2-1.adaLN_modulation.1",)),
    *(KeyRule(n, (n,)) for n in ("t_embedder.mlp.0", "t_embedder.mlp.2", "cap_embedder.1")),
))

#: Qwen3-4B's token embedding (151936 x 2560, tied with its head): outside the streamed decoder layers
QWEN3_4B_EMBED = 388_956_160
#: Qwen3's chat template for what ZImagePipeline asks of it (user turns, a generation prompt; `enable_thinking=False`
#: adds the empty think block), written out short for the tiny tokenizer: the real one also handles tools and
#: reasoning history
QWEN3_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)


def tiny_pipeline():
    """A tiny random Z-Image (Turbo-like: fixed shift 3) with a Qwen3 text encoder; the tokenizer is the tiny Qwen
    one with `QWEN3_CHAT_TEMPLATE`."""
    from transformers import Qwen3Config, Qwen3Model

    from .tiny import QWEN_SPECIAL, flow_scheduler, kl_vae, qwen_tokenizer

    tok = qwen_tokenizer()
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    cfg = Qwen3Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )
    torch.manual_seed(6)
    text_encoder = Qwen3Model(cfg).eval()
    torch.manual_seed(13)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=64, n_layers=2, n_refiner_layers=1, n_heads=2,
        n_kv_heads=2, cap_feat_dim=32, axes_dims=[8, 12, 12], axes_lens=[1024, 64, 64],
    )
    return ZImagePipeline(scheduler=flow_scheduler(shift=3.0, use_dynamic_shifting=False),
                          vae=kl_vae(0.1159, 0.3611), text_encoder=text_encoder, tokenizer=tok, transformer=transformer)


class ZImageAdapter(DiffusersAdapter):
    family = "z-image"
    transformer_cls = ZImageTransformer2DModel
    pipeline_cls = ZImagePipeline
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
    lora_key_map = Z_IMAGE_LORA_KEYS
    comfy_reads_diffusers_lora = True  # comfy/lora.py model_lora_keys_unet (Lumina2: z_image_to_diffusers)
    comfy_diffusers_lora_since = "v0.4.0 (December 2025)"  # run in ComfyUI v0.3.75 / v0.4.0 (docs/lora-files.md)
    text_encoder_dirs = ("text_encoder",)
    text_encoder_classes = ("Qwen3Model",)
    tokenizer_dirs = ("tokenizer",)
    default_scheduler = {"shift": 3.0, "use_dynamic_shifting": False}  # Z-Image-Turbo's scheduler config
    packs_2x2 = False  # the transformer patchifies 2x2 itself (`all_patch_size` (2,))
    max_sequence_length = 512  # ZImagePipeline's default
    full_name, example_path = "Z-Image-Turbo", "/path/to/Z-Image-Turbo"
    full_config = {  # ZImageTransformer2DModel defaults = Z-Image(-Turbo) (6.15 B)
        "all_patch_size": [2],
        "all_f_patch_size": [1],
        "in_channels": 16,
        "dim": 3840,
        "n_layers": 30,
        "n_refiner_layers": 2,
        "n_heads": 30,
        "n_kv_heads": 30,
        "norm_eps": 1e-5,
        "qk_norm": True,
        "cap_feat_dim": 2560,
        "rope_theta": 256.0,
        "t_scale": 1000.0,
        "axes_dims": [32, 48, 48],
        "axes_lens": [1024, 512, 512],
    }
    text_tokens = 256  # valid caption tokens only, padded to the batch's longest: assumed 256 for planning
    text_encoder_params = (("Qwen3-4B", 4_022_468_096),)
    text_encoder_nonblock_params = (QWEN3_4B_EMBED,)
    vae_params = 83_819_683  # Flux's AutoencoderKL
    sampling_uses_negative = True
    #: what the presets sample with: Z-Image-Turbo's settings (guidance 0: no negative pass, 9 steps)
    sample_defaults: ClassVar[dict[str, Any]] = {"steps": 9, "guidance": 0.0}
    #: `adaLN_modulation.0`: the time embedding to each block's 4 x dim scale / gate vectors
    modulation_linears = r"(^|\.)adaLN_modulation\."

    @classmethod
    def tiny_builders(cls):
        return {"z-image": tiny_pipeline}

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        # execution order of ZImageTransformer2DModel.forward: image refiners, caption refiners, the main layers
        return [*transformer.noise_refiner, *transformer.context_refiner, *transformer.layers]

    @classmethod
    def runs_cfg(cls, guidance: float) -> bool:
        """ZImagePipeline runs classifier-free guidance for any guidance_scale above 0."""
        return guidance > 0

    @torch.no_grad()
    def encode_prompts(self, components: Components, prompts: list[str]) -> dict[str, torch.Tensor]:
        (enc,), (tok,) = components.text_encoders, components.tokenizers
        dev = enc.get_input_embeddings().weight.device
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True,
                                         enable_thinking=True) for p in prompts]
        toks = tok(texts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                   return_tensors="pt")
        ids, valid = toks.input_ids.to(dev), toks.attention_mask.to(dev).bool()
        hidden = enc(input_ids=ids, attention_mask=valid, output_hidden_states=True).hidden_states[-2]
        parts = [h[m] for h, m in zip(hidden, valid, strict=True)]
        longest = max(p.shape[0] for p in parts)
        embeds = torch.stack([nn.functional.pad(p, (0, 0, 0, longest - p.shape[0])) for p in parts])
        mask = torch.zeros(len(parts), longest, dtype=torch.long, device=dev)
        for i, p in enumerate(parts):
            mask[i, : p.shape[0]] = 1
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def collate_text(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return collate_masked_text(items)

    def encode_images(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return self._kl_encode(vae, pixels)

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:
        embeds, mask = text["prompt_embeds"], text.get("prompt_embeds_mask")
        b = noisy_latents.shape[0]
        # Host-device sync only when captions of different lengths share a batch (the mask is there): the
        # transformer takes each caption as its own tensor.
        lengths = [embeds.shape[1]] * b if mask is None else mask.sum(1).tolist()
        caps = [e[:n] for e, n in zip(embeds, lengths, strict=True)]
        x = list(noisy_latents.unsqueeze(2).unbind(0))
        out = transformer(x, 1.0 - t.float(), caps, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta") -> dict:
        c, dev = transformer.config, torch.device(device)
        rnd = {"device": dev, "dtype": dtype}
        return dict(
            x=[torch.randn(c.in_channels, 1, height // 8, width // 8, **rnd) for _ in range(batch)],
            t=torch.ones(batch, device=dev),
            cap_feats=[torch.randn(text_tokens, c.cap_feat_dim, **rnd) for _ in range(batch)],
        )

    @classmethod
    def pipeline_embeds(cls, pipe, prompt, negative, device) -> dict[str, Any]:
        pe, npe = pipe.encode_prompt(prompt=prompt, device=device, do_classifier_free_guidance=negative is not None,
                                     negative_prompt=negative)
        out: dict[str, Any] = {"prompt_embeds": pe}
        if negative is not None:
            out["negative_prompt_embeds"] = npe
        return out
