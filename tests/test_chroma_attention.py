"""Chroma's attention mask in the training path (trainer/models/chroma.py, "Attention with the mask"): every
block attends with it (as the pipeline does, unlike diffusers' checkpointed forward), the compiled blocks make one
set of graphs per block class with no graph break, and `FlashMaskAttnProcessor` computes the masked attention
without handing SDPA a mask (flash-eligible) and with the same numbers."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn.functional as F
from diffusers import ChromaTransformer2DModel

from trainer.models.chroma import FlashMaskAttnProcessor, use_flash_mask
from trainer.offload import CompileOptions, attach_offload, compiled

TEXT, SIDE = 8, 4


def _chroma(layers=2, singles=3, head=16, seed=0):
    torch.manual_seed(seed)
    rope = {16: (4, 4, 8), 24: (8, 8, 8)}[head]
    m = ChromaTransformer2DModel(patch_size=1, in_channels=16, num_layers=layers, num_single_layers=singles,
                                 attention_head_dim=head, num_attention_heads=2, joint_attention_dim=32,
                                 axes_dims_rope=rope, approximator_num_channels=16, approximator_hidden_dim=32,
                                 approximator_layers=2)
    for p in m.parameters():  # diffusers zero-initialises some projections: real numbers everywhere
        p.data.normal_(0, 0.2)
    return m


def _inputs(dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    n = SIDE * SIDE
    ids = torch.zeros(n, 3)
    ids[:, 1], ids[:, 2] = torch.arange(n) // SIDE, torch.arange(n) % SIDE
    mask = torch.ones(1, TEXT + n, dtype=dtype)
    mask[:, 5:TEXT] = 0  # padded caption tokens, as ChromaAdapter.predict's mask
    return dict(hidden_states=torch.randn(1, n, 16, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(1, TEXT, 32, generator=g).to(dtype),
                timestep=torch.rand(1, generator=g).to(dtype), img_ids=ids, txt_ids=torch.zeros(TEXT, 3),
                attention_mask=mask, return_dict=False)


def _lora(m):
    from peft import LoraConfig

    m.requires_grad_(False)
    m.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_mlp"],
                             init_lora_weights=False))
    return m


def _blocks(m):
    return [*m.transformer_blocks, *m.single_transformer_blocks]


@pytest.fixture
def sdpa_masks(monkeypatch):
    """Every SDPA call's attention mask (None or its shape), in call order."""
    seen, orig = [], F.scaled_dot_product_attention

    def spy(*a, **kw):
        mask = a[3] if len(a) > 3 else kw.get("attn_mask")
        seen.append(None if mask is None else tuple(mask.shape))
        return orig(*a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


@pytest.fixture(autouse=True)
def _fresh_compile_cache():
    compiled.reset()
    yield
    compiled.reset()


@pytest.mark.parametrize("checkpointing", [True, False])
def test_every_block_attends_with_the_mask_unlike_diffusers_checkpointing(sdpa_masks, checkpointing):
    """The pipeline (no checkpointing) masks all blocks; dittrain's blocks do so with and without recompute.
    diffusers' checkpointed forward gives the single blocks no mask: the plain script's cheaper attention (if
    diffusers changes that, bench/RESULTS.md's Chroma note is stale)."""
    m = _lora(_chroma())
    n = len(_blocks(m))
    m(**_inputs())
    assert sdpa_masks == [(1, 1, TEXT + SIDE * SIDE, TEXT + SIDE * SIDE)] * n  # the pipeline's forward
    sdpa_masks.clear()
    h = attach_offload(_blocks(m), "cpu", 0.0, checkpointing=checkpointing)
    m(**_inputs())[0].square().mean().backward()
    h.close()
    assert len(sdpa_masks) == n * (2 if checkpointing else 1) and None not in sdpa_masks
    sdpa_masks.clear()
    m.enable_gradient_checkpointing()
    m(**_inputs())[0].square().mean().backward()
    assert sdpa_masks.count(None) == 2 * len(m.single_transformer_blocks)


@pytest.mark.parametrize("flash_mask", [False, True])
def test_compiled_chroma_makes_graphs_per_block_class_not_per_block(flash_mask):
    """No per-block recompile (each block gets its own slice of the modulation tensor) and no graph break, with
    diffusers' processor and with the flash-mask one; the blocks keep their activations (issue 29's `auto` row)."""
    from torch._dynamo.utils import counters

    m = _lora(_chroma(layers=3, singles=4))
    use_flash_mask(m, flash_mask)
    counters.clear()
    h = attach_offload(_blocks(m), "cpu", 0.0, checkpointing=False,
                       compile=CompileOptions(backend="aot_eager", shapes=2))
    for _ in range(2):
        m(**_inputs())[0].square().mean().backward()
    h.close()
    graphs = compiled.stats()["graphs"]
    assert 2 <= graphs <= 4 < len(_blocks(m)), graphs  # two classes, at most two variants each
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


@pytest.mark.parametrize(("head", "dtype", "tol"), [(16, torch.float32, 0.0), (24, torch.float32, 1e-5),
                                                    (16, torch.bfloat16, 0.0)])
def test_flash_mask_processor_matches_the_masked_attention(sdpa_masks, head, dtype, tol):
    """Forward and LoRA gradients as diffusers' processor with the mask; SDPA gets no mask and a head dimension
    that is a multiple of 8 (what flash attention needs). Head 16: sqrt(d) = 4 is exact, so are the numbers; head
    24: the key column's sqrt(24) rounds, within `tol`."""
    ref = _lora(_chroma(head=head)).to(dtype)
    fast = copy.deepcopy(ref)
    use_flash_mask(fast)
    assert all(isinstance(b.attn.processor, FlashMaskAttnProcessor) for b in _blocks(fast))
    outs, grads = [], []
    for m in (ref, fast):
        sdpa_masks.clear()
        out = m(**_inputs(dtype))[0]
        out.float().square().mean().backward()
        outs.append(out.float())
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.requires_grad]).float())
    assert collections.Counter(sdpa_masks) == collections.Counter({None: len(_blocks(fast))})
    assert outs[0].abs().max() > 0 and grads[0].abs().max() > 0
    torch.testing.assert_close(outs[1], outs[0], rtol=tol, atol=tol * outs[0].abs().max().item())
    torch.testing.assert_close(grads[1], grads[0], rtol=tol, atol=tol * grads[0].abs().max().item())
    # no mask: exactly diffusers' processor; the mask changes the result (the test above could fail)
    kw = {k: v for k, v in _inputs(dtype).items() if k != "attention_mask"}
    with torch.no_grad():
        assert torch.equal(fast(**kw)[0], ref(**kw)[0])
        assert not torch.equal(ref(**kw)[0], ref(**_inputs(dtype))[0])
    use_flash_mask(fast, False)
    assert not any(isinstance(b.attn.processor, FlashMaskAttnProcessor) for b in _blocks(fast))


