"""The planner's per-block saved bytes (what a block that keeps its activations holds until its backward) against
what autograd really saves, on tiny bf16 Flux and Qwen-Image models on the CPU (issue 29).

The truth side counts, with `saved_tensors_hooks`, the unique storages each block of the real model saves in one
training forward (weights and the block's own tensor arguments left out), with the trainer's own LoRA
(`add_lora`: fp32 masters, the branch in bf16 under `lora.compute_dtype: auto`):
- eager blocks: the planner's meta trace (trace.py with the CPU kernel model), within 2 % per block: CPU's bf16
  layer norm keeps its per-row mean and rstd in bf16 where meta (like CUDA) keeps them in float32, the only
  difference (the peft fp32 input copies the planner counted before issue 29 were +40 % here);
- compiled blocks, run by the offload handle at fraction 0 without checkpointing, as `fit` runs them. The backend is
  torch's `aot_eager_decomp_partition` (inductor's decompositions and partitioner without code generation; inductor
  itself saves the same bytes here, but compiles 4x slower). The planner compiles one block per class on meta and
  uses that count for every block of the class; tolerance: 2 % per block (the first block of each list, whose
  inputs carry no gradient, saves a little less than the rest).
Both regimes must also differ where the planner says they do: the compiled count is below the eager one.
"""

from __future__ import annotations

import pytest
import torch

from trainer import planner
from trainer.config import Config
from trainer.offload import CompileOptions, attach_offload, compiled
from trainer.planner import compiled_saves as pcompiled
from trainer.planner import trace as ptrace

FAMILIES = ("flux", "qwen-image")
TOLERANCE = 0.02


def _cfg(path, family) -> Config:
    return Config.model_validate({
        "model": {"family": family, "path": str(path), "dtype": "bf16"},
        "train": {"method": "lora", "gradient_checkpointing": False, "compile": True},
        "lora": {"rank": 4, "alpha": 4},
        "data": {"sources": [{"path": "unused"}], "resolutions": [64]},
        "output": {"dir": "unused"},
    })


def _folder(tiny_models, family):
    from trainer.models import adapter_class

    return tiny_models / next(iter(adapter_class(family).own_tiny_builders()))


def _real(folder, family, cfg):
    from trainer.train.model import add_lora

    model = ptrace.transformer_class(family).from_pretrained(folder / "transformer", torch_dtype=torch.bfloat16)
    torch.manual_seed(0)
    add_lora(model, cfg, ptrace.default_lora_targets(family))
    return model


def _saved_per_block(model, blocks, inputs) -> list[int]:
    """Bytes each block saves for backward in one forward of `model`, unique storages, weights and the block's
    own tensor arguments left out."""
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    current: list[tuple[int, set[int]]] = []
    saved: list[dict[int, int]] = [{} for _ in blocks]
    alive = []  # a freed storage's id could be reused by another tensor
    index = {id(b): i for i, b in enumerate(blocks)}

    def pre(mod, args, kwargs):
        direct = {a.untyped_storage()._cdata for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
        current.append((index[id(mod)], direct))

    def post(mod, args, kwargs, out):
        current.pop()

    def pack(t):
        alive.append(t)
        s = t.untyped_storage()
        if current and s._cdata not in weights and s._cdata not in current[-1][1]:
            saved[current[-1][0]][s._cdata] = s.nbytes()
        return t

    hooks = [b.register_forward_pre_hook(pre, with_kwargs=True) for b in blocks]
    hooks += [b.register_forward_hook(post, with_kwargs=True) for b in blocks]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**inputs, return_dict=False)
    finally:
        for h in hooks:
            h.remove()
    return [sum(s.values()) for s in saved]


def _close(planned: list[int], real: list[int]) -> None:
    assert len(planned) == len(real)
    for i, (got, want) in enumerate(zip(planned, real, strict=True)):
        assert abs(got - want) <= TOLERANCE * want, f"block {i}: planned {got} B, autograd saved {want} B"


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_bytes_per_block_match_autograd(tiny_models, family):
    folder = _folder(tiny_models, family)
    cfg = _cfg(folder, family)
    facts = planner.analyze(cfg)
    assert facts.compiled
    meta_in = ptrace.forward_inputs(family, facts.model, 2, 64, 64, facts.text_tokens, torch.bfloat16)
    eager = ptrace.trace_forward(facts.model, facts.blocks, meta_in, kernels="cpu")
    eager_saved = list(eager.block_saved)
    comp = pcompiled.apply_compiled(facts.model, facts.blocks, eager, kernels="cpu")
    assert comp.saved_by.startswith("compiled")

    model = _real(folder, family, cfg)
    blocks = ptrace.blocks_of(family, model)
    torch.manual_seed(0)
    real_in = ptrace.forward_inputs(family, model, 2, 64, 64, facts.text_tokens, torch.bfloat16, device="cpu")
    # eager: the meta trace, the planner's LoRA forward included
    _close(eager_saved, _saved_per_block(model, blocks, real_in))

    compiled.reset()
    handle = attach_offload(blocks, "cpu", 0.0, checkpointing=False,
                            compile=CompileOptions(backend="aot_eager_decomp_partition"))
    try:
        real = _saved_per_block(model, blocks, real_in)
        assert compiled.stats()["graphs"] >= 1
    finally:
        handle.close()
        compiled.reset()
    _close(comp.block_saved, real)
    # the partitioner recomputes what eager keeps (casts, norm and modulation arithmetic): fewer bytes
    assert sum(comp.block_saved) < sum(eager_saved)


def test_a_compiled_count_that_fails_is_said_beside_the_phase_lines(tiny_models, monkeypatch):
    """Where compiling the block on meta fails, the eager count stands and `phases.fallbacks` gives the line the
    trainer prints beside its phase lines (none when the count worked)."""
    from trainer.planner import phases

    cfg = _cfg(_folder(tiny_models, "flux"), "flux")
    facts = planner.analyze(cfg)
    facts.trace(max(facts.resolutions))
    assert phases.fallbacks(facts) == []

    def fail(*a, **k):
        raise AssertionError("Backend not supported for None")

    monkeypatch.setattr(pcompiled, "compiled_saved", fail)
    facts = planner.analyze(cfg)
    facts.trace(max(facts.resolutions))
    lines = phases.fallbacks(facts)
    assert len(lines) == 1 and "eager blocks (compiling the block on meta failed: AssertionError)" in lines[0]
