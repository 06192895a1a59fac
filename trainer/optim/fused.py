"""Fused back pass: each parameter's optimizer step runs inside backward, then its gradient is freed.

How. `FusedBackPass(optimizer)` registers a `register_post_accumulate_grad_hook` on every trainable
parameter. Autograd calls it once the parameter's gradient is complete (after all its uses in the graph have
contributed), on the thread running backward. The hook steps that one parameter (trainer/optim/single.py:
the one optimizer, narrowed to it) and sets `p.grad = None`, so at any moment only the gradients of the
parameters whose backward is in flight exist. For full fine-tuning that removes a model-sized buffer (the
gradients) from the peak, and with streamed blocks (trainer/offload/) it lets a block's weights be stepped
while the block is on the GPU, before its slot is reused.

What the training loop must do differently (the contract):
- Check the loss BEFORE `loss.backward()`: backward *is* the optimizer step here, so a NaN found after it
  has already been written into the weights. On a non-finite loss, do not call backward (drop the graph) and
  raise; `disable()` / `paused()` exist for backward passes that must not step (e.g. a diagnostic backward);
  while disabled, gradients accumulate in `.grad` as usual.
- Do not call `optimizer.step()` / `zero_grad()` / global-norm clipping: the gradients are gone. Call
  `finish_step()` after backward (it returns the gradient norm when `track_grad_norm` was set for this step)
  and `scheduler.step()` as in the unfused path; every parameter reads the scheduler's live lr.
- Gradient accumulation and global-norm clipping cannot work this way (each parameter steps before the other
  gradients exist); config.py `_combinations` rejects both with the fix to apply.

Hook point for offloading. `add_step_hooks(pre=, post=, synchronize=)` registers callables `f(param, state)`
run right before and after each parameter's step, where `state` is that parameter's optimizer state dict (the
same dict object the optimizer fills on its first step; empty before it); `synchronize()` runs before the
state is read on the host (`state_dict`). `StateOffload` is a ready-made pair that keeps the state of chosen
parameters in (pinned) CPU RAM between steps. For state packed beside streamed weights (tested on the CPU in
tests/test_optim_fused.py `_PackedStore`):
- reserve room with `state_layout(p)` (name -> shape, dtype of the tensors the optimizer will keep);
- between steps `state[name]` is the tensor in the host arena (what a checkpoint reads, after `synchronize`);
- pre: if `state` is empty (first step) do nothing, the optimizer creates it; else point `state[name]` at the
  GPU slot the block load filled, first copying `state[name]` into the slot if it is not the arena tensor
  (it was just set by `load_state_dict`);
- post: copy `state[name]` into the slot if it is not the slot (first step), set `state[name]` back to the
  arena tensor; the block's write-back makes the arena current.
Owners: with `owns` set, a parameter for which it is False is not stepped here (its gradient is freed after the
pre hooks, which sent it to the process that steps it); the post hooks still run (they bring its new value).
`step_param(p)` is public too, for an offloader that prefers to call the step from its own hooks (create the
FusedBackPass with `params=` the ones it should hook itself). One FusedBackPass per parameter (checked).

Numbers: in fp32 on the CPU the weights after N steps equal those of `optimizer.step()` after backward,
bitwise (tests/test_optim_fused.py), for AdamW and Adafactor, with weight decay and a warmup + cosine schedule.
Cost: one `optimizer.step()` call per parameter per step (~tens of microseconds of Python each).

Left out: non-finite gradients under a finite loss are not detected before they are applied (a per-parameter
check would need a host sync each); `track_grad_norm` reports the norm of the gradients as applied.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .build import torch_optimizer
from .single import NarrowStep
from .specs import master_layout
from .stochastic import Fp32StepOptimizer

StepHook = Callable[[torch.Tensor, dict[str, Any]], None]


class FusedBackPass:
    """Steps `optimizer` inside backward, one parameter at a time.

    optimizer: from `build_optimizer` (a torch optimizer or an `Fp32StepOptimizer`).
    params: the parameters to hook; default every parameter of the optimizer that requires grad.
    """

    def __init__(self, optimizer, *, params: list[torch.Tensor] | None = None):
        self.optimizer = optimizer
        if isinstance(optimizer, Fp32StepOptimizer):
            all_params = optimizer.params
            self._step_one = optimizer.step_param
            self._state_of = optimizer.state_of
            self._key_of = optimizer.key_of
        else:
            narrow = NarrowStep(optimizer)
            all_params = [p for g in optimizer.param_groups for p in g["params"]]

            def step_one(p: torch.Tensor) -> None:
                if p.grad is not None:
                    narrow(p)
                    p.grad = None  # frees the gradient now: the point of the fused pass

            self._step_one = step_one
            self._state_of = lambda p: optimizer.state[p]
            self._key_of = lambda p: p
        known = set(all_params)
        hooked = [p for p in (all_params if params is None else params) if p.requires_grad]
        unknown = [p for p in hooked if p not in known]
        if unknown:
            raise ValueError(f"{len(unknown)} parameter(s) given to FusedBackPass are not in the optimizer")
        self.params = hooked
        for p in hooked:
            owner = _driven_by(p)
            if owner is not None:
                raise ValueError(
                    "a parameter is already stepped by another FusedBackPass: call .remove() on that one first "
                    "(two would both step it, and the first would free the gradient before the second sees it)"
                )
        self.enabled = True
        self.track_grad_norm = False
        #: p -> whether this process steps p (None: every parameter). Several processes that each own some
        #: parameters (trainer/train/owners.py) run every hook for every parameter, but only the owner steps it.
        self.owns: Callable[[torch.Tensor], bool] | None = None
        self._pre: list[StepHook] = []
        self._post: list[StepHook] = []
        self._sync: list[Callable[[], None]] = []
        self._sq_norm: dict[torch.device, torch.Tensor] = {}
        self._stepped = 0
        self._layouts: dict[tuple, dict[str, tuple[torch.Size, torch.dtype]]] = {}
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in hooked]
        me = weakref.ref(self)
        for p in hooked:
            _DRIVERS[id(p)] = (weakref.ref(p), me)

    # ------------------------------------------------------------------------------------------- hooks

    def _hook(self, p: torch.Tensor) -> None:
        if self.enabled:
            self.step_param(p)

    def step_param(self, p: torch.Tensor) -> None:
        """Step p now with its gradient (pre hooks, step, post hooks) and free the gradient."""
        if p.grad is None:
            return
        if self.track_grad_norm:
            # Stays on the device (no sync); allocation: one fp32 scalar per parameter (no fp32 copy of the
            # gradient: the norm kernel accumulates in fp32).
            sq = torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float32).square()
            acc = self._sq_norm.get(sq.device)
            self._sq_norm[sq.device] = sq if acc is None else acc.add_(sq)
        state = self._state_of(p) if (self._pre or self._post) else None
        for f in self._pre:
            f(p, state)
        if self.owns is None or self.owns(p):
            self._step_one(p)
        else:
            p.grad = None  # another process steps p; its gradient went there in a pre hook
        for f in self._post:
            f(p, state)
        self._stepped += 1

    def add_step_hooks(
        self,
        pre: StepHook | None = None,
        post: StepHook | None = None,
        synchronize: Callable[[], None] | None = None,
    ) -> None:
        """Run `pre(param, state)` before and `post(param, state)` after every parameter's step;
        `synchronize()` before the state is read on the host (`state_dict`)."""
        if pre is not None:
            self._pre.append(pre)
        if post is not None:
            self._post.append(post)
        if synchronize is not None:
            self._sync.append(synchronize)

    def state_of(self, p: torch.Tensor) -> dict[str, Any]:
        """p's optimizer state dict (empty before its first step)."""
        return self._state_of(p)

    def key_of(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor the optimizer keys p's state by (p, or its fp32 shadow under stochastic rounding)."""
        return self._key_of(p)

    def state_layout(self, p: torch.Tensor) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Name -> (shape, dtype) of the state tensors (dim > 0) the optimizer will keep for p, known before
        its first step, so an offloader can reserve room for them (Adafactor's are row/column vectors, not
        p-shaped). Found by stepping a throwaway copy of the optimizer on a meta tensor of p's shape (no
        memory, no kernels); 0-dim entries (step counts, Adafactor's RMS) are left out: leave them in the dict.
        With fp32 master weights (`Fp32StepOptimizer(masters=True)`) a bf16/fp16 p's `master` is one of them."""
        inner = torch_optimizer(self.optimizer)
        key = self._key_of(p)
        group = next(g for g in inner.param_groups if any(q is key for q in g["params"]))
        cache_key = (tuple(p.shape), id(group))
        layout = self._layouts.get(cache_key)
        if layout is None:
            accepted = inspect.signature(type(inner).__init__).parameters
            kwargs = {k: v for k, v in group.items() if k in accepted and k != "params"}
            probe = torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float32, device="meta"))
            probe.grad = torch.empty_like(probe)
            throwaway = type(inner)([probe], **kwargs)
            throwaway.step()
            layout = {
                k: (v.shape, v.dtype)
                for k, v in throwaway.state[probe].items()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            }
            self._layouts[cache_key] = layout
        if isinstance(self.optimizer, Fp32StepOptimizer) and self.optimizer.masters and key is not p:
            return {**layout, **master_layout(p)}
        return dict(layout)

    # ------------------------------------------------------------------------------------------ control

    def enable(self) -> None:
        self.enabled = True

    def disable(self) -> None:
        """Hooks pass through: gradients stay in `.grad`, nothing is stepped."""
        self.enabled = False

    @contextmanager
    def paused(self) -> Iterator[None]:
        was, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = was

    def finish_step(self) -> float | None:
        """Call after `loss.backward()`. Returns the gradient norm when `track_grad_norm` was set during this
        backward (host-device sync here; set it on logging steps only), else None."""
        self._stepped = 0
        if not self._sq_norm:
            return None
        total = sum(float(t) for t in self._sq_norm.values())  # host-device sync (logging steps only)
        self._sq_norm.clear()
        return total**0.5

    @property
    def stepped(self) -> int:
        """Parameters stepped since the last `finish_step()`."""
        return self._stepped

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def remove(self) -> None:
        """Unregister the hooks (the optimizer is untouched)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for p in self.params:
            if _driven_by(p) is self:
                del _DRIVERS[id(p)]

    # ------------------------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict: the same layout as the unfused path, so checkpoints are
        interchangeable. State kept off the GPU by non-blocking copies is synchronised first."""
        for sync in self._sync:
            sync()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)


