"""Meta-device ops run once per layout of their arguments.

The planner runs whole models on the meta device (trainer/planner/trace.py: a transformer's training forward;
trainer/planner/vae.py: a VAE's chunked encode or decode) to count what they hold, and torch runs most meta kernels
in Python (~1-4 ms an op on 2 CPU cores, ~100x the dispatch itself). Those runs repeat the same ops on the same
shapes: a transformer's 20-60 identical blocks, a video VAE's time chunks. A meta tensor has no values, so an op
whose outputs are new tensors (no view of an input, nothing written in place) gives outputs of the same layouts
each time its arguments have the same layouts: `MetaOps.run` runs such an op once per layout and remakes its
outputs (`empty_strided`) after. Real tensors are never cached (the key refuses them), nor views (they share their
input's storage, which the counts read), in-place ops, or outputs `empty_strided` would not remake exactly (on
shared storage, at an offset, or a storage larger than the tensor).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class MetaOps:
    """Runs aten ops, each op that makes new meta tensors once per layout of its arguments (module essay);
    `reused`: the calls answered from an earlier one."""

    def __init__(self) -> None:
        self.reused = 0
        self._made: dict[tuple, list | tuple | None] = {}  # (op, its arguments' layouts) -> outputs' (None: run it)

    def run(self, func, args, kwargs):
        schema = func._schema
        if schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
            return func(*args, **kwargs)
        try:
            key = (func, _key(args), _key(kwargs))
        except _Uncached:
            return func(*args, **kwargs)
        if (made := self._made.get(key)) is not None:
            self.reused += 1
            outs = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in made]
            return tuple(outs) if isinstance(made, tuple) else outs[0]
        out = func(*args, **kwargs)
        if key not in self._made:
            self._made[key] = _layouts(out)
        return out


class MetaOpCache(TorchDispatchMode):
    """A dispatch mode that runs every op through one `MetaOps`. Entered before (under) the modes that count ops,
    so that they still see each op."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = MetaOps()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.ops.run(func, args, kwargs or {})


def _key(x):
    """A hashable description of one argument of an op on meta tensors: a tensor by its layout (a meta tensor has
    nothing else), lists as tuples; `_Uncached` where something cannot be a key."""
    if isinstance(x, torch.Tensor):
        if not x.is_meta:
            raise _Uncached
        return ("T", tuple(x.shape), x.stride(), x.dtype, x.storage_offset())
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *map(_key, x))
    if isinstance(x, dict):
        return ("D", *((k, _key(v)) for k, v in sorted(x.items())))
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                   torch.memory_format)):
        return x
    raise _Uncached


class _Uncached(Exception):
    pass


def _layouts(out) -> list | tuple | None:
    """The (shape, stride, dtype) of each of an op's outputs, a list for one tensor and a tuple for a tuple of them,
    where `empty_strided` remakes them exactly: meta tensors, each on a storage of its own that starts at its first
    element and holds just its elements (else None: the op is run each time)."""
    outs = out if isinstance(out, tuple) else (out,)
    if not outs or not all(isinstance(t, torch.Tensor) and t.is_meta for t in outs):
        return None
    if len({t.untyped_storage()._cdata for t in outs}) < len(outs):
        return None
    made = []
    for t in outs:
        like = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        if t.storage_offset() or like.untyped_storage().nbytes() != t.untyped_storage().nbytes():
            return None
        made.append((tuple(t.shape), t.stride(), t.dtype))
    return tuple(made) if isinstance(out, tuple) else made
