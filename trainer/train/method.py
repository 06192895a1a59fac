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
    method.write_ema_sharded(out_dir, step, main, dtype)  # fsdp: the same, collective (sharded_ema.py)
    method.describe(params)                           # "lora: 0.012 M trainable parameters in 56 tensors"

Everything the loop would otherwise decide with `if method == "lora"` is here, so trainer/train/trainer.py reads
the same for both.

LoRA (trainer/train/model.py `add_lora`): the base is frozen; the fp32 adapter weights are drawn from torch's
global generator, then broadcast from rank 0 so several processes start identical whatever they drew. They stay
on the device when blocks stream (the conductor streams only frozen base weights), and so does their optimizer
state. Weights: a checkpoint's `lora.safetensors` in peft's layout (resumes bitwise); the files for the user (final,
EMA, per step) are written from it in output.lora_format by trainer/lora_format/, with the alpha / rank scale where
that layout's loaders read it. LoKr and LoHa (lora.type) in the diffusers layout keep peft's key names, which
diffusers' `load_lora_weights` does not read: the log says how to load them with peft (`dittrain sample --lora`
does it itself). `lora.init_from` builds the adapter the file describes (kind, rank, alpha, modules) and loads its
weights, after checking every module and shape against the model.

Full: every transformer weight trains; several processes start identical because they load the same files. With
blocks streamed the weights stream as trainable, each stepped by the fused back pass while its block is on the
GPU, and the optimizer state goes with it: AdamW's moments and Adafactor's factors are packed beside each weight
and cross PCIe with it (trainer/offload/fused_state.py `bind_fused`); 8-bit AdamW's, whose layout is unknown before a
step, waits in pinned RAM and visits the GPU while its parameter steps (trainer/optim `StateOffload`). Weights: a
diffusers `transformer/` folder.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .. import quant
from ..config import Config
from ..lora_format.kinds import LORA_KINDS
from ..offload import fused_state as packed
from ..optim.specs import optimizer_spec
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

    def save_sharded(self, folder: Path, main: bool, dtype: torch.dtype) -> bool:  # noqa: ARG002
        """train.distributed: fsdp, collective: write the weights into `folder` together, if this method's are too
        big to gather whole on rank 0 (True), else nothing (False: rank 0's `save_weights` writes them gathered)."""
        return False

    def sharded_master_dtype(self, dtype: torch.dtype) -> torch.dtype | None:  # noqa: ARG002
        """fsdp: the dtype to keep the trainable shards in when it is not the model's `dtype` (None: the model's)."""
        return None

    def write_ema_sharded(self, out_dir: Path, step: int, main: bool, dtype: torch.dtype | None) -> Path:  # noqa: ARG002
        """fsdp, collective, with the EMA in the shards (sharded_ema.py): the trainable weights gathered to rank 0
        (`main`), which writes them as `write_ema` does."""
        from . import sharded

        with sharded.whole_trainable(self.transformer, main):
            return self.write_ema(out_dir, step) if main else out_dir

    def describe(self, params: list[torch.nn.Parameter]) -> str:
        return f"{self.name}: {count(params) / 1e6:.3f} M trainable parameters in {len(params)} tensors"

    def storage(self) -> str:
        """What the weights are stored and computed in, for the fit log's first line."""
        m = self.cfg.model
        return f"weights {m.dtype} (all trained)"


