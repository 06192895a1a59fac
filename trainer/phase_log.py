"""Phases of a run, their measured memory peaks, and out-of-memory errors that name the phase and the fix.

A run goes through a few phases that need different things on the GPU and in host RAM:

    load               the transformer read from disk (and its blocks packed into pinned RAM)
    latent caching     the VAE encodes every image (text encoders already freed)
    text caching       each text encoder encodes every caption (one encoder on the GPU at a time)
    training step      forward and backward through the streamed transformer
    sampling           images made with the model being trained (precomputed prompt embeddings, tiled VAE)
    checkpoint save    weights, optimizer state and generators written to disk

`with Phase("training step", fix=...)` around the code of a phase does two things:

Measure. At entry it resets CUDA's peak counters (`torch.cuda.reset_peak_memory_stats`: no sync, no allocation)
and Linux's peak RSS (writing "5" to /proc/self/clear_refs resets VmHWM); at exit it reads the peak reserved
VRAM and the peak resident set. The peaks of every phase are kept in a `PhaseLog` (largest over the run), so the
trainer can log each phase's measured peak beside the planner's prediction. Peak RSS counts file-backed pages
too (an mmapped safetensors file being read: the kernel drops those under pressure), so the phase lines report
the peak *anonymous* RSS (RssAnon: heap, pinned arena, tensors; what runs a machine out of memory), which Linux
keeps no peak of: a daemon thread samples /proc/self/status every 50 ms (about 20 us a read) and the phase
keeps the largest value since its entry. Where clear_refs cannot be written (not Linux, or a restricted /proc)
the RSS peak is the process's lifetime peak and says so; without RssAnon the lines fall back to all of RSS.

Own cache. A phase that runs between training steps with other tensor sizes (sampling, validation) is given
`own_cache=True`: CUDA's caching allocator is emptied at entry (before the peak reset) and at exit. The free
blocks the training step left cached are cut to its own sizes; without this the phase reserves new segments
beside them, and the training step after it beside the phase's, so both peaks rise (SD3.5-large's sampling
during training reserved 0.79 GB more than its training step, bench/history/2026-11-23.md). Emptying costs a few
cudaMalloc calls in the next step; these phases are rare.

Fail with one line. `torch.OutOfMemoryError` (the CUDA allocator) or `MemoryError` (host) raised inside the
phase becomes a `PhaseOutOfMemory` (a UserError: one line, non-zero exit, no traceback) that names the phase,
what it tried to allocate against what was free (parsed from torch's message: "Tried to allocate 2.00 GiB.
GPU 0 has a total capacity of 7.00 GiB of which 1.10 GiB is free"), and the setting that fixes that phase.
Checkpoints are written atomically (checkpoint.py), so an error in any phase leaves every finished one intact.
An error already turned into one line (a nested phase) passes through unchanged.
"""

from __future__ import annotations

import json
import os
import re
import resource
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import UserError

PHASES = ("load", "latent caching", "text caching", "training step", "sampling", "checkpoint save")

#: what fixes each phase when it runs out of memory (the trainer adds run-specific detail for training)
FIXES = {
    "load": "raise offload.transformer (more of the model stays in CPU RAM), or free host RAM for the pinned "
            "blocks",
    "latent caching": "lower data.resolutions or data.encode_batch_size (the VAE encodes tiled above "
                      "1024x1024 pixels, and a video's clips where their untiled encode does not fit the GPU)",
    "text caching": "raise offload.text_encoders (the text encoder streams from CPU RAM), or lower "
                    "data.encode_batch_size",
    "training step": "raise offload.transformer, or set offload.activations: true, or lower train.batch_size or "
                     "data.resolutions",
    "sampling": "set sample.every: 0 (sample after training with `dittrain sample`), or lower sample.width / "
                "sample.height",
    "checkpoint save": "free host RAM (what the GPU holds of the weights and optimizer state is copied to CPU RAM "
                       "to be written)",
}

_GIB = 2**30
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


class PhaseOutOfMemory(UserError):
    """Out of memory in a named phase; `str()` is the one line the CLI prints."""

    exit_code = 4


@dataclass
class PhasePeak:
    vram_reserved: int = 0  #: bytes, CUDA peak reserved (0 off CUDA)
    rss: int = 0  #: bytes, peak resident set of the process
    anon: int = 0  #: bytes, peak anonymous resident memory (sampled; 0 where /proc has no RssAnon)
    rss_reset: bool = False  #: whether the RSS peak was reset at entry (else it is the lifetime peak)
    runs: int = 0


