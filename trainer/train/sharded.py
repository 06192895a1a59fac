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
  The conductor's streaming (trainer/offload: arena, ring) is not used, being a single-process design; its
  activation offloader and nano split are (below).
- Full fine-tuning of bf16 weights: the shards are kept in fp32 (FSDP2's `MixedPrecisionPolicy`: all-gathered
  in bf16, gradients reduce-scattered in fp32), so AdamW steps fp32 master shards and nothing is rounded away; a
  one-process run steps fp32 copies made per weight instead (trainer/optim/stochastic.py), which cannot shard.
  The fp32 shards cost 4 bytes per weight / N; checkpoints and the final folder are written in the model dtype.
- Checkpointing: each block's forward runs under `torch.utils.checkpoint` (non-reentrant) inside the FSDP2 unit,
  so backward all-gathers a block once, recomputes it and reduce-scatters it; train.gradient_checkpointing: auto
  keeps the blocks the planner picks.
- Activation offloading (offload.activations): the conductor's own ActivationOffloader (trainer/offload/
  activations.py), which does not care where the weights come from. Its saved-tensor hooks wrap each block's
  checkpoint call, so the tensors checkpoint saves (the block's inputs; the tensor keyword arguments diffusers
  passes are made positional for that) go to pinned CPU RAM on a side stream in forward and come back one block
  ahead in backward, while FSDP2 all-gathers that block; a forward pre-hook on the root starts each step's
  arena. Only on a GPU, as with one process (tests/test_fsdp.py runs its CPU path: copies into an unpinned
  arena and back). Inside a checkpointed block FSDP2's all-gathered weights are not saved tensors (the
  recompute uses the weights FSDP2 gathers again), so only activations move.
- Nano-batches (offload.nano_batches): each block's token-wise MLPs are split (trainer/offload/nano.py) before
  it is sharded, as the conductor splits them.
- EMA (train.ema): each process keeps the EMA of its own shards; the checkpoint's ema.safetensors and the final
  -ema weights are what one process writes (trainer/train/sharded_ema.py).
