"""Lumina-Image 2.0 (Alpha-VLLM): Lumina2Transformer2DModel, a 2.6 B single-stream "Unified Next-DiT" (26 layers
after two noise-refiner and two context-refiner blocks, grouped-query attention 24 / 8 heads), a Gemma-2-2B text
encoder and Flux's 16-channel VAE. The architecture Z-Image grew out of (ComfyUI runs both as its Lumina2 model).

How each piece mirrors diffusers' Lumina2Pipeline (0.42):

- text: the pipeline's system prompt, " <Prompt Start> " and the caption, tokenized right-padded to
  `max_sequence_length` (256), run through Gemma 2 with the attention mask; the caption is the *second to last*
  hidden state. The transformer reads only the first `mask.sum()` tokens of each caption (its RoPE positions, the
  context refiner's keys and the joint sequence stop there), so the cache keeps the valid tokens only and
  `collate_text` re-pads a batch to its longest caption with a 0/1 mask (none when nothing is padded, as Z-Image's).
  `predict` hands the transformer an all-ones mask then: it requires one.
- latents: VAE mean, then (z - shift_factor) * scaling_factor, as the pipeline undoes before decoding; the
  transformer patchifies 2x2 itself, so latents stay (B, C, h, w).
- predict: Lumina's time runs the other way: the pipeline passes 1 - t (t = sigma) and negates the output before
  its scheduler step. So `predict` passes 1 - t and returns -output: the (noise - x0) velocity every family
  returns.
- shift: the scheduler config decides. With dynamic shifting the 0.42 pipeline computes mu from `latents.shape[1]`,
  the latent *channel* count, not the image token count, so the shift is the same at every size;
  `timestep_shift` trains with that same shift.
- sampling (`Lumina2Pipeline`): classifier-free guidance above guidance 1, with the pipeline's own defaults
  (`cfg_normalization` on, `cfg_trunc_ratio` 1.0: guidance at every step); the presets sample at the pipeline's
  defaults, guidance 4 and 30 steps.
- quantization: a block's modulation Linear is `norm1.linear` (LuminaRMSNormZero: the time embedding to
  4 x dim scale / gate vectors); the context refiners have none.

Left out: `cfg_trunc_ratio` / `cfg_normalization` other than the pipeline's defaults, a custom `system_prompt`
(the pipeline's default is part of every caption), Lumina-Image 2.0's "unified" captioning prompts.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers import Lumina2Pipeline, Lumina2Transformer2DModel
from torch import nn

from ._diffusers import DiffusersAdapter, collate_masked_text, flux_vae, tiny_token_ids
from .base import Components
from .lora_keys import KeyRule, LoraKeyMap

#: Alpha-VLLM's original layout (ComfyUI's NextDiT; diffusers' `convert_lumina2_to_diffusers` and its LoRA
#: converter `_convert_non_diffusers_lumina2_lora_to_diffusers`): each attention's q/k/v fused into
#: `attention.qkv` (grouped-query: k and v are 8 / 24 of q's width), `attention.out`, the feed-forward's `w1..w3`,
#: the modulation `adaLN_modulation.1`, and the embedders / final layer under their own names.
_KV = 1 / 3  # Lumina-Image 2.0: 8 key-value heads of 24
LUMINA2_LORA_KEYS = LoraKeyMap((
    *(rule for blk in ("layers", "noise_refiner", "context_refiner") for rule in (
        KeyRule(f"{blk}.{{i}}.attention.qkv", tuple(f"{blk}.{{i}}.attn.to_{p}" for p in "qkv"), (1, _KV, _KV)),
        KeyRule(f"{blk}.{{i}}.attention.out", (f"{blk}.{{i}}.attn.to_out.0",)),
        *(KeyRule(f"{blk}.{{i}}.feed_forward.w{n}", (f"{blk}.{{i}}.feed_forward.linear_{n}",)) for n in (1, 2, 3)),
        KeyRule(f"{blk}.{{i}}.adaLN_modulation.1", (f"{blk}.{{i}}.norm1.linear",)))),
    KeyRule("x_embedder", ("x_embedder",)),
    KeyRule("cap_embedder.1", ("time_caption_embed.caption_embedder.1",)),
    KeyRule("t_embedder.mlp.0", ("time_caption_embed.timestep_embedder.linear_1",)),
    KeyRule("t_embedder.mlp.2", ("time_caption_embed.timestep_embedder.linear_2",)),
    KeyRule("final_layer.adaLN_modulation.1", ("norm_out.linear_1",)),
    KeyRule("final_layer.linear", ("norm_out.linear_2",)),
))

#: Lumina2Pipeline's default `system_prompt` (set in its __init__; tests check it is the pipeline's)
SYSTEM_PROMPT = ("You are an assistant designed to generate superior images with the superior degree of image-text "
                 "alignment based on textual prompts or user prompts.")
#: Gemma-2-2B's token embedding (256000 x 2304): outside the streamed decoder layers
GEMMA2_2B_EMBED = 589_824_000
#: Gemma's special tokens, at the ids the real tokenizer gives them
GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]


def gemma_tokenizer():
    """A tiny Gemma tokenizer (BPE, spaces as "▁", no pre-tokenizer split beyond spaces), trained on the shared
    corpus (trainer/models/tiny.py) with the pipeline's system prompt added."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import GemmaTokenizer

    from .tiny import _bpe_vocab_merges, corpus

    tok = Tokenizer(BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="▁", behavior="merged_with_next")
    trainer = BpeTrainer(vocab_size=600, special_tokens=GEMMA_SPECIAL, show_progress=False)
    tok.train_from_iterator([*corpus(), *(SYSTEM_PROMPT + " <Prompt Start> " + s for s in corpus()[:20])], trainer=trainer)
    vocab, merges = _bpe_vocab_merges(tok)
    return GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=512)