# id(param) -> (weak param, weak FusedBackPass) for the hooks now registered; guards against two drivers.
_DRIVERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _driven_by(p: torch.Tensor) -> FusedBackPass | None:
    entry = _DRIVERS.get(id(p))
    if entry is None:
        return None
    param, owner = entry[0](), entry[1]()
    if param is not p or owner is None or not owner._handles:
        del _DRIVERS[id(p)]  # a dead entry (the id was reused, or its FusedBackPass is gone)
        return None
    return owner


class StateOffload:
    """Pre/post step hooks keeping the optimizer state of `params` in CPU RAM between steps.

    pre: state tensors (not 0-dim ones such as AdamW's CPU `step` count, which the optimizer wants on the CPU)
    are copied to the parameter's device. post: copied back into CPU buffers allocated on the first step and
    reused after (pinned when CUDA is available, so the copies are asynchronous). Both copies are queued on
    the current stream, which orders them; the host reads the CPU buffers only after `synchronize()`
    (`FusedBackPass.state_dict` calls it).

        offload = StateOffload(streamed_params)
        fused.add_step_hooks(pre=offload.pre, post=offload.post, synchronize=offload.synchronize)
    """

    def __init__(self, params: list[torch.Tensor], *, pin: bool | None = None, alloc=None):
        """`alloc(shape, dtype)`: makes each CPU buffer (default: torch's pinned allocator when `pin`, which
        rounds sizes up to a power of two; trainer/offload `pinned_exact` is exact)."""
        self._params = set(params)
        self._pin = torch.cuda.is_available() if pin is None else pin
        self._alloc = alloc or (lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=self._pin))
        self._buffers: dict[tuple[torch.Tensor, str], torch.Tensor] = {}
        self._dirty = False

    def pre(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        if p not in self._params:
            return
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.device != p.device:
                state[k] = v.to(p.device, non_blocking=True)  # allocation on p's device for this step

    def post(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        if p not in self._params:
            return
        for k, v in state.items():
            if not (isinstance(v, torch.Tensor) and v.dim() > 0) or v.device.type == "cpu":
                continue
            buf = self._buffers.get((p, k))
            if buf is None or buf.shape != v.shape or buf.dtype != v.dtype:
                buf = self._alloc(v.shape, v.dtype)  # once per state tensor, reused after
                self._buffers[(p, k)] = buf
            buf.copy_(v, non_blocking=self._pin)
            state[k] = buf
            self._dirty = self._pin

    def synchronize(self) -> None:
        """Wait for queued device-to-host copies (host-device sync) before reading the state on the host."""
        if self._dirty and torch.cuda.is_available():
            torch.cuda.synchronize()
        self._dirty = False
