"""What happens when a run is stopped or breaks.

Ctrl-C / SIGTERM. The first signal only sets a flag: the current step finishes (a step cut in half would leave
the optimizer state and the weights out of step), the loop sees the flag, saves a resumable checkpoint and ends
with exit code 130 (SIGINT) or 143 (SIGTERM), as shells report them. A second signal raises `KeyboardInterrupt`
at once, wherever the program is; its line still says how to continue. That is safe for the checkpoints because
every one is written under a temporary name and renamed into place only when complete: the worst a second Ctrl-C
can do is leave a `.tmp-*` folder, which the next run deletes. Before the first step (loading, caching) there is
no step to finish, so the first signal stops at once (`install(at_once=True)`); cache entries are written whole
(temp file + rename), so every one already written is kept and the next run reuses it.

Non-finite loss. The loss is checked before backward: with the fused back pass the optimizer steps inside
backward, so a check afterwards would come after the weights changed. The error names the step and the batch's
files (a broken image is the usual cause) and nothing is saved, so the last good checkpoint stays the newest.

Non-finite weights. A NaN or inf gradient under a finite loss (an overflow inside backward) steps weights to NaN
without tripping the loss check. Every save first checks the trained weights (one float32 norm per tensor) and
refuses to write non-finite ones (`NonFiniteWeightsError`, exit code 3, naming the weight and the last good
checkpoint); the next step's loss check would stop the run anyway, this keeps the bad weights off the disk.

A failing sampling pass during training (trainer.py `_sampling_pass`) is not a fault of the run: one line, sampling
off for the rest of it, training goes on (except under fsdp or a sharded stream, whose other ranks may be inside
the failed call).

Out of memory (GPU or host) becomes a one-line `UserError` naming the phase it happened in (trainer/
phase_log.py: load, latent / text caching, training step, sampling, checkpoint save), what it needed against what
was free, and the setting that fixes that phase; for the training step (`training_fix`) a higher offload
fraction than the one the run streamed with (for `offload.transformer: auto`, the float the planner picked),
else activation offloading, a smaller batch or resolution. `oom_error` is the fallback for an error outside
any phase.
"""

from __future__ import annotations

import signal
import threading

import torch

from ..errors import Interrupted, UserError


class TrainingInterrupted(Interrupted):
    """The run stopped on request after saving a resumable checkpoint (or at once, on a second signal). Not an
    error: the CLI prints the line without "error:" (exit code 130 for SIGINT, 143 for SIGTERM)."""


class StopFlag:
    """Installs SIGINT/SIGTERM handlers for the duration of a run (main thread only)."""

    def __init__(self, say=print):
        self.requested = False
        self.signal_name = ""
        self.at_once = False
        self._say = say
        self._previous: dict[int, object] = {}

    def handler(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        name = signal.Signals(signum).name
        if self.requested or self.at_once:
            raise KeyboardInterrupt(name)
        self.requested, self.signal_name = True, name
        self._say(f"{name}: finishing this step and saving a checkpoint (press Ctrl-C again to quit at once)")

    def install(self, at_once: bool = False) -> None:
        """Handle SIGINT / SIGTERM from now on; `at_once`: the first signal already stops (nothing to finish)."""
        self.at_once = at_once
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; run without them
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous.setdefault(sig, signal.getsignal(sig))  # installed twice: the first one's to restore
            signal.signal(sig, self.handler)

    def restore(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()


def nan_fixes(cfg) -> str:
    """What usually makes a loss go NaN, as settings of this config to change: too high a learning rate (most
    often), no gradient clipping, no warmup, fp16's small range."""
    o = cfg.optimizer
    fixes = [f"lower optimizer.lr (now {o.lr:g}, try {o.lr / 4:g})"]
    if o.max_grad_norm is None:
        fixes.append("set optimizer.max_grad_norm: 1.0 (gradient clipping)")
    if not o.warmup_steps:
        fixes.append("set optimizer.warmup_steps (e.g. 100)")
    if cfg.model.dtype == "fp16":
        fixes.append("use model.dtype: bf16 (fp16 overflows)")
    return ", ".join(fixes)


def training_fix(fraction: float | None, hint: str = "") -> str:
    """The setting that fixes an out-of-memory training step: a higher offload fraction than the one the run
    streamed with, else activation offloading, a smaller batch or resolution; `hint` is the method's advice."""
    if fraction is not None and fraction < 1.0:
        more = min(1.0, round(fraction + 0.25, 2))
        knob = f"raise offload.transformer from {fraction:g} to {more:g} (or auto with offload.vram_budget_gb)"
    else:
        knob = "set offload.activations: true, or lower train.batch_size or data.resolutions"
    return f"{knob}{hint}"


def oom_error(step: int, fraction: float | None, hint: str = "") -> UserError:
    """The message for a CUDA out-of-memory error in training. `fraction` is the offload fraction the run
    streamed with, resolved (for `offload.transformer: auto`, the planner's pick), or None if the error came
    before it was known; below 1 the message suggests a higher one. `hint` is the training method's own
    advice (trainer/train/method.py)."""
    knob = training_fix(fraction)
    used = ""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        used = f" ({(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use)"
    return UserError(
        f"CUDA out of memory at step {step}{used}: {knob}, or start from a preset for a smaller GPU "
        f"(`dittrain presets`; `dittrain plan CONFIG --vram GB` predicts what fits){hint}"
    )
