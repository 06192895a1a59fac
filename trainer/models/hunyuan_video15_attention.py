"""HunyuanVideo 1.5's joint attention without the (B, 1, S, S) mask.

What diffusers does (0.42, `HunyuanVideo15AttnProcessor2_0`). Each of the 54 dual-stream blocks joins the video
tokens and the 1985 text tokens (729 image, 256 ByT5, 1000 Qwen), S = video + 1985, pads the (B, 1985) text mask
with True for the video tokens and builds the outer product m_i & m_j as a (B, 1, S, S) boolean tensor for SDPA:
S^2 bytes per sample in every block (2.5 GB at 640x624 x 121 frames), and SDPA takes no flash attention with a
mask. The planner's meta trace holds its masks on the host (`dummy_inputs`), so there the mask was a real CPU
tensor allocated and filled in every block: `dittrain plan` of the full-size model at 480p x 33 frames took 393 s
(about 45 minutes at 121 frames), 21 s with the processor below (2026-11-27, a shared 2-core CPU).

The mask's shape. Before the blocks the transformer moves every sample's valid text tokens first (image, ByT5,
Qwen) and its padding last, and the video tokens come first in the joint sequence: the tokens sample b keeps are
a prefix of n_b = video + valid text tokens. A query row i < n_b attends exactly the keys j < n_b, which is SDPA
*without* a mask on the first n_b tokens; a row i >= n_b attends nothing, and masked SDPA returns zeros for such a
fully masked row. `PrefixAttnProcessor` computes q, k, v as diffusers' processor does, runs SDPA on each valid
prefix (no mask, so flash attention is eligible, and no work on the padding) and writes zeros in the padded rows.
It takes the video queries and the valid text queries in two calls (the same keys: each query row is attended
alone either way), so the video rows' output is the very tensor SDPA saves for backward and has a shape that does
not depend on the caption, and only the text rows are padded: no second (B, S, H D) output is made, which a block
recomputed in token chunks would keep beside SDPA's (trainer/models/hunyuan_video15_block.py). Nothing downstream reads those rows anyway (their keys
are masked out in every later block, and the transformer's output is the video tokens alone), but they equal the
reference's, so a block's whole output matches.

Batches. Batch 1 (the usual video batch) or equal lengths: one SDPA call pair on the common prefix. Different
lengths: one pair per sample on its own prefix, each still mask-free and exact, joined (a copy of the output). A key-padding form in one call was the
alternative: flex attention's BlockMask skips the padded blocks but is another kernel (other rounding), compiled
only on CUDA and without a CPU backward; nested (jagged) tensors add a layout the LoRA and offload code never see
elsewhere. Video batches are one or two clips, so a loop costs a launch or two.

Host reads and compile. The prefix lengths are read on the host (a sync) once per forward: the 54 blocks get the
same mask tensor, and recomputation in backward too, so the read is kept for it (`_valid_lengths`). They differ per
caption, and a compiled block with static shapes would recompile for each one: the prefix attention runs eagerly
(`torch.compiler.disable`, one graph break per block), the compiled parts around it keep the full S.

Exactness. fp32 on the CPU: not bitwise. SDPA's CPU kernel sums softmax(q k) v over the keys in vector blocks
whose grouping depends on the key count, so leaving out the padded keys (weight exactly 0 in the reference)
reorders the additions: within a few ulps (tests/test_hunyuan_video15_attention.py; on the AVX2 CPU at hand the
reference with a key-padding (B, 1, 1, S) mask instead agrees bitwise: the same keys in the same blocks). bf16:
within rounding. Sampling the tiny model: 1 to 4 of 67,200-87,360 8-bit values one level off diffusers' masked
pipeline, bitwise to it once its transformer attends this way (tests/test_hunyuan_video15*.py).
On CUDA the reference's masked call runs the memory-efficient kernel and this one flash: two kernels, as any
mask-free form would be.

Where it is installed. The family's transformer class (trainer/models/hunyuan_video15_block.py
`HunyuanVideo15Transformer3DModel`, diffusers' class under the same name) sets the processor in its constructor, so
every path that builds the family's transformer through the adapter's `transformer_cls` gets it: the loader
(`from_pretrained`, `from_single_file`, trainer/models/stream_load.py's `from_config`), hence training and
`dittrain sample`, and the planner's meta model (trainer/planner/meta.py `meta_transformer`). diffusers' own
pipeline loaded by its `from_pretrained` (the tests' reference) keeps the masked processor. Its blocks call the
pieces below (`video_qkv`, `text_qkv`, `joint`) themselves, in token chunks under offload.nano_batches.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0
from torch import nn


def attend_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: list[int], video: int, backend=None,
                  parallel_config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample b's first `valid[b]` tokens attend among themselves, without a mask; its rows after them are zero.
    q, k, v: (B, S, H, D) as diffusers' processors hold them, the first `video` tokens the video's; the result is the
    video rows (B, video, H, D) and the text rows (B, S - video, H, D), from one call each (module essay)."""
    s = q.shape[1]

    def one(batch: slice, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        def rows(r: slice) -> torch.Tensor:
            return dispatch_attention_fn(q[batch, r], k[batch, :n], v[batch, :n], dropout_p=0.0, is_causal=False,
                                         backend=backend, parallel_config=parallel_config)

        img = rows(slice(None, video))
        if n == video:  # no valid text token: every text row is padding
            return img, q.new_zeros(img.shape[0], s - video, *img.shape[2:])
        return img, F.pad(rows(slice(video, n)), (0, 0, 0, 0, 0, s - n))

    if len(set(valid)) == 1:
        return one(slice(None), valid[0])
    img, txt = zip(*(one(slice(b, b + 1), n) for b, n in enumerate(valid)), strict=True)
    return torch.cat(img), torch.cat(txt)


def video_qkv(attn: nn.Module, hidden_states: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None):
    """The video tokens' q, k, v (B, S, H, D) as diffusers' processor computes them: projections, q / k norms,
    rotary embedding (`rotary`: cos and sin, (S, D / H) each)."""
    query, key, value = (x.unflatten(2, (attn.heads, -1)) for x in (
        attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)))
    query, key = attn.norm_q(query), attn.norm_k(key)
    if rotary is not None:
        query = apply_rotary_emb(query, rotary, sequence_dim=1)
        key = apply_rotary_emb(key, rotary, sequence_dim=1)
    return query, key, value