- Compile (train.compile): each block is compiled with `torch.compile` before it is sharded (not yet measured on
  a GPU: bench/multi_gpu/bench_fsdp.py's rows are eager).
- Checkpoints: the trainable weights are gathered to rank 0 one at a time (a LoRA's frozen base is not) and
  written as today (a full fine-tune's folder file by file, `save_transformer`, so rank 0 never holds the
  model): the LoRA file or transformer folder in a checkpoint is the one a one-process run writes, and the final
  output too. The optimizer state, the part that is big and sharded, is written by every process through
  `torch.distributed.checkpoint` with its safetensors writer (`optimizer/shard-*.safetensors`, no pickle) and read
  back through the same planner, which re-shards it: a run saved on 4 processes resumes on 2 or on 1.
- The fused back pass (optimizer.fused_back_pass): FSDP2 (torch 2.13's `foreach_reduce`) calls the sharded
  parameters' post-accumulate-grad hooks itself, right after it has reduce-scattered a unit's gradients into
  them, under its post-reduce stream; the fused pass's hook (trainer/optim/fused.py) steps that shard there and
  frees its gradient, and the next forward's all-gather waits for that stream. Each process then never holds
  more than one unit's gradient shards: with CPU offload, the 4 bytes per weight / N of fp32 gradients in pinned
  RAM are gone. (FSDP2 copies the gradient to the CPU synchronously when such a hook exists, and the CPU AdamW
  step runs inside backward: not yet measured on GPUs.) The gradient norm is summed from the shards
  (distributed.py `ShardNorm`).
- Exactness: FSDP2 reduce-scatters the sum of the ranks' gradients and divides by N, so `fsdp` on N processes
  trains the one-process run with grad_accum x N micro-batches up to fp32 summation order (tests/test_fsdp.py);
  the data order and noise are distributed.py's, the same as ddp.

Optimizers: AdamW, schedule-free AdamW and Prodigy (their step counts, weight sums and step size d live in the
param groups, which rank 0 writes beside the shards, GROUPS; Prodigy's global sums are DTensor reductions;
its `p0` of a weight that was all zeros at its first step, a LoRA B, is a scalar, read back as saved: a
weight all zeros again at resume whose p0 was saved whole would not load). Left out (config.py refuses each in
one line): Adafactor (transformers' builds its factored moments as plain tensors beside DTensor gradients:
"mixed torch.Tensor and DTensor"), 8-bit AdamW (bitsandbytes; CUDA only, untested on shards), stochastic
rounding (the fp32 master shards above keep what it keeps), and `offload.transformer: auto` (the planner plans
one process). Gradient accumulation reduce-scatters after every micro-batch (`set_requires_gradient_sync(False)`
would save those collectives by keeping every unit's whole gradient until the last one: for a full fine-tune a
full-size gradient per process, what sharding is for removing). Sampling and validation during training run on
rank 0 as under ddp, the other ranks joining each of its transformer calls (`Lockstep`).

Measured (bench/history/2026-11-25.md 17:05, 2 x H100, Flux.1-dev LoRA): slower than ddp, resident (1.13 vs 0.87 s, for
10 GB less VRAM per GPU) and streamed (FSDP2's CPU offload 1.64 s vs the conductor's 1.11 s). It is for what does
not fit one process's share, not for speed.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from ..errors import UserError
from ..offload.activations import ActivationOffloader
from ..offload.nano import split_mlps
from ..offload.plan import inputs_on_device
from .checkpoint import first_nonfinite
from .monitor import say

OPTIMIZER_DIR = "optimizer"  # the optimizer state's shards inside a checkpoint folder
GROUPS = "param_groups.json"  # beside the shards: the param groups' settings (`save_optimizer`)
FILE_BYTES = 2 * 2**30  # whole-tensor bytes per optimizer-state file (`_files`)
ACTIVATION_MIN_BYTES = 1 << 20  # smaller checkpoint inputs stay where they are (the conductor's default)


def _checkpointed(block: nn.Module, index: int, activations: ActivationOffloader | None) -> None:
    """Run `block`'s forward under non-reentrant activation checkpointing: its class becomes a subclass whose
    forward wraps the original (names, state-dict keys and isinstance checks unchanged). Tensor keyword arguments
    (diffusers passes a block everything by keyword) become positional ones of the checkpointed function, so
    checkpoint saves them as saved tensors, which `activations`' hooks move to CPU RAM; only the non-tensor ones
    are kept by the closure (as trainer/offload/block.py does, and for the same reason)."""
    cls = type(block)

    def forward(self, *args, **kwargs):
        keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        static = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        n = len(args)

        def run(*a):
            return cls.forward(self, *a[:n], **static, **dict(zip(keys, a[n:], strict=True)))

        flat = [*args, *(kwargs[k] for k in keys)]
        del kwargs
        hooks = activations.hooks(index) if activations is not None and torch.is_grad_enabled() else \
            contextlib.nullcontext()
        with hooks:
            return checkpoint(run, *flat, use_reentrant=False)

    block.__class__ = type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward})


def shard(transformer: nn.Module, blocks: list[nn.Module], device: torch.device, *, offload: bool,
          checkpointed: bool | list[bool], compile: bool, loader=None, master: torch.dtype | None = None,
          activations: bool = False, nano_batches: int = 1, nano_mlps=None) -> ActivationOffloader | None:
    """Make `transformer` FSDP2 units across the default process group (see the module essay). `loader`: the
    stream_load.TransformerLoader whose placeholders fill block by block (None: the weights are already on the
    CPU). `checkpointed`: per block, or one bool for all. `master`: keep the shards in this dtype (fp32 for a
    full fine-tune of bf16 weights) and compute in the weights' own dtype. `activations`: the checkpointed
    blocks' inputs go to CPU RAM (returns the offloader: close it after training); `nano_batches`: each block's
    token-wise MLPs (`nano_mlps(block)`: the family's `token_wise_of`; None: every FeedForward) run in that many
    checkpointed chunks (trainer/offload/nano.py)."""
    world = tdist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    compute = next(p.dtype for p in transformer.parameters() if p.is_floating_point())
    mixed = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=master) if master else MixedPrecisionPolicy()
    per_block = checkpointed if isinstance(checkpointed, list) else [checkpointed] * len(blocks)
    offloader = ActivationOffloader(device, min_bytes=ACTIVATION_MIN_BYTES,
                                    on_device=inputs_on_device(per_block)) if activations else None
    with torch.no_grad():
        for i, (b, ckpt) in enumerate(zip(blocks, per_block, strict=True)):
            if loader is not None:
                loader.place(b, torch.device("cpu"))  # this block's whole tensors, dropped once sharded
            if master is not None:
                b.to(master)
            split_mlps(b, nano_batches, nano_mlps(b) if nano_mlps is not None else None)
            if ckpt:
                _checkpointed(b, i, offloader)
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
        f"{shards / 1e9:.2f} GB of weights {'in pinned CPU RAM' if offload else f'on {device}'}"
        f"{'; checkpointed block inputs offloaded to CPU RAM' if offloader else ''}"
        f"{f'; MLPs in {nano_batches} token chunks' if nano_batches > 1 else ''}")
    if offloader is not None:
        def new_step(module, args) -> None:  # returns None: a pre-hook's return value would replace the args
            if torch.is_grad_enabled():  # a training forward: the last backward has unpacked everything
                offloader.new_step()

        transformer.register_forward_pre_hook(new_step)
    return offloader


