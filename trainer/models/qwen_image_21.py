"""Qwen-Image 2.1: QwenImage21Transformer2DModel (single-stream, 32 blocks, block-causal attention), a Qwen3-VL
text encoder and a 16x video VAE with 64 latent channels, used on single frames.

How it mirrors diffusers' QwenImage21Pipeline (0.42.1), text-to-image:

- text: the prompt (an empty one becomes " ") goes into the pipeline's raw template (system prompt "Comprehend and
  analyze the provided prompt."), through the `processor` (Qwen3VLProcessor) with left padding, and Qwen3-VL runs
  with `output_hidden_states`. The last decoder layer's output is taken *before* the final RMSNorm (the pipeline
  hooks the norm to return its input, since transformers 5 ties `hidden_states[-1]` to the normed state). The
  valid tokens are kept, the system turn dropped (its length is the processor's chat template of the system
  message, `_drop_idx`), and the result right-padded: `prompt_embeds` (B, L, D) + `prompt_embeds_mask` (B, L).
  Collation is Qwen-Image's (trim, re-pad to the batch's longest, no mask when nothing is padded).
- latents: the VAE takes four channels (RGBA; an opaque image has alpha 1, i.e. +1 after [-1, 1] scaling) on one
  frame; the mode is normalised per channel with `latents_mean` / `latents_std`, giving (B, 64, H/16, W/16).
- predict: no 2x2 packing (patch size 1): the latents are flattened row-major into tokens. The transformer builds
  one joint sequence, [text, target image], from `img_mask` over the text sequence plus one slot per 2x2 group of
  target tokens (so the latent sides must be even: pixel sides are multiples of 32, as the pipeline rounds them),
  and returns the whole joint sequence: the prediction is its last h*w tokens. `img_shapes` = (1, h, w) in latent
  tokens; timestep = t (the pipeline passes its scheduler's t / 1000 = sigma).
- shift: dynamic, mu from the target's token count (H/16 * W/16) with the scheduler config's base / max shift.
- sampling: `prompt_embeds` + `prompt_embeds_mask`; true classifier-free guidance with `true_cfg_scale` and a
  negative prompt (the pipeline's default is 1: the model is meant to be sampled without guidance).

Training runs the full prefill (no KV cache): text tokens are modulated at t = 0 (`causal_condition`) inside the
transformer itself, nothing to do here. Sampling keeps the pipeline's KV cache (`use_kv_cache`): each block stores
`key[:, :prefix].clone()` (and the values) at the first step. Under inductor that clone comes back as a view of the
block's whole first-step keys and values, so the cache held 2.15 GB of them at 1024 px through every later step and
the decode (Qwen-Image 2.1's 16 GB preset, bench/RESULTS.md). `sampling_hooks` puts a forward hook on each block
that replaces such a view by a compact copy of the same rows as soon as the block returns: the same numbers, the
prompt's share of the memory (`compact_layer_cache`).

Left out: condition images (the pipeline's image-conditioned mode), which would need text entries keyed by the
reference as Qwen-Image-Edit does.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import torch
from diffusers import QwenImage21Pipeline, QwenImage21Transformer2DModel
from torch import nn

from ._diffusers import DiffusersAdapter
from .base import Components
from .lora_keys import KeyRule, LoraKeyMap, identity_rules
from .qwen_image import NoLogits, QwenImageAdapter

#: ComfyUI's layout (diffusers' `convert_qwen_image21_transformer_checkpoint_to_diffusers`) keeps diffusers' names
#: but fuses each block's SwiGLU gate and up projections into `img_mlp.gate_up` (gate rows first).
QWEN_IMAGE_21_LORA_KEYS = LoraKeyMap((
    KeyRule("transformer_blocks.{i}.img_mlp.gate_up", ("transformer_blocks.{i}.img_mlp.gate_layer",
                                                       "transformer_blocks.{i}.img_mlp.proj"), (3, 3)),
    *identity_rules("transformer_blocks", ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.out"),
                    ("img_in", "txt_in.in_layer", "txt_in.out_layer", "modulation.1", "norm_out.linear", "proj_out",
                     "time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2")),
))
SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
TEMPLATE = (
    f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n<|im_start|>assistant\n"
)
#: a chat template that renders system / user turns as Qwen3-VL's does (the tiny processor's; real folders ship
#: their own)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)


def qwen3_vl_8b_config(num_hidden_layers: int = 36) -> dict[str, Any]:
    """Qwen3-VL-8B-Instruct's config (text 4096 wide, 36 layers; vision 27 blocks), for full-size random folders
    (bench/program/bench_program.py) and the planner's parameter counts; `num_hidden_layers` may cut the text model."""
    return {
        "text_config": {
            "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": num_hidden_layers,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_interleaved": True,
                                "mrope_section": [24, 20, 20]},
            "bos_token_id": 151643, "eos_token_id": 151645,
        },
        "vision_config": {
            "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 4096,
            "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [8, 16, 24],
        },
        "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653, "tie_word_embeddings": False,
    }