def text_qkv(attn: nn.Module, encoder_hidden_states: torch.Tensor):
    """The text tokens' q, k, v (B, T, H, D) as diffusers' processor computes them (no rotary embedding)."""
    eq, ek, ev = (x.unflatten(2, (attn.heads, -1)) for x in (
        attn.add_q_proj(encoder_hidden_states), attn.add_k_proj(encoder_hidden_states),
        attn.add_v_proj(encoder_hidden_states)))
    if attn.norm_added_q is not None:
        eq = attn.norm_added_q(eq)
    if attn.norm_added_k is not None:
        ek = attn.norm_added_k(ek)
    return eq, ek, ev


class PrefixAttnProcessor(HunyuanVideo15AttnProcessor2_0):
    """diffusers' HunyuanVideo 1.5 attention, the masked SDPA call replaced by `attend_prefix` (module essay). A
    mask whose kept tokens are not a prefix (the transformer never makes one) gets diffusers' masked call."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: tuple | None = None  # (weakref to the mask, its version, its lengths)

    def _valid_lengths(self, mask: torch.Tensor) -> list[int] | None:
        """The text tokens each sample keeps, if they are a prefix of its text; else None. One host read per
        mask tensor (the blocks of a forward share it)."""
        seen = self._seen
        if seen is not None and seen[0]() is mask and seen[1] == mask._version:
            return seen[2]
        if mask.device.type == "meta":  # the planner's compiled count (planner/compiled_saves.py moves masks to meta)
            return [mask.shape[1]] * mask.shape[0]  # counts every text token valid: shapes only, nothing to read
        m = mask.bool()
        n = m.sum(1)
        prefix = (m == (torch.arange(m.shape[1], device=m.device) < n[:, None])).all()
        *lengths, ok = torch.cat([n, prefix.view(1).long()]).tolist()  # host sync: once per forward
        out = lengths if ok else None
        self._seen = (weakref.ref(mask), mask._version, out)
        return out

    @torch.compiler.disable  # the lengths vary per caption: eager, so no compiled code guards on them (essay)
    def joint(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              text: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The joint attention of q, k, v (B, S, H, D; the last `text` tokens the text's) under the text mask
        (B, T), as (video rows, text rows), (B, S - text, H D) and (B, text, H D): on the valid prefixes
        (`attend_prefix`), or, for a mask whose kept tokens are not a prefix, as diffusers does."""
        lengths = self._valid_lengths(mask)
        s, video = q.shape[1], q.shape[1] - text
        if lengths is not None:
            img, txt = attend_prefix(q, k, v, [video + n for n in lengths], video, self._attention_backend,
                                     self._parallel_config)
            return img.flatten(2, 3).to(q.dtype), txt.flatten(2, 3).to(q.dtype)
        m = F.pad(mask.bool(), (s - mask.shape[1], 0), value=True)  # diffusers' (B, 1, S, S) mask
        out = dispatch_attention_fn(q, k, v, attn_mask=m[:, None, None, :] & m[:, None, :, None], dropout_p=0.0,
                                    is_causal=False, backend=self._attention_backend,
                                    parallel_config=self._parallel_config).flatten(2, 3).to(q.dtype)
        return out[:, :video], out[:, video:]

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None:  # not how the dual-stream blocks call it
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        # q, k, v exactly as diffusers' processor computes them: video tokens, then text
        qkv = zip(video_qkv(attn, hidden_states, image_rotary_emb), text_qkv(attn, encoder_hidden_states),
                  strict=True)
        query, key, value = (torch.cat(pair, dim=1) for pair in qkv)
        img, txt = self.joint(query, key, value, attention_mask, encoder_hidden_states.shape[1])
        if getattr(attn, "to_out", None) is not None:
            img = attn.to_out[1](attn.to_out[0](img))
        if getattr(attn, "to_add_out", None) is not None:
            txt = attn.to_add_out(txt)
        return img, txt


def use_prefix_attention(transformer: nn.Module, on: bool = True) -> None:
    """Every dual-stream block's attention through one shared `PrefixAttnProcessor` (its length read serves all of
    them), or, for `on=False`, diffusers' masked processor."""
    proc = PrefixAttnProcessor() if on else None
    for b in transformer.transformer_blocks:
        b.attn.set_processor(proc if on else HunyuanVideo15AttnProcessor2_0())
