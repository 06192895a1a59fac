"""Step one parameter of an ordinary torch optimizer, leaving every other parameter alone.

The fused back pass steps each parameter the moment its gradient is complete, so it needs "optimizer.step()
for this one tensor". Instead of one optimizer per parameter (the PyTorch tutorial's pattern, which multiplies
param groups, schedulers and state dicts by the parameter count), we keep ONE optimizer and, for the length of
one `step()`, narrow its `param_groups` to a single group holding a single parameter. Every torch optimizer
(and transformers' Adafactor, bitsandbytes' 8-bit ones) walks `self.param_groups` in `step()` and keys its
state by the parameter object, so the narrowed step reads and writes exactly that parameter's state with its
group's current hyper-parameters (the live `lr` the scheduler wrote). What that buys:

- one scheduler (LambdaLR on the one optimizer) drives every parameter;
- the state dict has the same layout as the non-fused path, so a fused run's checkpoint resumes unfused and
  the other way round;
- each parameter's update is computed by the same kernels as `optimizer.step()` over all of them on the CPU
  (single-tensor implementations loop over parameters), hence bitwise equal results (tested).

Left out: on CUDA, an unfused `torch.optim.AdamW.step()` uses the multi-tensor (foreach) kernels, while a
narrowed step runs them on one-tensor lists; results agree to rounding, not bitwise.
"""

from __future__ import annotations

import torch


class NarrowStep:
    """`narrow(p)` runs `optimizer.step()` as if `p` were its only parameter.

    The group is looked up by index at each call: `Optimizer.load_state_dict` replaces the group dicts (a
    cached dict would keep stepping with the hyper-parameters, e.g. the lr, of before the load). The one-item
    lists are reused, so a step allocates nothing on the Python side. Parameters added to the optimizer later
    (`add_param_group`) are not known to this object.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._one: dict[torch.Tensor, tuple[int, list]] = {}
        for i, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                self._one[p] = (i, [p])
        self._only_group: list[dict] = [{}]

    def __contains__(self, p: torch.Tensor) -> bool:
        return p in self._one

    def __call__(self, p: torch.Tensor) -> None:
        index, only_p = self._one[p]
        opt = self.optimizer
        groups = opt.param_groups
        group = groups[index]
        params = group["params"]
        self._only_group[0] = group
        group["params"], opt.param_groups = only_p, self._only_group
        try:
            opt.step()
        finally:
            group["params"], opt.param_groups = params, groups
            self._only_group[0] = {}