def test_attention_mask_bench_smoke(tmp_path):
    """bench/attn_mask_speed.py (the GPU micro-benchmark of the forms above) runs on the CPU."""
    from test_train_support import bench_module

    mod = bench_module("attn_mask_speed")
    rows = mod.main(["--smoke", "--out", str(tmp_path)])
    assert [r["name"] for r in rows] == ["sdpa, (B,1,S,S) mask", "sdpa, no mask", "flash mask (head dim 24)"]
    assert rows[2]["max_diff_vs_masked"] == 0.0 and rows[1]["max_diff_vs_masked"] > 0  # the mask matters
    assert (tmp_path / "attn_mask_speed.md").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_mask_runs_on_flash_attention_where_the_mask_cannot():
    """At Chroma's head width (128) in bf16: the masked SDPA call is refused by flash attention; the flash-mask
    form runs forward and backward on flash alone and agrees with the masked call (the key column's sqrt(128)
    rounds in bf16: a bias of 0.99989 for 1)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trainer.models.chroma import attend_outer_mask

    torch.backends.cuda.enable_cudnn_sdp(False)
    s, h, d = 512 + 256, 4, 128
    q, k, v = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    m = torch.ones(1, s, device="cuda", dtype=torch.bfloat16)
    m[:, 81:512] = 0
    mask = m[:, None, None, :] * m[:, None, :, None]

    def run(fn):
        xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*xs)
        out.float().square().sum().backward()
        return [out.float(), *[x.grad.float() for x in xs]]

    def masked(a, b, c):
        return F.scaled_dot_product_attention(a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2),
                                              attn_mask=mask).transpose(1, 2)

    want = run(masked)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        with pytest.raises(RuntimeError):
            run(masked)
        got = run(lambda a, b, c: attend_outer_mask(a, b, c, m))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0.02, atol=0.02 * w.abs().max().item())


def test_train_attention_flash_trains_chroma_through_the_flash_mask_form(tiny_models, tmp_path):
    """`train.attention: flash` on Chroma: the trainer's transformer attends through FlashMaskAttnProcessor (the
    numbers are those of the masked attention: the test above)."""
    import json

    import numpy as np
    from test_train_support import make_config, write_images

    from trainer.train.trainer import Trainer

    cfg = make_config(tiny_models, write_images(tmp_path / "images"), tmp_path / "out", tmp_path / "cache", "chroma",
                      train={"steps": 1, "device": "cpu", "attention": "flash"})
    t = Trainer(cfg)
    t.fit()
    assert {type(b.attn.processor).__name__ for b in t.adapter.blocks(t.transformer)} == {"FlashMaskAttnProcessor"}
    assert np.isfinite(json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])["loss"])
