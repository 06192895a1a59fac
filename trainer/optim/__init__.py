"""Optimizers, schedules, the fused back pass, stochastic rounding and optimizer state as safetensors.

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

from .build import build_optimizer, build_scheduler, current_lr, lr_factor, torch_optimizer
from .clip import clip_grad_norm
from .fused import FusedBackPass, StateOffload
from .state import (
    load_optimizer_state,
    optimizer_state_from_safetensors,
    optimizer_state_to_safetensors,
    save_optimizer_state,
)
from .stochastic import Fp32StepOptimizer, copy_stochastic_, stochastic_round

__all__ = [
    "build_optimizer",
    "build_scheduler",
    "current_lr",
    "lr_factor",
    "torch_optimizer",
    "clip_grad_norm",
    "FusedBackPass",
    "StateOffload",
    "save_optimizer_state",
    "load_optimizer_state",
    "optimizer_state_to_safetensors",
    "optimizer_state_from_safetensors",
    "Fp32StepOptimizer",
    "copy_stochastic_",
    "stochastic_round",
]
