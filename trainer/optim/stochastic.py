"""fp32 optimizer steps for bf16 weights, written back with stochastic rounding (or kept as fp32 masters).

Why. A bf16 weight near 1.0 has a spacing of 2^-7 ~ 0.0078 between representable values; an Adam update of
lr = 1e-5 is 1/800 of that, so rounding to nearest throws every such update away and full fine-tuning of bf16
weights stalls. Stochastic rounding rounds up with probability equal to the distance from the lower neighbour
(in units of the spacing), so the rounded weight equals the exact fp32 result *in expectation* and small
updates accumulate over steps instead of vanishing.

How. An fp32 number's top 16 bits are exactly a bf16 number. Add a uniform random integer in [0, 2^16) to the
fp32 bit pattern (as int32) and clear the low 16 bits: the carry into bit 16 happens with probability
(low bits) / 2^16, which is the rounding-up probability we want. Sign-magnitude encoding makes this
symmetric for negative numbers; values already representable have zero low bits and never change; +-inf stay.

Stepping in fp32 without a master copy. `Fp32StepOptimizer` keeps, per low-precision weight, an fp32
*shadow* `nn.Parameter` whose storage is empty between steps: to step weight p it fills the shadow with
p.float() and p.grad.float() (allocations: one fp32 copy of p and of its gradient, live for one parameter
only), runs the inner torch optimizer on that one shadow (fp32 state, keyed by the shadow), rounds the result
back into p and drops the fp32 copy. So the optimizer state is fp32 but, by default, no full fp32 master copy of
the model is kept (that costs 4 bytes/param, 48 GB for Flux: the opt-in below). fp32 parameters in the same set
are stepped in place. Parameters are stepped one at a time in the non-fused path too, so fused and unfused runs
match bitwise.

fp32 master weights (`optimizer.master_weights`, `masters=True`). The shadow's fp32 values persist between
steps as an entry of the weight's optimizer state, `state["master"]`: the first step fills it from p.float(), every
later one steps it in place, and p gets it rounded to nearest. Being optimizer state, the master goes wherever that
state goes with no code of its own: packed beside a streamed weight and written back to the pinned host arena with
its block (trainer/offload/fused_state.py), in pinned RAM between steps under StateOffload, only on the owning
process under owned steps (trainer/train/owners.py), on the device for resident weights; and into the checkpoint's
safetensors files, so a resume continues from the exact fp32 values. Cost: 4 bytes per bf16 parameter (Flux.1-dev,
11.9 B: 47.6 GB). What it buys over stochastic rounding: the weights follow the fp32 trajectory exactly, not in
expectation, so many tiny updates add up the same whatever their order; stochastic rounding on top would only
add noise to the bf16 copy (config.py refuses the pair). A state without masters (a checkpoint saved without them)
starts them from the bf16 weights at the next step (`masters_from_weights` counts those after a load); without
`masters`, a loaded master is dropped.

The random bits of weight i at its n-th step come from a generator seeded with hash(seed, i, n): independent of
the order parameters are stepped in (backward order in the fused pass, list order otherwise) and of the
device's global RNG, and reproducible after a resume (the per-weight counts are part of the state dict).

Left out: fp16 stochastic rounding (fp16 training needs loss scaling, which this trainer does not do); the
rare NaN whose low 16 mantissa bits are all ones can turn into a finite number (NaN weights are lost anyway).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from .single import NarrowStep
from .specs import MASTER

_MASK64 = (1 << 64) - 1


def _mix(*values: int) -> int:
    """splitmix64 over the values: well-spread 63-bit seeds from small, correlated integers."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h ^= h >> 31
        h = h * 0x94D049BB133111EB & _MASK64
        h ^= h >> 29
    return h & ((1 << 63) - 1)


def copy_stochastic_(
    dst: torch.Tensor,
    src: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    clobber_src: bool = False,
) -> torch.Tensor:
    """dst (bf16) <- src (fp32) with stochastic rounding. Returns dst.

    Allocates one int32 tensor of random bits the size of src (plus a copy of src unless `clobber_src`, which
    lets the rounding overwrite src's storage).
    """
    if src.dtype != torch.float32 or dst.dtype != torch.bfloat16:
        raise TypeError(f"copy_stochastic_ rounds fp32 into bf16, got {src.dtype} -> {dst.dtype}")
    noise = torch.randint(0, 1 << 16, src.shape, dtype=torch.int32, device=src.device, generator=generator)
    if clobber_src and src.is_contiguous():
        bits = src.view(torch.int32).add_(noise)
    else:
        bits = src.contiguous().view(torch.int32) + noise
    del noise
    bits.bitwise_and_(-65536)  # 0xFFFF0000: keep sign, exponent and the 7 bf16 mantissa bits
    with torch.no_grad():
        # Exact: the value is representable in bf16, so copy_'s round-to-nearest does nothing.
        dst.copy_(bits.view(torch.float32))
    return dst


