"""One definition per optimizer: `OPTIMIZERS`, the registry every other part reads.

An `OptimizerSpec` holds all that the trainer, the config and the planner know of an optimizer: how to build it
over param groups (`make`), the tensors it keeps per parameter after a step (`state`: the planner's state bytes and
the layout the conductor packs beside a streamed weight), and what the trainer may do with it (`packed`,
`owned_steps`, `sharded`, `whole_step`). `optimizer.name` in the config is a key of `OPTIMIZERS`, its description
the specs' `doc`s; `build_optimizer` (build.py), the planner (planner/meta.py), the training method's state
placement (train/method.py), the sharded stream (train/streaming.py) and fsdp's check (config.py) read the flags.
So a new optimizer is one spec here, and tests/test_optim_specs.py steps it on a small model and checks `state`
against the real state.

Adafactor: torch 2.13 ships `torch.optim.Adafactor`, but it scales every step by the parameter's RMS (its `lr`
is a relative step size), so a zero-initialised LoRA B barely moves at lr 1e-4. We use transformers' Adafactor
with `relative_step=False, scale_parameter=False, warmup_init=False` (the setting diffusion trainers use), so
`optimizer.lr` and the schedule mean the same for every optimizer. It has no momentum (beta1=None): `betas`
apply to the Adam optimizers only.

Prodigy (`prodigy`, the prodigyopt package) estimates the step size itself: `optimizer.lr` is a multiplier of its
estimate, 1.0 as its authors advise. Schedule-free AdamW (`adamw_schedulefree`, the schedulefree package) replaces
the decay schedule by averaging: the weights the model trains with are an interpolation, and the weights to save
or sample are the average, which build.py `eval_weights` swaps in (and back) around every save and sample. It needs a
constant schedule (warmup still applies) and fp32 trainable weights, and does not run in the fused back pass.

Nothing here imports torch, transformers or the optional optimizer packages at import time: config.py reads the
names and docs, and importing the config stays cheap. Each `make` imports what it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import UserError

if TYPE_CHECKING:
    import torch

    from ..config import OptimizerConfig

#: name -> (shape, dtype) of the tensors (dim > 0) an optimizer keeps for one parameter
StateLayout = dict[str, tuple[Any, Any]]


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    name: str
    """`optimizer.name`."""
    label: str
    """Its name in messages and preset headers."""
    doc: str
    """What it is and what it needs, for the config's description of `optimizer.name`."""
    make: Callable[[OptimizerConfig, list[dict]], torch.optim.Optimizer]
    """The torch optimizer over param groups (fp32 parameters; build.py wraps it for bf16 weights)."""
    state: Callable[[torch.Tensor], StateLayout]
    """The tensors (dim > 0) it keeps for parameter p after a step, name -> (shape, dtype), as the optimizer names
    them: the planner's state bytes (state in fp32, as trainer/optim keeps it) and, where `packed`, the room the
    conductor reserves beside a streamed weight."""
    packed: bool = False
    """Its state shapes are known before the first step (optim/fused.py `state_layout`), so a streamed full
    fine-tune packs the state beside each weight (train/method.py); else it stays in pinned RAM between steps."""
    owned_steps: bool = False
    """A weight's step reads nothing of the other weights, so each process may step its own weights
    (trainer/train/owners.py: the sharded stream of a full fine-tune), and one optimizer may step two experts'
    weights (model.expert: both, train/experts.py). Prodigy's step size sums over all of them."""
    sharded: bool = False
    """train.distributed: fsdp trains and resumes it exactly on DTensor shards (tests/test_fsdp.py)."""
    whole_step: bool = False
    """It steps all weights at once with its own schedule (schedule-free): scheduler constant, no fused back pass,
    fp32 trainable weights only."""


def _f32():
    import torch

    return torch.float32


def _adam_state(p) -> StateLayout:
    return {"exp_avg": (p.shape, _f32()), "exp_avg_sq": (p.shape, _f32())}


def _adamw(cfg, groups):
    import torch

    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def _adafactor(cfg, groups):
    from transformers.optimization import Adafactor

    return Adafactor(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, beta1=None, relative_step=False,
                     scale_parameter=False, warmup_init=False)


def _adafactor_state(p) -> StateLayout:
    """beta1=None: no momentum; factored row and column second moments for a matrix, a full one for a vector."""
    if p.dim() < 2:
        return {"exp_avg_sq": (p.shape, _f32())}
    return {"exp_avg_sq_row": (p.shape[:-1], _f32()), "exp_avg_sq_col": (p.shape[:-2] + p.shape[-1:], _f32())}


