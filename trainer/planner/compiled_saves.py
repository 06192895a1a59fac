"""What a compiled block saves for backward: the planner's count under `train.compile` (regional compilation).

Why. trainer/offload/compiled.py compiles each block class's forward with inductor. AOTAutograd then splits the
block's joint forward + backward graph with its min-cut partitioner, which keeps for backward only what it cannot
recompute cheaply and recomputes the rest inside backward (dtype casts, the modulation and norm arithmetic, the
pointwise tails of the MLP and of rotary embeddings). A compiled block that keeps its activations therefore holds
fewer bytes than the same block run eagerly, which is what trace.py counts: on an H100 a compiled Qwen-Image step
without checkpointing peaked at 66.9 GiB where the eager count said 117 GB (part of that gap was an fp32 copy of
each LoRA input that the trainer does not make, see meta.py `add_meta_lora`). Eager blocks keep the eager count.

How. For each block class, the class's own forward (as the trainer compiles it: `cls.forward` with the block as
first argument) is compiled with torch's `aot_eager_decomp_partition` backend, which runs inductor's
decompositions and inductor's partitioner but generates no code, and called once on the meta arguments of the
class's last traced call (a block inside the stack, whose inputs carry gradients as in training). The compiled
function hands its saved tensors to `ctx.save_for_backward`, so `saved_tensors_hooks` see them, and they are
counted as trace.py counts: once per storage, the weights and the block's direct inputs left out.
Attention calls the kernel the GPU runs (flash attention, or memory-efficient attention when there is a mask;
CPU flash attention for kernels="cpu"): their meta functions and derivatives are torch's own, so the partitioner
sees what their backward needs. RMS norm is left to the decompositions (inductor decomposes it too).

Cost: one dynamo trace and partition per block class and bucket (2-6 s of one CPU core for full-size blocks), only
where a block may keep its activations (train.gradient_checkpointing false or auto) with compile on. If dynamo
cannot trace a family's block on meta, the eager count stays and the trace says so (`Trace.saved_by`).

Token chunks (offload.nano_batches, trainer/offload/nano.py). Compiled, each chunk of a split sub-layer is one of
torch.compile's activation-checkpoint regions, which the partitioner recomputes whole in backward: the block's
forward keeps nothing made inside a chunk, not even what eager chunks would keep of the sub-layer (its dequantized
weights, the text's keys and values), nor the sub-layers' inputs where they are cheap to make again (a norm's output).
`chunk_saving` counts what the split compiled block keeps: its saved bytes, the split compiled with `PROBE_CHUNKS`
chunks (the forward keeps nothing of any chunk, so the count does not depend on their number; one chunk's recompute
in backward is the planner's to add, trace.py `chunk_mlps`), and the largest tensor it saves, which sizes
backward's transients (the eager count's largest is then a float32 copy of a norm's
input that the compiled block never makes: inductor upcasts inside the norm's kernel). This is what a block
recomputed in backward (gradient checkpointing) holds too when it runs compiled: its recompute is the compiled
forward (trainer/offload/block.py `_compute`).

Left out: the first block of each list, whose inputs carry no gradient in LoRA training, is counted as the others
(it saves a little less); the small tensors the partitioner saves as Python numbers (symbolic sizes, seeds).
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn

from .trace import Trace, _storage

BACKEND = "aot_eager_decomp_partition"  # inductor's decompositions and partitioner, no code generation


def _attention(kernels: str):
    """F.scaled_dot_product_attention as the GPU (kernels="cuda") or CPU (kernels="cpu") dispatches it."""
    aten = torch.ops.aten

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # torch turns it into an additive mask
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                attn_mask.logical_not(), float("-inf"))
        if kernels == "cpu":
            return aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        if attn_mask is None:
            return aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask.expand(*query.shape[:-2], query.shape[-2], key.shape[-2]), True,
            dropout_p, is_causal, scale=scale)[0]

    return sdpa


#: chunks the split block is compiled with by `chunk_saving` (see the module essay)
PROBE_CHUNKS = 2


@contextlib.contextmanager
def _rng_state_on_meta():
    """Inside an activation-checkpoint region the partitioner wraps a random op (flash attention returns a seed) in
    `run_and_save_rng_state`, which has no meta implementation: while counting on meta, meta takes the CPU's (the
    state it saves is never read; the count is of shapes). torch's `get_device` names meta tensors' device "meta"
    (2.13) or None (2.11, the GPU hosts' torch: it looks for cuda, xpu, hpu or cpu tensors only), and either
    would fail (`Backend not supported`): both take the CPU's. Before this took None too, every compiled count of
    token chunks on a GPU host fell back to the eager one (Wan 2.2 A14B at 720p x 81, 16 chunks: 31.52 GB
    predicted where the compiled count is 27.34; bench/history/2026-11-28.md 07:43)."""
    from torch._prims import rng_prims

    real = rng_prims.get_device

    def device(args, kwargs):
        found = real(args, kwargs)
        return "cpu" if found in ("meta", None) else found

    rng_prims.get_device = device
    try:
        yield
    finally:
        rng_prims.get_device = real


@contextlib.contextmanager
def _split(block: nn.Module, mlps: list[nn.Module], n: int):
    """`block` with its token-wise sub-layers `mlps` split in `n` chunks as the trainer splits them
    (offload/nano.py `split_mlps`), restored after."""
    from ..offload.nano import join_mlps, split_mlps

    split_mlps(block, n, mlps)
    try:
        yield
    finally:
        join_mlps(mlps)


def _private_forward(cls: type):
    """`cls.forward` as a new function on a copy of its code object: the region the trainer compiles, while dynamo's
    cache entries (kept per code object, and counted against its recompile limit) stay off the trainer's own."""
    f = cls.forward
    g = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    g.__kwdefaults__ = f.__kwdefaults__
    return g


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _on_meta(obj):
    """Host-side layout tensors a family passes on the CPU (trace.py `_HostLayoutOnMeta`) moved to meta: the compiled
    graph must not mix devices (Qwen-Image 2.1's token masks)."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t, obj)


def _saved_by_one(block: nn.Module, args: tuple, kwargs: dict, weights: set[int]) -> tuple[int, int]:
    if next(block.parameters()).device.type == "meta":
        args, kwargs = _on_meta(args), _on_meta(kwargs)
    direct = {_storage(a)[0] for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
    saved: dict[int, int] = {}
    alive: list[torch.Tensor] = []  # keep counted tensors alive: a freed storage's id could be reused

    def pack(t):
        alive.append(t)
        sid, nbytes = _storage(t)
        if sid not in weights and sid not in direct:
            saved[sid] = nbytes
        return t

    before = _graphs()
    forward = _private_forward(type(block))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torch.compile(forward, backend=BACKEND, dynamic=False)(block, *args, **kwargs)
    finally:
        torch._dynamo.reset_code(forward.__code__)  # drop what dynamo cached for it
    if _graphs() == before:
        raise RuntimeError("dynamo ran the block without compiling it")
    return sum(saved.values()), max(saved.values(), default=0)


def _signature(obj) -> tuple:
    """What the compiled count depends on: the class, its parameters' and the arguments' shapes, dtypes and
    whether they carry gradients (LoRA rank and targets, quantization and the bucket shape included)."""
    if isinstance(obj, nn.Module):
        return (type(obj).__qualname__, tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                                               for n, p in obj.named_parameters()))
    if isinstance(obj, torch.Tensor):
        return (tuple(obj.shape), obj.dtype, obj.requires_grad, obj.device.type)
    if isinstance(obj, tuple | list):
        return tuple(_signature(o) for o in obj)
    if isinstance(obj, dict):
        return tuple((k, _signature(v)) for k, v in obj.items())
    return (repr(obj),)


#: counts already made in this process (the presets generator plans hundreds of configs of a dozen block kinds)
_CACHE: dict[tuple, tuple[int, int]] = {}


@contextlib.contextmanager
def _counting(transformer: nn.Module, kernels: str):
    """While blocks of `transformer` are counted: the storages of its weights (which a block's saves do not count)
    and the attention of `kernels` in place of torch's."""
    weights = {_storage(p)[0] for p in transformer.parameters()} | {
        _storage(b)[0] for b in transformer.buffers()
    }
    F = torch.nn.functional
    plain = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _attention(kernels)  # not thread-safe: the planner runs before training
    try:
        yield weights
    finally:
        F.scaled_dot_product_attention = plain


def _saved(block: nn.Module, args, kwargs, weights, kernels: str, token_wise=None) -> tuple[int, int]:
    """`_saved_by_one` of `block` at these arguments, counted once per process: whole, or with `token_wise` (its
    token-wise sub-layers) in PROBE_CHUNKS chunks."""
    key = (kernels, _signature(block), _signature(args), _signature(kwargs)) + (("chunks",) if token_wise else ())
    if key not in _CACHE:
        with (_split(block, token_wise, PROBE_CHUNKS) if token_wise else contextlib.nullcontext()), \
                (_rng_state_on_meta() if token_wise else contextlib.nullcontext()):
            _CACHE[key] = _saved_by_one(block, args, kwargs, weights)
    return _CACHE[key]


def compiled_saved(transformer: nn.Module, blocks: list[nn.Module], tr: Trace,
                   kernels: str = "cuda") -> dict[str, tuple[int, int]]:
    """Per block class name: (bytes a compiled block of it saves for backward, its largest saved tensor), at the
    shapes of `tr` (trace.py `trace_forward` of the same model); see the module essay."""
    with _counting(transformer, kernels) as weights:
        return {name: _saved(blocks[i], args, kwargs, weights, kernels)
                for name, (i, args, kwargs) in tr.last_calls.items()}


def chunk_saving(transformer: nn.Module, blocks: list[nn.Module], tr: Trace, token_wise_of,
                 kernels: str = "cuda") -> list[tuple[int, int]]:
    """Per block: (the bytes its compiled forward saves for backward when its token-wise sub-layers
    (`token_wise_of(block)`) run in token chunks, the largest tensor it saves then), at the shapes of `tr`; see the
    module essay."""
    per_class = {}
    with _counting(transformer, kernels) as weights:
        for name, (i, args, kwargs) in tr.last_calls.items():
            per_class[name] = _saved(blocks[i], args, kwargs, weights, kernels, token_wise_of(blocks[i]))
    return [per_class[type(b).__name__] for b in blocks]


def apply_compiled(transformer: nn.Module, blocks: list[nn.Module], tr: Trace, kernels: str = "cuda") -> Trace:
    """`tr` with each block's saved bytes (and largest saved tensor) as its compiled class saves them; `tr`
    unchanged, `saved_by` naming the reason, when dynamo cannot trace a block on meta."""
    try:
        per_class = compiled_saved(transformer, blocks, tr, kernels)
    except Exception as e:  # noqa: BLE001 - dynamo's errors have no common base; the eager count is the fallback
        tr.saved_by = f"eager blocks (compiling the block on meta failed: {type(e).__name__})"
        return tr
    names = [type(b).__name__ for b in blocks]
    tr.block_saved = [per_class[n][0] for n in names]
    tr.block_largest = [per_class[n][1] for n in names]
    tr.saved_by = "compiled blocks (AOTAutograd's partition)"
    return tr
