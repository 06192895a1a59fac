"""Exact weight bytes and estimated activation bytes of a transformer, counted on the meta device.

How: the family's diffusers transformer is built on the meta device from its config (the model folder's
`transformer/config.json`, or the built-in full-size config for presets), so a 20 B-parameter model costs no
memory and builds in a fraction of a second. Parameter bytes per block are then exact. For activations the
whole transformer runs one forward pass on meta tensors of the bucket's shape (meta ops only compute shapes),
with hooks on every block:

- the *checkpoint inputs* of a block are the tensors it is called with (what non-reentrant
  `torch.utils.checkpoint` keeps alive between forward and backward, and what activation offloading moves to
  the host). They are counted once per storage: a block's outputs are the next block's inputs, and Flux's
  single blocks get two views of one tensor. Those later blocks take too (the timestep's modulations, the text)
  are made once a call and, where no gradient reaches them, never differentiated (`Trace.block_const_inputs`);
- the *saved tensors of one block* (what its recompute holds for backward) are counted with
  `torch.autograd.graph.saved_tensors_hooks` around the block, deduplicated by storage, leaving out the
  weights (they are not activations) and the block's inputs (already counted).

Attention and RMS norm are the two ops whose saved tensors depend on the kernel, not the Python code. On meta,
`scaled_dot_product_attention` takes the math path (an N x N score matrix), which no GPU kernel stores, so
while tracing it is swapped (on `torch.nn.functional`, where diffusers looks it up at call time; not thread-safe,
the planner runs before training) for a stand-in that saves what the flash / memory-efficient kernels save
(q, k, v, the output, a float32 log-sum-exp per query row, and the mask if any); CPU's flash kernel saves the
same. On CUDA `rms_norm` is one
fused kernel saving its input and a float32 rstd per row; on CPU it is decomposed into float32 ops; `kernels=
"cuda"` models the former, `"cpu"` leaves the decomposition alone (the tests compare that mode with real CPU
runs of the tiny models).

Host work: while tracing, a dispatch mode counts the tensor operations each block's forward dispatches
(`Trace.block_ops`, the attention stand-in's included); without a GPU measurement the planner turns them into the
host's launch time (trainer/planner/replay.py).

Left out: the transient tensors of backward (gradients of intermediates, kernel workspaces) are not traced;
the planner adds a stated estimate for them. LoRA is injected into the meta model with peft as the trainer does,
its branch in the activations' dtype under `lora.compute_dtype: auto` (meta.py `add_meta_lora`: the trainer makes
no fp32 copy of a LoRA layer's input, so none is counted). What is counted here is what *eager* blocks save;
compiled blocks save less (compiled_saves.py, used where a block keeps its activations).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..models import adapter_class
from .meta import (  # noqa: F401 - re-exported: the planner's one entry point for model facts
    add_meta_lora,
    blocks_of,
    default_lora_targets,
    meta_transformer,
    transformer_class,
)
from .meta_ops import MetaOpCache

# ------------------------------------------------------------------------------------------- kernel model


class _FlashAttn(torch.autograd.Function):
    """Stand-in for SDPA that saves what flash / memory-efficient attention saves (shapes only)."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        # (B, H, L, D) viewed from (B, L, H, D) memory, as the flash kernels (CUDA and CPU) lay it out, so the
        # caller's transpose(1, 2).flatten() is a view of it, not a copy.
        b, h, lq = q.shape[:-3].numel(), q.shape[-3], q.shape[-2]
        out = torch.empty(b, lq, h, v.shape[-1], dtype=q.dtype, device=q.device).transpose(1, 2)
        out = out.reshape(*q.shape[:-1], v.shape[-1]) if q.dim() != 4 else out
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        # A mask is kept for backward too (CPU flash, CUDA memory-efficient attention), a boolean one after
        # torch converted it to an additive mask in the query's dtype.
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.empty(mask.shape, dtype=q.dtype, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse, *([mask] if mask is not None else []))
        return out

    @staticmethod
    def backward(ctx, g):  # pragma: no cover - shape bookkeeping only, never differentiated
        q, k, v = ctx.saved_tensors[:3]
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


