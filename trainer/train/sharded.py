"""train.distributed: fsdp — the transformer sharded across processes with PyTorch's FSDP2.

    torchrun --nproc_per_node 4 -m trainer.cli fit cfg.yaml --set train.distributed=fsdp

Why. Under `ddp` (distributed.py) every process holds the whole model: N copies of the base in host RAM when it
streams, and for a full fine-tune N copies of the fp32 optimizer state. Here each of the N processes owns 1/N of
every weight, gradient and optimizer moment.

How. `shard()` turns the transformer into FSDP2 units (`torch.distributed.fsdp.fully_shard`): one per block (the
blocks the adapter lists) and one root for everything outside them. A unit's parameters become DTensor shards;
before the block runs, FSDP2 all-gathers its shards into the whole block on every GPU (prefetching the next
block's while this one computes) and frees it after; in backward it gathers it again and reduce-scatters the
gradients, so each process ends the backward pass with the mean gradient of its own shard.

- Loading: the blocks come from the safetensors files one at a time (trainer/models/stream_load.py): a block is
  read to the CPU, sharded (each process keeps a copy of its rows), and its whole tensors are dropped before the
  next is read. Peak host memory of a process: its shards plus one block, not the model.
- `offload.transformer > 0`: FSDP2's `CPUOffloadPolicy`. Every shard lives in pinned CPU RAM; before a block
  runs each process copies only its 1/N of the block over its own PCIe link and the all-gather over NVLink
  assembles the rest, so each GPU moves 1/N of the bytes a single-GPU run moves. The gradients land in pinned RAM
  and the optimizer steps on the CPU (its state is there too). It is all or nothing: any fraction > 0 offloads
  every unit (FSDP2's policy is per unit; a mixed plan would step some shards on the GPU and some on the CPU).
  Our conductor (trainer/offload) is not used: the arena, ring and fused back pass are its single-process design.
- Full fine-tuning of bf16 weights: the shards are kept in fp32 (FSDP2's `MixedPrecisionPolicy`: all-gathered
  in bf16, gradients reduce-scattered in fp32), so AdamW steps fp32 master shards and nothing is rounded away; a
  one-process run steps fp32 copies made per weight instead (trainer/optim/stochastic.py), which cannot shard.
  The fp32 shards cost 4 bytes per weight / N; checkpoints and the final folder are written in the model dtype.
- Checkpointing: each block's forward runs under `torch.utils.checkpoint` (non-reentrant) inside the FSDP2 unit,
  so backward all-gathers a block once, recomputes it and reduce-scatters it; train.gradient_checkpointing: auto
  keeps the blocks the planner picks.
- Compile (train.compile): each block is compiled with `torch.compile` before it is sharded.
- Checkpoints: the weights are gathered to rank 0 (only the trainable ones: `ignore_frozen_params`) and written as
  today, so the LoRA file or transformer folder in a checkpoint is the same file a one-process run writes, and the
  final output too. The optimizer state, the part that is big and sharded, is written by every process through
  `torch.distributed.checkpoint` with its safetensors writer (`optimizer/shard-*.safetensors`, no pickle) and read
  back through the same planner, which re-shards it: a run saved on 4 processes resumes on 2 or on 1.
- Exactness: FSDP2 reduce-scatters the sum of the ranks' gradients and divides by N, so `fsdp` on N processes
  trains the one-process run with grad_accum x N micro-batches up to fp32 summation order (tests/test_fsdp.py);
  the data order and noise are distributed.py's, the same as ddp.

Left out (config.py refuses each in one line): the fused back pass (its point, never holding all gradients, is
what sharding does: each process holds 1/N of them), optimizers other than AdamW (untested on DTensor state),
EMA, activation offloading and nano-batches (the conductor's), `offload.transformer: auto` (the planner plans one
process), and sampling / validation during training (every process would have to run every forward of the
sampler; sample after training).
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from ..errors import UserError
from .monitor import say

OPTIMIZER_DIR = "optimizer"  # the optimizer state's shards inside a checkpoint folder


def _checkpointed(block: nn.Module) -> None:
    """Run `block`'s forward under non-reentrant activation checkpointing: its class becomes a subclass whose
    forward wraps the original (names, state-dict keys and isinstance checks unchanged)."""
    cls = type(block)

    def forward(self, *args, **kwargs):
        return checkpoint(cls.forward, self, *args, use_reentrant=False, **kwargs)

    block.__class__ = type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward})


def shard(transformer: nn.Module, blocks: list[nn.Module], device: torch.device, *, offload: bool,
          checkpointed: bool | list[bool], compile: bool, loader=None, master: torch.dtype | None = None) -> None:
    """Make `transformer` FSDP2 units across the default process group (see the module essay). `loader`: the
    stream_load.TransformerLoader whose placeholders fill block by block (None: the weights are already on the
    CPU). `checkpointed`: per block, or one bool for all. `master`: keep the shards in this dtype (fp32 for a
    full fine-tune of bf16 weights) and compute in the weights' own dtype."""
    world = tdist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    compute = next(p.dtype for p in transformer.parameters() if p.is_floating_point())
    mixed = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=master) if master else MixedPrecisionPolicy()
    per_block = checkpointed if isinstance(checkpointed, list) else [checkpointed] * len(blocks)
    with torch.no_grad():
        for b, ckpt in zip(blocks, per_block, strict=True):
            if loader is not None:
                loader.place(b, torch.device("cpu"))  # this block's whole tensors, dropped once sharded
            if master is not None:
                b.to(master)
            if ckpt:
                _checkpointed(b)
            if compile:
                b.compile()
            fully_shard(b, mesh=mesh, offload_policy=policy, mp_policy=mixed, reshard_after_forward=True)
        if loader is not None:
            loader.close()
        if master is not None:
            transformer.to(master)  # the rest (blocks are DTensor shards already in `master`)
        fully_shard(transformer, mesh=mesh, offload_policy=policy, mp_policy=mixed)
    shards = sum(p.to_local().numel() * p.element_size() for p in transformer.parameters() if isinstance(p, DTensor))
    say(f"fsdp: {len(blocks)} blocks + the rest sharded over {world} processes; this one holds "
        f"{shards / 1e9:.2f} GB of weights {'in pinned CPU RAM' if offload else f'on {device}'}")


