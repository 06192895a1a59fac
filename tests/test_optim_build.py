"""Optimizer choice, schedules, clipping, and the config's fused-back-pass restrictions."""

from __future__ import annotations

import json
import math

import pytest
import torch

from trainer.config import OptimizerConfig, load_config
from trainer.errors import ConfigError, UserError
from trainer.optim import (
    Fp32StepOptimizer,
    build_optimizer,
    build_scheduler,
    clip_grad_norm,
    current_lr,
    lr_factor,
)


def _params(dtype=torch.float32):
    torch.manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(4, 3, dtype=dtype)),
        torch.nn.Parameter(torch.randn(3, dtype=dtype)),
    ]


def test_optimizer_kinds():
    assert type(build_optimizer(_params(), OptimizerConfig(name="adamw"))) is torch.optim.AdamW
    ada = build_optimizer(_params(), OptimizerConfig(name="adafactor", lr=2e-3))
    assert type(ada).__name__ == "Adafactor"
    g = ada.param_groups[0]
    assert (g["lr"], g["relative_step"], g["scale_parameter"], g["beta1"]) == (2e-3, False, False, None)
    # bf16 weights: fp32 state and math, rounded back (nearest unless stochastic_rounding)
    opt = build_optimizer(_params(torch.bfloat16), OptimizerConfig(name="adamw"))
    assert isinstance(opt, Fp32StepOptimizer) and opt.rounding == "nearest"
    assert isinstance(opt.optimizer, torch.optim.AdamW)
    opt = build_optimizer(_params(torch.bfloat16), OptimizerConfig(stochastic_rounding=True))
    assert opt.rounding == "stochastic"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_adamw8bit_clear_error_on_cpu():
    with pytest.raises(UserError, match=r"optimizer\.name: adamw8bit .*CUDA.*set optimizer\.name: adamw"):
        build_optimizer(_params(), OptimizerConfig(name="adamw8bit"))


def test_errors_name_the_fix():
    with pytest.raises(UserError, match="no trainable parameters"):
        build_optimizer([], OptimizerConfig())
    with pytest.raises(UserError, match="model.dtype: bf16"):
        build_optimizer(_params(torch.float16), OptimizerConfig(stochastic_rounding=True))


# These tests walk the schedule without training, which torch warns about.
_NO_STEP = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")


@_NO_STEP
@pytest.mark.parametrize(
    "scheduler, expected",
    [
        # warmup 4 of 14 steps: 1/4, 2/4, 3/4, 1, then decay over the remaining 10 steps
        ("constant", {0: 0.25, 2: 0.75, 3: 1.0, 4: 1.0, 13: 1.0}),
        ("linear", {0: 0.25, 3: 1.0, 4: 1.0, 9: 0.5, 13: 0.1}),
        ("cosine", {0: 0.25, 3: 1.0, 4: 1.0, 9: 0.5, 13: 0.5 * (1 + math.cos(0.9 * math.pi))}),
    ],
)
def test_schedule_shapes(scheduler, expected):
    cfg = OptimizerConfig(lr=0.1, scheduler=scheduler, warmup_steps=4)
    for step, factor in expected.items():
        assert lr_factor(cfg, step, 14) == pytest.approx(factor, abs=1e-12), step
    # The LambdaLR gives optimizer step s the rate lr * factor(s): s=0 before any sched.step().
    opt = build_optimizer(_params(), cfg)
    sched = build_scheduler(opt, cfg, 14)
    seen = []
    for _ in range(14):
        seen.append(current_lr(opt))
        sched.step()
    for step, factor in expected.items():
        assert seen[step] == pytest.approx(0.1 * factor, rel=1e-12), step
    if scheduler != "constant":
        assert all(a >= b for a, b in zip(seen[3:], seen[4:], strict=False)) and seen[-1] > 0


def test_no_warmup_starts_at_peak():
    cfg = OptimizerConfig(lr=1.0, scheduler="cosine", warmup_steps=0)
    assert lr_factor(cfg, 0, 10) == 1.0 and lr_factor(cfg, 5, 10) == pytest.approx(0.5)


@_NO_STEP
def test_scheduler_state_is_json_and_restores_the_live_lr():
    cfg = OptimizerConfig(lr=0.1, scheduler="cosine", warmup_steps=2)
    opt = build_optimizer(_params(), cfg)
    sched = build_scheduler(opt, cfg, 10)
    for _ in range(5):
        sched.step()
    state = json.loads(json.dumps(sched.state_dict()))
    opt2 = build_optimizer(_params(), cfg)
    sched2 = build_scheduler(opt2, cfg, 10)  # sets the rate of step 0
    sched2.load_state_dict(state)  # without the optimizer's state: the rate must still be step 5's
    assert current_lr(opt2) == current_lr(opt) == pytest.approx(0.1 * lr_factor(cfg, 5, 10))
    sched.step()
    sched2.step()
    assert current_lr(opt2) == current_lr(opt)


def test_clip_grad_norm():
    params = _params()
    for p in params:
        p.grad = torch.full_like(p, 2.0)  # 15 elements: norm = 2 * sqrt(15)
    assert clip_grad_norm(params, 1.0) is None  # no value asked: no host sync
    assert torch.nn.utils.get_total_norm([p.grad for p in params]).item() == pytest.approx(1.0, rel=1e-6)
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    assert clip_grad_norm(params, 100.0, want_value=True) == pytest.approx(2 * math.sqrt(15))
    assert clip_grad_norm(params, None, want_value=True) == pytest.approx(2 * math.sqrt(15))
    assert params[0].grad[0, 0].item() == 2.0  # not clipped at 100 nor with None


def _yaml(tmp_path, **opt) -> str:
    lines = ["model: {family: flux, path: models/tiny/flux}", "output: {dir: out}", "optimizer:"]
    lines += [f"  {k}: {json.dumps(v)}" for k, v in opt.items()]
    path = tmp_path / "c.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_config_rejects_what_the_fused_pass_cannot_do(tmp_path):
    ok = load_config(_yaml(tmp_path, fused_back_pass=True, max_grad_norm=None))
    assert ok.optimizer.fused_back_pass
    with pytest.raises(ConfigError, match="max_grad_norm: null"):
        load_config(_yaml(tmp_path, fused_back_pass=True, max_grad_norm=1.0))
    with pytest.raises(ConfigError, match="grad_accum must be 1"):
        load_config(_yaml(tmp_path, fused_back_pass=True, max_grad_norm=None), ["train.grad_accum=2"])
    with pytest.raises(ConfigError, match="full fine-tuning only"):
        load_config(_yaml(tmp_path, stochastic_rounding=True))