class _FusedRms(torch.autograd.Function):
    """Stand-in for CUDA's fused rms_norm: saves the input and a float32 rstd per row."""

    @staticmethod
    def forward(ctx, x, w):
        rstd = torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, w, rstd) if w is not None else ctx.save_for_backward(x, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):  # pragma: no cover
        return torch.empty_like(g), None


class _KernelModel:
    """Context manager: `F.scaled_dot_product_attention` (and with kernels="cuda" `F.rms_norm`) replaced by the
    stand-ins above while tracing. diffusers and torch.nn.RMSNorm look both up on `torch.nn.functional` at call
    time; patching the attribute is ~10x cheaper than a TorchFunctionMode seeing every op."""

    def __init__(self, kernels: str):
        self.kernels = kernels
        self.attn_flops = 0
        #: storage -> bytes of the keys and values attention took since the last `clear()` (a KV cache keeps them:
        #: sampling.py); by storage, since a block's calls may take slices of one key tensor (Qwen-Image 2.1's prefix)
        self.kv: dict[int, int] = {}
        #: the attention calls since the last `calls.clear()`, as `attention_backward` reads them: (storages of q, k
        #: and v, their bytes, the float32 dq accumulator's bytes, whether a token-wise MLP made the call)
        self.calls: list[tuple[frozenset[int], int, int, bool]] = []
        self.in_mlp = lambda: False  # the tracer's: is a token-wise MLP running

    def _sdpa(self, query, key, value, attn_mask=None, *args, **kwargs):
        # QK^T and PV: 2 multiply-adds each per (query, key, channel)
        self.attn_flops += 4 * query.shape[:-1].numel() * key.shape[-2] * query.shape[-1]
        for t in (key, value):
            sid, nbytes = _storage(t)
            self.kv[sid] = nbytes
        qkv = dict(_storage(t) for t in (query, key, value))
        self.calls.append((frozenset(qkv), sum(qkv.values()), 4 * query.numel(), self.in_mlp()))
        return _FlashAttn.apply(query, key, value, attn_mask if isinstance(attn_mask, torch.Tensor) else None)

    @staticmethod
    def _rms(input, normalized_shape, weight=None, eps=None):
        return _FusedRms.apply(input, weight)

    def __enter__(self):
        F = torch.nn.functional
        self._saved = (F.scaled_dot_product_attention, F.rms_norm)
        F.scaled_dot_product_attention = self._sdpa
        if self.kernels == "cuda":
            F.rms_norm = self._rms
        return self

    def __exit__(self, *exc):
        F = torch.nn.functional
        F.scaled_dot_product_attention, F.rms_norm = self._saved
        return False


def attention_backward(calls: list[tuple[frozenset[int], int, int, bool]], in_mlp: bool) -> int:
    """Bytes flash attention's backward holds beside the block's saved tensors while it runs (`_KernelModel.calls`
    of one block; those made inside token-wise MLPs, `in_mlp`, or outside them). The backward of one call makes the
    gradients of q, k and v at once, and CUDA's flash attention (FlashAttention-2) accumulates dq in a float32
    buffer beside them; a call that read slices of a tensor gets the whole tensor's gradient back (slicing's
    backward pads it). Calls that read the same tensors (HunyuanVideo 1.5's video and text queries on one joint key
    tensor, trainer/models/hunyuan_video15_attention.py) hold their gradients together until the last one is
    summed, so they are counted as one group; the block's figure is its largest group."""
    groups: list[tuple[set[int], int, int]] = []
    for storages, grads, accum, inside in calls:
        if inside != in_mlp:
            continue
        joined = [g for g in groups if g[0] & storages]
        groups = [g for g in groups if not g[0] & storages]
        groups.append((set(storages).union(*(g[0] for g in joined)), grads + sum(g[1] for g in joined),
                       max([accum, *(g[2] for g in joined)])))
    return max((grads + accum for _, grads, accum in groups), default=0)


# ----------------------------------------------------------------------------------------------- tracing


