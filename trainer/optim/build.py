"""Optimizer and learning-rate schedule from `cfg.optimizer`.

`build_optimizer` returns a torch optimizer when every trainable parameter is fp32 (LoRA weights, fp32 full
fine-tuning), and an `Fp32StepOptimizer` (trainer/optim/stochastic.py) when some are bf16/fp16 (full
fine-tuning of bf16 weights): that one keeps fp32 optimizer state, computes each step in fp32 and writes the
result back rounded to nearest, or stochastically with `optimizer.stochastic_rounding`, or keeps an fp32 master
copy of each such weight in its state with `optimizer.master_weights`. Both answer `step()`,
`zero_grad()`, `param_groups`, `state_dict()` / `load_state_dict()`, and both are accepted by
`build_scheduler`, `FusedBackPass` and the safetensors state helpers.

The optimizers themselves (what each is, how it is built, its state) are specs in specs.py. A schedule-free one
(`whole_step`) replaces the decay schedule by averaging: the weights the model trains with are an interpolation, and
the weights to save or sample are the average, which `eval_weights` swaps in (and back) around every save and sample.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from ..errors import UserError
from .specs import optimizer_spec

if TYPE_CHECKING:
    from ..config import OptimizerConfig

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


def param_groups(params: ParamsT) -> list[dict[str, Any]]:
    """Normalise tensors or param-group dicts to a list of group dicts (copies; the tensors are shared)."""
    items = list(params)
    if not items:
        return []
    if isinstance(items[0], dict):
        return [{**g, "params": list(g["params"])} for g in items]
    return [{"params": items}]


@contextmanager
def eval_weights(optimizer):
    """Inside: the weights to save or sample. A schedule-free optimizer (a torch optimizer with `eval`/`train`)
    swaps its averaged weights in and back (exactly: the swap is an interpolation it inverts); every other
    optimizer, or None, does nothing."""
    if optimizer is None or not hasattr(optimizer, "eval") or not hasattr(optimizer, "train"):
        yield
        return
    optimizer.eval()
    try:
        yield
    finally:
        optimizer.train()


def build_optimizer(params: ParamsT, cfg: OptimizerConfig, *, seed: int = 0):
    """The optimizer named by `cfg` over `params` (tensors or param-group dicts).

    fp32 parameters -> a plain torch optimizer. Any bf16/fp16 parameter -> `Fp32StepOptimizer` (fp32 state and
    math, nearest or stochastic rounding back, or fp32 masters; `seed` seeds the stochastic rounding).
    """
    from .stochastic import Fp32StepOptimizer

    groups = param_groups(params)
    flat = [p for g in groups for p in g["params"]]
    if not flat:
        raise UserError("no trainable parameters to optimize (check train.method and lora.targets)")
    spec = optimizer_spec(cfg.name)

    def make(groups):
        return spec.make(cfg, groups)

    if cfg.stochastic_rounding and any(p.dtype == torch.float16 for p in flat):
        raise UserError("optimizer.stochastic_rounding needs bf16 weights: set model.dtype: bf16")
    if all(p.dtype == torch.float32 for p in flat):
        return make(groups)
    if spec.whole_step:
        raise UserError(f"optimizer.name: {cfg.name} needs fp32 trainable weights (LoRA, or model.dtype: fp32 "
                        "for full fine-tuning)")
    rounding = "stochastic" if cfg.stochastic_rounding else "nearest"
    return Fp32StepOptimizer(groups, make, rounding=rounding, seed=seed, masters=cfg.master_weights)


# ---------------------------------------------------------------------------------------------- schedule


def lr_factor(cfg: OptimizerConfig, step: int, total_steps: int) -> float:
    """Multiplier of `cfg.lr` used by optimizer step `step` (0-based).

    Warmup: (step + 1) / warmup_steps for step < warmup_steps, so the first step already moves and step
    warmup_steps - 1 reaches the peak. Then constant 1, or cosine / linear decay over the remaining steps,
    reaching 0 one step after the last (the last step still has a small non-zero rate).
    """
    w = cfg.warmup_steps
    if step < w:
        return (step + 1) / w
    if cfg.scheduler == "constant":
        return 1.0
    progress = min(1.0, (step - w) / max(1, total_steps - w))
    if cfg.scheduler == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - progress  # linear


class _Schedule(LambdaLR):
    """LambdaLR whose `load_state_dict` also puts the restored rate into the optimizer's groups, so a resume
    is right whatever order the optimizer and scheduler states are loaded in. The lambda itself is a closure
    over the config (LambdaLR saves it as None), so a resumed run follows the current config's schedule."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr


def build_scheduler(optimizer, cfg: OptimizerConfig, total_steps: int) -> LambdaLR:
    """LambdaLR for `lr_factor`: call `.step()` once after every optimizer step (fused or not).

    `state_dict()` is plain JSON (ints, floats, None); `load_state_dict` restores it and the live rate.
    """
    if total_steps < 1:
        raise UserError(f"train.steps must be at least 1 (got {total_steps})")
    inner = torch_optimizer(optimizer)

    def factor(step: int) -> float:
        return lr_factor(cfg, step, total_steps)

    return _Schedule(inner, factor)


def torch_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside an `Fp32StepOptimizer` or `FusedBackPass` (itself for a torch optimizer)."""
    while not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def current_lr(optimizer) -> float:
    """The rate the next step uses (first param group)."""
    return float(optimizer.param_groups[0]["lr"])
