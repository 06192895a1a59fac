"""HunyuanVideo 1.5's dual-stream block as two token-wise regions around its attention, which offload.nano_batches
runs in token chunks.

Why. A recomputed block's backward holds everything its forward saved. For diffusers' block that is, for every
video token, the norms' inputs and outputs, the modulated inputs of the q / k / v projections, q and k before their
RMS norms and before the rotary embedding, the attention output, the gated residuals, the second norm's output and
the feed-forward's 4 x hidden GELU: at 720p x 121 frames (111,600 video tokens, hidden 2048, bf16) 10.4 GB per block
(the planner's meta trace, 2026-11-28), where splitting the feed-forwards alone (nano.py) left a working set of 9.7 GB
in backward (16 chunks): a LoRA step at 720p x 121 was predicted at 18.3 GB with every block streamed, over a 16 GB
card (the H200 run of it that day ran out of memory sooner, for another reason since fixed: activation offloading
left every block's input on the GPU, bench/history/2026-11-28.md 10:10). Everything in the block except the
attention kernel is token-wise: a token's q, k, v depend on that token alone (norm, modulation by the per-sample
timestep, projections, q / k norms, its own rotary angle), and so does everything after attention (output
projection, gate, residual, second norm, modulation, feed-forward, gate, residual) given the token's attention
output and input.

How. `HunyuanVideo15TransformerBlock` (diffusers' class under the same name) computes what diffusers' block and its
processor compute, op for op, as: the modulation (one Linear on temb, per sample); `token_pre`, the video tokens'
q, k, v (`TokenPre`); the text stream's q, k, v (1985 tokens, whole); the joint attention (the prefix attention of
trainer/models/hunyuan_video15_attention.py); `token_post`, the video tokens' output projection through the
feed-forward's residual (`TokenPost`); the text stream's rest (whole, its feed-forward `ff_context` token-wise too).
`token_pre` and `token_post` are parameterless modules of the block (no state-dict keys; they reach the block's
layers through the `block` argument), which the family declares token-wise (`token_wise`): under
offload.nano_batches: N each runs in N token chunks, each under a non-reentrant checkpoint (trainer/offload/nano.py
`NanoBatched`, which splits the rotary tables with the tokens: `token_args`). The block's recompute then keeps, for
the whole sequence, only q, k, v, the attention output and its log-sum-exp (what the attention kernel saves) and
each region's inputs (the block's input, the attention output: saved already); backward recomputes one chunk of a
region at a time. The planner counts it as it counts any token-wise sub-layer (trainer/planner/trace.py
`chunk_mlps`, compiled: compiled_saves.py `chunk_saving`): at 720p x 121 with 16 chunks a block's recompute saves
2.6 GB instead of 9.9 and its backward's working set is 7.2 GB instead of 14.6 (eager and compiled alike; 3.7 GB of it
the attention's backward, trace.py `attention_backward`: both calls' gradients of the joint q, k, v and flash
attention's float32 dq), the training step with every block streamed and activations offloaded 15.0 GB reserved
(14.9 compiled; measured on an H200: 14.87, 11.56 allocated against 11.29 predicted, docs/families.md) instead of
18.3 with the feed-forwards alone split.

Exactness. Unsplit, the same ops on the same tensors as diffusers' block with `PrefixAttnProcessor`: bitwise. Split,
each token's rows are computed alone either way (bitwise forward on the CPU); the regions' weight gradients (the
LoRAs of to_q / to_k / to_v / to_out and the feed-forward's) and the gradients of the per-sample modulation are sums
over chunks: fp32 reassociation (tests/test_hunyuan_video15_block.py).

Left out: the text stream is not split (1985 tokens: its saves are 2 % of the video's at 720p x 121); the attention
itself is not split by queries (its saves are q, k, v and the output whatever the split). A processor other than
`PrefixAttnProcessor` (diffusers' masked one, `use_prefix_attention(on=False)`) runs diffusers' block forward.
"""

from __future__ import annotations

import functools

import diffusers
import torch
from diffusers.models.transformers import transformer_hunyuan_video15 as hv
from torch import nn

from .hunyuan_video15_attention import PrefixAttnProcessor, text_qkv, use_prefix_attention, video_qkv


class TokenPre(nn.Module):
    """The video tokens' work before attention: the first norm and its modulation, then q, k, v (`video_qkv`)."""

    token_args = 3  # hidden_states and the rotary cos, sin (1, S, D / H) are split along the tokens (nano.py)

    def forward(self, hidden_states, cos, sin, shift, scale, *, block):
        x = block.norm1.norm(hidden_states) * (1 + scale[:, None]) + shift[:, None]
        return video_qkv(block.attn, x, (cos[0], sin[0]))


class TokenPost(nn.Module):
    """The video tokens' work after attention: output projection, gated residual, second norm and its modulation,
    feed-forward, gated residual."""

    token_args = 2  # the attention output and hidden_states

    def forward(self, attn_output, hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp, *, block):
        attn = block.attn
        hidden_states = hidden_states + attn.to_out[1](attn.to_out[0](attn_output)) * gate_msa.unsqueeze(1)
        x = block.norm2(hidden_states) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return hidden_states + gate_mlp.unsqueeze(1) * block.ff(x)


class HunyuanVideo15TransformerBlock(hv.HunyuanVideo15TransformerBlock):
    """diffusers' dual-stream block, computed as `token_pre`, attention, `token_post` (module essay)."""

    def forward(self, hidden_states, encoder_hidden_states, temb, attention_mask=None, freqs_cis=None, *args,
                **kwargs):
        proc = self.attn.processor
        if not isinstance(proc, PrefixAttnProcessor) or freqs_cis is None:
            return super().forward(hidden_states, encoder_hidden_states, temb, attention_mask, freqs_cis, *args,
                                   **kwargs)
        # norm1's modulation (AdaLayerNormZero, per sample); its norm runs per token in token_pre
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1.linear(
            self.norm1.silu(temb)).chunk(6, dim=1)
        cos, sin = freqs_cis
        q, k, v = self.token_pre(hidden_states, cos[None], sin[None], shift_msa, scale_msa, block=self)
        text, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(encoder_hidden_states, emb=temb)
        q, k, v = (torch.cat(pair, dim=1) for pair in zip((q, k, v), text_qkv(self.attn, text), strict=True))
        img, txt = proc.joint(q, k, v, attention_mask, encoder_hidden_states.shape[1])
        hidden_states = self.token_post(img, hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp, block=self)
        encoder_hidden_states = encoder_hidden_states + self.attn.to_add_out(txt) * c_gate_msa.unsqueeze(1)
        text = self.norm2_context(encoder_hidden_states) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
        encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * self.ff_context(text)
        return hidden_states, encoder_hidden_states


def use_token_regions(transformer: nn.Module) -> None:
    """Make each of diffusers' dual-stream blocks of `transformer` this module's block: its class, and its two
    parameterless regions."""
    for b in transformer.transformer_blocks:
        b.__class__ = HunyuanVideo15TransformerBlock
        b.token_pre, b.token_post = TokenPre(), TokenPost()


class HunyuanVideo15Transformer3DModel(diffusers.HunyuanVideo15Transformer3DModel):
    """diffusers' HunyuanVideo15Transformer3DModel (same name, same config and weights) attending through
    `PrefixAttnProcessor` (trainer/models/hunyuan_video15_attention.py) with the blocks above, from construction on."""

    @functools.wraps(diffusers.HunyuanVideo15Transformer3DModel.__init__)  # diffusers reads the config's keys there
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        use_prefix_attention(self)
        use_token_regions(self)
