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

A block class may carry `dynamo_config` (a dict of `torch._dynamo.config` settings): they hold while its compiled
forward is traced and run. HiDream's (trainer/models/hidream.py) has dynamo capture the sizes of its experts'
token masks, which would otherwise break the graph and compile each expert again for every routing.

Shapes. `dynamic=False` (default): one compile per bucket shape, the fastest kernels, compile time growing with
the number of buckets. `dynamic="tokens"`: before every call the token axes of the block's inputs are
marked dynamic (`torch._dynamo.maybe_mark_dynamic`: every axis of a floating or complex input but its last, the
feature axis, and axes of size 1), so the first compile is already symbolic in the sequence lengths and later
buckets reuse it: one compile per run, while the model widths stay static for the matmul kernels.
`dynamic=True`: every dimension symbolic (torch's `dynamic=True`), widths included; measured 88 s of compile for
a 2 % slower step on Qwen-Image (bench/RESULTS.md). bench/speed/bench_speed.py measures them.

Compile cache (`use_cache(folder)`, `train.compile_cache`). Inductor keeps what it compiled on disk, keyed by the
graph, the inputs' properties and the torch / triton versions: the FX graph cache (each generated kernel module),
the AOTAutograd cache (forward + backward pair, so a hit skips the backward compile too), triton's kernel binaries
and dynamo's record of which dimensions turned dynamic. `use_cache` points all of it at one folder (env
`TORCHINDUCTOR_CACHE_DIR`, which inductor reads at each use; triton's folder lies under it unless
`TRITON_CACHE_DIR` is set), so a re-run or `--resume` finds the previous run's kernels beside the data cache
instead of in /tmp. The files are torch's own; nothing here writes or reads them. Dynamo still traces each block
class again in a new process (seconds), and inductor then loads instead of compiling. The folder gets one
subfolder per CPU vector ISA (`cpu-avx2`, `cpu-avx512`, `cpu-default`, ...): torch 2.13 keys an FX graph by the
thread count but not by the ISA its C++ kernels were generated for (a kernel written under
ATEN_CPU_CAPABILITY=default loads as a hit under AVX2), so a data cache on a disk that machines of different CPUs
share would hand one machine the other's kernels.

Compile time is measured here (`report()`): the time spent in calls that produced a new graph, with the cache's
hits and misses. Inductor compiles the backward graph lazily, at the first backward, so the first step's time
(logged by the loop) is the full cost.

Backend: inductor; `DITTRAIN_COMPILE_BACKEND` (e.g. `aot_eager`, `eager`) overrides it, for CPU tests.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class CompileOptions:
    """How the blocks are compiled. `shapes`: how many input shapes (aspect-ratio buckets) to expect."""

    backend: str = field(default_factory=lambda: os.environ.get("DITTRAIN_COMPILE_BACKEND", "inductor"))
    #: False: static shapes (one compile per bucket); "tokens": token axes marked dynamic; True: all symbolic
    dynamic: bool | str = False
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


def mark_token_axes(x) -> None:
    """`maybe_mark_dynamic` every axis but the last (and but those of size 1) of each floating or complex tensor
    in `x` (nested tuples / lists / dicts too): the sequence axes of a block's inputs (see the essay)."""
    if isinstance(x, torch.Tensor):
        if x.ndim >= 2 and (x.is_floating_point() or x.is_complex()):
            for d in range(x.ndim - 1):
                if x.shape[d] > 1:
                    torch._dynamo.maybe_mark_dynamic(x, d)
    elif isinstance(x, tuple | list):
        for y in x:
            mark_token_axes(y)
    elif isinstance(x, dict):
        for y in x.values():
            mark_token_axes(y)


