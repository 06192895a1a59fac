"""The planner's FLOP count (trainer/planner/trace.py: every nn.Linear's and attention's, on the meta device) for
ERNIE-Image, Ideogram 4 and HiDream-I1 at 1024 px, LoRA r16, against a count by hand from each architecture
(diffusers 0.42.1's modules, the families' full configs and token counts), and the step-time rules for HiDream's
host syncs (trainer/planner/replay.py).

Why: on the H200 HiDream ran 1.83 s a step where its FLOPs at the planner's rate say 0.94 s, and Ideogram 4 1.46 s
against 1.14 s (bench/logs/2026-11-28i). These counts rule out a missed sub-layer or token as the cause: HiDream's
shared expert, its two routed experts per token and the text tokens its blocks see, and Ideogram 4's 512 caption
tokens, are all counted."""

from __future__ import annotations

import pytest

from trainer import planner
from trainer.config import Config

R = 16  # LoRA rank
IMAGE = 4096  # 1024 px: (1024 / 16)^2 tokens of 2x2 patches of the 8x latent


def _facts(family: str, checkpointing=True):
    cfg = Config.model_validate({
        "model": {"family": family, "path": f"/nonexistent/{family}"},
        "train": {"method": "lora", "gradient_checkpointing": checkpointing},
        "lora": {"rank": R, "alpha": R},
        "data": {"sources": [{"path": "unused"}], "resolutions": [1024]},
        "output": {"dir": "unused"},
    })
    return planner.analyze(cfg)


def _linear(tokens: int, i: int, o: int, lora: bool = True) -> int:
    """Forward FLOPs of a Linear on `tokens` rows, with its rank-R LoRA branch."""
    return 2 * tokens * i * o + (2 * tokens * R * (i + o) if lora else 0)


def _swiglu(tokens: int, d: int, h: int) -> int:
    return 2 * _linear(tokens, d, h) + _linear(tokens, h, d)


def _attention(tokens: int, width: int) -> int:
    return 4 * tokens * tokens * width  # QK^T and PV over every head


def test_ernie_image_counts_its_36_blocks_over_image_and_caption_tokens():
    facts = _facts("ernie-image")
    tr = facts.trace(1024)
    d, s = 4096, IMAGE + 256  # the caption tokens the family plans with (`text_tokens`)
    block = 4 * _linear(s, d, d) + _swiglu(s, d, 12288)  # the shared modulation is outside the blocks
    assert tr.block_linear_flops == [block] * 36
    assert tr.attn_flops == 36 * _attention(s, d)


def test_ideogram4_counts_its_34_blocks_over_the_packed_caption_and_image():
    facts = _facts("ideogram4")
    tr = facts.trace(1024)
    d, s = 18 * 256, 512 + IMAGE  # [text][image] in one sequence; 512 caption tokens planned
    modulation = _linear(1, 512, 4 * d, lora=False)  # each block's adaLN from the 512-wide conditioning
    block = 4 * _linear(s, d, d) + _swiglu(s, d, 12288) + modulation
    assert tr.block_linear_flops == [block] * 34
    assert tr.attn_flops == 34 * _attention(s, d)


def test_hidream_counts_the_shared_expert_and_two_routed_experts_per_token():
    """Double blocks: 4096 image tokens and 384 text tokens (T5's 128, the first Llama layer's 128 and the block's
    own Llama layer's 128) in one attention, each stream with its own projections; the image stream's feed-forward
    the MoE (a shared SwiGLU 3584 wide on every token, 2 of 4 routed SwiGLUs 6912 wide per token), the text
    stream's a SwiGLU 6912 wide. Single blocks: the 4480 tokens through one set of projections and the MoE."""
    facts = _facts("hidream")
    tr = facts.trace(1024)
    d, text = 2560, 128 + 128 + 128
    shared, routed = 3584, 6912  # diffusers' SwiGLU widths: 2/3 of 2d and 4d, rounded up to 256

    def moe(tokens):
        return _swiglu(tokens, d, shared) + 2 * _swiglu(tokens, d, routed)  # top-2: each token through 2 experts

    def modulation(k):
        return _linear(1, d, k * d, lora=False)

    double = 4 * _linear(IMAGE, d, d) + 4 * _linear(text, d, d) + moe(IMAGE) + _swiglu(text, d, routed) + modulation(12)
    single = 4 * _linear(IMAGE + text, d, d) + moe(IMAGE + text) + modulation(6)
    assert tr.block_linear_flops == [double] * 16 + [single] * 32
    assert tr.attn_flops == 48 * _attention(IMAGE + text, d)


def test_hidream_step_is_launches_plus_kernels():
    """Its blocks wait on the GPU (the experts' boolean masks): the host cannot launch ahead, so the resident step is
    the host's time plus the GPU's, not the larger of the two (which it was: 1.12 s against 1.83 measured)."""
    facts = _facts("hidream")
    p = planner.predict(facts, 0.0, 1024)
    assert facts.adapter.blocks_sync_host
    assert p.step_s > p.host_s + p.compute_s * 0.99


def test_a_family_without_syncs_still_overlaps_launches_and_kernels():
    facts = _facts("ernie-image")
    p = planner.predict(facts, 0.0, 1024)
    assert not facts.adapter.blocks_sync_host
    assert p.step_s == pytest.approx(max(p.compute_s, p.host_s), rel=0.02)


@pytest.mark.parametrize("family", ["hidream", "ernie-image"])
def test_no_checkpointing_is_predicted_as_auto_keeping_every_block(family):
    """gradient_checkpointing false launches no recompute, as a block auto keeps: the same step either way (the
    host's launches counted a recompute without checkpointing, 1.76 s against 1.39 for HiDream)."""
    kept = _facts(family)
    every = frozenset(range(len(kept.blocks)))
    none = _facts(family, checkpointing=False)
    a, b = planner.predict(kept, 0.0, 1024, kept=every), planner.predict(none, 0.0, 1024)
    # (the two trace apart: a run that may keep activations counts them as compiled blocks keep them)
    assert (b.step_s, b.host_s, b.compute_s) == pytest.approx((a.step_s, a.host_s, a.compute_s), rel=1e-3)
