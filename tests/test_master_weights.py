"""fp32 master weights for a full fine-tune of bf16 weights (optimizer.master_weights, trainer/optim/stochastic.py):
the master is the fp32 run's weight bitwise, it lives in the optimizer state (so it follows that state: checkpoints,
owned steps over gloo), and the config and the planner know it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _offload_util import batch, blocks_of, run_ranks, tiny_flux

from trainer.config import Config, OptimizerConfig
from trainer.optim import FusedBackPass, build_optimizer
from trainer.optim.specs import MASTER
from trainer.optim.state import load_optimizer_state, save_optimizer_state

LR, WD = 1e-4, 0.01


def _cfg(name="adamw", **kw) -> OptimizerConfig:
    return OptimizerConfig(name=name, lr=LR, weight_decay=WD, max_grad_norm=None, **kw)


def _grads(step: int, params) -> list[torch.Tensor]:
    """Step `step`'s gradients: the same bf16 values for every run (an fp32 run gets them as fp32)."""
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g).abs().add_(0.1).to(torch.bfloat16) for p in params]


def _weights():
    """bf16 weights at 1.0 (each AdamW update, ~lr, is 1/40 of bf16's spacing below 1) and random ones."""
    return [torch.nn.Parameter(torch.ones(256, dtype=torch.bfloat16)),
            torch.nn.Parameter(torch.randn(16, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16))]


def _run(opt, params, steps: int, first: int = 0) -> None:
    for s in range(first, first + steps):
        for p, g in zip(params, _grads(s, params), strict=True):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_masters_accumulate_what_nearest_rounding_loses_and_are_the_fp32_run_bitwise(name):
    """Given the same gradients, the masters are an fp32 run's weights bitwise at every step (the same optimizer on
    fp32 weights), and the bf16 weights are those rounded to nearest; without masters nearest rounding leaves the
    weights at 1.0."""
    from trainer.optim.specs import optimizer_spec

    steps = 40
    plain = _weights()
    _run(build_optimizer(plain, _cfg(name)), plain, steps)
    assert torch.equal(plain[0], torch.ones_like(plain[0]))  # every update lost

    params = _weights()
    ref = [torch.nn.Parameter(p.detach().float()) for p in params]
    fp32 = optimizer_spec(name).make(_cfg(name), [{"params": ref}])
    opt = build_optimizer(params, _cfg(name, master_weights=True))
    for s in range(steps):
        _run(opt, params, 1, first=s)
        for r, g in zip(ref, _grads(s, ref), strict=True):
            r.grad = g.float()
        fp32.step()
        for p, r in zip(params, ref, strict=True):
            master = opt.state_of(p)[MASTER]
            assert master.dtype == torch.float32 and torch.equal(master, r.detach())
            assert torch.equal(p.detach(), r.detach().to(torch.bfloat16))
    assert (params[0] < 1).all()  # the tiny updates added up
    assert not torch.equal(params[1], _weights()[1])


def test_fused_back_pass_equals_unfused_bitwise_with_masters():
    torch.manual_seed(0)
    start = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(torch.bfloat16)
    x, y = torch.randn(16, 8, dtype=torch.bfloat16), torch.randn(16, 4, dtype=torch.bfloat16)
    results = []
    for fused in (False, True):
        model = copy.deepcopy(start)
        opt = build_optimizer(model.parameters(), _cfg(master_weights=True).model_copy(update={"lr": 1e-3}))
        fb = FusedBackPass(opt) if fused else None
        for _ in range(3):
            F.mse_loss(model(x).float(), y.float()).backward()
            if fb is None:
                opt.step()
            else:
                fb.finish_step()
        results.append((model, opt))
    (a, oa), (b, ob) = results
    for pa, pb, s in zip(a.parameters(), b.parameters(), start.parameters(), strict=True):
        assert torch.equal(pa, pb) and not torch.equal(pa, s)
        assert torch.equal(oa.state_of(pa)[MASTER], ob.state_of(pb)[MASTER])


