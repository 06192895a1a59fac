"""train.ema under train.distributed: fsdp: each process keeps the EMA of its own shards.

    ema = ShardedEMA.build(cfg, transformer, params)      # after sharded.shard: params are DTensor shards
    ema.after_step(step)                                  # every process, after each optimizer step
    ema.save(folder)                                      # collective: rank 0 writes folder/ema.safetensors
    ema.load(folder, step)                                # every process reads its rows of that file
    ema.write_final(method, out_dir, step, main, dtype)   # collective: lora-ema.safetensors or transformer-ema/

What. The one-process EMA (ema.py: an fp32 shadow, `shadow.lerp_(w, 1 - decay)` after every `every`-th step)
over the local shard of each DTensor parameter. The lerp is elementwise, so the N processes' shadows are the N
shards of the one-process shadow, given the same weights; each process holds 4 bytes per trainable weight / N.
`device: cpu` keeps the shadow in RAM; `gpu` beside the shard (the GPU, or RAM when FSDP2 offloads the
shards there).

Files. A checkpoint's ema.safetensors is the file one process writes (whole fp32 tensors keyed by parameter name,
step / decay / every in its header), so the run resumes on any number of processes, or on one. Rank 0 writes it
tensor by tensor as the shards are gathered (`write_safetensors`: the header first, its names, shapes and offsets
known from the global shapes, then each tensor's bytes), so it never holds more than one whole tensor: a full
fine-tune's EMA is 4 bytes per weight, more than the weights. Read back, each process reads only its own rows
(safetensors slices).

The final EMA weights. The shadow shards are copied into the parameters' local shards for the write and the
trained values copied back after (meanwhile a copy of this process's trainable shards, 1/N of them): a LoRA is
then gathered to rank 0 and written as the trained one is (lora-ema.safetensors in output.lora_format), a full
fine-tune's transformer-ema/ file by file with sharded.save_transformer, in the model dtype.
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as tdist
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..errors import UserError
from . import sharded
from .ema import EMA, FILE


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


class ShardedEMA(EMA):
    """See the module essay; `after_step` and the schedule of updates are ema.py's."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], decay: float, every: int, device: str):
        self.decay, self.every = decay, every
        self.params = dict(named)
        self.fused = False  # config.py refuses the fused back pass with fsdp
        # Allocation: one fp32 copy of this process's trainable shards (RAM, or beside the shards).
        self.shadow = {n: _local(p).detach().to("cpu" if device == "cpu" else _local(p).device, torch.float32,
                                                copy=True) for n, p in named}
        self.steps = 0

    @classmethod
    def build(cls, cfg, transformer: nn.Module, params: list[nn.Parameter]) -> ShardedEMA | None:  # type: ignore[override]
        e = cfg.train.ema
        if e is None:
            return None
        ids = {id(p) for p in params}
        return cls([(n, p) for n, p in transformer.named_parameters() if id(p) in ids], e.decay, e.every, e.device)

    def _update(self, name: str, p: torch.Tensor) -> None:
        s = self.shadow[name]
        w = _local(p).detach().to(s.device)  # device-to-host copy with device: cpu (a sync on a GPU)
        s.lerp_(w if w.dtype == torch.float32 else w.float(), 1.0 - self.decay)

    def _whole(self, name: str) -> torch.Tensor:
        """Collective: the whole fp32 shadow of parameter `name` on the CPU (every process gets it)."""
        p = self.params[name]
        s = self.shadow[name]
        if not isinstance(p, DTensor):
            return s.to("cpu", copy=True)
        return sharded._whole(DTensor.from_local(s, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()),
                              None)

    def save(self, folder: Path) -> None:
        """Collective: rank 0 writes folder/ema.safetensors (the one-process file), one gathered tensor at a time."""
        main = tdist.get_rank() == 0
        layout = [(n, tuple(p.shape)) for n, p in self.params.items()]
        meta = {"step": str(self.steps), "decay": str(self.decay), "every": str(self.every)}
        write_safetensors(Path(folder) / FILE, layout, (self._whole(n) for n, _ in layout), meta, write=main)

    def load(self, folder: Path, step: int) -> None:
        path = Path(folder) / FILE
        if not path.is_file():
            raise UserError(f"--resume {folder}: no {FILE} (the run was saved without train.ema); resume without "
                            "train.ema, or start a new run")
        with safe_open(str(path), "pt") as f:
            if set(f.keys()) != set(self.shadow):
                raise UserError(f"{path}: EMA weights do not match the trained parameters; resume with the run's "
                                "config")
            for n, s in self.shadow.items():
                p = self.params[n]
                rows = f.get_slice(n)
                if isinstance(p, DTensor):  # this process's block of the whole tensor
                    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                    s.copy_(rows[tuple(slice(o, o + k) for o, k in zip(offset, shape, strict=True))])
                else:
                    s.copy_(rows[:])
        self.steps = step

    @contextlib.contextmanager
    def swapped_in(self):
        """The EMA values in the parameters' local shards (in their dtype); the trained values back after."""
        saved: dict[str, torch.Tensor] = {}
        try:
            with torch.no_grad():
                for n, p in self.params.items():
                    local = _local(p)
                    saved[n] = local.clone()  # allocation: a copy of this process's trainable shards
                    local.copy_(self.shadow[n])
            yield
        finally:
            with torch.no_grad():
                for n, old in saved.items():
                    _local(self.params[n]).copy_(old)

    def write_final(self, method, out_dir: Path, step: int, main: bool = True,  # type: ignore[override]
                    dtype: torch.dtype | None = None) -> Path:
        """Collective: the method's EMA output (lora-ema.safetensors or transformer-ema/), written by rank 0."""
        with self.swapped_in():
            return method.write_ema_sharded(out_dir, step, main, dtype)


def write_safetensors(path: Path, layout: list[tuple[str, tuple[int, ...]]], tensors: Iterable[torch.Tensor],
                      metadata: dict[str, str], write: bool = True) -> None:
    """A safetensors file of fp32 tensors named and shaped as `layout`, written as `tensors` yields them (one in
    memory at a time). Every process iterates `tensors` (their gathers are collective); only `write` writes."""
    header: dict = {"__metadata__": metadata}
    end = 0
    for name, shape in layout:
        n = 4 * int(torch.Size(shape).numel())
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [end, end + n]}
        end += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    with open(path, "wb") if write else contextlib.nullcontext() as f:
        if f is not None:
            f.write(struct.pack("<Q", len(raw)) + raw)
        for (name, shape), t in zip(layout, tensors, strict=True):
            if f is not None:
                if tuple(t.shape) != shape or t.dtype != torch.float32:
                    raise RuntimeError(f"write_safetensors: {name} is {t.dtype} {tuple(t.shape)}, not fp32 {shape}")
                f.write(t.contiguous().numpy().data)
