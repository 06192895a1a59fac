"""The conductor on a CUDA GPU: exactness against the resident path, the race detector, activation offloading,
pinned bytes and no cudaMalloc in the steady state. Marked `gpu` (CI skips them); run with `make test-gpu`.

"Resident" is the same code with fraction 0 (same per-block checkpointing and graph), so fp32 must agree
bit for bit; runs use the math attention kernel, whose backward has no atomics."""

import os

import pytest
import torch
from _offload_util import (
    add_lora,
    all_state,
    batch,
    blocks_of,
    fused_adamw,
    place_non_blocks,
    tiny_flux,
    train_steps,
    trainable_state,
)

from trainer.offload import attach_offload

DEV = os.environ.get("OFFLOAD_TEST_DEVICE", "cuda")  # "cpu": dry run of these tests' own code
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


STEPS = 5
SIDE, TEXT = int(os.environ.get("OFFLOAD_TEST_SIDE", 32)), 64  # 1024 image tokens, 64 text tokens
SIZE = dict(layers=2, singles=4, dim_head=64, heads=4)


# cuDNN attention fails in backward on these machines (GPU.md); set at import so that module-scoped fixtures
# (which pytest sets up before function-scoped autouse ones) run without it too.
torch.backends.cuda.enable_cudnn_sdp(False)