def test_resume_is_bitwise_and_a_state_without_masters_starts_them_from_the_weights(tmp_path):
    params = _weights()
    opt = build_optimizer(params, _cfg(master_weights=True))
    _run(opt, params, 6)
    whole = [p.detach().clone() for p in params]
    masters = [opt.state_of(p)[MASTER].clone() for p in params]

    params = _weights()
    opt = build_optimizer(params, _cfg(master_weights=True))
    _run(opt, params, 3)
    save_optimizer_state(opt, tmp_path)
    saved = [p.detach().clone() for p in params]
    again = [torch.nn.Parameter(w.clone()) for w in saved]
    resumed = build_optimizer(again, _cfg(master_weights=True))
    load_optimizer_state(resumed, tmp_path)
    assert resumed.masters_from_weights == 0
    _run(resumed, again, 3, first=3)
    for p, w, m in zip(again, whole, masters, strict=True):
        assert torch.equal(p, w) and torch.equal(resumed.state_of(p)[MASTER], m)

    # saved without masters: the next step starts them from the bf16 weights
    plain = [torch.nn.Parameter(w.clone()) for w in saved]
    opt = build_optimizer(plain, _cfg())
    _run(opt, plain, 1)
    (tmp_path / "plain").mkdir()
    save_optimizer_state(opt, tmp_path / "plain")
    late = [torch.nn.Parameter(p.detach().clone()) for p in plain]
    masters_now = build_optimizer(late, _cfg(master_weights=True))
    load_optimizer_state(masters_now, tmp_path / "plain")
    assert masters_now.masters_from_weights == len(late)
    assert all(MASTER not in masters_now.state_of(p) for p in late)
    ref = [torch.nn.Parameter(p.detach().float()) for p in late]
    fp32 = torch.optim.AdamW(ref, lr=LR, weight_decay=WD)
    fp32.load_state_dict(opt.optimizer.state_dict())
    _run(masters_now, late, 1, first=1)
    for r, g in zip(ref, _grads(1, ref), strict=True):
        r.grad = g.float()
    fp32.step()
    assert all(torch.equal(masters_now.state_of(p)[MASTER], r.detach()) for p, r in zip(late, ref, strict=True))

    # saved with masters, resumed without: the masters are dropped, not carried along
    off = build_optimizer([torch.nn.Parameter(w.clone()) for w in saved], _cfg())
    load_optimizer_state(off, tmp_path)
    assert all(MASTER not in off.state_of(p) for p in off.params)


def test_streamed_state_layout_and_the_specs_bytes_count_the_master():
    params = _weights() + [torch.nn.Parameter(torch.zeros(5))]  # an fp32 weight steps in place: no master
    fused = FusedBackPass(build_optimizer(params, _cfg(master_weights=True)))
    from trainer.optim.specs import state_bytes

    assert fused.state_layout(params[1])[MASTER] == (params[1].shape, torch.float32)
    assert MASTER not in fused.state_layout(params[2])
    for p in params:
        p.grad = torch.ones_like(p)
        fused.step_param(p)
    real = sum(v.numel() * v.element_size() for p in params for v in fused.state_of(p).values() if v.dim())
    assert real == state_bytes("adamw", params, masters=True) == state_bytes("adamw", params) + 4 * (256 + 128)


# --------------------------------------------------------------------------------------- owners over gloo

def _owned_worker(rank: int, world: int, store: str, result: str, fraction: float) -> dict:
    """Both processes train on the same batches: the mean gradient (g + g) / 2 is g exactly, so owned steps
    must give bitwise what one process gives alone."""
    import torch.distributed as tdist

    from trainer.offload import attach_offload
    from trainer.offload.gather import SliceGather
    from trainer.optim.fused import StateOffload
    from trainer.train.owners import SHARD_GLOB, OwnedSteps

    def fit(model, fused) -> None:
        for s in range(3):
            kw, target = batch(100 + s, dtype=torch.bfloat16)
            F.mse_loss(model(**kw)[0].float(), target.float()).backward()
            fused.finish_step()

    def optimizer(model):
        params = [p for p in model.parameters() if p.requires_grad]
        cfg = OptimizerConfig(name="adamw", lr=1e-3, weight_decay=WD, max_grad_norm=None, master_weights=True)
        return FusedBackPass(build_optimizer(params, cfg)), params

    one = tiny_flux(0, dtype=torch.bfloat16)
    ref, ref_params = optimizer(one)
    hr = attach_offload(blocks_of(one), "cpu", 0.0)  # the same graph
    fit(one, ref)
    hr.close()

    m = tiny_flux(0, dtype=torch.bfloat16)
    fused, params = optimizer(m)
    owners = OwnedSteps(params, rank, world)
    owners.attach(fused)
    group = tdist.new_group(list(range(world)))
    h = attach_offload(blocks_of(m), "cpu", fraction, trainable=True,
                       gather=SliceGather(group, tdist.get_rank(group), world))
    streamed = [p for i in h._c.plan.streamed for p in blocks_of(m)[i].parameters()]
    off = StateOffload(owners.owned(streamed), pin=False)
    fused.add_step_hooks(pre=off.pre, post=off.post, synchronize=off.synchronize)
    fit(m, fused)
    h.sync()
    in_arena = {id(p) for i in h._c.plan.streamed if h._c.ring_offset[i] is None for p in blocks_of(m)[i].parameters()}
    pairs = list(zip(params, ref_params, strict=True))
    out = {
        "same": all(torch.equal(p, q) for p, q in pairs if id(p) not in in_arena),
        "compared": sum(id(p) not in in_arena for p in params),
        "masters": all(torch.equal(fused.state_of(p)[MASTER], ref.state_of(q)[MASTER])
                       for p, q in pairs if owners.owns(p)),
        "only_owned": all((MASTER in fused.state_of(p)) == owners.owns(p) for p in params),
        "master_numel": sum(p.numel() for p in params if MASTER in fused.state_of(p)),
        "numel": sum(p.numel() for p in params),
    }
    owners.save_state(fused, Path(result))
    tdist.barrier()
    saved = {id(p): fused.state_of(p)[MASTER].clone() for p in owners.owned(params)}
    fused.remove()
    again = FusedBackPass(build_optimizer(params, OptimizerConfig(name="adamw", lr=1e-3, max_grad_norm=None,
                                                                  weight_decay=WD, master_weights=True)))
    mine = OwnedSteps(params, rank, world)
    mine.attach(again)
    mine.load_state(again, sorted(Path(result).glob(SHARD_GLOB)))
    out["reloaded"] = all(torch.equal(again.state_of(p)[MASTER], saved[id(p)]) if owners.owns(p)
                          else not again.state_of(p) for p in params)
    out["from_weights"] = again.optimizer.masters_from_weights
    h.close()
    return out


