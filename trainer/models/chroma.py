"""Chroma (lodestones; Chroma1-HD, Chroma1-Base, Chroma1-Flash): ChromaTransformer2DModel, Flux.1-schnell's
architecture (19 double + 38 single blocks, 8.9 B) without CLIP and with its per-block modulation computed
outside the blocks by a small "distilled guidance" network, a T5-XXL text encoder and Flux's 16-channel VAE.

How each piece mirrors diffusers' ChromaPipeline (0.42):

- text: T5 on `max_sequence_length` (512) padded tokens *with* the tokenizer's attention mask, last hidden state
  -> `prompt_embeds` (B, 512, D). The pipeline's `prompt_attention_mask` (B, 512) is 1 up to and including one
  token past the last valid one (`arange <= length`: the EOS and one pad) and 0 after, in the embeddings' dtype;
  it is cached beside the embeddings, so every entry has the same 512 tokens and collating is plain stacking.
- latents: VAE mean, then (z - shift_factor) * scaling_factor, as for Flux.
- predict: latents packed 2x2 into tokens, image ids (0, row, col), text ids zeros, timestep = t (the pipeline
  passes scheduler timesteps / 1000; the transformer multiplies by 1000 again). The attention mask the
  transformer gets is the text mask followed by ones for the image tokens (the pipeline's
  `_prepare_attention_mask`); each block turns it into a (B, 1, S, S) outer product. It is a float mask, so
  attention *adds* it (1 on valid pairs, 0 elsewhere) rather than excluding padding: training reproduces that
  exactly, since a LoRA must act in the attention the pipeline runs. No pooled text embedding, no guidance input.
- shift: the scheduler config decides (dynamic, mu from the image token count, as Flux-dev's).
- sampling (`ChromaPipeline`): true classifier-free guidance when `guidance_scale` > 1, so the negative prompt
  (with its own mask) is encoded too; Chroma1-HD's card samples at guidance 3.0 with 40 steps (the presets'
  settings). Chroma1-Flash has CFG baked in: sample it with guidance 1 (one pass) and fewer steps.
- modulation and quantization: Chroma's blocks hold no modulation Linears (their norms are "pruned": they take
  ready scale / shift / gate vectors). All of them come from `distilled_guidance_layer` (a 5-layer MLP, 5120
  wide, 0.28 B parameters), one row per block. It is not a block module, so it stays resident in the model
  dtype and is never quantized: as for every family's non-block modules (trainer/quant.py), and on purpose here,
  because one error in it reaches every block's scale, shift and gate at once, while quantizing it would save
  0.28 GB of VRAM (bf16 to 8 bits) and no pinned RAM. `model.quantize_modulation` therefore changes nothing for Chroma.

Attention with the mask, and its speed (bench/history/2026-11-25.md, "Chroma at offload 0"). Every block attends with the
(B, 1, S, S) float mask, so torch's SDPA cannot use flash attention (it takes no mask) and runs the
memory-efficient kernel, whose backward is the slow part on an H100. The pipeline does this in all 57 blocks and so
does training here; diffusers' own checkpointed forward passes no mask to the 38 single blocks (they run flash
attention there and train attention the pipeline does not run), which is why the plain compiled script looked as
fast as dittrain's step without recomputation. `FlashMaskAttnProcessor` (`train.attention: flash`, which would
otherwise fail on the mask; `use_mask_attention`) computes the same attention with flash: the mask is an outer product
m_i m_j of a 0/1 vector (the block builds it from the transformer's mask), so its bias is one more head dimension,
m_i in the queries and m_j sqrt(d) in the keys (padded with zeros to a multiple of 8, values zero there, the
softmax scale kept at 1 / sqrt(d)). Only the key column's rounding differs (sqrt(128) in bf16: a bias of 0.99989
for 1). `FlexMaskAttnProcessor` (`train.attention: flex`) hands the same attention to torch's flex attention
with a score_mod adding m_i m_j to each fp32 score in the kernel: the pipeline's additive float mask, exactly
(a BlockMask could skip only pairs excluded outright, and this mask excludes none). flex_attention is fast only
compiled: inside a compiled block (train.compile) it compiles with the block, outside one a single module-level
`torch.compile(flex_attention)` serves every call (the score_mod's tensor is an input, not a recompile). Alone,
one block's attention forward + backward at 1024 px on an H100 takes 2.80 ms by flex, 6.37 ms by the flash form,
7.90 ms by masked SDPA and 3.24 ms by SDPA without any mask (bench/speed/attn_mask_speed.py,
bench/history/2026-11-25.md "Chroma's masked attention alone"). In a whole training step (1024 px, LoRA r16, bf16, compiled, H100,
bench/history/2026-11-26.md "2026-11-26"): 0.442 s by flex, 0.638 s by the flash form, 0.703 s by masked SDPA at offload 0,
and 0.94 against 1.08-1.43 s at the 8 GB preset (offload 0.9). So `auto` trains with flex on CUDA devices of
compute capability 8.0 and up (`flex_by_default`: torch tunes flex's kernels for those; consumer cards, sm86 / sm89,
are not measured: `train.attention: efficient` keeps the masked SDPA call there). Torch has no flex backward on the
CPU, so there `auto` keeps the masked SDPA call and `flex` is refused (the trainer says so).

Left out: IP-adapter inputs; training the attention on padding-free captions (the pipeline attends to all 512).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from diffusers import ChromaPipeline, ChromaTransformer2DModel
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, _get_qkv_projections
from torch import nn

from ._diffusers import T5_KEEP, DiffusersAdapter, pack_2x2, packed_inputs, unpack_2x2
from .base import Components, MeasuredPreset
from .flux import FLUX_LORA_KEYS, FluxAdapter, image_ids
from .lora_keys import KeyRule, LoraKeyMap

# diffusers' own ChromaTransformer2DModel builds its rotary embedding through the deprecated
# `diffusers.models.embeddings.FluxPosEmbed`, which warns at every construction (make-tiny, plan, fit, sample) about
# an import dittrain does not make and its user cannot change: that one warning, by its message, is dropped
warnings.filterwarnings("ignore", message=r"`FluxPosEmbed` is deprecated", category=FutureWarning)

#: Lodestone's original layout is BFL's Flux layout (ComfyUI's Chroma model subclasses its Flux model; diffusers'
#: `convert_chroma_transformer_checkpoint_to_diffusers`) without the per-block modulation and the time / vector /
#: guidance embedders, which Chroma replaces by `distilled_guidance_layer` (its `in_layer` / `out_layer` are
#: diffusers' `linear_1` / `linear_2`).
_CHROMA_ONLY = "distilled_guidance_layer"
CHROMA_LORA_KEYS = LoraKeyMap((
    *(r for r in FLUX_LORA_KEYS.rules if not r.original.endswith(".lin") and not r.original.startswith(
        ("time_in.", "vector_in.", "guidance_in."))),
    KeyRule(f"{_CHROMA_ONLY}.in_proj", (f"{_CHROMA_ONLY}.in_proj",)),
    KeyRule(f"{_CHROMA_ONLY}.out_proj", (f"{_CHROMA_ONLY}.out_proj",)),
    KeyRule(f"{_CHROMA_ONLY}.layers.{{i}}.in_layer", (f"{_CHROMA_ONLY}.layers.{{i}}.linear_1",)),
    KeyRule(f"{_CHROMA_ONLY}.layers.{{i}}.out_layer", (f"{_CHROMA_ONLY}.layers.{{i}}.linear_2",)),
))


def tiny_pipeline():
    """A tiny random Chroma (Chroma1-HD-like: dynamic shift) with the tiny T5."""
    from .tiny import flow_scheduler, kl_vae, t5_text, t5_tokenizer

    t5_tok = t5_tokenizer()
    torch.manual_seed(14)
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 4, 8), approximator_num_channels=16, approximator_hidden_dim=32,
        approximator_layers=2,
    )
    sched = flow_scheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                           base_image_seq_len=256, max_image_seq_len=4096)
    return ChromaPipeline(scheduler=sched, vae=kl_vae(0.1159, 0.3611), text_encoder=t5_text(t5_tok, 32),
                          tokenizer=t5_tok, transformer=transformer)


class ChromaAdapter(DiffusersAdapter):
    family = "chroma"
    transformer_cls = ChromaTransformer2DModel
    pipeline_cls = ChromaPipeline
    default_lora_targets = FluxAdapter.default_lora_targets  # the same attention and MLP module names
    lora_key_map = CHROMA_LORA_KEYS
    comfy_reads_diffusers_lora = True  # comfy/lora.py model_lora_keys_unet (model_base.Chroma is a Flux)
    text_encoder_dirs = ("text_encoder",)
    text_encoder_classes = ("T5EncoderModel",)
    tokenizer_dirs = ("tokenizer",)
    default_scheduler = FluxAdapter.default_scheduler
    max_sequence_length = 512  # ChromaPipeline's default (and its maximum)
    full_name, example_path = "Chroma1-HD", "/path/to/Chroma1-HD"
    # the whole `fit` under a 7 GB cap, full-size random weights (bench/program/bench_program.py; bench/history/2026-11-25.md,
    # 2026-11-25 15:36 UTC): the largest phase and the steady step
    measured_presets = {("lora", 8): MeasuredPreset(0.9, True, "measured on an H100: fits, 6.0 GB reserved, 1.08 s a step")}
    full_config = {  # ChromaTransformer2DModel defaults = Chroma1-HD (8.9 B)
        "patch_size": 1,
        "in_channels": 64,
        "num_layers": 19,
        "num_single_layers": 38,
        "attention_head_dim": 128,
        "num_attention_heads": 24,
        "joint_attention_dim": 4096,
        "axes_dims_rope": [16, 56, 56],
        "approximator_num_channels": 64,
        "approximator_hidden_dim": 5120,
        "approximator_layers": 5,
    }
    text_tokens = 512  # T5 padded to max_sequence_length, all attended
    text_encoder_params = FluxAdapter.text_encoder_params[1:]  # T5-XXL's encoder
    vae_params = 83_819_683  # Flux's AutoencoderKL
    text_encoder_keep_linears = T5_KEEP
    sampling_uses_negative = True
    #: what the presets sample with: Chroma1-HD's card (true CFG at 3.0, 40 steps)
    sample_defaults: ClassVar[dict[str, Any]] = {"steps": 40, "guidance": 3.0}
    modulation_linears = ""  # none inside blocks: see the module essay
    own_attention = ("flash", "flex")  # the masked attention in forms flash / flex attention run (essay)

    @classmethod
    def tiny_builders(cls):
        return {"chroma": tiny_pipeline}

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]

    def use_attention(self, transformer: nn.Module, choice: str, device: torch.device) -> str | None:
        # `flash` alone refuses a mask: the mask as a head dimension; `flex`: flex attention adds it (essay). auto:
        # flex where `flex_by_default`, else the masked SDPA call
        form = "flex" if choice == "auto" and flex_by_default(device) else choice if choice in MASK_PROCESSORS else None
        use_mask_attention(transformer, form)
        if form is None:
            return None
        how = {"flash": "flash attention, the mask as one more head dimension",
               "flex": "torch's flex attention, the mask added to the scores in the kernel"}[form]
        return f"chroma: masked attention by {how} (train.attention: {choice})"

    @torch.no_grad()
    def encode_prompts(self, components: Components, prompts: list[str]) -> dict[str, torch.Tensor]:
        (t5,), (tok,) = components.text_encoders, components.tokenizers
        dev = next(t5.parameters()).device
        toks = tok(prompts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                   return_tensors="pt")
        mask = toks.attention_mask.to(dev)
        embeds = t5(toks.input_ids.to(dev), output_hidden_states=False, attention_mask=mask)[0].to(t5.dtype)
        # the pipeline's mask: valid tokens and one more (`<=`), in the embeddings' dtype
        pos = torch.arange(mask.shape[1], device=dev).unsqueeze(0)
        return {"prompt_embeds": embeds, "prompt_attention_mask": (pos <= mask.sum(1, keepdim=True)).to(embeds.dtype)}

    def encode_images(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return self._kl_encode(vae, pixels)

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:
        b, _, h, w = noisy_latents.shape
        dev = noisy_latents.device
        x = pack_2x2(noisy_latents)
        img_ids = image_ids(h, w, dev)
        embeds, mask = text["prompt_embeds"], text.get("prompt_attention_mask")
        if mask is not None:  # as ChromaPipeline._prepare_attention_mask: the image tokens all count
            mask = torch.cat([mask, torch.ones(b, x.shape[1], device=dev, dtype=torch.bool)], dim=1)
        out = transformer(
            hidden_states=x,
            timestep=t.to(x.dtype),
            encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=dev),
            img_ids=img_ids.reshape(-1, 3),
            attention_mask=mask,
            return_dict=False,
        )[0]
        return unpack_2x2(out, h, w)

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta") -> dict:
        kw = packed_inputs(transformer, batch, height, width, text_tokens, dtype, device)
        ni = kw["hidden_states"].shape[1]
        kw["attention_mask"] = torch.ones(batch, text_tokens + ni, device=torch.device(device), dtype=dtype)
        return kw

    @classmethod
    def pipeline_embeds(cls, pipe, prompt, negative, device) -> dict[str, torch.Tensor]:
        pe, _, mask, npe, _, nmask = pipe.encode_prompt(prompt=prompt, negative_prompt=negative, device=device,
                                                        do_classifier_free_guidance=negative is not None)
        out = {"prompt_embeds": pe, "prompt_attention_mask": mask}
        if negative is not None:
            out |= {"negative_prompt_embeds": npe, "negative_prompt_attention_mask": nmask}
        return out


def attend_outer_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + m_i m_j) v without a mask tensor, so SDPA may pick flash attention (see the
    essay). q, k, v: (B, S, H, d) as diffusers' processors hold them; m: (B, S), 0 / 1."""
    b, s, h, d = q.shape
    pad = 8 - d % 8  # flash takes head dimensions in multiples of 8: the mask's column and zeros
    col = m[:, :, None, None].to(q.dtype).expand(b, s, h, 1)
    zeros = q.new_zeros(b, s, h, pad - 1)
    qa = torch.cat([q, col, zeros], dim=-1)
    ka = torch.cat([k, col * d ** 0.5, zeros], dim=-1)  # scale * sqrt(d) = 1: the bias m_i m_j
    va = torch.cat([v, q.new_zeros(b, s, h, pad)], dim=-1)
    out = F.scaled_dot_product_attention(qa.transpose(1, 2), ka.transpose(1, 2), va.transpose(1, 2),
                                         scale=d ** -0.5)
    return out.transpose(1, 2)[..., :d]