#: Qwen3-VL-8B's parameters (meta-counted from `qwen3_vl_8b_config`; tests/test_models.py checks them): all, the
#: language-model head, the vision tower, the token embedding
QWEN3_VL_8B, QWEN3_VL_LM_HEAD, QWEN3_VL_VISUAL, QWEN3_VL_EMBED = 8_767_123_696, 622_329_856, 576_388_336, 622_329_856


@cache
def _processor_class():
    """Qwen3VLProcessor that accepts a plain `BaseVideoProcessor`: without torchvision transformers has no real
    video processor, and no video goes through this one (see `load_processor`)."""
    from transformers import Qwen3VLProcessor
    from transformers.video_processing_utils import BaseVideoProcessor

    class TextQwen3VLProcessor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and isinstance(argument, BaseVideoProcessor):
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    return TextQwen3VLProcessor


def make_processor(tokenizer, image_processor=None, chat_template: str = CHAT_TEMPLATE):
    from transformers import Qwen2VLImageProcessorPil
    from transformers.video_processing_utils import BaseVideoProcessor

    image_processor = image_processor or Qwen2VLImageProcessorPil(patch_size=16, min_pixels=64 * 64,
                                                                  max_pixels=128 * 128)
    return _processor_class()(image_processor=image_processor, tokenizer=tokenizer,
                              video_processor=BaseVideoProcessor(), chat_template=chat_template)


