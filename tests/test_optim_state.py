"""Optimizer state through safetensors + JSON: a resumed run steps bitwise like an uninterrupted one."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open

from trainer.config import OptimizerConfig
from trainer.errors import UserError
from trainer.optim import (
    FusedBackPass,
    build_optimizer,
    build_scheduler,
    load_optimizer_state,
    optimizer_state_from_safetensors,
    optimizer_state_to_safetensors,
    save_optimizer_state,
)

TOTAL = 6


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)).to(dtype)


def _batch(step: int, dtype):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(5, 6, generator=g).to(dtype), torch.randn(5, 3, generator=g).to(dtype)


class _Run:
    def __init__(self, model, cfg, fused=False):
        self.model, self.cfg = model, cfg
        self.opt = build_optimizer(list(model.parameters()), cfg, seed=7)
        self.sched = build_scheduler(self.opt, cfg, TOTAL)
        self.fused = FusedBackPass(self.opt) if fused else None
        self.dtype = next(model.parameters()).dtype

    def steps(self, start: int, stop: int) -> None:
        for s in range(start, stop):
            x, y = _batch(s, self.dtype)
            torch.nn.functional.mse_loss(self.model(x).float(), y.float()).backward()
            if self.fused is None:
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
            else:
                self.fused.finish_step()
            self.sched.step()


def _cfg(name, **kw):
    return OptimizerConfig(
        name=name, lr=1e-2, weight_decay=0.05, scheduler="linear", warmup_steps=2, max_grad_norm=None, **kw
    )


@pytest.mark.parametrize(
    "name, dtype, kw, fused_before, fused_after",
    [
        ("adamw", torch.float32, {}, False, False),
        ("adafactor", torch.float32, {}, False, False),
        ("adamw", torch.float32, {}, True, False),  # a fused run's checkpoint resumes unfused
        ("adamw", torch.bfloat16, {"stochastic_rounding": True}, False, True),
        ("adafactor", torch.bfloat16, {}, True, True),
    ],
    ids=["adamw", "adafactor", "adamw-fused-then-unfused", "adamw-bf16-sr", "adafactor-bf16-fused"],
)
def test_resume_through_safetensors_is_bitwise(tmp_path, name, dtype, kw, fused_before, fused_after):
    cfg = _cfg(name, **kw)
    start = _model(dtype)
    ref = _Run(copy.deepcopy(start), cfg, fused=fused_before)
    ref.steps(0, TOTAL)

    first = _Run(copy.deepcopy(start), cfg, fused=fused_before)
    first.steps(0, 3)
    save_optimizer_state(first.fused or first.opt, tmp_path)
    sched_json = json.dumps(first.sched.state_dict())
    weights = {k: v.clone() for k, v in first.model.state_dict().items()}
    del first

    model = _model(dtype)
    model.load_state_dict(weights)
    resumed = _Run(model, cfg, fused=fused_after)
    load_optimizer_state(resumed.opt, tmp_path)
    resumed.sched.load_state_dict(json.loads(sched_json))
    resumed.steps(3, TOTAL)

    for (n, a), b in zip(ref.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), n
    assert not torch.equal(next(start.parameters()), next(resumed.model.parameters()))


def test_file_is_safetensors_with_json_header(tmp_path):
    run = _Run(_model(), _cfg("adamw"))
    run.steps(0, 2)
    path = save_optimizer_state(run.opt, tmp_path)
    assert path == tmp_path / "optimizer.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["dittrain.optimizer"])
        keys = set(f.keys())
    assert meta["format"] == "dittrain.optimizer/1"
    assert {"state/0/exp_avg", "state/0/exp_avg_sq", "state/0/step"} <= keys
    assert meta["state_dict"]["param_groups"][0]["betas"] == {"__tuple__": [0.9, 0.999]}


def test_in_memory_round_trip_and_shared_tensors():
    run = _Run(_model(), _cfg("adamw"))
    run.steps(0, 1)
    shared = torch.arange(4.0)
    run.opt.state[run.opt.param_groups[0]["params"][0]]["qmap"] = shared  # as bitsandbytes shares its map
    run.opt.state[run.opt.param_groups[0]["params"][1]]["qmap"] = shared
    tensors, meta = optimizer_state_to_safetensors(run.opt)
    assert "state/1/qmap" not in tensors  # stored once, referenced twice
    meta = json.loads(json.dumps(meta))
    other = _Run(_model(), _cfg("adamw"))
    optimizer_state_from_safetensors(other.opt, tensors, meta)
    a, b = other.opt.state_dict()["state"], run.opt.state_dict()["state"]
    assert a.keys() == b.keys()
    for i in a:
        for k in b[i]:
            assert torch.equal(a[i][k], b[i][k]), (i, k)


def test_missing_or_foreign_state_is_a_user_error(tmp_path):
    run = _Run(_model(), _cfg("adamw"))
    with pytest.raises(UserError, match="optimizer state missing"):
        load_optimizer_state(run.opt, tmp_path)
    (tmp_path / "optimizer.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="cannot read the optimizer state"):
        load_optimizer_state(run.opt, tmp_path)
    small = _Run(torch.nn.Linear(6, 3), _cfg("adamw"))
    save_optimizer_state(small.opt, tmp_path)
    with pytest.raises(UserError, match="does not fit"):
        load_optimizer_state(run.opt, tmp_path)
    other = _Run(_model(), _cfg("adafactor"))
    save_optimizer_state(other.opt, tmp_path)
    with pytest.raises(UserError, match="different optimizer"):
        load_optimizer_state(run.opt, tmp_path)


def test_disjoint_views_of_one_buffer_are_written_from_their_place(tmp_path):
    """A streamed full fine-tune's state between steps is disjoint views of one host arena (trainer/offload/
    fused_state.py): each is handed to safetensors where it lies, with no copy of the state in RAM (a clone of
    every view of a shared storage held a second copy of it for the whole save, bench/logs/2026-11-28i), and the
    file is byte for byte the one written from separate tensors. A view overlapping one already stored is cloned
    (safetensors refuses overlapping tensors) and reads back equal."""
    run = _Run(_model(), _cfg("adamw"))
    run.steps(0, 2)
    (tmp_path / "separate").mkdir()
    separate = save_optimizer_state(run.opt, tmp_path / "separate").read_bytes()
    states = [run.opt.state[p] for p in run.opt.param_groups[0]["params"]]
    arena = torch.empty(sum(st[k].numel() for st in states for k in ("exp_avg", "exp_avg_sq")))
    off = 0
    for st in states:
        for k in ("exp_avg", "exp_avg_sq"):
            n = st[k].numel()
            st[k] = arena[off : off + n].view_as(st[k]).copy_(st[k])
            off += n
    tensors, _ = optimizer_state_to_safetensors(run.opt)
    arena_bytes = [(n, t) for n, t in tensors.items() if t.untyped_storage().data_ptr() == arena.data_ptr()]
    assert sorted(n for n, _ in arena_bytes) == sorted(f"state/{i}/{k}" for i in range(len(states))
                                                        for k in ("exp_avg", "exp_avg_sq"))
    assert sum(t.nbytes for _, t in arena_bytes) == arena.nbytes  # every view as it lies: nothing copied
    assert save_optimizer_state(run.opt, tmp_path).read_bytes() == separate

    states[1]["overlap"] = arena[3:9]  # inside state 0's exp_avg
    tensors, meta = optimizer_state_to_safetensors(run.opt)
    assert tensors["state/1/overlap"].untyped_storage().data_ptr() != arena.data_ptr()
    assert tensors["state/0/exp_avg"].untyped_storage().data_ptr() == arena.data_ptr()
    other = _Run(_model(), _cfg("adamw"))
    optimizer_state_from_safetensors(other.opt, tensors, json.loads(json.dumps(meta)))
    assert torch.equal(other.opt.state_dict()["state"][1]["overlap"], arena[3:9])
    save_optimizer_state(run.opt, tmp_path)  # safetensors accepts the set