class LoraMethod(TrainingMethod):
    name = "lora"
    streams_trainable = False  # LoRA weights stay on the device; the conductor streams only the frozen base

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.lora = cfg.lora  # what is trained: lora.init_from's file replaces rank, alpha, kind and targets
        self.adapter = None  # set by trainable_params

    def storage(self) -> str:
        """The frozen base as quant.describe says (8-bit with per-channel scales, or the model dtype) and the LoRA:
        fp32 weights, with matmuls in the model dtype under lora.compute_dtype: auto."""
        m = self.cfg.model
        lowered = self.cfg.lora.compute_dtype == "auto" and m.dtype != "fp32"
        return (f"{quant.describe(m.quantize, m.quantize_modulation, m.dtype, m.fp8_matmul)}; LoRA fp32"
                + (f" (matmuls in {m.dtype})" if lowered else ""))

    def trainable_params(self, transformer: torch.nn.Module, adapter) -> list[torch.nn.Parameter]:
        """Freeze the transformer and add the LoRA adapter (draws from torch's global generator: seed it first), or
        the adapter of lora.init_from with that file's weights."""
        from .. import lora_format

        self.transformer, self.adapter = transformer, adapter
        init = None
        if self.cfg.lora.init_from is not None:
            init = lora_format.read_lora_file(self.cfg.lora.init_from, self.cfg.model.family)
            self.lora = init_lora_config(self.cfg, init, transformer)
        params = add_lora(transformer, self.cfg.model_copy(update={"lora": self.lora}), adapter.lora_targets())
        # output.lora_format must hold this adapter (a LoKr on fused q/k/v does not fit comfy): said before training
        lora_format.check_layout(adapted_modules(transformer), self.lora.type, self.cfg.output.lora_format,
                                 self.cfg.model.family)
        if init is not None:
            load_init(transformer, init, self.cfg.lora.init_from)
            say(f"lora.init_from {self.cfg.lora.init_from}: {len(init.modules)} modules, {self.lora.type}"
                f"{' + DoRA' if self.lora.dora else ''}, rank {self.lora.rank}, alpha {self.lora.alpha:g} (from the "
                "file; lora.rank / alpha / type / targets of the config are not used)")
        return params

    def same_start(self, dist, params: list[torch.nn.Parameter]) -> None:
        dist.same_start(params)  # cheap, and robust to any draw that differed between ranks

    def optimizer_state_layout(self, optim):  # noqa: ARG002 - the protocol's signature
        return ()

    def place_optimizer_state(self, handle, blocks, optim) -> None:
        """Nothing streams that trains: the optimizer state stays beside the LoRA weights."""

    def save_weights(self, folder: Path, step: int) -> None:
        ck.save_lora(folder / ck.ADAPTER_STATE, self.transformer, self._meta(step))

    def load_weights(self, folder: Path) -> None:
        ck.load_lora(ck.checkpoint_adapter(folder), self.transformer)

    def final_output(self, out_dir: Path) -> Path:
        """output.dir/lora.safetensors; a family of experts' lora-<model.expert>.safetensors (lora-low_noise: the
        name tells `dittrain sample` and the user which expert loads it)."""
        return self._named(out_dir, "")

    def _named(self, out_dir: Path, suffix: str) -> Path:
        """output.dir/lora<suffix>.safetensors, with `-<model.expert>` after `lora` for a family of experts."""
        expert = self.cfg.model.expert
        return out_dir / f"lora{'-' + expert if expert else ''}{suffix}.safetensors"

    def write_ema(self, out_dir: Path, step: int) -> Path:
        """The EMA weights (swapped in by ema.py) as output.dir/lora-ema.safetensors (lora-<model.expert>-ema), in
        output.lora_format."""
        from ..lora_format import lora_file_from

        path = self._named(out_dir, "-ema")
        self.export(path, lora_file_from(*ck.lora_file(self.transformer, self._meta(step))))
        return path

    def _meta(self, step: int) -> dict:
        lc = self.lora
        return {"rank": lc.rank, "alpha": lc.alpha, "step": step, "config_digest": self.cfg.digest(),
                "family": self.cfg.model.family, "type": lc.type, "dora": lc.dora}

    def export(self, path: Path, lf) -> None:
        """Write a LoRA for the user: output.lora_format's layout, the alpha / rank scale where its loaders read it (a
        DoRA's comfy / kohya dora_scale from the base weights of the model's files)."""
        ck.export_lora(path, lf, self.cfg.output.lora_format, self.cfg.model.family, self.cfg.model)

    def write_final(self, out_dir: Path, checkpoint: Path) -> Path:
        """The final LoRA file in output.dir: the checkpoint's weights in output.lora_format."""
        from ..lora_format import DORA_COMFY_NOTE, read_lora_file

        path = self.final_output(out_dir)
        self.export(path, read_lora_file(ck.checkpoint_adapter(checkpoint)))
        from ..models import adapter_class

        fmt, comfy_note = self.cfg.output.lora_format, adapter_class(self.cfg.model.family).comfy_diffusers_lora_note()
        if not LORA_KINDS[self.lora.type].loads_with_diffusers:
            say(ck.lycoris_loading_hint(path, self.lora.type, fmt, comfy_note))
        elif fmt == "diffusers":
            say(DORA_COMFY_NOTE if self.lora.dora else f"{path}: {comfy_note}")
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
        """Packed beside the weights, unless each process steps its own (owners.py: the state is the owner's)."""
        return (optim.fused is not None and optim.owners is None
                and optimizer_spec(self.cfg.optimizer.name).packed)

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

    def sharded_master_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        """fsdp: bf16 / fp16 weights train as fp32 master shards (no stochastic-rounding optimizer can shard)."""
        return torch.float32 if dtype in (torch.bfloat16, torch.float16) else None

    def save_sharded(self, folder: Path, main: bool, dtype: torch.dtype) -> bool:
        """fsdp: the diffusers folder written file by file as the shards are gathered (trainer/train/sharded.py)."""
        from . import sharded

        sharded.save_transformer(self.transformer, folder / "transformer", main, dtype)
        return True

    def load_weights(self, folder: Path) -> None:
        ck.load_transformer_weights(folder / "transformer", self.transformer)

    def final_output(self, out_dir: Path) -> Path:
        return out_dir / "transformer"

    def write_ema(self, out_dir: Path, step: int) -> Path:  # noqa: ARG002 - the step is in the checkpoint
        """The EMA weights (swapped in by ema.py) as the diffusers folder output.dir/transformer-ema."""
        path = out_dir / "transformer-ema"
        ck.atomic_dir(path, lambda tmp: ck.save_transformer(tmp, self.transformer))
        return path

    def write_ema_sharded(self, out_dir: Path, step: int, main: bool, dtype: torch.dtype | None) -> Path:  # noqa: ARG002
        """fsdp, collective: transformer-ema/ written by rank 0 file by file as the shards (the EMA swapped in)
        are gathered (sharded.save_transformer), in `dtype`."""
        from . import sharded

        path = out_dir / "transformer-ema"
        if main:
            ck.atomic_dir(path, lambda tmp: sharded.save_transformer(self.transformer, tmp, True, dtype))
        else:
            sharded.save_transformer(self.transformer, path, False, dtype)
        return path

    def write_final(self, out_dir: Path, checkpoint: Path) -> Path:
        """output.dir/transformer: the checkpoint's folder (just written from the same weights), hard-linked
        where the file system allows, else copied: a sharded run's weights exist whole only there."""
        path = self.final_output(out_dir)
        ck.atomic_dir(path, lambda tmp: ck.link_or_copy_tree(checkpoint / "transformer", tmp))
        return path


