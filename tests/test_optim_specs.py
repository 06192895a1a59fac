"""Every optimizer spec (trainer/optim/specs.py) against the optimizer it builds: one real step of a small model's
full fine-tune, and the state it keeps is the spec's `state` tensor by tensor, so the planner's state bytes are the
real ones (and a `packed` spec's layout is what the fused back pass reserves before the first step). The config's
name list and the flags' messages come from the registry."""

from __future__ import annotations

import pytest
import torch

from trainer.config import Config, OptimizerConfig
from trainer.optim import FusedBackPass, build_optimizer, torch_optimizer
from trainer.optim.specs import OPTIMIZERS, names_where
from trainer.planner import optimizer_state_bytes
from trainer.planner.meta import packed_state_layout


def _on_this_machine(name: str):
    if name == "adamw8bit" and not torch.cuda.is_available():
        return pytest.param(name, marks=pytest.mark.skip(reason="bitsandbytes' 8-bit AdamW runs on CUDA only"))
    return name


def _small_model(tiny_models) -> torch.nn.Module:
    """The tiny Flux transformer, fp32 (matrices, vectors, a few 4-d weights would show any shape rule's slip)."""
    from trainer.models import adapter_class

    cls = adapter_class("flux").transformer_cls
    return cls.from_pretrained(tiny_models / "flux" / "transformer", torch_dtype=torch.float32)


def _layout(st: dict) -> dict:
    return {k: (tuple(v.shape), v.dtype) for k, v in st.items() if torch.is_tensor(v) and v.dim()}


@pytest.mark.parametrize("name", [_on_this_machine(n) for n in OPTIMIZERS])
def test_the_spec_states_what_a_real_step_keeps(tiny_models, name):
    spec = OPTIMIZERS[name]
    device = "cuda" if name == "adamw8bit" else "cpu"
    model = _small_model(tiny_models).to(device)
    params = list(model.parameters())
    opt = build_optimizer(params, OptimizerConfig(name=name, lr=1e-3))
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    state = torch_optimizer(opt).state
    for p in params:
        want = {k: (tuple(s), d) for k, (s, d) in spec.state(p).items()}
        if name == "adamw8bit" and p.numel() < 4096:  # bitsandbytes keeps small tensors' state in fp32
            continue
        assert _layout(state[p]) == want, name
    real = sum(v.numel() * v.element_size() for st in state.values() for v in st.values()
               if torch.is_tensor(v) and v.dim())
    if name != "adamw8bit":
        assert optimizer_state_bytes(name, params) == real > 0  # the planner's bytes (and StateOffload's in RAM)


@pytest.mark.parametrize("masters", [False, True])
@pytest.mark.parametrize("name", [n for n, s in OPTIMIZERS.items() if s.packed])
def test_a_packed_spec_is_the_layout_the_fused_pass_reserves(tiny_models, name, masters):
    """What the conductor reserves beside a streamed weight (FusedBackPass.state_layout, found on a meta probe
    before any step) is the spec's `state`, and bf16 weights' fp32 masters (optimizer.master_weights), which is
    what the planner packs."""
    model = _small_model(tiny_models)
    params = list((model.to(torch.bfloat16) if masters else model).parameters())
    fused = FusedBackPass(build_optimizer(params, OptimizerConfig(name=name, master_weights=masters)))
    layout = packed_state_layout(name, masters)
    assert ("master" in layout(params[0])) == masters
    for p in params:
        assert {k: (tuple(s), d) for k, (s, d) in fused.state_layout(p).items()} == \
            {k: (tuple(s), d) for k, (s, d) in layout(p).items()}


def test_the_config_and_the_planner_read_the_registry():
    assert OptimizerConfig.model_fields["name"].annotation.__args__ == tuple(OPTIMIZERS)
    assert all(s.doc in OptimizerConfig.model_fields["name"].description for s in OPTIMIZERS.values())
    for name, spec in OPTIMIZERS.items():
        assert (packed_state_layout(name) is not None) == spec.packed
    base = {"model": {"family": "flux", "path": "m"}, "output": {"dir": "o"},
            "train": {"method": "full", "distributed": "fsdp"}}
    refused = next(n for n, s in OPTIMIZERS.items() if not s.sharded)
    with pytest.raises(ValueError, match="train.distributed: fsdp needs optimizer.name: " + ", ".join(
            names_where("sharded")[:-1])):
        Config.model_validate({**base, "optimizer": {"name": refused}})
    for name in names_where("sharded"):
        extra = {"scheduler": "constant"} if OPTIMIZERS[name].whole_step else {}
        Config.model_validate({**base, "optimizer": {"name": name, **extra}})
    for name in names_where("whole_step"):
        with pytest.raises(ValueError, match=f"optimizer.name: {name} replaces the decay schedule"):
            Config.model_validate({**base, "train": {"method": "lora"},
                                   "optimizer": {"name": name, "scheduler": "cosine"}})


def test_both_experts_take_the_optimizers_whose_steps_are_owned():
    """model.expert: both steps two experts' weights with one optimizer: it takes an optimizer whose spec says each
    weight's step reads nothing of the others (`owned_steps`), and refuses the rest in one line naming them."""
    from types import SimpleNamespace

    from trainer.errors import UserError
    from trainer.train import experts

    single = SimpleNamespace(active=False)
    for name, spec in OPTIMIZERS.items():
        cfg = SimpleNamespace(train=SimpleNamespace(method="lora", ema=None), optimizer=SimpleNamespace(name=name))
        if spec.owned_steps:
            experts.check(cfg, single)
        else:
            with pytest.raises(UserError, match=f"own state \\({', '.join(names_where('owned_steps'))}\\): {name}"):
                experts.check(cfg, single)