class _OpCounter(TorchDispatchMode):
    """Counts the aten operations each block's forward dispatches (views and metadata queries included: each
    costs the host a dispatch, whether or not it launches a kernel)."""

    def __init__(self, current: list[int], counts: list[int]):
        super().__init__()
        self.current, self.counts = current, counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.current:
            self.counts[self.current[-1]] += 1
        return func(*args, **(kwargs or {}))


class _HostLayoutOnMeta(TorchDispatchMode):
    """Lets a model that computes its token layout on the host (Qwen-Image 2.1 reads its `img_mask` with
    `.tolist()`, which a meta tensor cannot give) run on meta activations: the family passes such layout tensors on
    the CPU (`dummy_inputs`), and an op that then mixes them with meta tensors is retried with the CPU ones moved
    to meta. Ops that only index a meta tensor with a CPU mask already work and are left alone."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except RuntimeError as e:
            if "meta" not in str(e):
                raise
            from torch.utils._pytree import tree_map

            def to_meta(t):
                return t.to("meta") if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() else t

            return func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))


@contextlib.contextmanager
def _autocast_off_meta():
    """autocast knows no meta device: a model that turns it off around some math of its own (a rotary table kept
    in fp32) names its tensors' device, `torch.autocast(device_type="meta", enabled=False)`, which raises. While
    tracing, autocast for the meta device is a null context (nothing autocasts on meta anyway)."""
    real = torch.autocast

    def autocast(device_type, *args, **kwargs):
        return contextlib.nullcontext() if device_type == "meta" else real(device_type, *args, **kwargs)

    torch.autocast = autocast
    try:
        yield
    finally:
        torch.autocast = real


@dataclass
class Trace:
    """Activation bytes of one training forward at one bucket shape (batch included)."""

    checkpoint_inputs: int  #: all blocks' checkpoint inputs, each storage once
    block_inputs: list[int]  #: per block: bytes of its input storages first seen at that block
    block_saved: list[int]  #: per block: bytes autograd saves inside it (weights and inputs left out)
    block_largest: list[int]  #: per block: its largest single saved tensor (sizes backward's transients)
    outside_saved: int  #: saved by the embedders, final norm and projection (outside any block), and shared
    #: block arguments passed inside tuples (Flux's rotary cos/sin): kept once for the whole step
    linear_flops: int = 0  #: forward FLOPs of every nn.Linear (LoRA's included)
    attn_flops: int = 0  #: forward FLOPs of attention (QK^T and PV)
    block_linear_flops: list[int] = field(default_factory=list)  #: per block: its share of linear_flops
    #: per block: tensor operations its forward dispatches (the host's launch work scales with them)
    block_ops: list[int] = field(default_factory=list)
    storages: dict[int, int] = field(default_factory=dict, repr=False)
    #: per block class name: the index and (args, kwargs) of its first call, meta tensors (for GPU timing)
    calls: dict[str, tuple[int, tuple, dict]] = field(default_factory=dict, repr=False)
    #: how block_saved / block_largest were counted: the eager blocks, or compiled ones (planner/compiled_saves.py)
    saved_by: str = "eager blocks"
    #: the same for its last call: a block inside the stack, whose inputs carry gradients (planner/compiled_saves.py)
    last_calls: dict[str, tuple[int, tuple, dict]] = field(default_factory=dict, repr=False)
    #: per block: bytes of the keys and values its attention calls take (what a sampling KV cache can keep)
    block_kv: list[int] = field(default_factory=list)
    #: per block: what its token-wise MLPs (`trace_forward`'s `mlps`) save beyond their inputs (their hidden
    #: activations), the largest such tensor, and the largest tensor the block saves outside them
    block_mlp_saved: list[int] = field(default_factory=list)
    block_mlp_largest: list[int] = field(default_factory=list)
    block_largest_outside_mlp: list[int] = field(default_factory=list)
    #: per block: what its token-wise MLPs save that is not per token (a cross-attention's keys and values of the
    #: text, dequantized weights): made again by each chunk, so `chunk_mlps` leaves it counted once
    block_mlp_other: list[int] = field(default_factory=list)
    #: per block: the share of block_linear_flops inside its token-wise MLPs (chunked, they run once more)
    block_mlp_linear_flops: list[int] = field(default_factory=list)
    #: per block: what flash attention's backward holds beside the saved tensors (`attention_backward`): the
    #: larger of its calls' outside the token-wise MLPs and inside them; and each of the two (`chunk_mlps`)
    block_attn_bwd: list[int] = field(default_factory=list)
    block_attn_bwd_outside_mlp: list[int] = field(default_factory=list)
    block_mlp_attn_bwd: list[int] = field(default_factory=list)
    #: per block: of its block_inputs, those later blocks take too (the timestep's modulations, the text, masks:
    #: made once a call, before the blocks). Per token where the timestep is (LTX-2 I2V, Wan 2.2 TI2V; Flux.3's
    #: single blocks): 0.58 GB at LTX-2's 480p x 121. A no-grad forward holds them once for the call (sampling.py)
    block_shared_inputs: list[int] = field(default_factory=list)
    #: per block: of its block_shared_inputs, those no gradient reaches (made by layers LoRA leaves frozen): held
    #: through backward like any checkpoint input, never differentiated (prediction.py `_working_set`)
    block_const_inputs: list[int] = field(default_factory=list)


def chunk_mlps(tr: Trace, n: int, compiled: list[tuple[int, int]] | None = None) -> Trace:
    """`tr` as blocks whose token-wise MLPs run in `n` checkpointed token chunks (offload.nano_batches,
    trainer/offload/nano.py) save it. Eager blocks (`compiled` None): the recompute keeps each MLP's input but not its
    hidden activations, and backward recomputes one chunk's hidden at a time, so 1/n of them (and of their largest
    tensor) is what the block's working set holds of the MLP; what they save that is not per token
    (`block_mlp_other`) stays counted once, as one chunk's recompute holds it. Compiled blocks (`compiled`: per
    block, planner/compiled_saves.py `chunk_saving`): the recompute is the compiled forward, so the block saves what
    the split compiled block saves (every chunk is an activation-checkpoint region: nothing of the sub-layers, their
    dequantized weights and the inputs they can make again included) and one chunk's recompute (its hidden and
    `block_mlp_other`) comes back; the largest tensor is the split compiled block's or one chunk's. Attention inside
    the MLPs runs on one chunk's queries (`block_attn_bwd`). The chunk's share rounds up (chunks of whole tokens).
    Until 2026-11-28 the compiled count was the eager block's saves less what the split stops keeping, which left in
    what the compiled block never keeps outside the chunks (1.86 GB per HunyuanVideo 1.5 block at 720p x 121)."""
    if n <= 1 or not tr.block_mlp_saved:
        return tr
    attn = tr.block_attn_bwd
    if tr.block_mlp_attn_bwd:  # attention inside the MLPs (Wan's cross-attention) runs on one chunk's queries
        attn = [max(o, -(-m // n)) for o, m in zip(tr.block_attn_bwd_outside_mlp, tr.block_mlp_attn_bwd, strict=True)]
    if compiled is None:  # eager: the hidden activations go; block_mlp_other stays in block_saved
        kept = [s - m for s, m in zip(tr.block_saved, tr.block_mlp_saved, strict=True)]
        again, outside, how = [0] * len(tr.block_saved), tr.block_largest_outside_mlp, ""
    else:
        kept, outside = [s for s, _ in compiled], [big for _, big in compiled]
        again, how = tr.block_mlp_other, " as compiled chunks keep them"
    return replace(
        tr,
        block_saved=[k + -(-m // n) + o for k, m, o in zip(kept, tr.block_mlp_saved, again, strict=True)],
        block_largest=[max(o, -(-b // n)) for o, b in zip(outside, tr.block_mlp_largest, strict=True)],
        block_attn_bwd=attn,
        saved_by=f"{tr.saved_by}, token-wise MLPs in {n} chunks{how}",
    )


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s._cdata, s.nbytes()


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, list | tuple):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def trace_forward(
    transformer: nn.Module, blocks: list[nn.Module], inputs: dict, kernels: str = "cuda",
    mlps: list[list[nn.Module]] | None = None,
) -> Trace:
    """Run `transformer(**inputs)` (meta or CPU tensors) with hooks on `blocks`; see the module essay. `mlps`:
    per block, its token-wise MLPs (the family's `token_wise_of`), whose saved hidden activations are counted
    apart (`Trace.block_mlp_saved`, for `chunk_mlps`)."""
    tracer = _Tracer(transformer, blocks, kernels)
    handles = tracer.hook(transformer, blocks, mlps or [])
    try:
        tracer.run(transformer, inputs)
    finally:
        for h in handles:
            h.remove()
    return tracer.trace(with_mlps=bool(mlps))


class _Tracer:
    """What one `trace_forward` counts, and the hooks that count it: storages are told apart by address, each
    counted once (a checkpoint input first, saved inside a block next, saved outside any block last)."""

    def __init__(self, transformer: nn.Module, blocks: list[nn.Module], kernels: str):
        n = len(blocks)
        self.weights = {_storage(p)[0] for p in transformer.parameters()} | {
            _storage(b)[0] for b in transformer.buffers()
        }
        self.index = {id(b): i for i, b in enumerate(blocks)}
        self.seen: dict[int, int] = {}  # storages already counted as checkpoint inputs
        self.first: dict[int, int] = {}  # checkpoint-input storage -> the block that took it first
        self.takers: dict[int, set[int]] = {}  # checkpoint-input storage -> the blocks that take it
        self.with_grad: set[int] = set()  # checkpoint-input storages that carry a gradient
        self.outside: dict[int, int] = {}  # storage -> bytes saved outside any block
        self.current: list[int] = []  # index of the block being run (a stack of one)
        # Every tensor counted is kept alive until the trace ends: storages are told apart by address, and a freed
        # storage's address can be reused by a later tensor (which would then pass for one already counted).
        self.alive: list[torch.Tensor] = []
        # per block: input bytes, saved bytes, largest saved tensor, attention keys and values, linear FLOPs, ops
        self.b_inputs, self.b_saved, self.b_largest, self.b_kv, self.b_linear, self.b_ops = ([0] * n for _ in range(6))
        # per block, of its token-wise MLPs: hidden bytes, largest hidden tensor, the block's largest outside them,
        # what they save that is not per token, their linear FLOPs
        self.b_mlp, self.b_mlp_big, self.b_big_out, self.b_mlp_other, self.b_mlp_linear = (
            [0] * n for _ in range(5))
        # per block: flash attention's backward outside its token-wise MLPs and inside them (`attention_backward`)
        self.b_attn_out, self.b_attn_mlp = [0] * n, [0] * n
        self.linear_flops = 0
        self.calls: dict[str, tuple[int, tuple, dict]] = {}
        self.last_calls: dict[str, tuple[int, tuple, dict]] = {}
        # the block now running
        self.inside: dict[int, int] = {}  # storage -> bytes saved inside it
        self.in_mlp: dict[int, int] = {}  # storage -> bytes saved inside the token-wise MLP now running
        self.mlp_inputs: set[int] = set()
        self.outside_mlp: dict[int, int] = {}  # storage -> bytes saved in the block outside its MLPs (or not per token)
        self.mlp_other: dict[int, int] = {}  # storage -> bytes saved inside the MLPs, not per token
        self.mlp_on = [0, 0]  # while a token-wise MLP runs: its input's tokens S and B x S
        self.mode = _KernelModel(kernels) if kernels != "real" else contextlib.nullcontext(_KernelModel(kernels))
        if isinstance(self.mode, _KernelModel):
            self.mode.in_mlp = lambda: bool(self.mlp_on[0])

    def hook(self, transformer: nn.Module, blocks: list[nn.Module], mlps: list[list[nn.Module]]) -> list:
        """Hooks on the blocks (their calls), the token-wise MLPs (while one runs) and every nn.Linear (its FLOPs:
        every matmul of these models is an nn.Linear, LoRA's too; attention is counted by the kernel model)."""
        handles = [b.register_forward_pre_hook(self.block_pre, with_kwargs=True) for b in blocks]
        handles += [b.register_forward_hook(self.block_post, with_kwargs=True) for b in blocks]
        for m in (m for ms in mlps for m in ms):
            handles += [m.register_forward_pre_hook(self.mlp_pre, with_kwargs=True),
                        m.register_forward_hook(self.mlp_post, with_kwargs=True)]
        handles += [
            m.register_forward_pre_hook(self.count_linear) for m in transformer.modules() if isinstance(m, nn.Linear)
        ]
        return handles

    def run(self, transformer: nn.Module, inputs: dict) -> None:
        """The forward, with autograd's saved tensors packed through `pack`, the kernel model swapped in, the ops
        each block dispatches counted and autocast left off on meta."""
        with (torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t), MetaOpCache(), _HostLayoutOnMeta(),
              self.mode, _OpCounter(self.current, self.b_ops), _autocast_off_meta()):
            transformer(**inputs, return_dict=False)

    def pack(self, t: torch.Tensor):
        """A tensor autograd saves: inside the running block (sorted into its token-wise MLPs' per-token tensors
        and the rest), or outside any block; weights and checkpoint inputs are not activations saved here."""
        self.alive.append(t)
        sid, nbytes = _storage(t)
        if sid in self.weights:
            return t
        if self.current:
            if sid not in self.seen:
                self.inside[sid] = nbytes
                # the MLP's per-token tensors (an axis of its input's tokens S, or B x S flattened): not the
                # weights it dequantizes, nor a cross-attention's keys and values
                token_wise = bool(self.mlp_on[0]) and any(d in self.mlp_on for d in t.shape[:-1])
                (self.in_mlp if token_wise else self.outside_mlp)[sid] = nbytes
                if self.mlp_on[0] and not token_wise:
                    self.mlp_other[sid] = nbytes
        elif sid not in self.seen:
            self.outside[sid] = nbytes
        return t

    def block_pre(self, mod, args, kwargs):
        """A block starts: its first and last call are kept, its new input storages counted as its checkpoint
        inputs, and the per-block counters cleared."""
        i = self.index[id(mod)]
        self.calls.setdefault(type(mod).__name__, (i, args, dict(kwargs)))
        self.last_calls[type(mod).__name__] = (i, args, dict(kwargs))
        new = 0
        # Only direct tensor arguments: tensors nested in tuples (rotary embeddings) are shared by all blocks
        # and reach checkpoint as one Python object; they are counted once, with the outside tensors.
        direct = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        for t in _tensors(args) + _tensors(kwargs):
            self.alive.append(t)
            if not any(t is d for d in direct):
                sid, nbytes = _storage(t)
                if sid not in self.weights:
                    self.outside[sid] = nbytes
                continue
            if not t.is_floating_point() and not t.is_complex():
                continue
            sid, nbytes = _storage(t)
            if sid in self.weights:
                continue
            self.takers.setdefault(sid, set()).add(i)
            if t.requires_grad:
                self.with_grad.add(sid)
            if sid not in self.seen:
                self.seen[sid] = nbytes
                self.first[sid] = i
                self.outside.pop(sid, None)  # a block input saved outside too (e.g. temb) is counted once, here
                new += nbytes
        self.b_inputs[i] = new
        getattr(self.mode, "kv", {}).clear()
        getattr(self.mode, "calls", []).clear()
        self.current.append(i)
        self.inside.clear()
        self.in_mlp.clear()
        self.mlp_inputs.clear()
        self.outside_mlp.clear()
        self.mlp_other.clear()

    def block_post(self, mod, args, kwargs, out):
        """A block ends: what it saved (not its inputs), its largest saved tensor, its attention's keys and values,
        and its token-wise MLPs' share."""
        i = self.current.pop()
        saved = {s: n for s, n in self.inside.items() if s not in self.seen}
        self.b_saved[i] = sum(saved.values())
        self.b_largest[i] = max(saved.values(), default=0)
        self.b_kv[i] = sum(getattr(self.mode, "kv", {}).values())
        calls = getattr(self.mode, "calls", [])
        self.b_attn_out[i], self.b_attn_mlp[i] = attention_backward(calls, False), attention_backward(calls, True)
        # the MLPs' hidden activations: saved inside them, neither their inputs nor saved elsewhere in the block
        hidden = {s: n for s, n in self.in_mlp.items()
                  if s not in self.seen and s not in self.mlp_inputs and s not in self.outside_mlp}
        self.b_mlp[i] = sum(hidden.values())
        self.b_mlp_big[i] = max(hidden.values(), default=0)
        self.b_big_out[i] = max((n for s, n in saved.items() if s not in hidden), default=0)
        self.b_mlp_other[i] = sum(n for s, n in self.mlp_other.items() if s in saved and s not in self.mlp_inputs)

    def mlp_pre(self, mod, args, kwargs):
        """A token-wise MLP starts: its input's token counts (S and B x S) and its input storages."""
        x = (_tensors(args) + _tensors(kwargs) or [None])[0]
        # (B, S, D) only: nano.NanoBatched leaves anything else whole, and so is it counted
        self.mlp_on[:] = [x.shape[1], x.shape[:-1].numel()] if x is not None and x.dim() >= 3 else [0, 0]
        self.mlp_inputs.update(_storage(t)[0] for t in _tensors(args) + _tensors(kwargs))

    def mlp_post(self, mod, args, kwargs, out):
        """A token-wise MLP ends."""
        self.mlp_on[:] = [0, 0]

    def count_linear(self, mod, args):
        """An nn.Linear's forward FLOPs, to the whole model, the running block and its running MLP."""
        x = args[0]
        f = 2 * (x.numel() // mod.in_features) * mod.in_features * mod.out_features
        self.linear_flops += f
        if self.current:
            self.b_linear[self.current[-1]] += f
            if self.mlp_on[0]:
                self.b_mlp_linear[self.current[-1]] += f

    def trace(self, with_mlps: bool) -> Trace:
        """The counts as a Trace; a storage that was a checkpoint input is not also counted outside the blocks."""
        for s in self.seen:
            self.outside.pop(s, None)
        shared, const = [0] * len(self.b_inputs), [0] * len(self.b_inputs)
        for s, i in self.first.items():
            if len(self.takers[s]) > 1:
                shared[i] += self.seen[s]
                const[i] += 0 if s in self.with_grad else self.seen[s]
        return Trace(
            checkpoint_inputs=sum(self.seen.values()),
            block_inputs=self.b_inputs,
            block_saved=self.b_saved,
            block_largest=self.b_largest,
            outside_saved=sum(self.outside.values()),
            linear_flops=int(self.linear_flops),
            block_linear_flops=self.b_linear,
            block_ops=self.b_ops,
            attn_flops=int(getattr(self.mode, "attn_flops", 0)),
            storages=dict(self.seen),
            calls=self.calls,
            last_calls=self.last_calls,
            block_kv=self.b_kv,
            block_mlp_saved=self.b_mlp if with_mlps else [],
            block_mlp_largest=self.b_mlp_big if with_mlps else [],
            block_largest_outside_mlp=self.b_big_out if with_mlps else [],
            block_mlp_other=self.b_mlp_other if with_mlps else [],
            block_mlp_linear_flops=self.b_mlp_linear if with_mlps else [],
            block_attn_bwd=[max(o, m) for o, m in zip(self.b_attn_out, self.b_attn_mlp, strict=True)],
            block_attn_bwd_outside_mlp=self.b_attn_out if with_mlps else [],
            block_mlp_attn_bwd=self.b_attn_mlp if with_mlps else [],
            block_shared_inputs=shared,
            block_const_inputs=const,
        )


def forward_inputs(
    family: str,
    transformer: nn.Module,
    batch: int,
    height: int,
    width: int,
    text_tokens: int,
    dtype: torch.dtype,
    device: str | torch.device = "meta",
    references: int = 0,
    frames: int | None = None,
) -> dict:
    """Transformer call arguments for one bucket (pixels height x width; a video family's clip of `frames`
    frames; None: the family's `plan_frames`), from the family's adapter (`ModelAdapter.dummy_inputs`), with
    `references` optional reference images joined (`reference_inputs`)."""
    cls = adapter_class(family)
    clip = {"frames": frames} if cls.video and frames else {}
    inputs = cls.dummy_inputs(transformer, batch, height, width, text_tokens, dtype, device, **clip)
    return cls.reference_inputs(inputs, references) if references else inputs