def test_owned_steps_with_masters_train_what_one_process_trains_and_each_keeps_its_own_masters(tmp_path):
    rs = run_ranks(_owned_worker, 2, tmp_path, 1.0)
    for r in rs:
        assert r["error"] is None, r["error"]
    for r in rs:
        assert r["compared"] > 0 and r["same"]
        assert r["masters"] and r["only_owned"]
        assert abs(r["master_numel"] / r["numel"] - 0.5) < 0.1  # 1/N of the masters on each process
        assert r["reloaded"] and r["from_weights"] == 0
    assert sum(r["master_numel"] for r in rs) == rs[0]["numel"]


# ----------------------------------------------------------------------------------------------- config

BASE = {"model": {"family": "flux", "path": "m", "dtype": "bf16"}, "output": {"dir": "o"},
        "train": {"method": "full"}, "optimizer": {"master_weights": True}}


@pytest.mark.parametrize(("change", "error"), [
    ({"optimizer": {"master_weights": True, "stochastic_rounding": True}},
     "optimizer.master_weights keeps the exact fp32 weights, so optimizer.stochastic_rounding"),
    ({"train": {"method": "lora"}}, "optimizer.master_weights applies to full fine-tuning"),
    ({"model": {"family": "flux", "path": "m", "dtype": "fp32"}}, "optimizer.master_weights applies to full"),
    ({"train": {"method": "full", "distributed": "fsdp"}}, "train.distributed: fsdp needs optimizer.master_weights"),
])
def test_the_config_refuses_what_masters_do_not_go_with(change, error):
    Config.model_validate(BASE, context={"family_checks": False})
    with pytest.raises(ValueError, match=error):
        Config.model_validate({**BASE, **change}, context={"family_checks": False})


def test_the_planner_counts_4_bytes_per_parameter_of_masters_where_the_state_is():
    """Streamed (every block): the pinned arena and the RAM peak grow by the blocks' masters (packed in the blocks,
    which the ring carries too); resident: the VRAM by every master. Owned steps on two processes: the node
    holds the masters once, whole copies twice."""
    from trainer.config import load_config
    from trainer.planner.prediction import analyze, node_ram_of_processes, predict

    def plan(fraction, masters):
        over = [f"offload.transformer={fraction}", "optimizer.stochastic_rounding=false",
                f"optimizer.master_weights={str(masters).lower()}"]
        facts = analyze(load_config("configs/flux/full-24gb.yaml", over))
        return facts, predict(facts, fraction, max(facts.resolutions), True)

    f0, off = plan(1.0, False)
    f1, on = plan(1.0, True)
    blocks = 4 * sum(p.numel() for b in f1.blocks for p in b.parameters())
    assert blocks > 40e9  # Flux.1-dev: 11.9 B parameters, nearly all in blocks: 47.6 GB
    assert on.pinned - off.pinned == blocks
    assert on.ram_peak - off.ram_peak == blocks
    assert on.ring > off.ring  # the blocks in the ring carry their masters (they cross PCIe with their block)
    w0, o0 = node_ram_of_processes(f0, off, 1.0, 2)
    w1, o1 = node_ram_of_processes(f1, on, 1.0, 2)
    assert (w1 - w0, o1 - o0) == (2 * blocks, blocks)
    nonblock = 4 * f1.nonblock_params
    assert f1.state_gpu - f0.state_gpu == nonblock
    assert sum(f1.block_states) - sum(f0.block_states) == blocks
    off0, on0 = (predict(f, 0.0, max(f.resolutions), True) for f in (f0, f1))  # resident: every master in VRAM
    assert on0.trainable - off0.trainable == blocks + nonblock == 4 * f1.trainable_params
    assert on0.pinned == off0.pinned


def test_resuming_a_checkpoint_without_masters_says_they_start_from_its_weights(tmp_path, capsys):
    from trainer.train.distributed import Dist
    from trainer.train.optimizer import optimizer_for

    def optim(masters):
        cfg = Config.model_validate({**BASE, "optimizer": {"master_weights": masters}}, context={"family_checks": False})
        params = _weights()
        return optimizer_for(cfg, params, Dist()), params

    plain, params = optim(False)
    _run(plain.optimizer, params, 1)
    plain.scheduler.step()
    plain.save(tmp_path)
    resumed, _ = optim(True)
    resumed.load(tmp_path, plain.scheduler.state_dict())
    assert "has no fp32 master weights" in capsys.readouterr().err
    again, _ = optim(False)
    again.load(tmp_path, plain.scheduler.state_dict())
    assert "master" not in capsys.readouterr().err  # said only where masters are on
