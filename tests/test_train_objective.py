"""The flow-matching objective: formulas, distributions, and a generator whose state makes resume exact."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.config import TrainConfig
from trainer.train.objective import FlowMatching, loss_weights, shift_timesteps


def test_noisy_input_and_target_follow_the_straight_path():
    fm = FlowMatching(TrainConfig(timestep_sampling="uniform", shift=1.0, seed=3))
    x0 = torch.randn(3, 4, 8, 8)
    n = fm.noise(x0)
    # Re-draw the same t and eps from a generator in the same state.
    g = torch.Generator().manual_seed(3)
    t = torch.rand(3, generator=g)
    eps = torch.randn(x0.shape, generator=g)
    torch.testing.assert_close(n.t, t, rtol=0, atol=0)
    tb = t.view(-1, 1, 1, 1)
    torch.testing.assert_close(n.noisy, (1 - tb) * x0 + tb * eps, rtol=0, atol=0)
    torch.testing.assert_close(n.target, eps - x0, rtol=0, atol=0)
    # The loss of a perfect prediction is 0; of a zero prediction the mean squared target.
    assert FlowMatching.loss(n.target, n).item() == 0.0
    assert FlowMatching.loss(torch.zeros_like(x0), n).item() == pytest.approx(n.target.pow(2).mean().item(), rel=1e-6)


def test_noisy_input_is_cast_to_the_model_dtype_and_target_stays_fp32():
    fm = FlowMatching(TrainConfig(seed=0))
    n = fm.noise(torch.randn(2, 4, 4, 4), torch.bfloat16)
    assert n.noisy.dtype == torch.bfloat16 and n.target.dtype == torch.float32 and n.t.dtype == torch.float32


def test_shift_formula_and_its_direction():
    t = torch.linspace(0, 1, 11)
    torch.testing.assert_close(shift_timesteps(t, 1.0), t)
    s = shift_timesteps(t, 3.0)
    torch.testing.assert_close(s, 3 * t / (1 + 2 * t))
    assert s[0] == 0 and s[-1] == 1 and bool((s[1:-1] > t[1:-1]).all())  # towards noise


def test_auto_shift_asks_the_adapter_with_pixel_sizes():
    seen = []

    def shift_fn(h, w):
        seen.append((h, w))
        return 3.0

    fm = FlowMatching(TrainConfig(timestep_sampling="uniform", shift="auto", seed=1), shift_fn)
    n = fm.noise(torch.zeros(4, 4, 8, 16))
    assert seen == [(64, 128)]
    u = torch.rand(4, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(n.t, 3 * u / (1 + 2 * u))


@pytest.mark.parametrize("kind", ["uniform", "logit_normal", "mode"])
def test_timestep_distributions(kind):
    fm = FlowMatching(TrainConfig(timestep_sampling=kind, seed=0, shift=1.0))
    t = fm.sample_t(20000)
    assert float(t.min()) >= 0 and float(t.max()) <= 1
    mean = float(t.mean())
    assert abs(mean - 0.5) < 0.02  # all three are symmetric around 0.5 with these defaults
    if kind == "logit_normal":  # mass in the middle: fewer samples in the outer fifths than uniform
        assert float(((t < 0.1) | (t > 0.9)).float().mean()) < 0.1
    if kind == "mode":  # SD3 paper: mode_scale > 0 puts mass in the middle (uniform: 0.1 here), < 0 at the ends
        mid = float(((t > 0.45) & (t < 0.55)).float().mean())
        assert mid > 0.2
        ends = FlowMatching(TrainConfig(timestep_sampling=kind, mode_scale=-0.5, shift=1.0)).sample_t(20000)
        assert float(((ends > 0.45) & (ends < 0.55)).float().mean()) < 0.1


def test_logit_normal_mean_moves_the_distribution():
    t = FlowMatching(TrainConfig(timestep_sampling="logit_normal", logit_mean=1.0, shift=1.0)).sample_t(5000)
    assert float(t.median()) == pytest.approx(1 / (1 + math.exp(-1.0)), abs=0.02)


def test_loss_weightings():
    t = torch.tensor([0.25, 0.5, 0.75])
    torch.testing.assert_close(loss_weights(t, "none"), torch.ones(3))
    torch.testing.assert_close(loss_weights(t, "sigma_sqrt"), t**-2)
    torch.testing.assert_close(loss_weights(t, "cosmap"), 2 / (math.pi * (1 - 2 * t + 2 * t**2)))


def test_weighted_loss_is_the_mean_of_weighted_per_sample_errors():
    fm = FlowMatching(TrainConfig(loss_weighting="cosmap", seed=5, shift=1.0))
    x0 = torch.randn(3, 4, 4, 4)
    n = fm.noise(x0)
    pred = torch.randn_like(x0)
    per = (pred - n.target).pow(2).mean(dim=(1, 2, 3))
    expected = (per * loss_weights(n.t, "cosmap")).mean()
    torch.testing.assert_close(FlowMatching.loss(pred, n), expected)


def test_generator_state_round_trip_reproduces_the_draws():
    fm = FlowMatching(TrainConfig(seed=7))
    x0 = torch.randn(2, 4, 4, 4)
    fm.noise(x0)
    state = fm.state().clone()
    a = fm.noise(x0)
    other = FlowMatching(TrainConfig(seed=999))
    other.load_state(state)
    b = other.noise(x0)
    assert torch.equal(a.noisy, b.noisy) and torch.equal(a.t, b.t)
    assert state.dtype == torch.uint8  # stored as a safetensors tensor in checkpoints


def test_global_rng_is_not_used():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    FlowMatching(TrainConfig(seed=1)).noise(torch.zeros(2, 4, 4, 4))
    assert torch.equal(before, torch.get_rng_state())