def trainable(transformer: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters after `shard` (FSDP2 replaced them with DTensor parameters)."""
    return [p for p in transformer.parameters() if p.requires_grad]


@contextlib.contextmanager
def whole_trainable(transformer: nn.Module, main: bool, dtype: torch.dtype | None = None):
    """Collective: inside, on rank 0 (`main`), every trainable parameter of `transformer` is its whole tensor on
    the CPU (in `dtype`, if given: a full fine-tune's fp32 master shards are saved in the model dtype, as one
    process saves them), so the one-process writers (method.save_weights / write_final) save it unchanged; the
    shards are put back on exit. Frozen weights (a LoRA's base) are not gathered."""
    sd = get_model_state_dict(transformer, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=True))
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        if main:
            for name, value in sd.items():
                owner, _, leaf = name.rpartition(".")
                module = transformer.get_submodule(owner)
                old = module._parameters[leaf]
                swapped.append((module, leaf, old))
                value = value if dtype is None else value.to(dtype)
                module._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad)
        yield
    finally:
        for module, leaf, old in swapped:
            module._parameters[leaf] = old
        del sd


def local_nonfinite(transformer: nn.Module) -> str | None:
    """The first trainable parameter whose shard on this process holds a NaN or inf, else None."""
    for name, p in transformer.named_parameters():
        if p.requires_grad:
            t = p.to_local() if isinstance(p, DTensor) else p
            if t.numel() and not torch.isfinite(torch.linalg.vector_norm(t.detach(), dtype=torch.float32)):
                return name
    return None


# ---------------------------------------------------------------------------------------------- optimizer state


def _flat(osd: dict) -> dict[str, torch.Tensor]:
    """The tensors of an FQN-keyed optimizer state dict (get_optimizer_state_dict) as one flat dict."""
    return {f"{fqn}/{k}": v for fqn, state in osd["state"].items() for k, v in state.items()
            if isinstance(v, torch.Tensor)}


def staging(root: Path, step: int) -> Path:
    """Where every process writes its optimizer shards before rank 0 moves them into the checkpoint (a `.tmp-`
    name: checkpoint.remove_partial clears it after a crash)."""
    return root / f".tmp-optimizer-{step:06d}"


def save_optimizer(transformer: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Collective: every process writes its shards of the optimizer state into `folder` (safetensors)."""
    state = _flat(get_optimizer_state_dict(transformer, optimizer))
    if tdist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
    tdist.barrier()
    dcp.save(state, storage_writer=dcp.HuggingFaceStorageWriter(str(folder), save_distributed=True))


def load_optimizer(transformer: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Collective: the state `save_optimizer` wrote (on any number of processes), re-sharded for this job. Also
    in one process without a process group (plain parameters: the shards are read back whole)."""
    if not folder.is_dir():
        raise UserError(f"--resume: {folder} is missing: this checkpoint was not written by a train.distributed: "
                        "fsdp run (resume it with train.distributed: ddp, or one process)")
    osd = get_optimizer_state_dict(transformer, optimizer)  # initialises the state: the right shapes to read into
    flat = _flat(osd)
    dcp.load(flat, storage_reader=dcp.HuggingFaceStorageReader(str(folder)))
    for key, value in flat.items():
        fqn, _, k = key.rpartition("/")
        osd["state"][fqn][k] = value
    set_optimizer_state_dict(transformer, optimizer, osd)
