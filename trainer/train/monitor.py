"""Seeing a run: a tqdm bar, a JSONL metrics file and TensorBoard.

Every number here is already on the host when it is logged: the loss is read once per micro-batch by the
non-finite check (a sync the loop needs anyway), the gradient norm only on logging steps. `metrics.jsonl` in
output.dir gets one line per logged step; on resume, lines after the resumed step are dropped first, so the file
reads like one run. TensorBoard (if enabled) gets loss, lr, grad norm, VRAM and sample images under
output.dir/tensorboard.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tqdm import tqdm

from .checkpoint import atomic_write


def say(msg: str) -> None:
    """One line to stderr that does not break the progress bar. Several processes (torchrun): rank 0 speaks."""
    if os.environ.get("RANK", "0") != "0":
        return
    tqdm.write(msg, file=sys.stderr)


class Monitor:
    def __init__(self, out_dir: Path, total: int, start: int, tensorboard: bool):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self._truncate_after(start)
        self._file = self.metrics_path.open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=start + 1 if start else None)
        self.bar = tqdm(total=total, initial=start, desc="fit", unit="step", dynamic_ncols=True, file=sys.stderr)

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

    def log(self, step: int, metrics: dict[str, float], write: bool) -> None:
        self.bar.update(1)
        self.bar.set_postfix(
            loss=f"{metrics['loss']:.4f}", s_step=f"{metrics['step_time']:.2f}", img_s=f"{metrics['samples_per_s']:.1f}"
        )
        if not write:
            return
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k in ("loss", "lr", "grad_norm", "vram_gb", "samples_per_s"):
                if metrics.get(k) is not None:
                    self._tb.add_scalar(f"train/{k}", metrics[k], step)

    def images(self, step: int, images: list, prompts: list[str]) -> None:
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