def trainable(transformer: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters after `shard` (FSDP2 replaced them with DTensor parameters)."""
    return [p for p in transformer.parameters() if p.requires_grad]


@contextlib.contextmanager
def whole_trainable(transformer: nn.Module, main: bool, dtype: torch.dtype | None = None):
    """Collective: inside, on rank 0 (`main`), every trainable parameter of `transformer` is its whole tensor on
    the CPU (in `dtype`, if given: a full fine-tune's fp32 master shards are saved in the model dtype, as one
    process saves them), so the one-process writers (method.save_weights / write_final) save it unchanged; the
    shards are put back on exit. Frozen weights (a LoRA's base) are not gathered. One parameter at a time, over
    the GPUs (CPU-offloaded shards visit them for the all-gather): rank 0 holds the weights once, in `dtype`."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        for name, p in list(transformer.named_parameters()):
            if not p.requires_grad:
                continue
            whole = _whole(p.detach(), dtype)
            if main:
                owner, _, leaf = name.rpartition(".")
                module = transformer.get_submodule(owner)
                swapped.append((module, leaf, p))
                module._parameters[leaf] = nn.Parameter(whole, requires_grad=True)
        yield
    finally:
        for module, leaf, old in swapped:
            module._parameters[leaf] = old


def _whole(p: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The whole value of parameter `p` (a DTensor shard: all-gathered) on the CPU, in `dtype` if given."""
    if isinstance(p, DTensor):
        local = p.to_local()
        if local.device.type == "cpu" and torch.cuda.is_available():  # CPU offload: gather over NCCL
            local = local.to(torch.device("cuda", torch.cuda.current_device()), non_blocking=True)
        p = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
    return (p if dtype is None else p.to(dtype)).to("cpu", copy=True)


def save_transformer(transformer: nn.Module, folder: Path, main: bool, dtype: torch.dtype) -> None:
    """Collective: the diffusers folder `save_pretrained` writes (config.json, safetensors files of about
    FILE_BYTES each with their index), written by rank 0 (`main`) one file at a time as the weights are gathered,
    so rank 0 never holds more than one file's worth (a full fine-tune of 12 B weights would otherwise gather
    24 GB on rank 0 before writing). Floating-point weights in `dtype` (the fp32 master shards in the model dtype)."""
    state = transformer.state_dict()
    size = {k: v.numel() * (dtype.itemsize if v.is_floating_point() else v.element_size()) for k, v in state.items()}
    groups: list[list[str]] = [[]]
    for k in state:  # the same split on every rank: whole-tensor sizes
        if groups[-1] and sum(size[g] for g in groups[-1]) + size[k] > FILE_BYTES:
            groups.append([])
        groups[-1].append(k)
    names = (["diffusion_pytorch_model.safetensors"] if len(groups) == 1 else
             [f"diffusion_pytorch_model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    if main:
        folder.mkdir(parents=True, exist_ok=True)
        transformer.save_config(str(folder))
    for keys, name in zip(groups, names, strict=True):
        part = {}
        for k in keys:
            v = state[k].detach()
            whole = _whole(v, dtype if v.is_floating_point() else None)  # collective for a shard
            if main:
                part[k] = whole.contiguous()
        if main:
            save_file(part, str(folder / name), metadata={"format": "pt"})
    if main and len(groups) > 1:
        index = {"metadata": {"total_size": sum(size.values())},
                 "weight_map": {k: n for keys, n in zip(groups, names, strict=True) for k in keys}}
        (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def local_nonfinite(transformer: nn.Module) -> str | None:
    """The first trainable parameter whose shard on this process holds a NaN or inf, else None."""
    return first_nonfinite((n, p.to_local() if isinstance(p, DTensor) else p)
                           for n, p in transformer.named_parameters() if p.requires_grad)


class Lockstep:
    """The transformer's forward passes that only rank 0 makes (sampling, validation), joined by every other rank.

    Under FSDP2 each block's forward all-gathers its shards from every process (and under the conductor's sharded
    stream each block's load gathers its slices: trainer/offload/gather.py), so a forward on rank 0 alone would
    wait forever. Rank 0 runs `with lockstep.lead():` around its pipeline or validation; a pre-forward hook (ahead
    of FSDP2's own) broadcasts "one more forward" before each call of the transformer, and leaving the block
    broadcasts "done". The other ranks run `lockstep.follow()`: for each "one more forward" they call the
    transformer once under no_grad on the adapter's dummy inputs for a tiny image (64 px), so their all-gathers
    pair with rank 0's, then return at "done". Their outputs are dropped; their cost is one small forward per
    call, the all-gathers being what they are there for.

    Left out: an error on rank 0 in the middle of a transformer call (out of memory while sampling) leaves the
    other ranks inside that call's all-gather until the process group's timeout (30 minutes), as any collective
    one rank abandons does; rank 0 has already reported it."""

    def __init__(self, transformer: nn.Module, adapter, device: torch.device, dtype: torch.dtype):
        self.transformer, self.adapter, self.device, self.dtype = transformer, adapter, device, dtype
        self._flag = torch.zeros(1, dtype=torch.int32, device=device if device.type == "cuda" else "cpu")

    def _say(self, value: int) -> int:
        self._flag.fill_(value)
        tdist.broadcast(self._flag, src=0)
        return int(self._flag.item())

    @contextlib.contextmanager
    def lead(self):
        def announce(module, args) -> None:  # returns None: a pre-hook's return value would replace the args
            self._say(1)

        hook = self.transformer.register_forward_pre_hook(announce, prepend=True)
        try:
            yield
        finally:
            hook.remove()
            self._say(0)

    def follow(self) -> None:
        side = 64
        inputs = self.adapter.dummy_inputs(self.transformer, 1, side, side, 8, self.dtype, self.device)
        was_training = self.transformer.training
        self.transformer.eval()
        try:
            with torch.no_grad():
                while self._say(0) == 1:  # rank 0's value arrives; ours is ignored
                    self.transformer(**inputs)
        finally:
            self.transformer.train(was_training)


# ---------------------------------------------------------------------------------------------- optimizer state


def _flat(osd: dict) -> dict[str, torch.Tensor]:
    """The tensors of an FQN-keyed optimizer state dict (get_optimizer_state_dict) as one flat dict."""
    return {f"{fqn}/{k}": v for fqn, state in osd["state"].items() for k, v in state.items()
            if isinstance(v, torch.Tensor)}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def staging(root: Path, step: int) -> Path:
    """Where the processes write what they write together (the optimizer shards, a full fine-tune's weights)
    before rank 0 moves it into the checkpoint (a `.tmp-` name: checkpoint.remove_partial clears it after a
    crash)."""
    return root / f".tmp-sharded-{step:06d}"


def save_optimizer(transformer: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Collective: every process writes its shards of the optimizer state into `folder` (safetensors); rank 0
    adds the param groups' settings (GROUPS: Prodigy's step size d, schedule-free's weight sum and mode live
    there, the same on every process)."""
    osd = get_optimizer_state_dict(transformer, optimizer)
    state = _flat(osd)
    if tdist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
    tdist.barrier()
    writer = dcp.HuggingFaceStorageWriter(str(folder), save_distributed=True, fqn_to_index_mapping=_files(state))
    dcp.save(state, storage_writer=writer)
    if tdist.get_rank() == 0:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]
        (folder / GROUPS).write_text(json.dumps(groups))  # floats through repr: exact


def _files(state: dict[str, torch.Tensor], group_bytes: int | None = None) -> dict[str, int]:
    """Which file (from 1) each tensor of the flat state goes to: about `group_bytes` of *whole* tensors per
    file, the same split on every rank. The writer builds each safetensors file in memory before writing it, so
    one file per rank would hold a copy of the rank's whole optimizer state in RAM (a 12 B full fine-tune on 2
    processes: +48 GB per process)."""
    group_bytes = FILE_BYTES if group_bytes is None else group_bytes
    out, index, size = {}, 1, 0
    for key, t in state.items():
        nbytes = t.numel() * t.element_size()  # DTensor: the whole tensor's numel, equal on every rank
        if size and size + nbytes > group_bytes:
            index, size = index + 1, 0
        out[key] = index
        size += nbytes
    return out


def load_optimizer(transformer: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Collective: the state `save_optimizer` wrote (on any number of processes), re-sharded for this job. Also
    in one process without a process group (plain parameters: the shards are read back whole)."""
    if not folder.is_dir():
        raise UserError(f"--resume: {folder} is missing: this checkpoint was not written by a train.distributed: "
                        "fsdp run (resume it with train.distributed: ddp, or one process)")
    for p in [p for p, st in optimizer.state.items() if not st]:  # schedule-free's train() leaves empty entries,
        del optimizer.state[p]  # which would make torch skip initialising the state below
    osd = get_optimizer_state_dict(transformer, optimizer)  # initialises the state: the right shapes to read into
    flat = _flat(osd)
    saved = dcp.HuggingFaceStorageReader(str(folder)).read_metadata().state_dict_metadata
    for key, t in flat.items():  # state whose shape depends on the weights at its first step (Prodigy's p0: a
        meta = saved.get(key)  # scalar for a weight that was all zeros, a LoRA B) is read as it was saved, whole
        if meta is not None and tuple(meta.size) != tuple(t.shape) and meta.size.numel() == 1:
            flat[key] = torch.empty(meta.size, dtype=t.dtype, device=_local(t).device)
    dcp.load(flat, storage_reader=dcp.HuggingFaceStorageReader(str(folder)))
    for key, value in flat.items():
        fqn, _, k = key.rpartition("/")
        osd["state"][fqn][k] = value
    if (folder / GROUPS).is_file():
        for group, saved in zip(osd["param_groups"], json.loads((folder / GROUPS).read_text()), strict=True):
            group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})
    set_optimizer_state_dict(transformer, optimizer, osd)
    if hasattr(optimizer, "train") and not all(g.get("train_mode", True) for g in optimizer.param_groups):
        optimizer.train()  # schedule-free: saved with the averaged weights in place (build.eval_weights)
