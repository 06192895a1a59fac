"""Stochastic rounding fp32 -> bf16, and the fp32-step optimizer for bf16 weights."""

from __future__ import annotations

import copy

import pytest
import torch

from trainer.config import OptimizerConfig
from trainer.optim import FusedBackPass, build_optimizer, copy_stochastic_, stochastic_round

ULP_AT_1 = 2.0**-7  # spacing of bf16 values in [1, 2)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_representable_values_unchanged():
    torch.manual_seed(0)
    x = (torch.randn(10_000) * torch.logspace(-30, 30, 10_000)).to(torch.bfloat16)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1.0, -(2.0**-130)], dtype=torch.bfloat16)
    x = torch.cat([x, special])
    got = stochastic_round(x.float(), _gen())
    assert torch.equal(got.view(torch.int16), x.view(torch.int16))  # bitwise, so -0.0 stays -0.0
    assert stochastic_round(torch.tensor([float("nan")]), _gen()).isnan().all()


@pytest.mark.parametrize("value", [1.0 + 0.3 * ULP_AT_1, -(1.0 + 0.8 * ULP_AT_1), 3.0e-3 * (1 + 0.55 / 128)])
def test_mean_equals_fp32_value(value):
    n = 200_000
    x = torch.full((n,), value, dtype=torch.float32)
    value = x[0].item()  # as fp32
    r = stochastic_round(x, _gen(1)).float()
    low_bits = x[:1].view(torch.int32) & -65536  # truncated toward zero, and the next bf16 away from zero
    lo, hi = low_bits.view(torch.float32).item(), (low_bits + 65536).view(torch.float32).item()
    assert set(r.unique().tolist()) == {lo, hi}  # only the two neighbours ever come out
    p_up = (value - lo) / (hi - lo)
    # Mean within 5 standard errors of the exact value; nearest rounding would be off by >= 0.2 ulp.
    tol = 5 * abs(hi - lo) * (p_up * (1 - p_up) / n) ** 0.5
    assert abs(r.double().mean().item() - value) < tol
    assert abs(x.to(torch.bfloat16).double().mean().item() - value) > 10 * tol


def test_unbiased_over_random_values():
    x = torch.randn(2_000, generator=_gen(3)) * 10
    draws = torch.stack([stochastic_round(x, _gen(s)).float() for s in range(400)])
    err = (draws.double().mean(0) - x.double()) / x.double().abs()
    assert err.abs().mean() < 2e-4  # nearest rounding: ~1e-3 on average
    nearest = (x.to(torch.bfloat16).double() - x.double()) / x.double().abs()
    assert nearest.abs().mean() > 5 * err.abs().mean()


def test_seeded_and_in_place():
    x = torch.randn(1000, generator=_gen(4))
    a, b, c = (stochastic_round(x, _gen(s)) for s in (5, 5, 6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    dst = torch.empty(1000, dtype=torch.bfloat16)
    src = x.clone()
    copy_stochastic_(dst, src, _gen(5), clobber_src=True)
    assert torch.equal(dst, a)
    with pytest.raises(TypeError):
        copy_stochastic_(torch.empty(3), torch.empty(3))


def _cfg(**kw):
    return OptimizerConfig(name="adamw", lr=1e-4, max_grad_norm=None, **kw)


def test_small_updates_survive_only_with_stochastic_rounding():
    """bf16 weights at 1.0, constant gradient: AdamW moves each by ~lr a step, 1/40 of bf16's spacing below 1.
    Nearest rounding loses every update; stochastic rounding keeps the fp32 trajectory on average."""
    steps, n = 60, 1024
    finals = {}
    for sr in (False, True):
        w = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
        opt = build_optimizer([w], _cfg(stochastic_rounding=sr), seed=3)
        for _ in range(steps):
            w.grad = torch.ones_like(w)
            opt.step()
            assert w.grad is None and w.dtype == torch.bfloat16
        finals[sr] = w.detach().double().mean().item()
        assert len(opt.state_of(w)) == 3 and opt.state_of(w)["exp_avg"].dtype == torch.float32
    assert finals[False] == 1.0
    assert finals[True] == pytest.approx(1.0 - steps * 1e-4, abs=1e-3)


def test_bf16_fused_equals_unfused_bitwise():
    torch.manual_seed(0)
    start = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(
        torch.bfloat16
    )
    x, y = torch.randn(16, 8, dtype=torch.bfloat16), torch.randn(16, 4, dtype=torch.bfloat16)
    results = []
    for fused in (False, True):
        model = copy.deepcopy(start)
        opt = build_optimizer(model.parameters(), _cfg(stochastic_rounding=True, weight_decay=0.01), seed=11)
        fb = FusedBackPass(opt) if fused else None
        for _ in range(3):
            torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
            if fb is None:
                opt.step()
            else:
                fb.finish_step()
        results.append(model)
    for a, b, s in zip(results[0].parameters(), results[1].parameters(), start.parameters(), strict=True):
        assert torch.equal(a, b) and not torch.equal(a, s)