def tiny_pipeline():
    """A tiny random Lumina-Image 2.0 (fixed shift 6, as Lumina-Image-2.0's scheduler config) with a Gemma 2
    text encoder 32 wide."""
    from transformers import Gemma2Config, Gemma2Model

    from .tiny import flow_scheduler, kl_vae

    tok = gemma_tokenizer()
    cfg = Gemma2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, sliding_window=64,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(21)
    text_encoder = Gemma2Model(cfg).eval()
    torch.manual_seed(22)
    transformer = Lumina2Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, hidden_size=48, num_layers=2, num_refiner_layers=1,
        num_attention_heads=3, num_kv_heads=1, multiple_of=16, norm_eps=1e-5, axes_dim_rope=(4, 6, 6),
        axes_lens=(300, 64, 64), cap_feat_dim=32,
    )
    return Lumina2Pipeline(transformer=transformer, scheduler=flow_scheduler(shift=6.0), vae=kl_vae(0.1159, 0.3611),
                           text_encoder=text_encoder, tokenizer=tok)


class Lumina2Adapter(DiffusersAdapter):
    family = "lumina2"
    transformer_cls = Lumina2Transformer2DModel
    pipeline_cls = Lumina2Pipeline
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "feed_forward.linear_1", "feed_forward.linear_2",
                            "feed_forward.linear_3")
    lora_key_map = LUMINA2_LORA_KEYS
    text_encoder_dirs = ("text_encoder",)
    text_encoder_classes = ("Gemma2Model",)
    tokenizer_dirs = ("tokenizer",)
    #: Lumina-Image-2.0's scheduler config as recalled (not checked offline: no copy of the released folder here)
    default_scheduler = {"shift": 6.0, "use_dynamic_shifting": False}
    packs_2x2 = False  # the transformer patchifies 2x2 itself (`patch_size` 2)
    max_sequence_length = 256  # Lumina2Pipeline's default
    full_name, example_path = "Lumina-Image-2.0", "/path/to/Lumina-Image-2.0"
    full_config = {  # Lumina-Image-2.0 (2.61 B): diffusers' defaults, except cap_feat_dim = Gemma-2-2B's width
        "sample_size": 128,
        "patch_size": 2,
        "in_channels": 16,
        "hidden_size": 2304,
        "num_layers": 26,
        "num_refiner_layers": 2,
        "num_attention_heads": 24,
        "num_kv_heads": 8,
        "multiple_of": 256,
        "ffn_dim_multiplier": None,
        "norm_eps": 1e-5,
        "scaling_factor": 1.0,
        "axes_dim_rope": [32, 32, 32],
        "axes_lens": [300, 512, 512],
        "cap_feat_dim": 2304,
    }
    text_tokens = 256  # valid caption tokens only (system prompt included), at most the pipeline's 256
    text_encoder_params = (("Gemma-2-2B", 2_614_341_888),)
    text_encoder_nonblock_params = (GEMMA2_2B_EMBED,)
    text_encoder_layers = (26,)
    vae_params = 83_819_683  # Flux's AutoencoderKL
    sampling_uses_negative = True
    #: what the presets sample with: Lumina2Pipeline's defaults
    sample_defaults: ClassVar[dict[str, Any]] = {"steps": 30, "guidance": 4.0}
    #: `norm1.linear`: the time embedding to each modulated block's 4 x dim scale / gate vectors
    modulation_linears = r"(^|\.)norm1\.linear\."

    @classmethod
    def tiny_builders(cls):
        return {"lumina2": tiny_pipeline}

    @classmethod
    def full_size_parts(cls, folder):
        """bench/program/bench_program.py's full-size random folders: Flux's VAE and Gemma-2-2B as Gemma2Model
        whole (26 layers; the pipeline reads the second to last hidden state, so the last layer must stay for that
        state to be the one the release gives), bf16 (5.2 GB), with the folder's tiny tokenizer's special ids."""
        from transformers import Gemma2Config, Gemma2Model

        return flux_vae(), [("text_encoder", Gemma2Model, Gemma2Config(
            vocab_size=256_000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
            num_key_value_heads=4, head_dim=256, max_position_embeddings=8192, sliding_window=4096,
            query_pre_attn_scalar=256, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
            **tiny_token_ids(folder)))]

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        # execution order of Lumina2Transformer2DModel.forward: caption refiners, image refiners, the main layers
        return [*transformer.context_refiner, *transformer.noise_refiner, *transformer.layers]

    def shift_seq_len(self, height: int, width: int) -> int:
        # Lumina2Pipeline (0.42) takes mu's "image_seq_len" from latents.shape[1]: the latent channels
        return self.latent_channels

    @torch.no_grad()
    def encode_prompts(self, components: Components, prompts: list[str]) -> dict[str, torch.Tensor]:
        (enc,), (tok,) = components.text_encoders, components.tokenizers
        dev = enc.get_input_embeddings().weight.device
        texts = [SYSTEM_PROMPT + " <Prompt Start> " + p for p in prompts]
        tok.padding_side = "right"  # as Lumina2Pipeline sets it
        toks = tok(texts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                   return_tensors="pt")
        ids, mask = toks.input_ids.to(dev), toks.attention_mask.to(dev)
        hidden = enc(ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2].to(enc.dtype)
        lengths = mask.sum(1)
        longest = int(lengths.max())  # host sync: once per batch of captions, outside training
        return {"prompt_embeds": hidden[:, :longest], "prompt_embeds_mask": mask[:, :longest].long()}

    def collate_text(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return collate_masked_text(items)

    def encode_images(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return self._kl_encode(vae, pixels)

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:
        embeds, mask = text["prompt_embeds"], text.get("prompt_embeds_mask")
        if mask is None:  # every caption of the batch is whole: the transformer still takes a mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        out = transformer(hidden_states=noisy_latents, timestep=1.0 - t.to(noisy_latents.dtype),
                          encoder_hidden_states=embeds, encoder_attention_mask=mask, return_dict=False)[0]
        return -out

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta") -> dict:
        c, dev = transformer.config, torch.device(device)
        rnd = {"device": dev, "dtype": dtype}
        return dict(
            hidden_states=torch.randn(batch, c.in_channels, height // 8, width // 8, **rnd),
            timestep=torch.ones(batch, **rnd),
            encoder_hidden_states=torch.randn(batch, text_tokens, c.cap_feat_dim, **rnd),
            # on the CPU: the transformer reads the caption lengths from it with `.tolist()` (the planner's meta
            # trace mixes such host-side layout tensors in: trainer/planner/trace.py)
            encoder_attention_mask=torch.ones(batch, text_tokens, dtype=torch.long),
        )

    @classmethod
    def pipeline_embeds(cls, pipe, prompt, negative, device) -> dict[str, torch.Tensor]:
        pe, mask, npe, nmask = pipe.encode_prompt(prompt=prompt, negative_prompt=negative, device=device,
                                                  do_classifier_free_guidance=negative is not None)
        out = {"prompt_embeds": pe, "prompt_attention_mask": mask}
        if negative is not None:
            out |= {"negative_prompt_embeds": npe, "negative_prompt_attention_mask": nmask}
        return out
