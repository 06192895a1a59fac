"""Chroma's attention mask in the training path (trainer/models/chroma.py, "Attention with the mask"): every
block attends with it (as the pipeline does, unlike diffusers' checkpointed forward), the compiled blocks make one
set of graphs per block class with no graph break, `FlashMaskAttnProcessor` computes the masked attention
without handing SDPA a mask (flash-eligible) and `FlexMaskAttnProcessor` through flex attention, both with the
same numbers. Torch has no flex backward on the CPU: the tests that need one lift its device check
(`flex_cpu_backward`), so flex's unfused reference runs forward and backward here."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn.functional as F
from diffusers import ChromaTransformer2DModel

from trainer.models.chroma import (
    FlashMaskAttnProcessor,
    FlexMaskAttnProcessor,
    use_mask_attention,
)
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
def flex_cpu_backward(monkeypatch):
    """flex_attention refuses CPU inputs that need a gradient (no CPU backward kernel); without that check its
    unfused reference (the dense math torch checks its GPU kernels against) runs both ways."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)


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


@pytest.mark.parametrize("form", [None, "flash", "flex"])
def test_compiled_chroma_makes_graphs_per_block_class_not_per_block(request, form):
    """No per-block recompile (each block gets its own slice of the modulation tensor) and no graph break, with
    diffusers' processor, the flash-mask one and the flex one; the blocks keep their activations (issue 29's
    `auto` row)."""
    from torch._dynamo.utils import counters

    if form == "flex":
        request.getfixturevalue("flex_cpu_backward")
    m = _lora(_chroma(layers=3, singles=4))
    use_mask_attention(m, form)
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
    use_mask_attention(fast, "flash")
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
    use_mask_attention(fast, None)
    assert not any(isinstance(b.attn.processor, FlashMaskAttnProcessor) for b in _blocks(fast))


def test_attention_mask_bench_smoke(tmp_path):
    """bench/speed/attn_mask_speed.py (the GPU micro-benchmark of the forms above) runs on the CPU."""
    from test_train_support import bench_module

    mod = bench_module("attn_mask_speed")
    rows = mod.main(["--smoke", "--out", str(tmp_path)])
    assert [r["name"] for r in rows] == ["sdpa, (B,1,S,S) mask", "sdpa, no mask", "flash mask (head dim 24)"]
    assert rows[2]["max_diff_vs_masked"] == 0.0 and rows[1]["max_diff_vs_masked"] > 0  # the mask matters
    assert (tmp_path / "attn_mask_speed.md").exists()


