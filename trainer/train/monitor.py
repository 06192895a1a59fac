"""Seeing a run: a tqdm bar, a JSONL metrics file, TensorBoard and (optionally) Weights & Biases.

Every number here is already on the host when it is logged: the loss is read once per micro-batch by the
non-finite check (a sync the loop needs anyway), the gradient norm only on logging steps. `metrics.jsonl` in
output.dir gets one line per logged step; on resume, lines after the resumed step are dropped first, so the file
reads like one run. Every line carries the run id (trainer/train/run.py) and the epoch. TensorBoard (if
enabled) gets loss, smoothed loss, lr, grad norm, step time, images/s, VRAM, the run id and config as text, and
sample images under output.dir/tensorboard. `output.wandb` sends the same to Weights & Biases (wandb_log.py).

The progress bar shows a smoothed loss (an exponential moving average, 0.9 per step, bias-corrected, as most
trainers print), the epoch, s/step and img/s. When stderr is not a terminal (a log file, a job scheduler) there is
no bar: a plain status line every ~5 % of the run instead, so a log does not fill with carriage returns.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from .checkpoint import atomic_write


def say(msg: str) -> None:
    """One line to stderr that does not break the progress bar. Several processes (torchrun): rank 0 speaks."""
    if os.environ.get("RANK", "0") != "0":
        return
    tqdm.write(msg, file=sys.stderr)


class Monitor:
    def __init__(self, out_dir: Path, total: int, start: int, tensorboard: bool, run_id: str | None = None,
                 config=None, epoch: Callable[[], int] | None = None, wandb=None):
        self.run_id, self._epoch = run_id, epoch or (lambda: 0)
        self.total, self._ema, self._ema_n = total, 0.0, 0
        self._tty = sys.stderr.isatty()
        self._every = max(1, total // 20)  # status lines when stderr is not a terminal
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self._truncate_after(start)
        self._file = self.metrics_path.open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

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
                        disable=not self._tty)

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

    def smoothed(self, loss: float) -> float:
        """Bias-corrected exponential moving average of the loss (0.9 per step)."""
        self._ema, self._ema_n = 0.9 * self._ema + 0.1 * loss, self._ema_n + 1
        return self._ema / (1 - 0.9**self._ema_n)

    def status(self, step: int, metrics: dict[str, float], smooth: float, epoch: int) -> str:
        return (f"loss {smooth:.4f} (step {metrics['loss']:.4f}), epoch {epoch}, {metrics['step_time']:.2f} s/step, "
                f"{metrics['samples_per_s']:.1f} img/s")

    def log(self, step: int, metrics: dict[str, float], write: bool) -> None:
        smooth, epoch = self.smoothed(metrics["loss"]), int(self._epoch())
        line = self.status(step, metrics, smooth, epoch)
        if self._tty:
            self.bar.update(1)
            self.bar.set_postfix_str(line, refresh=False)
        elif step % self._every == 0 or step == self.total:
            say(f"step {step}/{self.total}: {line}")
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
        say(f"saved {len(images)} sample image(s) for step {step} in {self.out_dir / 'samples'}")
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
