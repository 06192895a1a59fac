"""trainer/planner/meta_ops.py: the planner's meta runs make each op's outputs once per layout of its arguments; the
trace counts what it counts running every op."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch.utils._pytree import tree_map

from trainer.models import adapter_class
from trainer.planner import meta_ops
from trainer.planner import trace as ptrace


def test_the_transformer_trace_counts_the_same_with_the_meta_op_cache(monkeypatch):
    """Flux at its full widths (1 double and 3 single blocks), LoRA in the input's dtype, bf16, 256 px: every field
    of the trace (bytes saved per block, inputs, FLOPs, ops dispatched per block) equals the trace that runs every
    op, and the repeated blocks' ops are answered from the first ones."""
    family = "flux"

    def trace():
        conf = {**adapter_class(family).full_config, "num_layers": 1, "num_single_layers": 3}
        model = ptrace.meta_transformer(family, conf, torch.bfloat16)
        blocks = ptrace.blocks_of(family, model)
        ptrace.add_meta_lora(model, ptrace.default_lora_targets(family), 16, 16.0, True)
        inputs = ptrace.forward_inputs(family, model, 1, 256, 256, 64, torch.bfloat16)
        return ptrace.trace_forward(model, blocks, inputs)

    reused = []
    real_run = meta_ops.MetaOps.run

    def run(self, func, args, kwargs):
        before = self.reused
        out = real_run(self, func, args, kwargs)
        reused.append(self.reused - before)
        return out

    monkeypatch.setattr(meta_ops.MetaOps, "run", run)
    cached = trace()
    assert sum(reused) > len(reused) / 3, (sum(reused), len(reused))  # most of the repeated single blocks' ops
    monkeypatch.setattr(ptrace, "MetaOpCache", contextlib.nullcontext)
    every = trace()
    for f in dataclasses.fields(every):
        got, want = getattr(cached, f.name), getattr(every, f.name)
        if f.name == "storages":  # storage ids -> bytes: the ids are two runs' own
            got, want = sorted(got.values()), sorted(want.values())
        elif f.name in ("calls", "last_calls"):  # block calls' meta arguments: compared by their layouts
            got, want = (tree_map(lambda x: (x.shape, x.stride(), x.dtype) if isinstance(x, torch.Tensor) else x, c)
                         for c in (got, want))
        assert got == want, f.name
    assert sum(every.block_saved) > 0


def test_outputs_are_remade_only_where_empty_strided_gives_them_exactly():
    """Views, in-place ops and real tensors run each time; a new tensor's layout is remade (shape, stride, dtype);
    a tuple of outputs stays a tuple."""
    ops = meta_ops.MetaOps()
    a = torch.empty(4, 6, device="meta").t()  # a transposed layout
    for _ in range(2):
        out = ops.run(torch.ops.aten.mul.Tensor, (a, a), {})
        assert (out.shape, out.stride(), out.dtype) == ((6, 4), (1, 6), torch.float32)
        ops.run(torch.ops.aten.t.default, (out,), {})
        ops.run(torch.ops.aten.add_.Tensor, (out, a), {})
        pair = ops.run(torch.ops.aten.var_mean.correction, (a,), {"dim": [1]})
        assert isinstance(pair, tuple) and [t.shape for t in pair] == [(6,), (6,)]
        ops.run(torch.ops.aten.mul.Tensor, (torch.ones(2), torch.ones(2)), {})
    assert ops.reused == 2  # the second mul and var_mean
