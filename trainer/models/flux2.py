"""Flux.2-dev: Flux2Transformer2DModel (32.2 B: 8 double + 48 single blocks), a Mistral-3 (Small 3.1, 24 B) text
encoder read at three intermediate layers, and AutoencoderKLFlux2 (32 latent channels, batch-norm statistics).

How each piece mirrors diffusers' Flux2Pipeline (0.42):

- text: the prompt goes into the pipeline's chat (its system message, then the prompt as the user turn), padded
  to 512 tokens, through Mistral-3; the hidden states after layers 10, 20 and 30 are stacked and laid side by side
  per token: `prompt_embeds` (B, 512, 3 x 5120). `encode_prompts` calls the pipeline's own static
  `_get_mistral_3_small_prompt_embeds`, so the template, padding and layer choice cannot drift from it. Text
  position ids are (0, 0, 0, l) per token (made in `predict`).
- latents: the VAE's mean (the pipeline's `argmax`), patchified 2x2 into 4 x 32 = 128 channels, normalised with the
  VAE's batch-norm running mean and sqrt(running var + eps) (`vae.bn`), then un-patchified back to (B, 32, H/8,
  W/8). That last step is a pure permutation, so the trainer keeps its one latent layout (B, C, H/8, W/8) for
  every family (buckets, masks, caches) and `predict`'s `pack_2x2` gives exactly the pipeline's tokens
  (`_patchify_latents` then `_pack_latents`: features ordered channel, row, column).
- predict: tokens as above, image ids (0, row, col, 0), timestep = the flow time t (the pipeline passes scheduler
  timesteps / 1000; the transformer multiplies by 1000 inside), guidance = the distilled guidance value when the
  transformer has a guidance embedding (dev: yes).
- shift in training: the scheduler config's resolution-dependent shift (mu linear in the image token count, 0.5 at
  256 tokens to 1.15 at 4096). The pipeline's sampling shift (`compute_empirical_mu`) also depends on the number of
  sampling steps; at 200 steps it is this same line, at 50 steps it is stronger. Sampling goes through the pipeline
  and uses its own.
- sampling (`Flux2Pipeline`): `prompt_embeds`; `guidance_scale` is the guidance embedding's value, one forward
  per step, no negative prompt.

The text encoder is built without the decoder layers after the deepest one read (`text_encoder_config`: 31 of 40
stay, so 5 B of the 24 B parameters are never even read from disk), and slimmed before it is placed
(`slim_text_encoder`): the language-model head becomes a no-op, the Pixtral vision tower and its projector go
(text-to-image captions have no image). The kept hidden states are bitwise unchanged (a test checks it against
the encoder as transformers loads it).

Reference images (the pipeline's `image=`) train through Kontext's pairs layout, and they are optional
(`reference_optional`). Flux.2 is one model for text-to-image and for editing: the pipeline joins each reference's
tokens after the target's (time ids 10, 20, ...: `_prepare_image_ids`) when `image=` is given and runs plainly when
it is not. Kontext's `takes_reference` alone would make every item a pair, which is wrong for the plain caption
data most Flux.2 LoRAs train on; a config switch would duplicate what the data already says (and a forgotten switch
would train the `control/` images as targets). So the data decides: a data set with references (a `control/`
folder beside the images or a "control" metadata key, `DataConfig.has_references`) trains (reference, target,
caption) pairs, one without trains text-to-image, in the same family and with the same LoRA targets. The pairs
are Kontext's: the reference is cut to the target's bucket, cached as a latent like any image, and reaches
`predict` as `control_latents`; the planner counts its tokens for such data only (`reference_inputs`, the same
doubling Kontext's `dummy_inputs` does). `dittrain sample --image` passes it as the pipeline's `image=` at the
sample's size (the pipeline keeps a reference of at most 1 MP with sides divisible by 16 as it is).

Several references per target, as the pipeline's list of images: the pairs layout says them cheaply (the same
name in control2/, control3/, ..., or a "control" list in metadata.jsonl), each is cut to the target's bucket and
cached like the first, and `control_latents` is then (B, K, C, h, w); `predict` joins them in order with time ids
10, 20, ... (`_prepare_image_ids`), and the planner counts K times the target's tokens. `dittrain sample` takes
them as `--image` repeated (`sample.image` a list), in the same order, as the pipeline's list. `max_references`:
BFL's documented limits (dev: 6 recommended, klein: 4).

Left out: a reference of a size other than the target's bucket (the pipeline keeps a reference's own size up to
1 MP; training cuts it to the target's bucket, which matches the pipeline for same-size pairs). Caption upsampling
(`caption_upsample_temperature`). The single blocks' fused output projection (`attn.to_out`) is not a default
LoRA target: peft's suffix matching cannot tell it from the double blocks' `attn.to_out` ModuleList.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers import Flux2Pipeline, Flux2Transformer2DModel
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from torch import nn

from ..errors import UserError
from ._diffusers import DiffusersAdapter, pack_2x2, packed_inputs, unpack_2x2
from .base import Components
from .lora_keys import KeyRule, LoraKeyMap
from .qwen_image import NoLogits

_D, _S = "transformer_blocks.{i}", "single_transformer_blocks.{i}"
#: BFL's Flux.2 layout (ComfyUI's model; diffusers' `convert_flux2_transformer_checkpoint_to_diffusers`): q/k/v fused
#: into `qkv` in the double blocks; a single block's `linear1` / `linear2` are diffusers' (already fused)
#: `to_qkv_mlp_proj` / `to_out`. ComfyUI maps no diffusers-keyed Flux.2 LoRA: this layout is the one it loads.
#: `norm_out.linear` is left out (the original stores its halves swapped).
FLUX2_LORA_KEYS = LoraKeyMap((
    KeyRule("double_blocks.{i}.img_attn.qkv", (f"{_D}.attn.to_q", f"{_D}.attn.to_k", f"{_D}.attn.to_v"), (1, 1, 1)),
    KeyRule("double_blocks.{i}.img_attn.proj", (f"{_D}.attn.to_out.0",)),
    KeyRule("double_blocks.{i}.txt_attn.qkv", (f"{_D}.attn.add_q_proj", f"{_D}.attn.add_k_proj",
                                               f"{_D}.attn.add_v_proj"), (1, 1, 1)),
    KeyRule("double_blocks.{i}.txt_attn.proj", (f"{_D}.attn.to_add_out",)),
    KeyRule("double_blocks.{i}.img_mlp.0", (f"{_D}.ff.linear_in",)),
    KeyRule("double_blocks.{i}.img_mlp.2", (f"{_D}.ff.linear_out",)),
    KeyRule("double_blocks.{i}.txt_mlp.0", (f"{_D}.ff_context.linear_in",)),
    KeyRule("double_blocks.{i}.txt_mlp.2", (f"{_D}.ff_context.linear_out",)),
    KeyRule("single_blocks.{i}.linear1", (f"{_S}.attn.to_qkv_mlp_proj",)),
    KeyRule("single_blocks.{i}.linear2", (f"{_S}.attn.to_out",)),
    KeyRule("img_in", ("x_embedder",)),
    KeyRule("txt_in", ("context_embedder",)),
    KeyRule("final_layer.linear", ("proj_out",)),
    KeyRule("time_in.in_layer", ("time_guidance_embed.timestep_embedder.linear_1",)),
    KeyRule("time_in.out_layer", ("time_guidance_embed.timestep_embedder.linear_2",)),
    KeyRule("guidance_in.in_layer", ("time_guidance_embed.guidance_embedder.linear_1",)),
    KeyRule("guidance_in.out_layer", ("time_guidance_embed.guidance_embedder.linear_2",)),
    KeyRule("double_stream_modulation_img.lin", ("double_stream_modulation_img.linear",)),
    KeyRule("double_stream_modulation_txt.lin", ("double_stream_modulation_txt.linear",)),
    KeyRule("single_stream_modulation.lin", ("single_stream_modulation.linear",)),
))

CONTROL = "control_latents"
#: Flux.2's scheduler settings (the folder's scheduler config is read first; this is the fallback)
FLUX2_SCHEDULER = {"shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
                   "base_image_seq_len": 256, "max_image_seq_len": 4096}
#: Mistral-Small-3.1-24B's parameters by part (Mistral3ForConditionalGeneration)
MISTRAL_LAYER, MISTRAL_LAYERS = 555_755_520, 40
MISTRAL_EMBED = MISTRAL_HEAD = 671_088_640
MISTRAL_VISION, MISTRAL_PROJECTOR = 403_305_472, 35_652_608


def keep_layers(layers: nn.ModuleList, read: tuple[int, ...]) -> nn.ModuleList:
    """The decoder layers needed for `output_hidden_states` entries `read` to be what the full model gives.

    Entry k is the input of layer k (0: the embeddings); the last entry is replaced by the final-normed output. So
    entry max(read) is unchanged only while at least one more layer follows it: max(read) + 1 layers stay."""
    need = max(read) + 1
    return layers if len(layers) <= need else nn.ModuleList(list(layers)[:need])


def position_ids(h2: int, w2: int, first: float, dev) -> torch.Tensor:
    """(h2 * w2, 4) ids (first, row, col, 0): `_prepare_latent_ids` (first 0) / `_prepare_image_ids` (10, 20...)."""
    ids = torch.zeros(h2, w2, 4, device=dev)
    ids[..., 0] = first
    ids[..., 1] += torch.arange(h2, device=dev)[:, None]
    ids[..., 2] += torch.arange(w2, device=dev)[None, :]
    return ids.reshape(-1, 4)


def text_ids(n: int, dev) -> torch.Tensor:
    """(n, 4) ids (0, 0, 0, l): `_prepare_text_ids`."""
    ids = torch.zeros(n, 4, device=dev)
    ids[:, 3] = torch.arange(n, device=dev)
    return ids


class Flux2Adapter(DiffusersAdapter):
    family = "flux2"
    transformer_cls = Flux2Transformer2DModel
    pipeline_cls = Flux2Pipeline
    default_lora_targets = (
        "to_q", "to_k", "to_v", "to_out.0",
        "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
        "to_qkv_mlp_proj",
    )
    lora_key_map = FLUX2_LORA_KEYS
    comfy_reads_diffusers_lora = True  # comfy/lora.py model_lora_keys_unet, in recent releases only:
    comfy_diffusers_lora_since = "v0.11.0 (January 2026)"  # run in ComfyUI v0.10.0 / v0.11.0 (docs/lora-files.md)
    text_encoder_dirs = ("text_encoder",)
    text_encoder_classes = ("Mistral3ForConditionalGeneration",)
    tokenizer_dirs = ("tokenizer",)
    vae_cls_name = "AutoencoderKLFlux2"
    default_scheduler = FLUX2_SCHEDULER
    max_sequence_length = 512  # Flux2Pipeline's default
    #: hidden-state entries of the text encoder that make up the embedding (the pipeline's text_encoder_out_layers)
    text_layers: ClassVar[tuple[int, ...]] = (10, 20, 30)
    full_name, example_path = "Flux.2-dev", "/path/to/FLUX.2-dev"
    full_config = {  # FLUX.2-dev: Flux2Transformer2DModel defaults (32.2 B parameters)
        "patch_size": 1,
        "in_channels": 128,
        "num_layers": 8,
        "num_single_layers": 48,
        "attention_head_dim": 128,
        "num_attention_heads": 48,
        "joint_attention_dim": 15360,
        "timestep_guidance_channels": 256,
        "mlp_ratio": 3.0,
        "axes_dims_rope": [32, 32, 32, 32],
        "rope_theta": 2000,
        "guidance_embeds": True,
    }
    #: AutoencoderKLFlux2 defaults
    vae_params: ClassVar[int] = 84_046_115
    text_tokens = 512  # padded to max_sequence_length
    text_encoder_params = (("Mistral-Small-3.1-24B", MISTRAL_LAYERS * MISTRAL_LAYER + MISTRAL_EMBED + MISTRAL_HEAD
                            + MISTRAL_VISION + MISTRAL_PROJECTOR + 5120),)
    # `slim_text_encoder` drops the head, the vision tower with its projector and layers 31-39; the token embedding
    # stays beside the streamed decoder layers
    text_encoder_unused_params = (MISTRAL_HEAD + MISTRAL_VISION + MISTRAL_PROJECTOR
                                  + (MISTRAL_LAYERS - 31) * MISTRAL_LAYER,)
    text_encoder_nonblock_params = (MISTRAL_EMBED,)
    text_encoder_unloaded_params = ((MISTRAL_LAYERS - 31) * MISTRAL_LAYER,)  # `text_encoder_config`: layers 31-39
    text_encoder_layers = (31,)  # the decoder layers it keeps, streamed as blocks
    sampling_uses_negative = False
    takes_reference = True  # optional: the data decides (module docstring)
    reference_optional = True
    max_references = 6  # BFL's recommended maximum for Flux.2-dev (docs.bfl.ml, reference images per model)

    @property
    def tokenizer_classes(self) -> tuple[str, ...]:
        """The class model_index.json names for `tokenizer/`, which is what the pipeline loads and calls: a
        PixtralProcessor in the real folder (its chat template is applied to the prompts), any tokenizer class with
        a chat template works the same for text-only prompts (the tiny folder has one)."""
        entry = self._json("model_index.json", required=False).get("tokenizer") or [None, None]
        return (entry[1] or "AutoProcessor",)

    @classmethod
    def tiny_builders(cls):
        return {"flux2": tiny_pipeline}

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]

    def text_encoder_config(self, config):
        """Built with only the decoder layers up to the deepest hidden state read: layers 31-39 of Mistral-3 (5 B
        parameters) are never loaded, so caching captions holds 10 GB less in RAM."""
        text = config.get_text_config()
        need = max(self.text_layers) + 1
        if text.num_hidden_layers > need:
            text.num_hidden_layers = need
            if getattr(text, "layer_types", None):
                text.layer_types = text.layer_types[:need]
        return config

    def slim_text_encoder(self, encoder: nn.Module) -> nn.Module:
        """Captions are intermediate hidden states, never logits nor image features: the head becomes a no-op,
        the vision tower and projector go, and the layers after the deepest one read. Kept outputs are unchanged."""
        if hasattr(encoder, "lm_head"):
            encoder.lm_head = NoLogits()
        inner = getattr(encoder, "model", encoder)
        for name in ("vision_tower", "multi_modal_projector"):
            if getattr(inner, name, None) is not None:
                setattr(inner, name, None)
        lm = getattr(inner, "language_model", inner)
        lm.layers = keep_layers(lm.layers, self.text_layers)
        return encoder

    @torch.no_grad()
    def encode_prompts(self, components: Components, prompts: list[str]) -> dict[str, torch.Tensor]:
        (enc,), (tok,) = components.text_encoders, components.tokenizers
        dev = enc.get_input_embeddings().weight.device
        embeds = Flux2Pipeline._get_mistral_3_small_prompt_embeds(
            text_encoder=enc, tokenizer=tok, prompt=list(prompts), dtype=enc.dtype, device=dev,
            max_sequence_length=self.max_sequence_length, system_message=SYSTEM_MESSAGE,
            hidden_states_layers=self.text_layers,
        )
        return {"prompt_embeds": embeds}

    def encode_images(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        lat = vae.encode(pixels.to(vae.dtype)).latent_dist.mode()
        p = Flux2Pipeline._patchify_latents(lat)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(p.device, p.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(p.device, p.dtype)
        return Flux2Pipeline._unpatchify_latents((p - mean) / std)

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:
        b, _, h, w = noisy_latents.shape
        dev = noisy_latents.device
        x = pack_2x2(noisy_latents)
        n = x.shape[1]
        # Hot path: small id tensors built per call; the rotary tables are computed from them inside anyway.
        img_ids = position_ids(h // 2, w // 2, 0.0, dev)
        ref = text.get(CONTROL)
        if ref is not None:  # reference images: their tokens follow the target's, time ids 10, 20, ... in order
            refs = ref.unbind(1) if ref.dim() == 5 else (ref,)  # (B, K, C, h, w): K references
            x = torch.cat([x, *(pack_2x2(r.to(x.dtype)) for r in refs)], dim=1)
            img_ids = torch.cat([img_ids, *(position_ids(r.shape[-2] // 2, r.shape[-1] // 2, 10.0 * (k + 1), dev)
                                            for k, r in enumerate(refs))])
        embeds = text["prompt_embeds"]
        g = None
        if transformer.config.guidance_embeds:
            g = torch.full((b,), float(guidance), device=dev, dtype=torch.float32)
        out = transformer(
            hidden_states=x,
            encoder_hidden_states=embeds,
            timestep=t.to(x.dtype),
            img_ids=img_ids,
            txt_ids=text_ids(embeds.shape[1], dev),
            guidance=g,
            return_dict=False,
        )[0]
        return unpack_2x2(out[:, :n], h, w)

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta") -> dict:
        kw = packed_inputs(transformer, batch, height, width, text_tokens, dtype, device, id_axes=4)
        if transformer.config.guidance_embeds:
            kw["guidance"] = torch.ones(batch, device=torch.device(device), dtype=dtype)
        return kw

    @classmethod
    def reference_inputs(cls, inputs: dict[str, Any], references: int) -> dict[str, Any]:
        """Each reference (cut to the target's bucket) adds the target's token count, as in Kontext."""
        kw = dict(inputs)
        kw["hidden_states"] = torch.cat([inputs["hidden_states"]] * (1 + references), dim=1)
        kw["img_ids"] = torch.cat([inputs["img_ids"]] * (1 + references), dim=0)
        return kw

    @classmethod
    def pipeline_image(cls, pipe, image: Any) -> dict[str, Any]:
        """The reference (or a list of references) as the pipeline's `image=` (already the sample's size: the
        pipeline keeps it as it is up to 1 MP with sides divisible by 16); None: text-to-image. The pipeline refuses
        a reference under 64 px a side or beyond 8:1: said here in one line, before any step runs."""
        if image is None:
            return {}
        for im in image if isinstance(image, list) else [image]:
            try:
                pipe.image_processor.check_image_input(im)
            except ValueError as e:
                raise UserError(f"--image / sample.image: {type(pipe).__name__} cannot take the reference at the "
                                f"sample's size {im.width}x{im.height} ({e}); sample at least 64x64 pixels") from None
        return {"image": image}

    @classmethod
    def pipeline_embeds(cls, pipe, prompt, negative, device) -> dict[str, torch.Tensor]:
        pe, _ = pipe.encode_prompt(prompt=prompt, device=device, num_images_per_prompt=1)
        out = {"prompt_embeds": pe}
        if negative is not None:
            npe, _ = pipe.encode_prompt(prompt=negative, device=device, num_images_per_prompt=1)
            out["negative_prompt_embeds"] = npe
        return out


# ---------------------------------------------------------------------------------------------- tiny model

#: Mistral's chat tokens: the pipeline's chat is [SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST]
MISTRAL_SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                   "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
#: a Mistral-style chat template over list-of-parts content (the shape Flux2Pipeline's `format_input` builds)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['content'] is string %}{% set text = m['content'] %}"
    "{% else %}{% set text = m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{% endif %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif m['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)


def mistral_tokenizer():
    """A byte-level BPE tokenizer with Mistral's chat tokens and a Mistral-style chat template. The real folder's
    `tokenizer/` is a PixtralProcessor, which transformers builds only with torchvision; the pipeline calls just
    its `apply_chat_template`, which a tokenizer offers with the same arguments (text-only prompts)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    from .tiny import corpus

    tok = Tokenizer(BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=800, special_tokens=MISTRAL_SPECIAL,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus() + [SYSTEM_MESSAGE] * 16, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", model_max_length=131072, chat_template=MISTRAL_TEMPLATE)


def tiny_vae():
    """AutoencoderKLFlux2 at 4 latent channels with batch-norm statistics far from 0 / 1, so the latents'
    normalisation shows."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(6)
    vae = AutoencoderKLFlux2(
        latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4, sample_size=64,
    )
    g = torch.Generator().manual_seed(7)
    vae.bn.running_mean.copy_(torch.randn(vae.bn.num_features, generator=g) * 0.3)
    vae.bn.running_var.copy_(torch.rand(vae.bn.num_features, generator=g) * 2 + 0.5)
    return vae


def tiny_transformer(guidance: bool, text_hidden: int = 16):
    torch.manual_seed(13)
    return Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=3 * text_hidden, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance,
    )


def tiny_scheduler():
    from .tiny import flow_scheduler

    return flow_scheduler(**FLUX2_SCHEDULER)


def tiny_pipeline():
    """A tiny random Flux.2-dev: a 32-layer, 16-wide Mistral-3 text encoder with a one-layer Pixtral vision tower
    (the pipeline reads hidden states 10 / 20 / 30), the tokenizer above, the VAE above, a 2 + 2 block transformer
    with a guidance embedding."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tok = mistral_tokenizer()
    cfg = Mistral3Config(
        text_config={
            "model_type": "mistral", "vocab_size": len(tok), "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 32, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8,
            "max_position_embeddings": 1024, "sliding_window": None, "pad_token_id": tok.pad_token_id,
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        },
        vision_config={"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "head_dim": 8, "image_size": 64, "patch_size": 16},
        image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=1,
    )
    transformer = tiny_transformer(guidance=True)
    torch.manual_seed(9)
    enc = Mistral3ForConditionalGeneration(cfg).eval()
    return Flux2Pipeline(scheduler=tiny_scheduler(), vae=tiny_vae(), text_encoder=enc, tokenizer=tok,
                         transformer=transformer)