def attend_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor,
                compiled: bool | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + m_i m_j) v by torch's flex attention, the bias added to each score in the kernel
    (a score_mod), so no (B, 1, S, S) tensor exists and the scale stays 1 / sqrt(d). q, k, v: (B, S, H, d);
    m: (B, S), 0 / 1. Inside a compiled block flex is compiled with it; outside one, on CUDA, through one
    module-level `torch.compile(flex_attention)` (`compiled=None`). On the CPU (tests) the unfused reference runs:
    torch compiles no flex backward there."""
    from torch.nn.attention.flex_attention import flex_attention

    bias = m.float()  # the scores are fp32 in the kernel; 0 / 1 are exact in any dtype

    def add_outer(score, b, h, i, j):
        return score + bias[b, i] * bias[b, j]

    if compiled is None:
        compiled = q.is_cuda and not torch.compiler.is_compiling()
    fn = _compiled_flex() if compiled else flex_attention
    out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=add_outer)
    return out.transpose(1, 2)


@functools.cache
def _compiled_flex():
    """torch.compile(flex_attention), built on first use (compiling costs nothing until it is called)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


class _MaskAttnProcessor(FluxAttnProcessor):
    """diffusers' FluxAttnProcessor (Chroma's blocks use it) with the masked attention computed by `attend`
    from the mask's token vector; without a mask it is that processor."""

    def attend(self, q, k, v, m):
        raise NotImplementedError

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if attention_mask is None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, None, image_rotary_emb)
        q, k, v, eq, ek, ev = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        q, k, v = (x.unflatten(-1, (-1, attn.head_dim)) for x in (q, k, v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if attn.added_kv_proj_dim is not None:  # a double block: text tokens first, as the plain processor
            eq, ek, ev = (x.unflatten(-1, (-1, attn.head_dim)) for x in (eq, ek, ev))
            q = torch.cat([attn.norm_added_q(eq), q], dim=1)
            k = torch.cat([attn.norm_added_k(ek), k], dim=1)
            v = torch.cat([ev, v], dim=1)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        m = attention_mask.diagonal(dim1=-2, dim2=-1)[:, 0]  # (B, S): m_i m_i = m_i for a 0 / 1 mask
        out = self.attend(q, k, v, m).flatten(2, 3).to(q.dtype)
        if encoder_hidden_states is None:
            return out
        n = encoder_hidden_states.shape[1]
        img = attn.to_out[1](attn.to_out[0](out[:, n:].contiguous()))
        return img, attn.to_add_out(out[:, :n].contiguous())


class FlashMaskAttnProcessor(_MaskAttnProcessor):
    """The masked attention by `attend_outer_mask` (SDPA without a mask: flash-eligible)."""

    def attend(self, q, k, v, m):
        return attend_outer_mask(q, k, v, m)


class FlexMaskAttnProcessor(_MaskAttnProcessor):
    """The masked attention by `attend_flex` (flex attention adding m_i m_j to the scores). A boolean mask
    (SDPA would exclude pairs instead of adding 1; `ChromaAdapter.predict` never makes one) goes to SDPA."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            return FluxAttnProcessor.__call__(self, attn, hidden_states, encoder_hidden_states, attention_mask,
                                              image_rotary_emb)
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)

    def attend(self, q, k, v, m):
        return attend_flex(q, k, v, m)


def flex_by_default(device: torch.device) -> bool:
    """`train.attention: auto` trains Chroma with flex attention: on CUDA devices of compute capability 8.0 and up
    (Ampere on), for which torch ships flex attention's tuned kernel configs (below that its backward falls back to
    16 x 16 tiles, and the CPU has no flex backward at all). Measured faster only on an H100 (essay); elsewhere
    `train.attention: efficient` keeps the masked SDPA call."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


#: `train.attention` values Chroma computes itself, and the processor each one sets
MASK_PROCESSORS = {"flash": FlashMaskAttnProcessor, "flex": FlexMaskAttnProcessor}


def use_mask_attention(transformer: nn.Module, form: str | None) -> None:
    """Every block's attention through the processor of `form` ("flash", "flex"; `MASK_PROCESSORS`) or, for
    None, diffusers' FluxAttnProcessor (masked SDPA)."""
    for b in [*transformer.transformer_blocks, *transformer.single_transformer_blocks]:
        b.attn.set_processor(MASK_PROCESSORS[form]() if form is not None else FluxAttnProcessor())