@dataclass
class PhaseLog:
    """Peaks per phase name, the largest over the run."""

    peaks: dict[str, PhasePeak] = field(default_factory=dict)

    def record(self, name: str, vram: int, rss: int, rss_reset: bool, anon: int = 0) -> PhasePeak:
        p = self.peaks.setdefault(name, PhasePeak())
        p.vram_reserved, p.rss, p.anon = max(p.vram_reserved, vram), max(p.rss, rss), max(p.anon, anon)
        p.rss_reset = p.rss_reset or rss_reset
        p.runs += 1
        return p

    def lines(self, predicted: dict[str, tuple[float, float]] | None = None) -> list[str]:
        """One line per phase: measured peaks, and the planner's (VRAM, RAM) bytes where given."""
        out = []
        for name in [n for n in PHASES if n in self.peaks] + [n for n in self.peaks if n not in PHASES]:
            p = self.peaks[name]
            line = f"phase {name}: peak reserved VRAM {p.vram_reserved / 1e9:.2f} GB, {ram_words(p)}"
            if predicted and name in predicted:
                v, r = predicted[name]
                line += f" (predicted {v / 1e9:.2f} GB VRAM, {r / 1e9:.1f} GB RAM)"
            out.append(line)
        return out


#: the process-wide log the phases write to (the trainer and `dittrain cache` read it)
LOG = PhaseLog()


def ram_words(p: PhasePeak) -> str:
    """The host-RAM part of a phase line: peak anonymous RSS, all of RSS beside it (file pages included)."""
    if not p.anon:
        return f"peak RSS {p.rss / 1e9:.1f} GB"
    return f"peak anonymous RSS {p.anon / 1e9:.1f} GB (all RSS with file pages {p.rss / 1e9:.1f} GB)"


class _AnonPeak:
    """The largest RssAnon since `reset()`, sampled by one daemon thread (Linux keeps no peak of it)."""

    def __init__(self) -> None:
        self._peak, self._thread = 0, None
        self._lock = threading.Lock()

    def _run(self) -> None:
        while True:
            time.sleep(0.05)
            v = anon_rss()
            with self._lock:
                self._peak = max(self._peak, v)

    def reset(self) -> None:
        if self._thread is None and anon_rss():
            self._thread = threading.Thread(target=self._run, name="dittrain-anon-rss", daemon=True)
            self._thread.start()
        with self._lock:
            self._peak = anon_rss()

    def read(self) -> int:
        v = anon_rss()
        with self._lock:
            self._peak = max(self._peak, v)
            return self._peak


_ANON = _AnonPeak()


def _reset_rss_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _status_kb(key: str) -> int | None:
    """A `key:` line of /proc/self/status in bytes (None where there is no such file or line)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss() -> int:
    """Peak resident set in bytes since the last reset (VmHWM), or the lifetime peak from getrusage."""
    hwm = _status_kb("VmHWM")
    if hwm is not None:
        return hwm
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def anon_rss() -> int:
    """Current anonymous resident memory in bytes (RssAnon): the host RAM not backed by a file."""
    return _status_kb("RssAnon") or 0


def _size(text: str) -> float | None:
    m = re.match(r"\s*([\d.]+)\s*(B|KiB|MiB|GiB|TiB)", text)
    return float(m.group(1)) * _UNITS[m.group(2)] if m else None


def parse_oom(message: str) -> tuple[float | None, float | None, float | None]:
    """(tried to allocate, free, total) in bytes from torch's CUDA OOM message; None where absent."""
    tried = re.search(r"Tried to allocate ([\d.]+\s*\w+)", message)
    total = re.search(r"total capacity of ([\d.]+\s*\w+)", message)
    free = re.search(r"of which ([\d.]+\s*\w+) is free", message)
    return tuple(_size(m.group(1)) if m else None for m in (tried, free, total))  # type: ignore[return-value]


def oom_detail(error: BaseException, device: torch.device | None = None) -> tuple[str, str]:
    """("GPU" or "host RAM", "tried to allocate X GiB with Y GiB free of Z GiB") for an out-of-memory error."""
    if isinstance(error, torch.OutOfMemoryError):
        tried, free, total = parse_oom(str(error))
        if free is None and torch.cuda.is_available():
            try:
                free_b, total_b = torch.cuda.mem_get_info(device)
                free, total = float(free_b), float(total_b)
            except RuntimeError:
                pass
        need = f"tried to allocate {tried / _GIB:.2f} GiB" if tried is not None else "an allocation failed"
        have = f" with {free / _GIB:.2f} GiB free" if free is not None else ""
        of = f" of {total / _GIB:.1f} GiB" if total is not None else ""
        return "GPU", f"{need}{have}{of}"
    return "host RAM", f"a host allocation failed (peak RSS {peak_rss() / _GIB:.1f} GiB)"