def load_processor(folder: str | Path):
    """The folder's `processor/` (Qwen3VLProcessor). With torchvision, as diffusers loads it; without, assembled
    from the folder's tokenizer, its image processor (PIL variant, same settings) and its chat template."""
    import transformers
    from transformers.utils import is_torchvision_available

    folder = Path(folder)
    if is_torchvision_available():
        return transformers.Qwen3VLProcessor.from_pretrained(folder, local_files_only=True)
    template = None
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    elif (folder / "chat_template.json").is_file():
        template = json.loads((folder / "chat_template.json").read_text())["chat_template"]
    image_processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(folder, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return make_processor(tokenizer, image_processor, template)


def full_text_config(folder: Path, cfg: dict[str, Any]):
    """A full-size Qwen3VLConfig whose special token ids are those of `folder`'s tiny text encoder (its tokenizer
    is the tiny one; every id exists in the full vocabulary)."""
    from transformers import Qwen3VLConfig

    tiny = json.loads((Path(folder) / "text_encoder" / "config.json").read_text())
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if k in tiny.get("text_config", {}):
            cfg["text_config"][k] = tiny["text_config"][k]
    for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        if k in tiny:
            cfg[k] = tiny[k]
    return Qwen3VLConfig(**cfg)


def system_tokens(processor) -> int:
    """Tokens of the system turn the pipeline drops (`QwenImage21Pipeline._drop_idx`), from the chat template."""
    msg = [{"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]}]
    return len(processor.apply_chat_template(msg, tokenize=True, return_dict=False)[0])


@torch.no_grad()
def qwen3_vl_hidden(enc: nn.Module, inputs) -> torch.Tensor:
    """The last decoder layer's output *before* the final norm, as the Qwen-Image 2.1 / Krea 2 pipelines read it."""
    kw = {"input_ids": inputs.input_ids, "attention_mask": inputs.attention_mask, "output_hidden_states": True}
    if "mm_token_type_ids" in inputs:
        kw["mm_token_type_ids"] = inputs.mm_token_type_ids
    text_model = getattr(enc.model, "language_model", enc.model)
    handle = text_model.norm.register_forward_hook(lambda module, args, output: args[0])
    try:
        return enc(**kw).hidden_states[-1]
    finally:
        handle.remove()


def _compact(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy holding only its own elements where it is a view into a larger storage."""
    if t.untyped_storage().nbytes() <= t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def compact_layer_cache(block: nn.Module, args, kwargs: dict, output):  # noqa: ARG001 - a forward hook's signature
    """Forward hook (with kwargs) on a transformer block: after the pipeline's first step (`kv_cache_mode`
    "extract") the block's `layer_cache` keeps copies of the prompt's keys and values, not views of the block's
    whole ones (see the module essay)."""
    cache_ = kwargs.get("layer_cache")
    if cache_ is not None and kwargs.get("kv_cache_mode") == "extract" and cache_.k is not None:
        cache_.k, cache_.v = _compact(cache_.k), _compact(cache_.v)


class QwenImage21Adapter(DiffusersAdapter):
    family = "qwen-image-2.1"
    transformer_cls = QwenImage21Transformer2DModel
    pipeline_cls = QwenImage21Pipeline
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "img_mlp.proj", "img_mlp.gate_layer", "img_mlp.out")
    lora_key_map = QWEN_IMAGE_21_LORA_KEYS
    comfy_reads_diffusers_lora = True  # comfy/lora.py model_lora_keys_unet, in recent releases only:
    comfy_diffusers_lora_since = "v0.37"  # its key-map branch run on tiny files (docs/lora-files.md)
    text_encoder_dirs = ("text_encoder",)
    text_encoder_classes = ("Qwen3VLForConditionalGeneration",)
    tokenizer_dirs = ()
    extra_text_dirs = ("processor",)
    vae_cls_name = "AutoencoderKLQwenImage21"
    packs_2x2 = False
    default_scheduler = {"shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
                         "base_image_seq_len": 256, "max_image_seq_len": 4096}
    full_name, example_path = "Qwen-Image-2.1", "/path/to/Qwen-Image-2.1"
    full_config = {  # QwenImage21Transformer2DModel defaults (7.1 B)
        "patch_size": 1, "in_channels": 64, "out_channels": 64, "num_layers": 32, "attention_head_dim": 128,
        "num_attention_heads": 32, "context_in_dim": 4096, "mlp_ratio": 3, "axes_dims_rope": [16, 56, 56],
        "causal_condition": True,
    }
    text_tokens = 256  # padded to the longest caption in the batch: assumed 256 for planning
    text_encoder_params = (("Qwen3-VL-8B", QWEN3_VL_8B),)
    # the head and the vision tower never run for text-to-image captions (`slim_text_encoder`)
    text_encoder_unused_params = (QWEN3_VL_LM_HEAD + QWEN3_VL_VISUAL,)
    text_encoder_keep_linears = r"(^|\.)lm_head\."  # the head is never run (and `slim_text_encoder` drops it)
    text_encoder_nonblock_params = (QWEN3_VL_EMBED,)
    sampling_uses_negative = True
    #: the pipeline's defaults: 40 steps, no classifier-free guidance (`true_cfg_scale` 1); presets sample so
    sample_defaults = {"steps": 40, "guidance": 1.0}
    #: the pipeline's `use_kv_cache` (default on): the planner counts what it keeps (ModelAdapter.sampling_kv_cache)
    sampling_kv_cache = True
    #: full-size latent geometry: 16 px per latent, one latent per token (the planner's image tokens)
    latent_scale, token_patch = 16, 1
    #: VAE parameters at full size (AutoencoderKLQwenImage21 defaults, meta-counted), for the planner
    vae_params = 337_740_404

    @contextmanager
    def sampling_hooks(self, transformer: nn.Module):
        handles = [b.register_forward_hook(compact_layer_cache, with_kwargs=True) for b in self.blocks(transformer)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @classmethod
    def full_size_parts(cls, folder: Path):
        """bench/program/bench_program.py's full-size random folders: (the VAE, built for real: 0.34 B; [(sub-folder,
        encoder class, config)] built on meta). Qwen3-VL-8B whole (36 layers, vision tower included), its special
        token ids those of the folder's tiny tokenizer."""
        import transformers
        from diffusers import AutoencoderKLQwenImage21

        return AutoencoderKLQwenImage21(), [("text_encoder", transformers.Qwen3VLForConditionalGeneration,
                                             full_text_config(folder, qwen3_vl_8b_config()))]

    @classmethod
    def tiny_builders(cls):
        from .tiny import qwen_tokenizer

        return {"qwen-image-2.1": lambda: tiny_pipeline(qwen_tokenizer())}

    # ------------------------------------------------------------------------------------------ geometry

    @property
    def resolution_divisor(self) -> int:
        # one token per 16 px, and the joint sequence holds one text-side slot per 2x2 group of target tokens
        return 2 * self.vae_scale_factor * self.patch_size

    def image_seq_len(self, height: int, width: int) -> int:
        s = self.vae_scale_factor * self.patch_size
        return (height // s) * (width // s)

    # ------------------------------------------------------------------------------------------ loading

    processor_label = "Qwen3-VL"
    load_processor = staticmethod(load_processor)

    def pipeline(self, components: Components) -> Any:
        return self.pipeline_cls(
            transformer=components.transformer, vae=components.vae, scheduler=components.scheduler,
            text_encoder=components.text_encoders[0] if components.text_encoders else None,
            processor=components.tokenizers[0] if components.tokenizers else None,
        )

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        return list(transformer.transformer_blocks)

    def slim_text_encoder(self, encoder: nn.Module) -> nn.Module:
        """The head (0.6 B) becomes a no-op and the vision tower (0.6 B) goes: text-to-image never runs them."""
        if hasattr(encoder, "lm_head"):
            encoder.lm_head = NoLogits()
        inner = getattr(encoder, "model", None)
        if getattr(inner, "visual", None) is not None:
            inner.visual = None
        return encoder

    # ------------------------------------------------------------------------------------------ tensors

    @torch.no_grad()
    def encode_prompts(self, components: Components, prompts: list[str]) -> dict[str, torch.Tensor]:
        (enc,), (proc,) = components.text_encoders, components.tokenizers
        dev = enc.get_input_embeddings().weight.device
        prompts = [p or " " for p in prompts]  # Qwen has no bos token: an empty prompt would leave nothing to read
        inputs = proc(text=[TEMPLATE.format(p) for p in prompts], padding=True, padding_side="left",
                      return_tensors="pt").to(dev)
        hidden = qwen3_vl_hidden(enc, inputs)
        drop = system_tokens(proc)
        valid = inputs.attention_mask.bool()
        parts = [h[m][drop:] for h, m in zip(hidden, valid, strict=True)]
        longest = max(p.shape[0] for p in parts)
        embeds = torch.stack([nn.functional.pad(p, (0, 0, 0, longest - p.shape[0])) for p in parts])
        mask = torch.zeros(len(parts), longest, dtype=torch.long, device=dev)
        for i, p in enumerate(parts):
            mask[i, : p.shape[0]] = 1
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    collate_text = QwenImageAdapter.collate_text

    def encode_images(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        c = vae.config
        alpha = torch.ones_like(pixels[:, :1])  # opaque: the pipeline's RGBA preprocessing gives alpha +1
        x = torch.cat([pixels, alpha], dim=1)[:, : c.in_channels]
        lat = vae.encode(x.to(vae.dtype).unsqueeze(2)).latent_dist.mode()[:, :, 0]
        mean = torch.tensor(c.latents_mean, device=lat.device, dtype=lat.dtype).view(1, -1, 1, 1)
        std = torch.tensor(c.latents_std, device=lat.device, dtype=lat.dtype).view(1, -1, 1, 1)
        return (lat - mean) / std

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:
        b, c, h, w = noisy_latents.shape
        x = noisy_latents.flatten(2).transpose(1, 2)  # the pipeline's _pack_latents: row-major, no patching
        embeds = text["prompt_embeds"]
        out = transformer(
            hidden_states=x,
            timestep=t.to(x.dtype),
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=text.get("prompt_embeds_mask"),
            img_shapes=[[(1, h, w)]] * b,
            img_mask=_img_mask(b, embeds.shape[1], h * w, x.device),
            return_dict=False,
        )[0]
        return out[:, -h * w:].transpose(1, 2).reshape(b, c, h, w)

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta") -> dict:
        c, dev = transformer.config, torch.device(device)
        rnd = {"device": dev, "dtype": dtype}
        ph, pw = height // 16, width // 16
        return dict(
            hidden_states=torch.randn(batch, ph * pw, c.in_channels, **rnd),
            encoder_hidden_states=torch.randn(batch, text_tokens, c.context_in_dim, **rnd),
            timestep=torch.ones(batch, **rnd),
            img_shapes=[[(1, ph, pw)]] * batch,
            # the layout mask is read on the host (rotary positions, token ids): a CPU tensor even when tracing
            img_mask=_img_mask(batch, text_tokens, ph * pw, "cpu" if dev.type == "meta" else dev),
        )

    @classmethod
    def pipeline_embeds(cls, pipe, prompt, negative, device) -> dict[str, torch.Tensor]:
        pe, mask, _ = pipe.encode_prompt(prompt=prompt, device=device, num_images_per_prompt=1)
        out = {"prompt_embeds": pe, "prompt_embeds_mask": mask}
        if negative is not None:
            npe, nmask, _ = pipe.encode_prompt(prompt=negative, device=device, num_images_per_prompt=1)
            out |= {"negative_prompt_embeds": npe, "negative_prompt_embeds_mask": nmask}
        return out

    @classmethod
    def pipeline_guidance(cls, pipe, guidance: float) -> dict:
        return {"true_cfg_scale": guidance}


def _img_mask(batch: int, text_len: int, image_tokens: int, device) -> torch.Tensor:
    """The pipeline's `img_mask` for text-to-image: no image slot in the text, one per 2x2 target group after it."""
    return torch.cat([torch.zeros(batch, text_len, dtype=torch.bool, device=device),
                      torch.ones(batch, image_tokens // 4, dtype=torch.bool, device=device)], dim=1)


# ---------------------------------------------------------------------------------------------- tiny model


def tiny_qwen3_vl(tokenizer, hidden: int = 16, seed: int = 4, layers: int = 2) -> nn.Module:
    """A `layers`-layer Qwen3-VL (vision tower of one block) over the tiny Qwen tokenizer (trainer/models/tiny.py)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in
           ("<|endoftext|>", "<|im_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    cfg = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_hidden_layers": layers, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_interleaved": True,
                                "mrope_section": [1, 1, 2]},
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": hidden, "deepstack_visual_indexes": [0], "num_position_embeddings": 64},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    return Qwen3VLForConditionalGeneration(cfg).eval()


def tiny_pipeline(tokenizer) -> QwenImage21Pipeline:
    """Tiny random Qwen-Image 2.1: 2 blocks 32 wide, Qwen3-VL 16 wide, a 16x VAE with 4 latent channels."""
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler

    torch.manual_seed(5)
    vae = AutoencoderKLQwenImage21(
        base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 1, 2, 2, 2], num_res_blocks=1,
        temperal_downsample=[False, True, True, True], latents_mean=[0.1, -0.2, 0.05, 0.0],
        latents_std=[1.5, 2.0, 1.2, 1.8],
    )
    torch.manual_seed(13)
    transformer = QwenImage21Transformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        context_in_dim=16, mlp_ratio=3, axes_dims_rope=(4, 6, 6),  # the full ratio: the LoRA key map fuses by it
    )
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, **QwenImage21Adapter.default_scheduler)
    return QwenImage21Pipeline(scheduler=sched, vae=vae, text_encoder=tiny_qwen3_vl(tokenizer),
                               processor=make_processor(tokenizer), transformer=transformer)
