"""Weights & Biases beside TensorBoard: the same curves, the config and the sample images (`output.wandb`).

W&B is an optional dependency (`pip install dittrain[wandb]`): with its service binary and the OpenTelemetry
packages it brings it is about 25 MB to download and 75 MB installed, which most runs never use. It is imported
only when `output.wandb` is set, and a missing package is one line naming the install command, checked before the
model loads (`require_wandb`).

The W&B run id is the dittrain run id (trainer/train/run.py) with `resume="allow"`, so `fit --resume` continues
the same W&B run. A resume from an earlier checkpoint logs some steps a second time; W&B drops a step it already
has and keeps the first values (which an exact resume repeats). Offline mode (`mode: offline`) writes everything
under <output.dir>/wandb and needs no network or account; `wandb sync` uploads it later. Only rank 0 logs.

Left out: W&B's own system metrics (CPU, GPU use, ...) are switched off, since dittrain's metrics carry VRAM and
step times; so are its console capture and git probing (dittrain prints its own lines; output.dir need not be in
a repository).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError

INSTALL_HINT = "pip install dittrain[wandb]"


def require_wandb():
    """The wandb module, or one line naming the install command."""
    try:
        import wandb
    except ImportError:
        raise UserError(f"output.wandb is set but the wandb package is not installed: {INSTALL_HINT} "
                        "(or remove output.wandb from the config)") from None
    return wandb


class WandbLog:
    """One W&B run for one dittrain run: scalars by step, text, images; `close` finishes it."""

    def __init__(self, cfg, out_dir: Path, run_id: str | None, config: dict | None) -> None:
        wandb = require_wandb()
        self._wandb = wandb
        out_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                project=cfg.project, entity=cfg.entity, name=cfg.name or run_id, tags=list(cfg.tags) or None,
                id=run_id, resume="allow" if run_id else None, dir=str(out_dir), mode=cfg.mode, config=config,
                settings=wandb.Settings(x_disable_stats=True, console="off", silent=True, disable_git=True),
            )
        except Exception as e:  # no login, no network, a refused project: say which and what to do
            hint = "run `wandb login` (or set WANDB_API_KEY), or set output.wandb.mode: offline"
            raise UserError(f"output.wandb: W&B did not start ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                            f"{hint}") from None

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def images(self, step: int, images: list, prompts: list[str]) -> None:
        self.run.log({f"sample/{i}": self._wandb.Image(img, caption=prompt)
                      for i, (img, prompt) in enumerate(zip(images, prompts, strict=False))}, step=step)

    def close(self) -> None:
        self.run.finish()
