"""Training methods: what is trained, and how its weights go to disk. LoRA and full fine-tuning.

    method = method_for(cfg)                          # LoraMethod or FullMethod
    params = method.trainable_params(transformer, adapter)
    method.same_start(dist, params)                   # every rank starts from the same weights
    method.streams_trainable                          # the conductor streams trainable weights (full) or not
    method.optimizer_state_layout(optim)              # what the conductor packs beside each streamed weight
    method.place_optimizer_state(handle, blocks, optim)
    method.save_weights(folder, step) / method.load_weights(folder)
    method.write_final(out_dir, checkpoint) -> path   # output.dir/lora.safetensors or output.dir/transformer
    method.write_ema(out_dir, step) -> path           # the same for the EMA weights (-ema), swapped in by ema.py
    method.describe(params)                           # "lora: 0.012 M trainable parameters in 56 tensors"

Everything the loop would otherwise decide with `if method == "lora"` is here, so trainer/train/trainer.py reads
the same for both.

LoRA (trainer/train/model.py `add_lora`): the base is frozen; the fp32 adapter weights are drawn from torch's
global generator, then broadcast from rank 0 so several processes start identical whatever they drew. They stay
on the device when blocks stream (the conductor streams only frozen base weights), and so does their optimizer
state. Weights: one `lora.safetensors` in diffusers' format; the final file is the last checkpoint's, copied. LoKr and
LoHa (lora.type) are saved the same way, in peft's key names, which diffusers' `load_lora_weights` does not read:
the log says how to load them with peft (`dittrain sample --lora` does it itself).

Full: every transformer weight trains; several processes start identical because they load the same files. With
blocks streamed the weights stream as trainable, each stepped by the fused back pass while its block is on the
GPU, and the optimizer state goes with it: AdamW's moments and Adafactor's factors are packed beside each weight
and cross PCIe with it (trainer/offload/fused.py `bind_fused`); 8-bit AdamW's, whose layout is unknown before a
step, waits in pinned RAM and visits the GPU while its parameter steps (trainer/optim `StateOffload`). Weights: a
diffusers `transformer/` folder.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .. import quant
from ..config import Config
from ..offload import fused as packed  # module, not names: tests swap PACKED_STATE_OPTIMIZERS
from . import checkpoint as ck
from .model import add_lora, count, full_params
from .monitor import say


class TrainingMethod:
    """What LoRA and full fine-tuning share; the subclasses fill in the rest of the protocol above."""

    name = ""
    streams_trainable = False  # whether the conductor streams trainable weights
    oom_hint = ""  # appended to the out-of-memory advice

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.transformer: torch.nn.Module | None = None  # set by trainable_params

    def describe(self, params: list[torch.nn.Parameter]) -> str:
        return f"{self.name}: {count(params) / 1e6:.3f} M trainable parameters in {len(params)} tensors"

    def storage(self) -> str:
        """What the weights are stored and computed in, for the fit log's first line."""
        m = self.cfg.model
        return f"weights {m.dtype} (all trained)"


