"""An exponential moving average of the trained weights (train.ema).

    ema = EMA.build(cfg, transformer, params, optim)   # None without train.ema; before the blocks stream
    ema.after_step(step)                               # after each optimizer step
    ema.save(folder) / ema.load(folder, step)          # ema.safetensors in every checkpoint
    ema.write_final(method, out_dir, step)             # lora-ema.safetensors or transformer-ema/

What. An fp32 shadow of every trainable parameter, started from the weights the run starts (or resumes) with;
after every `every`-th optimizer step each shadow does `shadow.lerp_(w, 1 - decay)`, i.e.
shadow = decay * shadow + (1 - decay) * w, in fp32 whatever the weights' dtype. No bias correction and no warmup
of the decay: with decay 0.999 the first ~1000 steps lean towards the starting weights (for a LoRA, zero update).

Where. `device: cpu` keeps the shadow in RAM (each weight crosses to the host when it updates: one
device-to-host copy per parameter per update, a sync on a GPU), `gpu` on the training device. Unfused, all
shadows update after the optimizer step (`after_step`). With the fused back pass (trainer/optim/fused.py) each
parameter updates in the optimizer's post-step hook, right after it stepped, while its block is on the GPU: so a
streamed full fine-tune never needs its weights in one place, and its EMA lives in RAM (config.py refuses
`device: gpu` there). The hook knows which step is being taken from the count `after_step` / `load` keep.

Exactness. The shadow is saved bitwise (fp32 safetensors, keyed by parameter name, with the step it is at), so a
resumed run's EMA equals the uninterrupted run's. The EMA draws no random numbers.

The final EMA weights are saved in the method's own format (the weights swapped in for the write, then back).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import UserError

FILE = "ema.safetensors"


class EMA:
    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], decay: float, every: int, device: str,
                 fused=None):
        self.decay, self.every = decay, every
        self.params = dict(named)
        self._names = {id(p): n for n, p in named}
        on_cpu = device == "cpu"
        # Allocation: one fp32 copy of the trainable weights (RAM or the device).
        self.shadow = {n: p.detach().to("cpu" if on_cpu else p.device, torch.float32, copy=True) for n, p in named}
        self.steps = 0  # optimizer steps taken (the trainer's step), kept by after_step / load
        self.fused = fused is not None
        if fused is not None:
            fused.add_step_hooks(post=self._post)

    @classmethod
    def build(cls, cfg, transformer: torch.nn.Module, params: list[torch.nn.Parameter], optim) -> EMA | None:
        e = cfg.train.ema
        if e is None:
            return None
        ids = {id(p) for p in params}
        named = [(n, p) for n, p in transformer.named_parameters() if id(p) in ids]
        return cls(named, e.decay, e.every, e.device, optim.fused)

    def _due(self, step: int) -> bool:
        return step % self.every == 0

    def _update(self, name: str, p: torch.Tensor) -> None:
        s = self.shadow[name]
        w = p.detach().to(s.device)  # device-to-host copy with device: cpu (a sync on a GPU)
        s.lerp_(w if w.dtype == torch.float32 else w.float(), 1.0 - self.decay)

    def _post(self, p: torch.Tensor, state) -> None:  # noqa: ARG002 - the fused pass's hook signature
        """Fused back pass: p has just stepped (on the GPU, if its block streams) in step self.steps + 1."""
        name = self._names.get(id(p))
        if name is not None and self._due(self.steps + 1):
            self._update(name, p)

    def after_step(self, step: int) -> None:
        """Call after optimizer step `step`; unfused, the shadows update here."""
        if not self.fused and self._due(step):
            for n, p in self.params.items():
                self._update(n, p)
        self.steps = step

    # ------------------------------------------------------------------------------------------- files

    def save(self, folder: Path) -> None:
        tensors = {n: s.detach().to("cpu").contiguous() for n, s in self.shadow.items()}  # host copies
        save_file(tensors, str(Path(folder) / FILE), metadata={"step": str(self.steps), "decay": str(self.decay),
                                                               "every": str(self.every)})

    def load(self, folder: Path, step: int) -> None:
        path = Path(folder) / FILE
        if not path.is_file():
            raise UserError(f"--resume {folder}: no {FILE} (the run was saved without train.ema); resume without "
                            "train.ema, or start a new run")
        sd = load_file(str(path))
        if set(sd) != set(self.shadow):
            raise UserError(f"{path}: EMA weights do not match the trained parameters; resume with the run's config")
        for n, s in self.shadow.items():
            s.copy_(sd[n])
        self.steps = step

    @contextlib.contextmanager
    def swapped_in(self):
        """The EMA weights in place of the trained ones (in their dtype), for writing; the trained ones back after."""
        saved = {n: p.data for n, p in self.params.items()}
        try:
            for n, p in self.params.items():
                p.data = self.shadow[n].to(p.device if p.device.type != "meta" else "cpu", p.dtype)
            yield
        finally:
            for n, p in self.params.items():
                p.data = saved[n]

    def write_final(self, method, out_dir: Path, step: int) -> Path:
        with self.swapped_in():
            return method.write_ema(out_dir, step)