def _cuda_attention_case():
    """q, k, v of Chroma's head width (128) in bf16 on CUDA, the token mask m (text tokens 81-511 padded), its
    outer-product SDPA mask, and `run(fn)`: fn's output and input gradients in fp32."""
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

    return m, mask, run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_mask_runs_on_flash_attention_where_the_mask_cannot():
    """At Chroma's head width (128) in bf16: the masked SDPA call is refused by flash attention; the flash-mask
    form runs forward and backward on flash alone and agrees with the masked call (the key column's sqrt(128)
    rounds in bf16: a bias of 0.99989 for 1)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trainer.models.chroma import attend_outer_mask

    torch.backends.cuda.enable_cudnn_sdp(False)
    m, mask, run = _cuda_attention_case()

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


# ---------------------------------------------------------------------------------------------- flex attention


def _fit_and_grads(m, dtype, mask=True):
    kw = _inputs(dtype) if mask else {k: v for k, v in _inputs(dtype).items() if k != "attention_mask"}
    out = m(**kw)[0]
    out.float().square().mean().backward()
    grads = torch.cat([p.grad.flatten() for p in m.parameters() if p.requires_grad]).float()
    return out.detach().float(), grads


@pytest.mark.parametrize(("dtype", "tol", "compile"), [(torch.float32, 1e-5, False), (torch.bfloat16, 0.03, False),
                                                       (torch.float32, 1e-5, True)])
def test_flex_mask_processor_matches_the_masked_attention(sdpa_masks, flex_cpu_backward, dtype, tol, compile):
    """Forward and LoRA gradients as diffusers' processor with the (float, added) mask, with several caption
    tokens padded; no SDPA call at all. Eager, and inside compiled, recomputed blocks (where flex is traced with
    the block, as train.compile has it on the GPU). bf16: both round differently, within `tol`."""
    ref = _lora(_chroma()).to(dtype)
    fast = copy.deepcopy(ref)
    use_mask_attention(fast, "flex")
    assert all(isinstance(b.attn.processor, FlexMaskAttnProcessor) for b in _blocks(fast))
    want = _fit_and_grads(ref, dtype)
    sdpa_masks.clear()
    h = attach_offload(_blocks(fast), "cpu", 0.0, checkpointing=True,
                       compile=CompileOptions(backend="aot_eager")) if compile else None
    got = _fit_and_grads(fast, dtype)
    if h is not None:
        h.close()
    assert sdpa_masks == []
    for g, w in zip(got, want, strict=True):
        assert w.abs().max() > 0
        torch.testing.assert_close(g, w, rtol=tol, atol=tol * w.abs().max().item())


def test_flex_mask_processor_without_a_float_mask_is_diffusers_processor():
    """No mask: diffusers' processor, the same numbers exactly. A boolean mask (SDPA excludes pairs rather than
    adding 1; Chroma's predict never makes one) goes to SDPA too; the float mask changes the result."""
    ref = _chroma()
    fast = copy.deepcopy(ref)
    use_mask_attention(fast, "flex")
    kw = {k: v for k, v in _inputs().items() if k != "attention_mask"}
    boolean = {**_inputs(), "attention_mask": _inputs()["attention_mask"].bool()}
    with torch.no_grad():
        assert torch.equal(fast(**kw)[0], ref(**kw)[0])
        torch.testing.assert_close(fast(**boolean)[0], ref(**boolean)[0], rtol=0, atol=0, equal_nan=True)
        assert not torch.equal(fast(**_inputs())[0], fast(**kw)[0])
    use_mask_attention(fast, None)
    assert not any(isinstance(b.attn.processor, FlexMaskAttnProcessor) for b in _blocks(fast))


