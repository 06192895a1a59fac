"""Checkpoints of `dittrain fit`: what `Trainer` saves and restores (a mixin of trainer.py's Trainer).

save      a complete, resumable checkpoint, written atomically into a temporary folder and renamed
          (checkpoint.py): the trained weights (the method's: LoRA file or transformer folder), the optimizer
          and schedule, the data position, every generator's state, the EMA, the config; with `final`, also
          the method's final weights in output.dir. Never over the last good checkpoint when a weight went NaN.
          Under train.distributed: fsdp the processes first write what is sharded together (sharded.py), then
          rank 0 writes the rest.
restore   `--resume`: the weights (`_load_weights`, before the blocks stream) and then everything else
          (`_restore`), so a resumed run computes the uninterrupted run's losses bitwise (fp32, CPU).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from safetensors.torch import load_file, save_file

from ..errors import NonFiniteWeightsError, UserError
from ..optim.build import eval_weights
from . import checkpoint as ck
from . import run as runs
from . import sharded
from .inputs import data_state, load_data_state
from .monitor import say


class Saving:
    """`Trainer`'s checkpoint methods (they use its attributes: cfg, method, optim, data, objective, ema, step,
    run, out, dist, sharded, transformer, offload, params, monitor)."""

    def _load_weights(self, folder: Path) -> None:
        self._check_resumed_method(folder)
        self.method.load_weights(folder)

    def _check_resumed_method(self, folder: Path) -> None:
        state = json.loads((folder / "state.json").read_text())
        if state.get("method") != self.method.name:
            raise UserError(f"--resume {folder}: checkpoint of a {state.get('method')} run, config says {self.method.name}")

    def _restore(self, folder: Path) -> None:
        """Everything but the weights (`_load_weights`): optimizer, schedule, data position, generators, step."""
        state = json.loads((folder / "state.json").read_text())
        if state.get("config_digest") != self.cfg.digest():
            changes = runs.config_changes(state.get("config"), self.cfg.model_dump(mode="json"))
            say(f"note: the config differs from the one {folder} was saved with"
                f"{' (' + '; '.join(changes) + ')' if changes else ''}; continuing with the current one")
        self.optim.load(folder, state["scheduler"])
        load_data_state(self.data, state["data"])
        self.objective.load_state(ck.restore_rng(load_file(str(folder / "rng.safetensors"))))
        self.step = int(state["step"])
        self._smoothing = state.get("loss_smoothing")  # the monitor's smoothed loss goes on from here
        if self.ema is not None:
            self.ema.load(folder, self.step)
        self.last_checkpoint = folder
        say(f"resumed from {folder} at step {self.step}")

    def _state(self) -> dict:
        return {"step": self.step, "method": self.method.name, "config_digest": self.cfg.digest(),
                "config": self.cfg.model_dump(mode="json"), **self.run.state(),
                "scheduler": self.optim.scheduler.state_dict(), "data": data_state(self.data),
                "loss_smoothing": self.monitor.smoothing_state() if self.monitor is not None else None}

    def _newest_checkpoint(self) -> str:
        """This run's last checkpoint, else the newest complete one of this run in output.dir (a resumed run's)."""
        found = self.last_checkpoint or (runs.run_checkpoints(self.out, getattr(getattr(self, "run", None), "id", None))
                                         or [(0, None)])[-1][1]
        return str(found) if found else "none (no checkpoint was saved yet)"

    def save(self, final: bool = False) -> Path:
        """A complete resumable checkpoint; with `final`, also the weights in output.dir. Returns the checkpoint
        folder, or the final weights' path. (A schedule-free optimizer's averaged weights are what is saved.)"""
        self.release_activations()  # the activation offloader's buffers: nothing waits in them between steps
        with self._phase("checkpoint save"), eval_weights(self.optim.optimizer if getattr(self, "optim", None)
                                                          else None):
            return self._save(final)

    def _save(self, final: bool) -> Path:
        if self.offload is not None:
            self.offload.sync()  # host copies of streamed trainable weights must be current
        # A NaN or inf gradient under a finite loss steps the weights to NaN without tripping the loss check; never
        # save such weights over the last good checkpoint. Every rank holds the same weights, so all raise together.
        if self.sharded:  # each process checks its shards; every rank raises together
            mine = sharded.local_nonfinite(self.transformer)
            bad = (mine or "a weight on another process") if self.dist.any(mine is not None) else None
        else:
            bad = ck.first_nonfinite((n, p) for n, p in self.transformer.named_parameters() if p.requires_grad)
        if bad is not None:
            raise NonFiniteWeightsError(
                f"weight {bad} is NaN or inf after step {self.step} (a non-finite gradient under a finite loss); "
                f"nothing was saved; last checkpoint: {self._newest_checkpoint()}. Lower optimizer.lr or set "
                "optimizer.max_grad_norm, then resume from it"
            )
        root = ck.checkpoint_root(self.out)
        staged, wrote = None, False
        if self.optim.shards_state:  # collective: each process's part of the optimizer state written together
            staged = sharded.staging(root, self.step)
            self.optim.save_shards(staged)
        if self.sharded:  # and a full fine-tune's weights, the EMA
            wrote = self.method.save_sharded(staged, self.dist.is_main, self.dtype)
            if self.ema is not None:  # ema.safetensors, gathered tensor by tensor (sharded_ema.py)
                self.ema.save(staged)
        elif staged is not None:
            self.dist.barrier()  # every process's file is in `staged` before rank 0 moves them
        whole = sharded.whole_trainable(self.transformer, self.dist.is_main) if self.sharded and not wrote else None
        with whole or contextlib.nullcontext():  # a LoRA: gathered on rank 0, written by save_weights
            path = self._write(final, root, staged, wrote)
        if final and self.sharded and self.ema is not None:  # collective: the EMA shards gathered as the weights
            ema_path = self.ema.write_final(self.method, self.out, self.step, self.dist.is_main, self.dtype)
            if self.dist.is_main:
                say(f"saved {ema_path} (EMA)")
        return path

    def _write(self, final: bool, root: Path, staged: Path | None, wrote: bool) -> Path:
        if not self.dist.is_main:  # rank 0 writes (every rank holds the same weights); the others wait for it
            self.dist.barrier()
            return (self.method.final_output(self.out) if final
                    else ck.checkpoint_root(self.out) / f"step-{self.step:06d}")

        def write(tmp: Path) -> None:
            if not wrote:
                self.method.save_weights(tmp, self.step)
            self.optim.save(tmp)
            for part in sorted(staged.iterdir()) if staged is not None else ():
                os.replace(part, tmp / part.name)
            if staged is not None:
                staged.rmdir()
            if self.ema is not None and not self.sharded:  # fsdp: staged by `_save`
                self.ema.save(tmp)
            save_file(ck.rng_state(self.objective.state()), str(tmp / "rng.safetensors"))
            ck.write_json(tmp / "state.json", self._state())

        keep = self.cfg.train.keep_checkpoints
        with runs.disk_errors(root, runs.estimate_checkpoint_bytes(self.out, self.params)):
            self.last_checkpoint = ck.write_checkpoint(
                root, self.step, write, keep, prune=lambda r: runs.prune(r, self.run.id, self.step, keep))
            say(f"saved checkpoint {self.last_checkpoint}")
            runs.keep_step_lora(self.cfg, self.run, self.last_checkpoint, self.step)
            if not final:
                self.dist.barrier()
                return self.last_checkpoint
            path = self.method.write_final(self.out, self.last_checkpoint)
            if self.ema is not None and not self.sharded:  # fsdp: after this, collectively (`_save`)
                say(f"saved {self.ema.write_final(self.method, self.out, self.step)} (EMA)")
        say(f"saved {path} (step {self.step})")
        self.dist.barrier()
        return path

