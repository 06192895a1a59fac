"""LTX-2 image-to-video's training step holds what text-to-video's does and the per-token modulations: `predict`
gives the transformer a timestep per token (the first frame's at 0), so its timestep embedding (6 x 4096 a token),
the audio-video cross-attention's scale-shift (4 x 4096) and gate (4096) are made per token once a step, taken by
every block and held through backward, and each block saves per-token modulation tensors for its recompute. On an
H200 (2026-11-28, 16 GB preset settings at 832x480 x 121 with sound) the I2V step peaked at 7.90 GB allocated
against text-to-video's 6.78, where the planner, tracing text-to-video's (B,) timestep for both, predicted 9.47 GB
reserved for each. These tests: the planner traces the call `predict` makes (tiny model, real CPU tensors against
meta), and at full size it counts the difference once, in training (no gradient reaches those tensors) and in a
sample's forward."""

from __future__ import annotations

import pytest
import torch

from trainer import planner
from trainer.config import Config
from trainer.models import get_adapter
from trainer.planner import trace as ptrace

FAMILY = "ltx2-i2v"
GB = 1e9


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from trainer.models.tiny import make_tiny_models

    root = tmp_path_factory.mktemp("tiny-ltx2-i2v")
    make_tiny_models(root, [FAMILY])
    return root


def _cfg(path, family: str, **extra) -> Config:
    data = {
        "model": {"family": family, "path": str(path), "dtype": "fp32"},
        "train": {"method": "lora"},
        "lora": {"rank": 4, "alpha": 4},
        "data": {"sources": [{"path": "unused"}], "resolutions": [64]},
        "output": {"dir": "unused"},
    }
    for section, values in extra.items():
        data[section] = {**data.get(section, {}), **values}
    return Config.model_validate(data)


def test_the_planner_traces_the_call_predict_makes(root):
    """The meta trace of the family's `dummy_inputs` saves and holds, block by block, what the tiny model saves
    and holds on the CPU when it runs the call `predict` makes (a per-token timestep); text-to-video's (B,)
    timestep, which the planner traced for I2V until 2026-11-28, holds less in the first block."""
    from trainer.train.model import add_lora

    cfg = _cfg(root / FAMILY, FAMILY)
    facts = planner.analyze(cfg)
    adapter = get_adapter(cfg.model)
    model = ptrace.transformer_class(FAMILY).from_pretrained(root / FAMILY / "transformer", torch_dtype=torch.float32)
    torch.manual_seed(0)
    add_lora(model, cfg, ptrace.default_lora_targets(FAMILY))
    c, b, grid, text_tokens = model.config, 2, (2, 2, 2), 8
    calls = []
    model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw), with_kwargs=True)
    text = {"prompt_embeds": torch.randn(b, text_tokens, c.caption_channels),
            "prompt_attention_mask": torch.ones(b, text_tokens, dtype=torch.long),
            "image_latents": torch.randn(b, c.in_channels, 1, *grid[1:])}
    adapter.predict(model, torch.randn(b, c.in_channels, *grid), torch.rand(b), text)
    (call,) = calls
    assert call["timestep"].shape == (b, grid[0] * grid[1] * grid[2])  # per token
    call = {k: v for k, v in call.items() if k != "return_dict"}
    real = ptrace.trace_forward(model, adapter.blocks(model), call, kernels="real")

    size = grid[1] * adapter.latent_scale
    frames = (grid[0] - 1) * adapter.frame_step + 1
    meta_in = ptrace.forward_inputs(FAMILY, facts.model, b, size, size, text_tokens, torch.float32, frames=frames)
    meta = ptrace.trace_forward(facts.model, facts.blocks, meta_in, kernels="cpu")
    assert (meta.block_inputs, meta.block_saved, meta.block_shared_inputs, meta.block_const_inputs) == (
        real.block_inputs, real.block_saved, real.block_shared_inputs, real.block_const_inputs)
    assert real.block_const_inputs == real.block_shared_inputs  # LoRA: no gradient reaches them
    assert real.block_const_inputs[0] > 0 and not any(real.block_const_inputs[1:])

    t2v = ptrace.forward_inputs("ltx2", facts.model, b, size, size, text_tokens, torch.float32, frames=frames)
    assert ptrace.trace_forward(facts.model, facts.blocks, t2v, kernels="cpu").block_inputs[0] < real.block_inputs[0]


def _full_size(family: str) -> planner.Facts:
    """The 16 GB preset's settings as measured (fp8 base, activation offloading), 480p x 121, on the meta device."""
    return planner.analyze(_cfg(f"/nonexistent/{family}", family, model={"dtype": "bf16", "quantize": "fp8"},
                                data={"resolutions": [632], "clip_frames": 121, "bucket_step": 32},
                                offload={"transformer": 0.9, "activations": True},
                                lora={"rank": 16, "alpha": 16}))


def test_full_size_i2v_step_counts_its_per_token_modulations_once():
    """At 480p x 121 (the planner's 640x640 bucket: 16 x 20 x 20 = 6400 tokens) the I2V step's first block takes
    the per-token timestep embedding, cross-attention scale-shift and gate (11 x 4096 bf16 values a token, 0.58 GB;
    text-to-video's are one row each), which no gradient reaches: the planner holds them once, and its
    allocated training step exceeds text-to-video's by about what the H200 measured (+1.13 GB at 832x480's 6240
    tokens). Counted twice more in the working set (before `Trace.block_const_inputs`) it was +2.16 GB."""
    t2v, i2v = _full_size("ltx2"), _full_size(FAMILY)
    res = 632
    tokens = i2v.tokens(res)
    assert tokens == 6400
    a, b = t2v.trace(res), i2v.trace(res)
    per_token = (tokens - 1) * 11 * 4096 * 2
    assert b.block_inputs[0] - a.block_inputs[0] == per_token
    assert b.block_const_inputs[0] - a.block_const_inputs[0] == per_token
    p, q = planner.predict(t2v, 0.9, res, True), planner.predict(i2v, 0.9, res, True)
    more = q.peak_allocated - p.peak_allocated
    assert per_token < more < 1.35 * GB, more / GB
    # a sample's forward (no gradient; the pipeline's batch of two) holds them once for the call, beside one
    # block's input and output and its larger per-token modulation tensor (0.1 GB more, made twice)
    s, u = planner.predict_sampling(t2v, 0.9, res, batch=2), planner.predict_sampling(i2v, 0.9, res, batch=2)
    held = (u.peak_reserved - s.peak_reserved) / planner.ALLOCATOR_OVERHEAD / 2
    assert per_token < held < per_token + 0.3 * GB, held / GB