def test_compiled_flex_forward_on_the_cpu_matches_and_compiles_once():
    """The score_mod as inductor compiles it (forward only: the CPU has no compiled flex backward), against
    masked SDPA; a second mask is a new input of the same graph, not a recompile.

    32 tokens, not 24: torch 2.13's C++ flex kernel computes a wrong row (NaN, zeros or other garbage, varying
    per process) on AVX2 CPUs when the key length is 8 more than a multiple of 16, with or without a score_mod,
    whatever the thread count or cache. Its q k^T micro-GEMM takes the 8-column tail as a full 16-column block:
    it reads past the keys and writes past the scores into the row maxima. AVX-512 (16 lanes: the tail takes the
    other path) does not meet it; dittrain compiles flex only on CUDA (triton), so no user meets it either."""
    from torch._dynamo.utils import counters

    from trainer.models.chroma import attend_flex

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 32, 2, 16, generator=g) for _ in range(3))
    counters.clear()
    for pad in (slice(5, 8), slice(3, 8)):
        m = torch.ones(1, 32)
        m[:, pad] = 0
        mask = m[:, None, None, :] * m[:, None, :, None]
        want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask).transpose(1, 2)
        with torch.no_grad():
            got = attend_flex(q, k, v, m, compiled=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_train_attention_flex_is_chromas_and_cuda_only(tmp_path):
    """The config takes `flex`; the trainer refuses it in one line, before anything loads, for a family that
    does not compute it, and for Chroma off CUDA (torch has no CPU flex backward). Chroma on CUDA is let through."""
    from test_train_support import make_config

    from trainer.errors import UserError
    from trainer.models import get_adapter
    from trainer.train.trainer import Trainer, check_attention

    for family, match in (("flux", r"train.attention: flex is chroma's own attention; model.family flux takes auto, "
                                    r"flash, efficient or math"),
                          ("chroma", r"train.attention: flex trains on CUDA only")):
        cfg = make_config(tmp_path / "models", tmp_path / "images", tmp_path / family, tmp_path / "cache", family,
                          train={"steps": 1, "device": "cpu", "attention": "flex"})
        with pytest.raises(UserError, match=match) as e:
            Trainer(cfg).fit()
        assert "\n" not in str(e.value)
    chroma = get_adapter(cfg.model)
    check_attention(chroma, "flex", torch.device("cuda"))
    check_attention(chroma, "flash", torch.device("cpu"))
    check_attention(get_adapter(make_config(tmp_path, tmp_path, tmp_path, tmp_path, "flux").model), "flash",
                    torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flex_mask_matches_the_masked_sdpa_on_cuda():
    """At Chroma's head width (128) in bf16, outside any compiled block (the module-level compiled flex): forward
    and input gradients as the masked SDPA call."""
    from trainer.models.chroma import attend_flex

    m, mask, run = _cuda_attention_case()

    want = run(lambda a, b, c: F.scaled_dot_product_attention(
        a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), attn_mask=mask).transpose(1, 2))
    got = run(lambda a, b, c: attend_flex(a, b, c, m))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0.02, atol=0.02 * w.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flex_mask_processor_in_inductor_compiled_blocks_on_cuda():
    """The trainer's path on the GPU: the flex processor inside blocks compiled by inductor (flex compiled with
    the block), recomputed in backward; forward and LoRA gradients as diffusers' masked processor, eager."""
    ref = _lora(_chroma()).cuda()
    fast = copy.deepcopy(ref)
    use_mask_attention(fast, "flex")

    def cuda(kw):
        return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}

    outs = []
    for m, compile in ((ref, False), (fast, CompileOptions())):
        h = attach_offload(_blocks(m), "cuda", 0.0, checkpointing=True, compile=compile)
        out = m(**cuda(_inputs()))[0]
        out.square().mean().backward()
        h.close()
        outs.append([out.detach(), torch.cat([p.grad.flatten() for p in m.parameters() if p.requires_grad])])
    for g, w in zip(outs[1], outs[0], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-3 * w.abs().max().item())


def test_auto_trains_with_flex_on_cuda_and_the_masked_sdpa_elsewhere(tmp_path, monkeypatch):
    """`train.attention: auto` for Chroma: flex attention where training runs on CUDA of compute capability 8.0
    and up (the fastest whole step on the GPU: bench/history/2026-11-26.md 2026-11-26), diffusers' masked SDPA on older
    CUDA devices and on the CPU (no flex backward there), with a line naming the form; the explicit choices set
    their own processors, and the SDPA backends set none."""
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
    from test_train_support import make_config

    from trainer.models import get_adapter
    from trainer.models.chroma import FlashMaskAttnProcessor, FlexMaskAttnProcessor

    chroma = get_adapter(make_config(tmp_path, tmp_path, tmp_path, tmp_path, "chroma").model)
    m = _chroma()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    for choice, device, want, line in (("auto", cuda, FlexMaskAttnProcessor, "flex attention"),
                                       ("auto", cpu, FluxAttnProcessor, None),
                                       ("flash", cpu, FlashMaskAttnProcessor, "flash attention"),
                                       ("flex", cuda, FlexMaskAttnProcessor, "flex attention"),
                                       ("efficient", cuda, FluxAttnProcessor, None)):
        said = chroma.use_attention(m, choice, device)  # sets processors only: nothing moves to the device
        assert {type(b.attn.processor) for b in _blocks(m)} == {want}, (choice, device)
        assert (said is None) == (line is None) and (line is None or line in said), said
        assert said is None or f"train.attention: {choice}" in said
    capability[0] = (7, 5)  # Turing: torch's flex backward falls back to 16 x 16 tiles there
    assert chroma.use_attention(m, "auto", cuda) is None
    assert {type(b.attn.processor) for b in _blocks(m)} == {FluxAttnProcessor}
    assert chroma.use_attention(m, "flex", cuda) is not None  # asked for: still set
    flux = get_adapter(make_config(tmp_path, tmp_path, tmp_path, tmp_path, "flux").model)
    assert flux.use_attention(m, "auto", cuda) is None