class LoraMethod(TrainingMethod):
    name = "lora"
    streams_trainable = False  # LoRA weights stay on the device; the conductor streams only the frozen base

    def storage(self) -> str:
        """The frozen base as quant.describe says (8-bit with per-channel scales, or the model dtype) and the LoRA:
        fp32 weights, with matmuls in the model dtype under lora.compute_dtype: auto."""
        m = self.cfg.model
        lowered = self.cfg.lora.compute_dtype == "auto" and m.dtype != "fp32"
        return (f"{quant.describe(m.quantize, m.quantize_modulation, m.dtype, m.fp8_matmul)}; LoRA fp32"
                + (f" (matmuls in {m.dtype})" if lowered else ""))

    def trainable_params(self, transformer: torch.nn.Module, adapter) -> list[torch.nn.Parameter]:
        """Freeze the transformer and add the LoRA adapter (draws from torch's global generator: seed it first)."""
        self.transformer = transformer
        return add_lora(transformer, self.cfg, adapter.default_lora_targets)

    def same_start(self, dist, params: list[torch.nn.Parameter]) -> None:
        dist.same_start(params)  # cheap, and robust to any draw that differed between ranks

    def optimizer_state_layout(self, optim):  # noqa: ARG002 - the protocol's signature
        return ()

    def place_optimizer_state(self, handle, blocks, optim) -> None:
        """Nothing streams that trains: the optimizer state stays beside the LoRA weights."""

    def save_weights(self, folder: Path, step: int) -> None:
        self.save_weights_to(folder / "lora.safetensors", step)

    def load_weights(self, folder: Path) -> None:
        ck.load_lora(folder / "lora.safetensors", self.transformer)

    def final_output(self, out_dir: Path) -> Path:
        return out_dir / "lora.safetensors"

    def write_ema(self, out_dir: Path, step: int) -> Path:
        """The EMA weights (swapped in by ema.py) as output.dir/lora-ema.safetensors, in the LoRA's format."""
        path = out_dir / "lora-ema.safetensors"
        self.save_weights_to(path, step)
        return path

    def save_weights_to(self, path: Path, step: int) -> None:
        lc = self.cfg.lora
        meta = {"rank": lc.rank, "alpha": lc.alpha, "step": step, "config_digest": self.cfg.digest(),
                "family": self.cfg.model.family, "type": lc.type, "dora": lc.dora}
        ck.save_lora(path, self.transformer, meta)

    def write_final(self, out_dir: Path, checkpoint: Path) -> Path:
        """The final LoRA file in output.dir: the checkpoint's, copied atomically."""
        path, src = self.final_output(out_dir), checkpoint / "lora.safetensors"
        ck.atomic_write(path, lambda tmp: tmp.write_bytes(src.read_bytes()))
        if self.cfg.lora.type != "lora":
            say(ck.lycoris_loading_hint(path, self.cfg.lora.type))
        return path


class FullMethod(TrainingMethod):
    name = "full"
    streams_trainable = True  # streamed blocks carry trainable weights, stepped inside backward
    oom_hint = "; LoRA needs far less memory than train.method: full"

    def trainable_params(self, transformer: torch.nn.Module, adapter) -> list[torch.nn.Parameter]:  # noqa: ARG002
        self.transformer = transformer
        return full_params(transformer)

    def same_start(self, dist, params: list[torch.nn.Parameter]) -> None:
        """Nothing to do: every rank loaded the same files."""

    def _packs_state(self, optim) -> bool:
        return optim.fused is not None and self.cfg.optimizer.name in packed.PACKED_STATE_OPTIMIZERS

    def optimizer_state_layout(self, optim):
        return optim.fused.state_layout if self._packs_state(optim) else ()

    def place_optimizer_state(self, handle, blocks, optim) -> None:
        """Packed beside each streamed weight, or (8-bit AdamW) in pinned RAM between steps."""
        if self._packs_state(optim):
            packed.bind_fused(handle, optim.fused)
        elif handle.plan is not None:  # at fraction 0 nothing streams: the state stays where it is
            optim.keep_state_in_ram([p for i in handle.plan.streamed for p in blocks[i].parameters() if p.requires_grad])

    def save_weights(self, folder: Path, step: int) -> None:  # noqa: ARG002 - the step is in state.json
        ck.save_transformer(folder / "transformer", self.transformer)

    def load_weights(self, folder: Path) -> None:
        ck.load_transformer_weights(folder / "transformer", self.transformer)

    def final_output(self, out_dir: Path) -> Path:
        return out_dir / "transformer"

    def write_ema(self, out_dir: Path, step: int) -> Path:  # noqa: ARG002 - the step is in the checkpoint
        """The EMA weights (swapped in by ema.py) as the diffusers folder output.dir/transformer-ema."""
        path = out_dir / "transformer-ema"
        ck.atomic_dir(path, lambda tmp: ck.save_transformer(tmp, self.transformer))
        return path

    def write_final(self, out_dir: Path, checkpoint: Path) -> Path:  # noqa: ARG002 - saved from the live weights
        path = self.final_output(out_dir)
        ck.atomic_dir(path, lambda tmp: ck.save_transformer(tmp, self.transformer))
        return path


METHODS = {m.name: m for m in (LoraMethod, FullMethod)}


def method_for(cfg: Config) -> TrainingMethod:
    """The training method named by train.method."""
    return METHODS[cfg.train.method](cfg)