def forward_of(cls: type, opts: CompileOptions):
    """The compiled `cls.forward` (called with the block as first argument); compiled lazily, once per class."""
    key = (cls, opts.backend, opts.dynamic, opts.mode)
    fn = _COMPILED.get(key)
    if fn is None:
        _raise_limit(opts)
        tokens = opts.dynamic == "tokens"
        dynamo = dict(getattr(cls, "dynamo_config", {}))  # the class's own tracing settings (see the essay)
        # "tokens": torch's default (None: static first, automatic dynamic after) plus the marks made below
        compiled = torch.compile(cls.forward, backend=opts.backend, dynamic=None if tokens else bool(opts.dynamic),
                                 mode=opts.mode)

        def fn(*args, **kwargs):
            if tokens:
                mark_token_axes(args[1:])  # args[0] is the block (its parameters keep their static shapes)
                mark_token_axes(kwargs)
            before = _graphs()
            t0 = time.perf_counter()
            with torch._dynamo.config.patch(**dynamo) if dynamo else contextlib.nullcontext():
                out = compiled(*args, **kwargs)
            if _graphs() != before:  # a new graph was traced and compiled in this call
                _STATS["graphs"] += _graphs() - before
                _STATS["seconds"] += time.perf_counter() - t0
            return out

        _COMPILED[key] = fn
    return fn


def stats() -> dict:
    """Graphs compiled by `forward_of` so far, the seconds spent in the calls that compiled them, and torch's
    compile-cache counters of this process (AOTAutograd: forward + backward pairs; FX graph: kernel modules)."""
    from torch._dynamo.utils import counters

    return {"classes": len(_COMPILED), "graphs": _STATS["graphs"], "seconds": _STATS["seconds"],
            "aot_hits": int(counters["aot_autograd"]["autograd_cache_hit"]),
            "aot_misses": int(counters["aot_autograd"]["autograd_cache_miss"]),
            "fx_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
            "fx_misses": int(counters["inductor"]["fxgraph_cache_miss"])}


def use_cache(folder: str | os.PathLike) -> str:
    """Keep inductor's compile caches in `folder`'s subfolder for this CPU's vector ISA (created) from now on in
    this process; returns it. See the essay: the files are torch's own."""
    path = os.path.join(os.path.abspath(os.fspath(folder)), _cpu_key())
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    _STATS["cache"] = path
    return path


def _cpu_key() -> str:
    """The compile cache's subfolder: the CPU's vector ISA as ATen dispatches it (ATEN_CPU_CAPABILITY counted, as
    inductor counts it), AMX noted (inductor's AVX-512 GEMM kernels use its tiles where it is present). Read from
    cpuinfo: no compiler probe (inductor's own `pick_vec_isa` compiles one: 1-7 s)."""
    cap = torch.backends.cpu.get_cpu_capability().lower()
    amx = cap.startswith("avx512") and getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return f"cpu-{cap}{'-amx' if amx else ''}"


def later_compile_line(before: dict, step: int, step_s: float) -> str | None:
    """The log line for a training step after the first that compiled new block graphs (`before`: `stats()` at the
    step's start), else None: a new bucket shape's compile costs its step tens of seconds, and a slow step with
    this line is explained by it, one without it is not (the first step's compile has its own line, `report`)."""
    now = stats()
    new = now["graphs"] - before["graphs"]
    if step <= 1 or new <= 0:
        return None
    return (f"compile: step {step} compiled {new} more block graph{'s' if new > 1 else ''} in "
            f"{now['seconds'] - before['seconds']:.1f} s of its {step_s:.1f} s (a new input shape or grad mode; "
            f"{now['graphs']} in all)")


def report(once: bool = True) -> str | None:
    """One line about compilation for the log; None when nothing compiled (or, with `once`, after the first)."""
    if not _STATS["graphs"] or (once and _STATS["reported"]):
        return None
    _STATS["reported"] = True
    s = stats()
    line = (f"compile: {s['graphs']} block graphs for {s['classes']} block classes in {s['seconds']:.1f} s "
            "(forward; the backward compiles within the first step)")
    if s["aot_hits"] + s["aot_misses"] + s["fx_hits"] + s["fx_misses"]:
        line += (f"; cache {s['aot_hits']} of {s['aot_hits'] + s['aot_misses']} forward+backward graphs and "
                 f"{s['fx_hits']} of {s['fx_hits'] + s['fx_misses']} kernel modules loaded")
        if _STATS.get("cache"):
            line += f" ({_STATS['cache']})"
    return line


def reset() -> None:
    """Forget every compiled function (and torch's caches): benchmarks between rows, tests."""
    _COMPILED.clear()
    _STATS.update(graphs=0, seconds=0.0, reported=False)
    from torch._dynamo.utils import counters

    for k in ("aot_autograd", "inductor"):  # the cache counters report() reads, per run
        counters[k].clear()
    torch._dynamo.reset()
