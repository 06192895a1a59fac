"""The optimizer pieces on CUDA: fused pass with optimizer state kept in CPU RAM, bf16 stochastic rounding,
8-bit AdamW. Run with `make test-gpu` (CI skips them)."""

from __future__ import annotations

import copy

import pytest
import torch

from trainer.config import OptimizerConfig
from trainer.optim import FusedBackPass, StateOffload, build_optimizer, build_scheduler

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to(
        "cuda", dtype
    )


def _train(model, cfg, *, fused, offload=False, steps=4, alloc=None):
    params = list(model.parameters())
    opt = build_optimizer(params, cfg, seed=1)
    sched = build_scheduler(opt, cfg, steps)
    fb = None
    if fused:
        fb = FusedBackPass(opt)
        if offload:
            off = StateOffload(params, alloc=alloc)
            fb.add_step_hooks(pre=off.pre, post=off.post, synchronize=off.synchronize)
    g = torch.Generator("cuda").manual_seed(0)
    dtype = params[0].dtype
    for _ in range(steps):
        x = torch.randn(32, 64, device="cuda", generator=g).to(dtype)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        if fb is None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            fb.finish_step()
        sched.step()
    return model, opt, fb


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_state_offload_is_exact_and_keeps_state_in_cpu_ram(name, exact):
    """`exact`: the buffers from trainer/offload `pinned_exact` (cudaHostRegister, no power-of-two rounding), as
    the trainer makes them."""
    from trainer.offload.allocators import pinned_exact

    cfg = OptimizerConfig(
        name=name, lr=1e-3, weight_decay=0.01, warmup_steps=1, scheduler="cosine", max_grad_norm=None
    )
    start = _model(torch.float32)
    ref, _, _ = _train(copy.deepcopy(start), cfg, fused=True)
    got, opt, fb = _train(copy.deepcopy(start), cfg, fused=True, offload=True, alloc=pinned_exact if exact else None)
    for a, b in zip(ref.parameters(), got.parameters(), strict=True):
        assert torch.equal(a, b)
    for p in got.parameters():
        for v in fb.state_of(p).values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                assert v.device.type == "cpu" and v.is_pinned()
    fb.state_dict()  # synchronises the queued copies
    unfused, _, _ = _train(copy.deepcopy(start), cfg, fused=False)
    for a, b in zip(unfused.parameters(), got.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # foreach vs one-tensor kernels: not bitwise


def test_pinned_exact_is_page_locked_at_its_own_size_and_released_with_the_tensor():
    from trainer.offload.allocators import pinned_exact

    before = torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0) if hasattr(
        torch.cuda.memory, "host_memory_stats") else None
    t = pinned_exact((3, 1000), torch.float32)
    assert t.is_pinned() and t.shape == (3, 1000)
    if before is not None:  # not from torch's caching host allocator
        assert torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0) == before
    ptr = t.data_ptr()
    del t
    again = torch.empty(3000, dtype=torch.float32)
    assert again.data_ptr() != ptr or not again.is_pinned()  # unregistered when the tensor died


def test_bf16_stochastic_rounding_fused_equals_unfused():
    cfg = OptimizerConfig(lr=1e-4, max_grad_norm=None, stochastic_rounding=True)
    start = _model(torch.bfloat16)
    a, _, _ = _train(copy.deepcopy(start), cfg, fused=False)
    b, _, _ = _train(copy.deepcopy(start), cfg, fused=True)
    for x, y, s in zip(a.parameters(), b.parameters(), start.parameters(), strict=True):
        assert torch.equal(x, y) and not torch.equal(x, s)


def test_adamw8bit_trains():
    pytest.importorskip("bitsandbytes")
    cfg = OptimizerConfig(name="adamw8bit", lr=1e-3, max_grad_norm=None)
    start = _model(torch.float32)
    before = start(torch.ones(4, 64, device="cuda")).pow(2).mean().item()
    model, _, _ = _train(copy.deepcopy(start), cfg, fused=True, steps=20)
    assert model(torch.ones(4, 64, device="cuda")).pow(2).mean().item() < before