def _kernel(dtype):
    """The math attention kernel: flash / memory-efficient backward accumulate with atomics, so two resident
    runs differ too; the comparison is about offloading, not attention kernels."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _run(fraction, dtype, method, steps=STEPS, **kw):
    m = tiny_flux(0, dtype=dtype, **SIZE)
    blocks = blocks_of(m)
    if method == "lora":
        add_lora(m)
        for p in m.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    place_non_blocks(m, blocks, DEV)  # non-block modules are the caller's
    trainable = method == "full"
    if trainable:
        m.requires_grad_(True)
    h = attach_offload(
        blocks,
        DEV,
        fraction,
        trainable=trainable,
        optimizer_state=("exp_avg", "exp_avg_sq") if trainable else (),
        **kw,
    )
    if trainable:
        fused_adamw(m, handle=h, lr=1e-3)
    with _kernel(dtype):
        losses = train_steps(
            m,
            steps,
            lr=1e-3,
            device=DEV,
            dtype=dtype,
            fused=True if trainable else None,
            side=SIDE,
            text=TEXT,
        )
    _sync()
    stats = h.stats()
    h.close()
    state = all_state(m) if trainable else trainable_state(m)
    return losses, state, stats


@pytest.fixture(scope="module")
def references():
    return {
        (dt, me): _run(0.0, dt, me)[:2] for dt in (torch.float32, torch.bfloat16) for me in ("lora", "full")
    }


@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_fp32_offloaded_training_is_identical(references, method, fraction):
    l0, s0 = references[(torch.float32, method)]
    l1, s1, st = _run(fraction, torch.float32, method)
    assert st["h2d_bytes_per_step"] > 0
    assert torch.equal(l0, l1), (l0, l1)
    assert all(torch.equal(s0[k], s1[k]) for k in s0)


@pytest.mark.parametrize("method", ["lora", "full"])
def test_bf16_offloaded_training_within_1e3(references, method):
    l0, s0 = references[(torch.bfloat16, method)]
    l1, s1, _ = _run(0.5, torch.bfloat16, method)
    assert ((l1 - l0).abs() / l0.abs()).max() <= 1e-3, (l0, l1)
    for k in s0:
        rel = (s1[k] - s0[k]).norm() / s0[k].norm().clamp_min(1e-12)
        assert rel <= 1e-3, (k, rel)


def test_race_detector_leaves_results_unchanged(references):
    l0, s0 = references[(torch.float32, "lora")]
    l1, s1, _ = _run(1.0, torch.float32, "lora", race_detector=True)
    assert torch.equal(l0, l1)
    assert all(torch.equal(s0[k], s1[k]) for k in s0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compile", [False, True])
def test_streamed_blocks_that_keep_their_activations_train_bitwise_resident(dtype, compile):
    """Nothing recomputed, every block streamed on the copy stream, eager and inductor-compiled: the saved weight
    views resolve to where each block is loaded for its backward (conductor `saved_weights`), so the run is
    bitwise the resident one that keeps its activations too (race detector on: a stale view reads NaN)."""
    from trainer.offload import CompileOptions, compiled

    opts = CompileOptions(backend="inductor", shapes=4) if compile else False
    compiled.reset()
    l0, s0, _ = _run(0.0, dtype, "lora", steps=3, checkpointing=False, compile=opts)
    l1, s1, st = _run(1.0, dtype, "lora", steps=3, checkpointing=False, compile=opts, race_detector=True)
    compiled.reset()
    assert st["h2d_bytes_per_step"] > 0 and torch.isfinite(l1).all()
    assert torch.equal(l0, l1), (l0, l1)
    assert all(torch.equal(s0[k], s1[k]) for k in s0)


def test_race_detector_catches_release_after_recompute():
    m = add_lora(tiny_flux(0, **SIZE)).to(DEV)
    attach_offload(blocks_of(m), DEV, 1.0, race_detector=True, _release_at_recompute=True)
    with _kernel(torch.float32):
        losses = train_steps(m, 3, device=DEV, side=SIDE, text=TEXT)
    assert not torch.isfinite(losses).all()


def test_activation_offloading_gives_equal_gradients():
    def grads(activations):
        m = add_lora(tiny_flux(0, **SIZE)).to(DEV)
        h = attach_offload(blocks_of(m), DEV, 0.5, activations=activations, activation_min_bytes=0)
        kw, target = batch(3, device=DEV, side=SIDE, text=TEXT)
        with _kernel(torch.float32):
            torch.nn.functional.mse_loss(m(**kw)[0], target).backward()
        _sync()
        out = {n: p.grad.detach().cpu() for n, p in m.named_parameters() if p.requires_grad}
        moved = h._c.activations.offloaded_bytes if activations else 0
        h.close()
        return out, moved

    g0, _ = grads(False)
    g1, moved = grads(True)
    assert moved > 0
    assert all(torch.equal(g0[k], g1[k]) for k in g0)


def test_pinned_bytes_and_no_cuda_malloc_in_steady_state():
    m = add_lora(tiny_flux(0, dtype=torch.bfloat16, **SIZE)).to(DEV)
    for p in m.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    h = attach_offload(blocks_of(m), DEV, 1.0, activations=True)
    train_steps(m, 3, device=DEV, dtype=torch.bfloat16, side=SIDE, text=TEXT)
    _sync()
    before = torch.cuda.memory_stats() if DEV == "cuda" else {}
    train_steps(m, 3, device=DEV, dtype=torch.bfloat16, side=SIDE, text=TEXT)
    _sync()
    after = torch.cuda.memory_stats() if DEV == "cuda" else {}
    st = h.stats()
    h.close()
    assert st["pinned_bytes"] <= 1.05 * st["offloaded_bytes"], st
    assert after.get("num_alloc_retries") == before.get("num_alloc_retries")
    assert after.get("segment.all.allocated") == before.get("segment.all.allocated"), (
        "cudaMalloc in steady state"
    )


def test_sampling_is_identical():
    ref = tiny_flux(1, **SIZE).to(DEV)
    with torch.no_grad(), _kernel(torch.float32):
        o0 = [ref(**batch(5 + i, device=DEV, side=SIDE, text=TEXT)[0])[0] for i in range(3)]
    m = tiny_flux(1, **SIZE)
    blocks = blocks_of(m)
    place_non_blocks(m, blocks, DEV)
    h = attach_offload(blocks, DEV, 0.5, mode="sample", race_detector=True)
    with torch.no_grad(), _kernel(torch.float32):
        o1 = [m(**batch(5 + i, device=DEV, side=SIDE, text=TEXT)[0])[0] for i in range(3)]
    h.close()
    assert all(torch.equal(a, b) for a, b in zip(o0, o1, strict=True))


def test_hold_switches_are_identical():
    """The conductor's `hold` on the GPU (a captioner's decode placement): frozen blocks streamed at 0.75, passes
    alternating between the constructor's plan and one holding what 0.25 keeps (the held blocks copied on the
    transfer stream, compute waiting for them; freed and taken again), with the race detector: the outputs of the
    resident model, bit for bit."""
    ref = tiny_flux(1, **SIZE).to(DEV)
    holds = [None, 0.25, 0.25, 0.25, None, 0.25, None, None, 0.25]
    with torch.no_grad(), _kernel(torch.float32):
        o0 = [ref(**batch(5 + i, device=DEV, side=SIDE, text=TEXT)[0])[0] for i in range(len(holds))]
    m = tiny_flux(1, **SIZE).requires_grad_(False)  # frozen: every block is packed and streams
    blocks = blocks_of(m)
    place_non_blocks(m, blocks, DEV)
    h = attach_offload(blocks, DEV, 0.75, mode="sample", race_detector=True)
    o1 = []
    with torch.no_grad(), _kernel(torch.float32):
        for i, f in enumerate(holds):
            assert h.hold(f)
            assert (h.stats()["held_bytes"] > 0) == (f is not None)
            o1.append(m(**batch(5 + i, device=DEV, side=SIDE, text=TEXT)[0])[0])
    h.close()
    assert all(torch.equal(a, b) for a, b in zip(o0, o1, strict=True))


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_trainer_optim_fused_back_pass_with_packed_state_is_identical(fraction):
    """The real full fine-tune path: trainer.optim FusedBackPass, its AdamW state packed beside the streamed
    weights (bind_fused), written back on the side stream; against the same fused pass on the resident path
    (fused = unfused AdamW is trainer/optim's own test)."""
    from trainer.config import OptimizerConfig
    from trainer.offload import bind_fused
    from trainer.optim import FusedBackPass, build_optimizer

    cfg = OptimizerConfig(name="adamw", lr=1e-3, weight_decay=0.1, max_grad_norm=None)

    def run(f):
        m = tiny_flux(0, **SIZE)
        blocks = blocks_of(m)
        place_non_blocks(m, blocks, DEV)
        fb = FusedBackPass(build_optimizer(list(m.parameters()), cfg))
        h = attach_offload(blocks, DEV, f, trainable=True, optimizer_state=fb.state_layout if f else ())
        bind_fused(h, fb)
        losses = []
        with _kernel(torch.float32):
            for s in range(3):
                kw, target = batch(100 + s, device=DEV, side=SIDE, text=TEXT)
                loss = torch.nn.functional.mse_loss(m(**kw)[0], target)
                loss.backward()
                fb.finish_step()
                losses.append(loss.detach().cpu())
        h.sync()
        _sync()
        h.close()
        return torch.stack(losses), all_state(m)

    l0, s0 = run(0.0)
    l1, s1 = run(fraction)
    assert torch.equal(l0, l1), (l0, l1)
    assert all(torch.equal(s0[k], s1[k]) for k in s0)
