"""HunyuanVideo 1.5's blocks as two token-wise regions around attention (trainer/models/hunyuan_video15_block.py),
which offload.nano_batches runs in token chunks. fp32 on the CPU, the tiny transformer with a LoRA on every
attention projection (tests/test_hunyuan_video15_attention.py `_pair`):

- unsplit, the block is bitwise diffusers' block with the prefix processor (output, input and LoRA gradients);
- split in token chunks: the output and the latents' gradient are bitwise the same (every op on a video token's rows
  computes them alone, and attention runs whole either way); the LoRA gradients of the split regions (to_q, to_k,
  to_v, to_out) are sums over chunks: fp32 reassociation, within 1e-6 of their size (measured up to 2.8e-7);
  the text stream's LoRAs are not split: bitwise;
- compiled (aot_eager, as train.compile on the CPU), split: the eager split block's numbers;
- `dittrain fit` at nano_batches 4 and 1: the same first loss, close after;
- the planner: what a split block's recompute saves, traced at the real 720p x 121 token count (111,600 video
  tokens), is trace.py `chunk_mlps`'s count less the one chunk that backward recomputes at a time, and the full-size
  model's `act_block` falls by the traced bytes the regions stop holding."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_hunyuan_video15_attention import _inputs, _pair

from trainer.models import adapter_class
from trainer.models.hunyuan_video15_block import (
    HunyuanVideo15Transformer3DModel,
    HunyuanVideo15TransformerBlock,
    use_token_regions,
)
from trainer.offload import CompileOptions, attach_offload, compiled
from trainer.offload.nano import NanoBatched, split_mlps
from trainer.planner import trace as ptrace

FAMILY = "hunyuan-video-1.5"
HV = adapter_class(FAMILY)
#: batch 1 with padded text; batch 2 of different caption lengths
CASES = {"batch 1": ([13], [4], False), "batch 2, different lengths": ([13, 5], [0, 6], False)}


@pytest.fixture(autouse=True)
def _fresh_compile_cache():
    compiled.reset()
    yield
    compiled.reset()


def _ours():
    """(diffusers' tiny transformer with the prefix processor, the same weights as this family's blocks)."""
    _, prefix = _pair()
    ours = copy.deepcopy(prefix)
    use_token_regions(ours)
    return prefix, ours


def _run(m, case: str, nano: int | None = None, compile=None):
    """Output, the latents' gradient and every LoRA gradient of one forward and backward; `nano`: through the
    offload handle (resident, checkpointed) with the blocks' regions in that many chunks."""
    h = None
    if nano is not None:
        h = attach_offload(list(m.transformer_blocks), "cpu", 0.0, checkpointing=True, nano_batches=nano,
                           nano_mlps=HV.token_wise_of, compile=compile)
    try:
        kw = _inputs(*CASES[case])
        x = kw["hidden_states"].requires_grad_(True)
        out = m(**kw)[0]
        out.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        m.zero_grad(set_to_none=True)
        split = sum(isinstance(s, NanoBatched) for s in m.modules())
    finally:
        if h is not None:
            h.close()
    return out.detach(), x.grad, grads, split


@pytest.mark.parametrize("case", list(CASES))
def test_unsplit_block_is_diffusers_block_bitwise(case):
    prefix, ours = _ours()
    assert {type(b) for b in ours.transformer_blocks} == {HunyuanVideo15TransformerBlock}
    assert ours.state_dict().keys() == prefix.state_dict().keys()  # the regions hold no weights
    want, got = _run(prefix, case), _run(ours, case)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2].keys() == want[2].keys() and len(got[2]) > 8
    for k in want[2]:
        assert torch.equal(got[2][k], want[2][k]), k


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_block_equals_unchunked(case):
    """24 video tokens in 4 chunks of 6 (the last block's text-only LoRAs get no gradient)."""
    _, ours = _ours()
    whole, split = _run(ours, case, 1), _run(ours, case, 4)
    assert whole[3] == 0 and split[3] == 3 * len(ours.transformer_blocks)  # token_pre, token_post, ff_context
    assert torch.equal(split[0], whole[0]) and torch.equal(split[1], whole[1])
    assert split[2].keys() == whole[2].keys()
    differ = []
    for k, want in whole[2].items():
        got = split[2][k]
        if not torch.equal(got, want):
            differ.append(k)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * want.abs().max().item())
    # the video stream's projections are split (a weight gradient summed per chunk); the text stream's are whole
    assert differ and all(".to_q." in k or ".to_k." in k or ".to_v." in k or ".to_out." in k for k in differ)


