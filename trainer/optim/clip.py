"""Global gradient-norm clipping for the unfused path, without a host sync on ordinary steps.

`torch.nn.utils.clip_grad_norm_` computes the norm and scales the gradients by min(1, max_norm / norm) on the
device, so clipping itself never waits for the GPU. Reading the norm as a Python float does; we do that only
when the caller asks for the value (logging steps). With the fused back pass there is nothing to clip: the
config validator rejects `max_grad_norm` there, and `FusedBackPass.track_grad_norm` measures the norm instead.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def clip_grad_norm(
    params: Iterable[torch.Tensor], max_norm: float | None, *, want_value: bool = False
) -> float | None:
    """Clip the gradients of `params` to a global L2 norm of `max_norm` (None: do not clip).

    Returns the norm before clipping as a float when `want_value` (one host-device sync, here), else None.
    A non-finite norm is not an error here (that would sync every step): it is returned on logging steps.
    """
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad or (max_norm is None and not want_value):
        return None
    if max_norm is None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in with_grad])
    else:
        norm = torch.nn.utils.clip_grad_norm_(with_grad, max_norm)  # scales on the device, no sync
    return float(norm) if want_value else None  # float(): host-device sync, logging steps only
