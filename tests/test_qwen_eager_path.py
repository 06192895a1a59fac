"""Issue 29: what dittrain's eager training step runs against the plain diffusers + peft script (bench/speed/bench_speed.py
`plain_setup` vs `ours_setup`) on Qwen-Image, with Flux beside it (bench/RESULTS.md, "Qwen-Image eager at
offload 0"). Counts, not timings:

- diffusers' checkpointed Qwen-Image forward hands every block the arguments the pipeline's uncheckpointed
  forward does, and so does dittrain's StreamedBlock (unlike Chroma, whose checkpointed forward drops the mask:
  tests/test_chroma_attention.py), so both rows attend with the same mask;
- one training forward + backward of dittrain dispatches exactly the plain script's aten ops, plus one cast per
  LoRA weight per LoRA call (the fp32 masters cast to bf16 at use, `lora.compute_dtype: auto`) and one per LoRA
  weight that receives a gradient (that gradient cast back to fp32). Any other copy, cast, `.contiguous()`, extra
  recompute or changed attention in our path makes this fail.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from test_train_support import bench_module
from torch.utils._python_dispatch import TorchDispatchMode

OURS = dict(kind="ours", fraction=0.0, act=False, compile=False, math="auto", quant="none", modulation=False,
            dynamic=False, ckpt="all", fp8mm=False)
#: not kernels, or placed differently only: the release identity's `view_as` on each block's grad-carrying inputs,
#: and AccumulateGrad's `detach` of each gradient
NOT_KERNELS = {"aten.view.default", "aten.detach.default"}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _row(bs, family: str, kind: str):
    args = SimpleNamespace(family=family, rank=4, res=64, smoke=True, backend="eager")
    adapter, m = bs.build(family, torch.device("cpu"), True)
    kw = bs.model_inputs(adapter, m, torch.device("cpu"), 64)
    if kind == "plain":
        bs.plain_setup(adapter, m, args, dict(kind="plain", compile=False))
    elif kind == "pipeline":  # what the pipeline runs: no checkpointing
        bs.plain_setup(adapter, m, args, dict(kind="plain", compile=False, ckpt=False))
    else:
        bs.ours_setup(adapter, m, args, OURS, torch.device("cpu"))
    return adapter, m, kw


def _describe(v):
    if isinstance(v, torch.Tensor):
        return (str(v.dtype), tuple(v.shape))
    if isinstance(v, tuple | list):
        return tuple(_describe(x) for x in v)
    return v


@contextlib.contextmanager
def _calls_of(fn, record):
    """`record(arguments)` at every call of the function `fn` however it is reached (module __call__, a
    checkpoint's recompute, a wrapper's direct call), through the interpreter's profile hook: nothing in the
    model is replaced (tests/test_offload.py::test_nothing_assigns_forward)."""
    code = fn.__code__
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]

    def profile(frame, event, arg):  # noqa: ARG001
        if event == "call" and frame.f_code is code:
            record({k: frame.f_locals[k] for k in names if k in frame.f_locals})

    old = sys.getprofile()
    sys.setprofile(profile)
    threading.setprofile(profile)  # the autograd engine's threads, should the recompute run on one
    try:
        yield
    finally:
        sys.setprofile(old)
        threading.setprofile(None)


@pytest.fixture
def sdpa_masks(monkeypatch):
    seen, orig = [], F.scaled_dot_product_attention

    def spy(*a, **kw):
        mask = a[3] if len(a) > 3 else kw.get("attn_mask")
        seen.append(None if mask is None else (str(mask.dtype), tuple(mask.shape)))
        return orig(*a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


def test_checkpointed_qwen_blocks_get_the_pipelines_arguments(sdpa_masks):
    """Every block call (forward and recompute) of the plain checkpointed script and of dittrain gets the
    arguments the pipeline's forward gives it, the text mask included, and SDPA gets the same mask."""
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    bs = bench_module("bench_speed")
    calls = []

    def spy(arguments):
        calls.append(tuple((k, _describe(v)) for k, v in arguments.items() if k != "self"))

    seen = {}
    for kind in ("pipeline", "plain", "ours"):
        calls.clear()
        sdpa_masks.clear()
        _, m, kw = _row(bs, "qwen_image", kind)
        with _calls_of(QwenImageTransformerBlock.forward, spy):
            m(**kw)[0].float().square().mean().backward()
        seen[kind] = (collections.Counter(calls), collections.Counter(sdpa_masks))
    n = len(m.transformer_blocks)
    pipe_calls, pipe_masks = seen["pipeline"]
    assert sum(pipe_calls.values()) == n and len(pipe_calls) == 1  # every block: the same argument shapes
    args = dict(next(iter(pipe_calls)))
    assert args["encoder_hidden_states_mask"] == ("torch.bool", (1, 8)) and args["image_rotary_emb"] is not None
    assert pipe_masks == collections.Counter({("torch.bool", (1, 1, 1, 8 + 16)): n})
    for kind in ("plain", "ours"):  # forward and recompute: twice the pipeline's calls, the same arguments
        assert seen[kind][0] == collections.Counter({k: 2 * v for k, v in pipe_calls.items()}), kind
        assert seen[kind][1] == collections.Counter({k: 2 * v for k, v in pipe_masks.items()}), kind


@pytest.mark.parametrize("family", ["qwen_image", "flux"])
def test_dittrain_step_dispatches_the_plain_ops_plus_lora_weight_casts(family):
    """One training forward + backward: the aten ops of dittrain (trainer LoRA, StreamedBlock checkpointing at
    offload 0) are the plain script's (peft bf16 LoRA, diffusers' checkpointing) plus, per LoRA call, the casts
    of its two fp32 weights to bf16, and per LoRA weight that gets a gradient, that gradient's cast to fp32."""
    from trainer.train.model import ComputeDtypeLora

    bs = bench_module("bench_speed")
    counts, lora_calls = {}, collections.Counter()

    def counted(arguments):  # noqa: ARG001
        lora_calls["n"] += 1

    for kind in ("plain", "ours"):
        _, m, kw = _row(bs, family, kind)
        with _calls_of(ComputeDtypeLora.forward, counted), _Ops() as ops:
            m(**kw)[0].float().square().mean().backward()
        counts[kind] = collections.Counter({k: v for k, v in ops.ops.items() if k not in NOT_KERNELS})
        grads = sum(p.grad is not None for p in m.parameters() if p.requires_grad)
    n_lora = sum(isinstance(x, ComputeDtypeLora) for x in m.modules())
    assert lora_calls["n"] == 2 * n_lora  # forward and recompute: every LoRA layer, twice
    assert 0 < grads <= 2 * n_lora
    extra = counts["ours"] - counts["plain"]
    assert counts["plain"] - counts["ours"] == collections.Counter()
    assert extra == collections.Counter({"aten._to_copy.default": 2 * lora_calls["n"] + grads}), extra