def adapted_modules(transformer: torch.nn.Module) -> list[str]:
    """Names of the modules peft put an adapter on."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [n for n, m in transformer.named_modules() if isinstance(m, BaseTunerLayer)]


def init_lora_config(cfg: Config, init, transformer: torch.nn.Module):
    """The lora section lora.init_from's file stands for: its kind, rank, alpha (scale x rank) and modules."""
    from ..errors import UserError

    path, family = cfg.lora.init_from, cfg.model.family
    for name in init.modules:
        try:
            transformer.get_submodule(name)
        except AttributeError:
            raise UserError(f"lora.init_from {path}: {name} is not a layer of this {family} model (a LoRA for "
                            "another model?)") from None
    ranks = {m.rank if m.rank is not None else m.peft_r for m in init.modules.values()}
    scales = {round(m.scale, 6) for m in init.modules.values()}
    if len(ranks) != 1 or len(scales) != 1:
        raise UserError(f"lora.init_from {path}: its modules have ranks {sorted(ranks)} and alpha / rank "
                        f"{sorted(scales)}; training on needs one rank and one alpha for every module")
    rank, scale = ranks.pop(), next(iter(init.modules.values())).scale
    return cfg.lora.model_copy(update={"type": init.kind, "dora": init.dora, "rank": rank, "alpha": scale * rank,
                                       "targets": sorted(init.modules)})


def load_init(transformer: torch.nn.Module, init, path: Path) -> None:
    """Put lora.init_from's weights into the adapter built from `init_lora_config`; shapes checked first."""
    from peft.utils import set_peft_model_state_dict

    from ..errors import UserError
    from ..lora_format import peft_state_dict

    sd, want = peft_state_dict(init), ck.lora_state_dict(transformer)
    for k, v in want.items():
        if k not in sd:
            raise UserError(f"lora.init_from {path}: no {k} in the file (this adapter needs it)")
        if sd[k].shape != v.shape:
            raise UserError(f"lora.init_from {path}: {k} has shape {list(sd[k].shape)} in the file, this model "
                            f"needs {list(v.shape)} (a LoRA for another model?)")
    extra = sorted(set(sd) - set(want))
    if extra:
        raise UserError(f"lora.init_from {path}: {extra[0]} has no place in this adapter")
    set_peft_model_state_dict(transformer, {k: v.float() for k, v in sd.items()})


METHODS = {m.name: m for m in (LoraMethod, FullMethod)}


def method_for(cfg: Config) -> TrainingMethod:
    """The training method named by train.method."""
    return METHODS[cfg.train.method](cfg)