def _adamw8bit(cfg, groups):
    import torch

    if not torch.cuda.is_available():
        raise UserError("optimizer.name: adamw8bit runs on CUDA only (bitsandbytes) and no CUDA device is available; "
                        "set optimizer.name: adamw")
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise UserError(f"optimizer.name: adamw8bit needs bitsandbytes ({e}): `pip install bitsandbytes`, "
                        "or set optimizer.name: adamw") from None
    return bnb.optim.AdamW8bit(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def _adamw8bit_state(p) -> StateLayout:
    """Two uint8 moments (the block-wise scales, and the fp32 state bitsandbytes keeps for tensors under 4096
    elements, left out)."""
    import torch

    return {"state1": (p.shape, torch.uint8), "state2": (p.shape, torch.uint8)}


def _prodigy(cfg, groups):
    from prodigyopt import Prodigy

    return Prodigy(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def _prodigy_state(p) -> StateLayout:
    """s and p0 flat, and the two moments. p0 is one number for a weight that is all zeros at its first step (a
    LoRA's B): counted whole here."""
    n = (p.numel(),)
    return {"s": (n, _f32()), "p0": (n, _f32()), **_adam_state(p)}


def _schedulefree(cfg, groups):
    from schedulefree import AdamWScheduleFree

    opt = AdamWScheduleFree(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    opt.train()  # training mode from the first step; build.eval_weights swaps to the averaged weights
    return opt


def _schedulefree_state(p) -> StateLayout:
    return {"z": (p.shape, _f32()), "exp_avg_sq": (p.shape, _f32())}


#: every optimizer, by `optimizer.name`; the config's order
OPTIMIZERS: dict[str, OptimizerSpec] = {s.name: s for s in (
    OptimizerSpec(
        name="adamw", label="AdamW", doc="adamw",
        make=_adamw, state=_adam_state, packed=True, owned_steps=True, sharded=True,
    ),
    OptimizerSpec(
        name="adamw8bit", label="8-bit AdamW", doc="adamw8bit (needs bitsandbytes and a GPU)",
        make=_adamw8bit, state=_adamw8bit_state, owned_steps=True,
    ),
    OptimizerSpec(
        name="adafactor", label="Adafactor",
        doc="adafactor (transformers' Adafactor with lr as an absolute step size: relative_step and "
        "scale_parameter off, no momentum)",
        make=_adafactor, state=_adafactor_state, packed=True, owned_steps=True,
    ),
    OptimizerSpec(
        name="prodigy", label="Prodigy", doc="prodigy (prodigyopt: finds the step size itself, set lr: 1.0)",
        make=_prodigy, state=_prodigy_state, sharded=True,
    ),
    OptimizerSpec(
        name="adamw_schedulefree", label="schedule-free AdamW",
        doc="adamw_schedulefree (schedulefree: no decay schedule, scheduler: constant; saves and samples the "
        "averaged weights)",
        make=_schedulefree, state=_schedulefree_state, sharded=True, whole_step=True,
    ),
)}
#: the names, in the registry's order (the config's `Literal`)
OPTIMIZER_NAMES = tuple(OPTIMIZERS)


def optimizer_spec(name: str) -> OptimizerSpec:
    """The spec of `optimizer.name` (the config has checked the name; this says so for any other caller)."""
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise UserError(f"optimizer.name: unknown optimizer {name!r} ({', '.join(OPTIMIZERS)})") from None


def names_where(flag: str) -> list[str]:
    """The optimizers whose spec has `flag` (packed, owned_steps, sharded, whole_step) set: for messages."""
    return [n for n, s in OPTIMIZERS.items() if getattr(s, flag)]


#: the state entry holding a low-precision weight's fp32 master copy (`optimizer.master_weights`, stochastic.py)
MASTER = "master"


def master_layout(p: torch.Tensor) -> StateLayout:
    """The master copy's entry in p's state, for a bf16/fp16 weight (fp32 weights are stepped in place: none)."""
    import torch

    return {} if p.dtype == torch.float32 else {MASTER: (p.shape, torch.float32)}


def state_layout(name: str, p: torch.Tensor, masters: bool = False) -> StateLayout:
    """What the trainer keeps for p beside it: optimizer `name`'s state, and the fp32 master copy with `masters`."""
    return {**optimizer_spec(name).state(p), **(master_layout(p) if masters else {})}


def state_bytes(name: str, params, masters: bool = False) -> int:
    """Bytes of optimizer `name`'s state for `params`, from its spec's `state`, plus 4 per element of each bf16/fp16
    weight with `masters` (pinned RAM holds the same: trainer/optim StateOffload's buffers are exactly sized). Checked
    against a real step: tests/test_optim_specs.py."""
    import math

    return sum(math.prod(shape) * dtype.itemsize for p in params
               for shape, dtype in state_layout(name, p, masters).values())