def stochastic_round(src: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """A new bf16 tensor: src (fp32) rounded stochastically."""
    return copy_stochastic_(torch.empty_like(src, dtype=torch.bfloat16), src, generator)


class Fp32StepOptimizer:
    """An optimizer over (partly) low-precision weights with fp32 state and fp32 math.

    Duck-types the parts of `torch.optim.Optimizer` the trainer uses: `step()`, `zero_grad()`,
    `param_groups` (the inner optimizer's, so schedulers write the live lr), `state_dict()` /
    `load_state_dict()`. Adds `step_param(p)` (the fused back pass calls it from p's gradient hook) and
    `state_of(p)` (p's optimizer state dict, for offload hooks).

    make_optimizer: builds the inner torch optimizer from param-group dicts (see build.py `_factory`).
    rounding: "stochastic" (bf16 weights only) or "nearest".
    masters: keep each low-precision weight's fp32 master copy in its optimizer state (module docstring); rounds
    to nearest.
    """

    def __init__(
        self,
        groups: list[dict[str, Any]],
        make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
        *,
        rounding: Literal["stochastic", "nearest"] = "stochastic",
        seed: int = 0,
        masters: bool = False,
    ):
        if rounding not in ("stochastic", "nearest"):
            raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}")
        if masters and rounding != "nearest":
            raise ValueError("fp32 master weights round to nearest (stochastic rounding would only add noise)")
        self.rounding = rounding
        self.masters = masters
        self.masters_from_weights = 0  # after a load: weights with state but no master (it starts from p)
        self.seed = seed
        self.params: list[torch.Tensor] = []
        self._key: dict[
            torch.Tensor, torch.Tensor
        ] = {}  # weight -> optimizer key (itself, or its fp32 shadow)
        inner_groups = []
        for g in groups:
            keys = []
            for p in g["params"]:
                if p in self._key:
                    raise ValueError("a parameter appears twice in the optimizer's groups")
                k = p if p.dtype == torch.float32 else torch.nn.Parameter(_empty_fp32(p.device))
                self._key[p] = k
                self.params.append(p)
                keys.append(k)
            inner_groups.append({**g, "params": keys})
        self._index = {p: i for i, p in enumerate(self.params)}
        self.optimizer = make_optimizer(inner_groups)
        self._narrow = NarrowStep(self.optimizer)
        self._counts = [0] * len(self.params)  # how often each weight was rounded back (seeds the bits)
        self._generators: dict[torch.device, torch.Generator] = {}

    # ------------------------------------------------------------------------------------- optimizer API

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def key_of(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor the inner optimizer knows weight p by: p itself (fp32) or its fp32 shadow."""
        return self._key[p]

    def state_of(self, p: torch.Tensor) -> dict[str, Any]:
        """The optimizer state dict of weight p (empty before its first step)."""
        return self.optimizer.state[self._key[p]]

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step every weight that has a gradient, one at a time, and free its gradient."""
        loss = closure() if closure is not None else None
        for p in self.params:
            if p.grad is not None:
                self.step_param(p)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    @torch.no_grad()
    def step_param(self, p: torch.Tensor) -> None:
        """Step weight p with its gradient and free the gradient. No-op when p has no gradient."""
        if p.grad is None:
            return
        k = self._key[p]
        if k is p:  # fp32 weight: the optimizer steps it in place
            self._narrow(p)
            p.grad = None
            return
        master = self.optimizer.state[k].get(MASTER) if self.masters else None
        # allocation (no master yet, or none kept): fp32 copy of this weight only; with masters it becomes the master
        k.data = p.detach().to(torch.float32) if master is None else master
        k.grad = p.grad.to(torch.float32)  # allocation: fp32 copy of its gradient
        p.grad = None
        self._narrow(k)
        k.grad = None
        i = self._index[p]
        if self.masters:
            self.optimizer.state[k][MASTER] = k.data  # stepped in place; kept (first step: the copy above)
            p.copy_(k.data)
        elif self.rounding == "stochastic" and p.dtype == torch.bfloat16:
            gen = self._generator(p.device)
            gen.manual_seed(_mix(self.seed, i, self._counts[i]))  # no host-device sync, also on CUDA
            copy_stochastic_(p, k.data, gen, clobber_src=True)
        else:
            p.copy_(k.data)
        self._counts[i] += 1
        k.data = _empty_fp32(p.device)  # drop the fp32 copy

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        return gen

    # ------------------------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict (same layout as a torch optimizer over these weights in fp32) plus
        `rounding_counts`, the per-weight step counts that seed stochastic rounding."""
        sd = self.optimizer.state_dict()
        sd["rounding_counts"] = list(self._counts)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = dict(state_dict)
        counts = sd.pop("rounding_counts", None)
        if counts is not None and len(counts) != len(self._counts):
            raise ValueError(f"state has {len(counts)} rounding counts for {len(self._counts)} parameters")
        self.optimizer.load_state_dict(sd)
        self._counts = [int(c) for c in counts] if counts is not None else [0] * len(self.params)
        states = [self.optimizer.state[k] for k in self._key.values() if k in self.optimizer.state]
        if self.masters:
            self.masters_from_weights = sum(1 for st in states if st and MASTER not in st)
        else:
            for st in states:
                st.pop(MASTER, None)  # saved with masters, resumed without: not carried along

    def __repr__(self) -> str:
        masters = ", fp32 masters" if self.masters else ""
        return f"Fp32StepOptimizer(rounding={self.rounding}{masters}, {self.optimizer!r})"


def _empty_fp32(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32, device=device)
