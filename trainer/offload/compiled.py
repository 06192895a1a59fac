"""Regional compilation of the blocks: one `torch.compile`d forward per block class, shared by every block of it.

How. `StreamedBlock._compute` (trainer/offload/block.py) calls `forward_of(plain_cls, options)(self, ...)`: the
plain class's own `forward` function compiled once (one compiled function per class and options, kept here)
and called with the block as its first argument, as diffusers' `compile_repeated_blocks` does per instance. With
torch's default `inline_inbuilt_nn_modules`, dynamo treats the block's parameters as graph inputs rather than
constants, so all blocks of a class run the same compiled code, and so do ring views: when the conductor points
a parameter's `.data` at another region of its ring the guards (shape, stride, dtype, device) still hold and
nothing recompiles (tests/test_compile.py counts compiled graphs to show it). The conductor's calls, the
checkpoint, the release identity and the activation offloader's hooks all stay eager around the compiled region;
only the block's own arithmetic is compiled (LoRA layers and fp8 dequantization inside it included).

What makes a new compiled graph (a "variant"): a new input shape (one per aspect-ratio bucket with
`dynamic=False`), grad mode (training forward vs sampling), and inputs that differ in `requires_grad` or
strides: the first block of a list gets inputs that carry no gradient in LoRA training (its inputs come from
frozen embedders), and in sampling Flux's first single block gets a contiguous input where the others get a slice.
So per block class and bucket shape there are at most two variants per grad mode, whatever the number of
blocks. Dynamo's per-function recompile limit (8 by default) is raised to fit `shapes` bucket shapes.

Shapes. `dynamic=False` (default): one compile per bucket shape, the fastest kernels, compile time growing with
the number of buckets. `dynamic=True`: the token dimension (and every other) is symbolic, one compile for all
buckets; kernels may be slower. bench/bench_speed.py measures both.

Compile time is measured here (`report()`): the time spent in calls that produced a new graph. Inductor compiles
the backward graph lazily, at the first backward, so the first step's time (logged by the loop) is the full cost.

Backend: inductor; `DITTRAIN_COMPILE_BACKEND` (e.g. `aot_eager`, `eager`) overrides it, for CPU tests.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class CompileOptions:
    """How the blocks are compiled. `shapes`: how many input shapes (aspect-ratio buckets) to expect."""

    backend: str = field(default_factory=lambda: os.environ.get("DITTRAIN_COMPILE_BACKEND", "inductor"))
    dynamic: bool = False
    shapes: int = 8
    mode: str | None = None


def options(compile) -> CompileOptions | None:
    """`attach_offload`'s `compile` argument: False / None (eager), True (defaults), or CompileOptions."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return CompileOptions()
    if isinstance(compile, CompileOptions):
        return compile
    raise TypeError(f"compile must be a bool or CompileOptions, not {type(compile).__name__}")


_COMPILED: dict[tuple, object] = {}
_STATS = {"graphs": 0, "seconds": 0.0, "reported": False}


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _raise_limit(opts: CompileOptions) -> None:
    """Two grad modes x two variants per shape (see the essay), plus room: never below torch's own setting."""
    cfg = torch._dynamo.config
    need = 4 * max(1, opts.shapes) + 4
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), need))
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * need)


def forward_of(cls: type, opts: CompileOptions):
    """The compiled `cls.forward` (called with the block as first argument); compiled lazily, once per class."""
    key = (cls, opts.backend, opts.dynamic, opts.mode)
    fn = _COMPILED.get(key)
    if fn is None:
        _raise_limit(opts)
        compiled = torch.compile(cls.forward, backend=opts.backend, dynamic=opts.dynamic, mode=opts.mode)

        def fn(*args, **kwargs):
            before = _graphs()
            t0 = time.perf_counter()
            out = compiled(*args, **kwargs)
            if _graphs() != before:  # a new graph was traced and compiled in this call
                _STATS["graphs"] += _graphs() - before
                _STATS["seconds"] += time.perf_counter() - t0
            return out

        _COMPILED[key] = fn
    return fn


def stats() -> dict:
    """Graphs compiled by `forward_of` so far and the seconds spent in the calls that compiled them."""
    return {"classes": len(_COMPILED), "graphs": _STATS["graphs"], "seconds": _STATS["seconds"]}


def report(once: bool = True) -> str | None:
    """One line about compilation for the log; None when nothing compiled (or, with `once`, after the first)."""
    if not _STATS["graphs"] or (once and _STATS["reported"]):
        return None
    _STATS["reported"] = True
    s = stats()
    return (f"compile: {s['graphs']} block graphs for {s['classes']} block classes in {s['seconds']:.1f} s "
            "(forward; the backward compiles within the first step)")


def reset() -> None:
    """Forget every compiled function (and torch's caches): benchmarks between rows, tests."""
    _COMPILED.clear()
    _STATS.update(graphs=0, seconds=0.0, reported=False)
    torch._dynamo.reset()