def test_compiled_chunks_equal_eager_chunks():
    """Compiled (aot_eager) blocks trace the regions' chunks as activation-checkpoint regions: the eager chunked
    block's output and gradients."""
    _, ours = _ours()
    eager = _run(ours, "batch 1", 4)
    fast = _run(ours, "batch 1", 4, CompileOptions(backend="aot_eager"))
    assert compiled.stats()["graphs"] >= 1
    torch.testing.assert_close(fast[0], eager[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fast[1], eager[1], rtol=1e-6, atol=1e-7)
    for k, want in eager[2].items():
        torch.testing.assert_close(fast[2][k], want, rtol=0, atol=1e-6 * want.abs().max().item())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from trainer.models.tiny import make_tiny_models

    root = tmp_path_factory.mktemp("tiny-hv15-block")
    make_tiny_models(root, [FAMILY])
    return root


def test_fit_with_token_chunks_trains_as_without(models, tmp_path, monkeypatch):
    """`dittrain fit`'s Trainer at offload.nano_batches 4 and 1 (the tiny model's 64 px stills: 16 video tokens,
    4 chunks of 4): the first loss bitwise, the rest within fp32 reassociation of the split LoRA gradients."""
    from test_train_support import losses, make_config, write_images

    from trainer.offload import nano
    from trainer.train.trainer import Trainer

    images = write_images(tmp_path / "images")
    monkeypatch.setattr(Trainer, "_can_stream", lambda self: True)  # the offload handle on the CPU
    chunked, plain = [], nano.checkpoint

    def counted(run, *a, **kw):  # each chunk's checkpoint, by its region's class
        chunked.append(type(run.__self__).__name__)
        return plain(run, *a, **kw)

    monkeypatch.setattr(nano, "checkpoint", counted)
    runs = {}
    for n in (1, 4):
        cfg = make_config(models, images, tmp_path / f"n{n}", tmp_path / "cache", FAMILY,
                          train={"steps": 3, "device": "cpu"}, optimizer={"lr": 1e-2},
                          offload={"transformer": 0.0, "nano_batches": n})
        Trainer(cfg).fit()
        runs[n] = losses(tmp_path / f"n{n}")
        # every block's two regions and its text feed-forward run in chunks
        assert set(chunked) == (set() if n == 1 else {
            "NanoBatchedTokenPre", "NanoBatchedTokenPost", "NanoBatchedFeedForward"})
        if n > 1:  # 4 chunks of the 16 video tokens, 2 blocks, 3 steps, in forward and in the recompute
            assert chunked.count("NanoBatchedTokenPre") == 4 * 2 * 3 * 2
    assert len(runs[1]) == 3 and all(np.isfinite(runs[1]))
    assert runs[4][0] == runs[1][0]
    np.testing.assert_allclose(runs[4], runs[1], rtol=1e-5)


def _narrow():
    """Two narrow blocks (2 heads of 16: the count is per tensor, the width only scales it) on the meta device."""
    with torch.device("meta"):
        m = HunyuanVideo15Transformer3DModel(
            in_channels=65, out_channels=32, num_attention_heads=2, attention_head_dim=16, num_layers=2,
            num_refiner_layers=1, mlp_ratio=4.0, text_embed_dim=32, text_embed_2_dim=32, image_embed_dim=16,
            rope_axes_dim=(4, 6, 6), target_size=64, task_type="t2v")
    torch.nn.Module.to(m, torch.bfloat16)
    return m.requires_grad_(True)


def test_planner_counts_what_a_chunked_block_saves_at_720p_x_121():
    """At the 720p x 121 bucket's 111,600 video tokens (31 latent frames of 60 x 60) and the 1985 text tokens: the
    regions hold most of what a block's recompute saves; with the split installed the traced block saves
    `chunk_mlps`'s count less one chunk of them (which the planner keeps in backward's working set)."""
    n = 16
    plain = _narrow()
    x = ptrace.forward_inputs(FAMILY, plain, 1, 960, 960, HV.text_tokens, torch.bfloat16, frames=121)
    assert x["hidden_states"][0, 0].numel() == 111_600
    tr = ptrace.trace_forward(plain, list(plain.transformer_blocks), x,
                              mlps=[HV.token_wise_of(b) for b in plain.transformer_blocks])
    planned = ptrace.chunk_mlps(tr, n)
    split = _narrow()
    for b in split.transformer_blocks:
        split_mlps(b, n, HV.token_wise_of(b))
    real = ptrace.trace_forward(split, list(split.transformer_blocks), x)
    for i in range(2):
        assert tr.block_mlp_saved[i] > 0.75 * tr.block_saved[i]
        chunk = -(-tr.block_mlp_saved[i] // n)
        assert real.block_saved[i] == planned.block_saved[i] - chunk - tr.block_mlp_other[i]
        assert planned.block_largest[i] == tr.block_largest_outside_mlp[i] < tr.block_largest[i]


def test_plan_at_720p_x_121_counts_the_regions():
    """The full-size model's LoRA at 720p x 121, every block streamed, activations offloaded: with 16 chunks the
    block's working set (saved + 2 x inputs + the larger of 2 x largest and the attention's backward, prediction.py)
    is the chunked trace's. Eager blocks: the regions' saved bytes go but one chunk's, and the largest tensor is q
    (the feed-forward's 8192-wide GELU, 1.83 GB, was); the attention's backward (3.7 GB) is then the transient.
    Compiled blocks (train.compile): what the split compiled block keeps is counted on meta (compiled_saves.py
    `chunk_saving`; the prefix attention reads no mask there), not the eager fallback, and is less than the eager
    split block's."""
    from trainer.config import Config
    from trainer.planner import presets as P
    from trainer.planner.prediction import analyze, predict

    cfg = Config.model_validate(P._config(FAMILY, "lora", "720p", True, 1.0, True, "adamw", frames=121))
    facts = analyze(cfg)
    facts.checkpointing, facts.compiled, facts.compile_blocks, facts.frames = True, False, False, 121
    res = cfg.data.resolutions[0]
    assert facts.tokens(res) == 111_600

    def working_sets(tr):  # per block: the peak is at one of them (the first block's inputs are larger)
        return {s + max(2 * b, a) + 2 * (i - c) for s, b, i, a, c in zip(
            tr.block_saved, tr.block_largest, tr.block_inputs, tr.block_attn_bwd, tr.block_const_inputs, strict=True)}

    off = predict(facts, 1.0, res, True)
    tr = facts.trace(res)
    facts.nano_batches = 16
    on = predict(facts, 1.0, res, True)
    ch = facts.trace(res)
    assert off.act_block in working_sets(tr) and on.act_block in working_sets(ch)
    q = (111_600 + 1985) * 2048 * 2
    assert tr.block_largest[5] == 111_600 * 8192 * 2 and ch.block_largest[5] == q
    hidden = tr.block_mlp_saved[5] - -(-tr.block_mlp_saved[5] // 16)
    assert ch.block_saved[5] == tr.block_saved[5] - hidden
    assert tr.block_mlp_saved[5] > 0.75 * tr.block_saved[5]  # the regions hold most of the block's saves
    assert on.act_block < off.act_block / 2 and on.peak_reserved < off.peak_reserved - 9.5e9
    assert on.step_s > off.step_s  # the regions' matmuls once more in backward
    facts.compile_blocks = True
    fast = predict(facts, 1.0, res, True)
    assert "compiled chunks" in facts.trace(res).saved_by and "failed" not in facts.trace(res).saved_by
    assert fast.act_block < on.act_block < off.act_block / 2


def test_planned_working_set_holds_what_a_chunked_blocks_backward_holds_at_720p_x_121():
    """The narrow blocks at the 720p x 121 bucket's tokens, 16 chunks: one block checkpointed as the trainer runs
    it (forward, then the recompute and backward), every storage counted from the op that makes it until it goes
    (planner/vae.py `_LiveBytes`), with the attention kernels the GPU runs (flash, on meta). Its backward peaks
    inside the video queries' flash-attention backward: the joint q, k, v and output saved, the text queries'
    gradients of k and v (and of q, padded to the joint tensor by slicing's backward) still unsummed, and this
    call's dq, dk, dv, beside which CUDA's kernel keeps a float32 dq (not a tensor the mode sees: added here). The
    planner's working set (prediction.py: saved + 2 x inputs + the larger of 2 x largest and the attention's
    backward, trace.py `attention_backward`) covers it; 2 x largest alone, as before 2026-11-28 (the H200 run at
    720p x 121 measured 11.56 GB allocated where the plan said 10.37), falls short by a fifth."""
    from torch.utils._pytree import tree_flatten, tree_map
    from torch.utils.checkpoint import checkpoint

    from trainer.planner import compiled_saves as pcompiled
    from trainer.planner.vae import _LiveBytes

    n = 16
    m = _narrow()
    x = ptrace.forward_inputs(FAMILY, m, 1, 960, 960, HV.text_tokens, torch.bfloat16, frames=121)
    blocks = list(m.transformer_blocks)
    ch = ptrace.chunk_mlps(ptrace.trace_forward(m, blocks, x, mlps=[HV.token_wise_of(b) for b in blocks]), n)
    i, args, kwargs = ch.last_calls[type(blocks[0]).__name__]
    block = blocks[i]

    def alone(t):  # the block's inputs as leaves: backward stops at them
        return t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t

    args, kwargs = tree_map(alone, pcompiled._on_meta(args)), tree_map(alone, pcompiled._on_meta(kwargs))
    split_mlps(block, n, HV.token_wise_of(block))
    mode = _LiveBytes()
    with pcompiled._counting(m, "cuda"), mode:
        outs = [o for o in tree_flatten(checkpoint(block, *args, use_reentrant=False, **kwargs))[0]
                if isinstance(o, torch.Tensor) and o.requires_grad]
        grads = [torch.ones_like(o) for o in outs]  # the gradient coming in
        held = mode.peak = mode.now  # the outputs (the next block's inputs) and their gradients
        torch.autograd.backward(outs, grads)
    video = args[0].shape[1]
    assert mode.peak > held and video == 111_600
    accum = video * 32 * 4  # flash attention's float32 dq of the video queries (32 channels: 2 heads of 16)
    real = mode.peak - held + sum(g.numel() * g.element_size() for g in grads) + accum
    saved, big, inputs, attn = ch.block_saved[i], ch.block_largest[i], ch.block_inputs[i], ch.block_attn_bwd[i]
    planned = saved + max(2 * big, attn) + 2 * inputs
    assert real <= planned <= 1.25 * real
    assert saved + 2 * big + 2 * inputs < 0.8 * real
    q = (video + 1985) * 32 * 2  # one of the joint q, k, v (1985 text rows): both calls' gradients of each + the dq
    assert attn == 2 * 3 * q + accum
