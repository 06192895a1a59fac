"""Optimizers, schedules, the fused back pass, stochastic rounding and optimizer state as safetensors.

The optimizers are the specs of specs.py (`OPTIMIZERS`: one `OptimizerSpec` each, what every other part reads).

The training loop, unfused:

    opt = build_optimizer(params, cfg.optimizer, seed=cfg.train.seed)
    sched = build_scheduler(opt, cfg.optimizer, cfg.train.steps)
    ...                                   # per step:
    loss.backward()                       # (after checking the loss is finite)
    norm = clip_grad_norm(params, cfg.optimizer.max_grad_norm, want_value=is_log_step)
    opt.step(); opt.zero_grad(set_to_none=True); sched.step()

fused (`cfg.optimizer.fused_back_pass`):

    fused = FusedBackPass(opt)            # hooks every trainable parameter
    fused.track_grad_norm = is_log_step   # optional, before backward
    loss.backward()                       # the loss MUST be checked finite before this: it steps the weights
    norm = fused.finish_step()
    sched.step()

Offloading (trainer/offload/), fused pass only: `fused.add_step_hooks(pre=f, post=g, synchronize=h)` with
`f(param, state)` / `g(param, state)` around each parameter's step inside backward (`state` is its optimizer
state dict, `fused.state_of(param)`); `StateOffload(params)` is a ready pair keeping that state in pinned CPU
RAM; `FusedBackPass(opt, params=subset)` + `fused.step_param(p)` to drive the step from the offloader's hooks.

Checkpoints: `save_optimizer_state(opt, folder)` / `load_optimizer_state(opt, folder)` (one file,
`folder/optimizer.safetensors`), or `optimizer_state_to_safetensors(opt) -> (tensors, meta)` and
`optimizer_state_from_safetensors(opt, tensors, meta)`; `sched.state_dict()` is plain JSON.
"""

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .build import build_optimizer, build_scheduler, current_lr, lr_factor, torch_optimizer
    from .clip import clip_grad_norm
    from .fused import FusedBackPass, StateOffload
    from .specs import OPTIMIZERS, OptimizerSpec, optimizer_spec
    from .state import (
        load_optimizer_state,
        optimizer_state_from_safetensors,
        optimizer_state_to_safetensors,
        save_optimizer_state,
    )
    from .stochastic import Fp32StepOptimizer, copy_stochastic_, stochastic_round

__all__ = [
    "build_optimizer", "build_scheduler", "current_lr", "lr_factor", "torch_optimizer", "clip_grad_norm",
    "FusedBackPass", "StateOffload", "OPTIMIZERS", "OptimizerSpec", "optimizer_spec",
    "load_optimizer_state", "optimizer_state_from_safetensors", "optimizer_state_to_safetensors",
    "save_optimizer_state", "Fp32StepOptimizer", "copy_stochastic_", "stochastic_round",
]
#: the module of this package each public name is defined in, imported when the name is first asked for (PEP 562),
#: so that config.py reads the optimizer registry (specs.py) without importing torch
_MODULE_OF = {
    "build_optimizer": "build", "build_scheduler": "build", "current_lr": "build", "lr_factor": "build",
    "torch_optimizer": "build",
    "clip_grad_norm": "clip",
    "FusedBackPass": "fused", "StateOffload": "fused",
    "OPTIMIZERS": "specs", "OptimizerSpec": "specs", "optimizer_spec": "specs",
    "load_optimizer_state": "state", "optimizer_state_from_safetensors": "state",
    "optimizer_state_to_safetensors": "state", "save_optimizer_state": "state",
    "Fp32StepOptimizer": "stochastic", "copy_stochastic_": "stochastic", "stochastic_round": "stochastic",
}


def __getattr__(name: str):
    if name in _MODULE_OF:
        return getattr(import_module(f".{_MODULE_OF[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
