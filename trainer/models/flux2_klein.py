"""Flux.2-klein (4 B and 9 B): the Flux.2 transformer at small sizes without a guidance embedding, a Qwen3 text
encoder (Qwen3-4B / Qwen3-8B) read at three intermediate layers, and Flux.2's VAE. Latents, tokens, position
ids, timestep and training shift are Flux.2-dev's (`Flux2Adapter`); the text and the sampling guidance differ.

How it mirrors diffusers' Flux2KleinPipeline (0.42):

- text: each prompt is put in the tokenizer's chat template as one user turn (generation prompt on, thinking
  off), padded to 512 tokens, run through Qwen3; the hidden states after layers 9, 18 and 27 are laid side by
  side per token: `prompt_embeds` (B, 512, 3 x hidden). `encode_prompts` calls the pipeline's static
  `_get_qwen3_prompt_embeds`.
- sampling: true classifier-free guidance. With `guidance_scale` > 1 and a base (not step-distilled) checkpoint
  the pipeline runs a second pass on the negative prompt's embeddings (`negative_prompt_embeds`; the pipeline's
  own default is the empty prompt, which is `sample.negative_prompt`'s default too). A distilled checkpoint
  (`is_distilled` in model_index.json) ignores the guidance value, as the pipeline does.

The text encoder is built without the layers after the 28th (8 of Qwen3's 36 are never needed, nor read) and its
language-model head becomes a no-op.

Reference images train and sample as for Flux.2-dev (optional pairs, `--image` as the pipeline's `image=`; its
negative pass sees the reference too, as the pipeline's does). Left out: the KV-cached / inpainting klein
pipelines.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel

from .base import Components
from .flux2 import Flux2Adapter

#: Qwen3-4B's parameters by part (Qwen3ForCausalLM, tied embedding and head)
QWEN3_LAYER, QWEN3_LAYERS, QWEN3_EMBED = 100_930_816, 36, 388_956_160


class Flux2KleinAdapter(Flux2Adapter):
    family = "flux2-klein"
    transformer_cls = Flux2Transformer2DModel
    pipeline_cls = Flux2KleinPipeline
    text_encoder_classes = ("Qwen3ForCausalLM",)
    text_layers: ClassVar[tuple[int, ...]] = (9, 18, 27)
    full_name, example_path = "Flux.2-klein-base-4B", "/path/to/FLUX.2-klein-base-4B"
    full_config = {  # FLUX.2-klein-4B (3.9 B parameters); klein-9B: 32 heads, 8 + 24 blocks, joint dim 12288
        "patch_size": 1,
        "in_channels": 128,
        "num_layers": 5,
        "num_single_layers": 20,
        "attention_head_dim": 128,
        "num_attention_heads": 24,
        "joint_attention_dim": 7680,
        "timestep_guidance_channels": 256,
        "mlp_ratio": 3.0,
        "axes_dims_rope": [32, 32, 32, 32],
        "rope_theta": 2000,
        "guidance_embeds": False,
    }
    text_encoder_params = (("Qwen3-4B", QWEN3_LAYERS * QWEN3_LAYER + QWEN3_EMBED + 2560),)
    text_encoder_unused_params = ((QWEN3_LAYERS - 28) * QWEN3_LAYER,)
    text_encoder_nonblock_params = (QWEN3_EMBED,)
    text_encoder_unloaded_params = ((QWEN3_LAYERS - 28) * QWEN3_LAYER,)  # `text_encoder_config`: layers 28-35
    text_encoder_layers = (28,)  # the decoder layers it keeps, streamed as blocks
    sampling_uses_negative = True
    max_references = 4  # BFL's limit for klein 4B and 9B (docs.bfl.ml, reference images per model)

    @classmethod
    def tiny_builders(cls):
        return {"flux2-klein": tiny_pipeline}

    @torch.no_grad()
    def encode_prompts(self, components: Components, prompts: list[str]) -> dict[str, torch.Tensor]:
        (enc,), (tok,) = components.text_encoders, components.tokenizers
        dev = enc.get_input_embeddings().weight.device
        embeds = Flux2KleinPipeline._get_qwen3_prompt_embeds(
            text_encoder=enc, tokenizer=tok, prompt=list(prompts), dtype=enc.dtype, device=dev,
            max_sequence_length=self.max_sequence_length, hidden_states_layers=self.text_layers,
        )
        return {"prompt_embeds": embeds}

    def pipeline(self, components: Components) -> Any:
        pipe = super().pipeline(components)
        distilled = bool(self._json("model_index.json", required=False).get("is_distilled", False))
        pipe.register_to_config(is_distilled=distilled)
        return pipe


#: Qwen3's chat layout for one user turn with the generation prompt and thinking switched off
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def tiny_pipeline():
    """A tiny random Flux.2-klein: a 30-layer, 16-wide Qwen3 (the pipeline reads hidden states 9 / 18 / 27) with
    the tiny Qwen tokenizer and a Qwen3-style chat template, Flux.2's tiny VAE, a 2 + 2 block transformer without
    a guidance embedding; saved as a base (not step-distilled) checkpoint."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from .flux2 import tiny_scheduler, tiny_transformer, tiny_vae
    from .tiny import qwen_tokenizer

    tok = qwen_tokenizer()
    tok.add_tokens(["<think>", "</think>"], special_tokens=True)
    tok.chat_template = QWEN3_TEMPLATE
    transformer = tiny_transformer(guidance=False)
    torch.manual_seed(8)
    enc = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=30, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=1024, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
    )).eval()
    return Flux2KleinPipeline(scheduler=tiny_scheduler(), vae=tiny_vae(), text_encoder=enc, tokenizer=tok,
                              transformer=transformer, is_distilled=False)
