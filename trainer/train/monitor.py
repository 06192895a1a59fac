"""Seeing a run: a tqdm bar, a JSONL metrics file, TensorBoard and (optionally) Weights & Biases.

Every number here is already on the host when it is logged: the loss is read once per micro-batch by the
non-finite check (a sync the loop needs anyway), the gradient norm only on logging steps. `metrics.jsonl` in
output.dir gets one line per logged step; on resume, lines after the resumed step are dropped first, so the file
reads like one run. TensorBoard's event files are trimmed the same way (events past the resumed step rewritten
out), so no reader sees a step twice: a killed run's events past its last checkpoint are gone, not merely
hidden by the purge marker that only some readers honour. The smoothed loss is part of the checkpoint
(`smoothing_state`), so a resumed run continues the curve the uninterrupted run draws. Every line carries the run id (trainer/train/run.py) and the epoch. TensorBoard (if
enabled) gets loss, smoothed loss, lr, grad norm, step time, images/s, VRAM, the run id and config as text, and
sample images under output.dir/tensorboard. `output.wandb` sends the same to Weights & Biases (wandb_log.py).

The progress bar shows a smoothed loss (an exponential moving average, 0.9 per step, bias-corrected, as most
trainers print), the epoch and s/step, laid out to fit 80 columns with a bar 10 characters wide (tqdm's default
layout shrank the bar to one character and cut the postfix there). When stderr is not a terminal (a log file, a
job scheduler) there is no bar: a plain status line (with the step's own loss and img/s too) every ~5 % of the
run, and at least every `STATUS_EVERY_S` seconds, so a log does not fill with carriage returns nor go quiet.
Its s/step is the wall time since the last line per step, sampling and saving included (what the run's pace
is), but not what the trainer sets `aside`: the planner's diagnostics between steps, which a short run's line
every step had charged to one step (Flux.1 on an H200: "step 6/8 ... 2.27 s/step, 1.7 img/s" where the step took
0.59 s and the planner's check after step 5 the rest).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tqdm import tqdm

from ..words import count
from .checkpoint import atomic_write

STATUS_EVERY_S = 30.0  # without a terminal: a status line at least this often
# "fit 12345/50000  25%|##4       | 12:34:56 left, loss 1.4571, ep 123, 12.3 s/step": 80 columns at worst
_BAR_FORMAT = "{desc} {n_fmt}/{total_fmt} {percentage:3.0f}%|{bar:10}| {remaining} left{postfix}"
_now = time.monotonic  # tests replace it


def say(msg: str) -> None:
    """One line to stderr that does not break the progress bar. Several processes (torchrun): rank 0 speaks."""
    if os.environ.get("RANK", "0") != "0":
        return
    tqdm.write(msg, file=sys.stderr)


class Monitor:
    def __init__(self, out_dir: Path, total: int, start: int, tensorboard: bool, run_id: str | None = None,
                 config=None, epoch: Callable[[], int] | None = None, smoothing: dict | None = None,
                 wandb=None):
        self.run_id, self._epoch = run_id, epoch or (lambda: 0)
        self.total, self._ema, self._ema_n = total, 0.0, 0
        if smoothing:  # a resume: the moving average goes on from the checkpoint's
            self._ema, self._ema_n = float(smoothing["ema"]), int(smoothing["n"])
        self._tty = sys.stderr.isatty()
        self._every = max(1, total // 20)  # status lines when stderr is not a terminal
        self._said, self._said_step = _now(), start  # the last status line (without a terminal): when, at which step
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self._truncate_after(start)
        self._file = self.metrics_path.open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            if start:
                _trim_tensorboard(self.out_dir / "tensorboard", start)
            self._tb = SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=start + 1 if start else None)
            if run_id:
                self._tb.add_text("run/id", run_id, start)
            if config is not None:
                import yaml

                text = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
                self._tb.add_text("run/config", "\n".join("    " + line for line in text.splitlines()), start)
        self._wb = None
        if wandb is not None:  # output.wandb: after TensorBoard, so a W&B start failure leaves no half-open bar
            from .wandb_log import WandbLog

            self._wb = WandbLog(wandb, self.out_dir, run_id,
                                config.model_dump(mode="json") if config is not None else None)
        self.bar = tqdm(total=total, initial=start, desc="fit", unit="step", dynamic_ncols=True, file=sys.stderr,
                        disable=not self._tty, bar_format=_BAR_FORMAT)

    def _truncate_after(self, step: int) -> None:
        if not self.metrics_path.exists():
            return
        keep = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except json.JSONDecodeError:
                pass  # a line cut short by a kill
        text = "".join(line + "\n" for line in keep)
        atomic_write(self.metrics_path, lambda tmp: tmp.write_text(text))

    def smoothing_state(self) -> dict:
        """The smoothed loss's state, for the checkpoint (floats round-trip exactly through JSON)."""
        return {"ema": self._ema, "n": self._ema_n}

    def smoothed(self, loss: float) -> float:
        """Bias-corrected exponential moving average of the loss (0.9 per step)."""
        self._ema, self._ema_n = 0.9 * self._ema + 0.1 * loss, self._ema_n + 1
        return self._ema / (1 - 0.9**self._ema_n)

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """Wall time spent inside is left out of the next status line's s/step (see the module essay)."""
        t0 = _now()
        try:
            yield
        finally:
            self._said += _now() - t0

    def status(self, step: int, metrics: dict[str, float], smooth: float, epoch: int,
               per_step: float | None = None) -> str:
        """`per_step`: the wall seconds per step since the last status line (sampling and saving included, time
        set `aside` not), else this step's own time."""
        per = metrics["step_time"] if per_step is None else per_step
        return (f"loss {smooth:.4f} (step {metrics['loss']:.4f}), epoch {epoch}, {per:.2f} s/step, "
                f"{metrics['samples_per_s']:.1f} img/s")

    def log(self, step: int, metrics: dict[str, float], write: bool) -> None:
        smooth, epoch = self.smoothed(metrics["loss"]), int(self._epoch())
        if self._tty:
            self.bar.update(1)
            self.bar.set_postfix_str(f"loss {smooth:.4f}, ep {epoch}, {metrics['step_time']:.3g} s/step", refresh=False)
        elif step % self._every == 0 or step == self.total or _now() - self._said >= STATUS_EVERY_S:
            now, n = _now(), step - self._said_step
            say(f"step {step}/{self.total}: "
                f"{self.status(step, metrics, smooth, epoch, (now - self._said) / n if n > 0 else None)}")
            self._said, self._said_step = now, step
        if not write:
            return
        self._file.write(json.dumps({"step": step, **metrics, "loss_smoothed": smooth, "epoch": epoch,
                                     "run": self.run_id}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k in ("loss", "lr", "grad_norm", "vram_gb", "samples_per_s", "step_time"):
                if metrics.get(k) is not None:
                    self._tb.add_scalar(f"train/{k}", metrics[k], step)
            self._tb.add_scalar("train/loss_smoothed", smooth, step)
            self._tb.add_scalar("train/epoch", epoch, step)
        if self._wb is not None:
            keys = ("loss", "lr", "grad_norm", "vram_gb", "samples_per_s", "step_time")
            self._wb.scalars(step, {**{f"train/{k}": metrics[k] for k in keys if metrics.get(k) is not None},
                                    "train/loss_smoothed": smooth, "train/epoch": epoch})

    def validation(self, step: int, metrics: dict[str, float]) -> None:
        """A validation result: its own metrics.jsonl line ({"step", "val_loss", "val_loss_t<t>"...}, no "loss"),
        TensorBoard scalars under val/, and a status line."""
        say(f"validation at step {step}: val_loss {metrics['val_loss']:.4f}")
        self._file.write(json.dumps({"step": step, **metrics, "run": self.run_id}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(f"val/{k.removeprefix('val_')}", v, step)
        if self._wb is not None:
            self._wb.scalars(step, {f"val/{k.removeprefix('val_')}": v for k, v in metrics.items()})

    def images(self, step: int, images: list, prompts: list[str]) -> None:
        say(f"saved {count(len(images), 'sample image')} for step {step} in {self.out_dir / 'samples'}")
        if self._wb is not None:
            self._wb.images(step, images, prompts)
        if self._tb is None:
            return
        import numpy as np

        for i, (img, prompt) in enumerate(zip(images, prompts, strict=False)):
            self._tb.add_image(f"sample/{i}", np.asarray(img), step, dataformats="HWC")
            self._tb.add_text(f"sample/{i}/prompt", prompt, step)

    def finish(self) -> None:
        """Close the progress bar (before the closing messages)."""
        self.bar.close()

    def close(self) -> None:
        self.bar.close()
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wb is not None:
            self._wb.close()


def _trim_tensorboard(folder: Path, step: int) -> None:
    """Rewrite each event file under `folder` without its events past `step` (a resume from that step logs them
    again). A record cut short by a kill ends the file's readable part and is dropped with what follows it."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    for path in sorted(Path(folder).glob("events.out.tfevents.*")):
        records = list(RawEventFileLoader(str(path)).Load())
        keep = [r for r in records if Event.FromString(r).step <= step]
        if len(keep) == len(records):
            continue

        def write(tmp: Path, keep=keep) -> None:
            with tmp.open("wb") as f:
                w = RecordWriter(f)
                for r in keep:
                    w.write(r)
                w.flush()

        atomic_write(path, write)