def oom_line(name: str, error: BaseException, fix: str | None = None, device: torch.device | None = None) -> str:
    """The one line for an out-of-memory error in phase `name`."""
    where, detail = oom_detail(error, device)
    return f"out of {where} in phase {name}: {detail}; fix: {fix or FIXES.get(name, 'lower the batch size or resolution')}"


def _write_record(name: str, t0: float, vram: int, rss: int, error, allocated: int = 0) -> None:
    """With DITTRAIN_PHASE_LOG=FILE, one JSON line per phase run (bench/program/bench_program.py reads them)."""
    path = os.environ.get("DITTRAIN_PHASE_LOG")
    if not path:
        return
    rec = {"phase": name, "start": t0, "end": time.time(), "vram_reserved": vram, "vram_allocated": allocated,
           "rss": rss, "anon_rss": anon_rss(), "error": type(error).__name__ if error is not None else None,
           "rank": int(os.environ.get("RANK", "0") or 0)}
    try:
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
    except OSError:
        pass  # a measurement must never replace the phase's own outcome


def apply_vram_cap() -> float | None:
    """DITTRAIN_VRAM_CAP_GB=N (for benchmarks): cap this process's CUDA allocations at N GB of the card with
    `torch.cuda.set_per_process_memory_fraction`, as if the card were that small. Returns the cap or None."""
    cap = os.environ.get("DITTRAIN_VRAM_CAP_GB")
    if not cap or not torch.cuda.is_available():
        return None
    gpu = int(os.environ.get("LOCAL_RANK", "0") or 0)  # torchrun: this process's GPU
    total = torch.cuda.get_device_properties(gpu).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, float(cap) * 1e9 / total), gpu)
    return float(cap)


class Phase:
    """Context manager for one phase (see the module essay). `fix` overrides the phase's default advice;
    `message(detail)` replaces the whole line (the trainer's training step keeps its step-numbered advice and adds
    the phase and `detail`); `on_exit(name, peak)` is called after a phase that ended normally (the trainer logs
    the first one of each)."""

    def __init__(self, name: str, fix: str | None = None, *, device: torch.device | None = None,
                 log: PhaseLog | None = None, on_exit=None, message=None, own_cache: bool = False) -> None:
        self.name, self.fix, self.log, self.on_exit, self.message = name, fix, log or LOG, on_exit, message
        self.own_cache = own_cache
        self.device = device if device is not None else (torch.device("cuda") if torch.cuda.is_available() else None)
        self._cuda = self.device is not None and self.device.type == "cuda" and torch.cuda.is_available()
        self.peak: PhasePeak | None = None

    def __enter__(self) -> Phase:
        if self._cuda and self.own_cache:
            torch.cuda.empty_cache()
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._rss_reset = _reset_rss_peak()
        _ANON.reset()
        self._t0 = time.time()
        return self

    def _record(self, name: str, error=None) -> PhasePeak:
        """The peaks since entry (reserved and allocated VRAM, RSS) into the log and the phase-log file."""
        vram = torch.cuda.max_memory_reserved(self.device) if self._cuda else 0
        alloc = torch.cuda.max_memory_allocated(self.device) if self._cuda else 0
        rss, anon = peak_rss(), _ANON.read()
        _write_record(name, self._t0, vram, rss, error, alloc)
        return self.log.record(name, vram, rss, self._rss_reset, anon)

    def mark(self, part: str) -> None:
        """Record the peaks so far under "<phase> (<part>)" without resetting them: where a phase has two steps
        (sampling: denoising, then decoding), the mark before the second tells which one set the phase's peak."""
        self._record(f"{self.name} ({part})")

    def __exit__(self, kind, error, tb) -> bool:
        self.peak = self._record(self.name, error)
        if self._cuda and self.own_cache:
            torch.cuda.empty_cache()
        if error is None:
            if self.on_exit is not None:
                self.on_exit(self.name, self.peak)
            return False
        if isinstance(error, PhaseOutOfMemory):
            return False
        if isinstance(error, torch.OutOfMemoryError | MemoryError):
            if self._cuda:
                torch.cuda.empty_cache()  # let whatever runs next (a save on the way out) find memory
            if self.message is not None:
                where, detail = oom_detail(error, self.device)
                raise PhaseOutOfMemory(self.message(f"out of {where} in phase {self.name}: {detail}")) from None
            raise PhaseOutOfMemory(oom_line(self.name, error, self.fix, self.device)) from None
        return False


def measured(name: str, fn, fix: str | None = None):
    """`fn` run inside `Phase(name, fix)` (its peaks recorded; an out-of-memory error `fn` did not already turn
    into one line becomes the phase's line)."""

    def run(*args, **kwargs):
        with Phase(name, fix):
            return fn(*args, **kwargs)

    return run
