"""Fused back pass: bitwise the same weights as stepping after backward (fp32, CPU), grads freed at once."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import inject_adapter_in_model

from trainer.config import OptimizerConfig
from trainer.optim import FusedBackPass, StateOffload, build_optimizer, build_scheduler

STEPS = 4


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.GELU(),
        torch.nn.Linear(16, 16),
        torch.nn.GELU(),
        torch.nn.Linear(16, 4),
    )


class _Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.v, self.o = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.o(torch.tanh(self.q(x)) * self.v(x))


def _lora() -> torch.nn.Module:
    torch.manual_seed(0)
    model = inject_adapter_in_model(PeftLoraConfig(r=4, lora_alpha=8, target_modules=["q", "v"]), _Attn())
    with torch.no_grad():  # B starts at zero; give it values so that A gets gradients from the first step
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def _cfg(name: str, **kw) -> OptimizerConfig:
    base = dict(name=name, lr=3e-2, weight_decay=0.1, scheduler="cosine", warmup_steps=2, max_grad_norm=None)
    return OptimizerConfig(**{**base, **kw})


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(STEPS)]


def _train(model, cfg, fused: bool, steps: int = STEPS, hooks=()):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(params, cfg)
    sched = build_scheduler(opt, cfg, total_steps=steps + 2)
    fb = FusedBackPass(opt) if fused else None
    for pre, post in hooks:
        fb.add_step_hooks(pre=pre, post=post)
    lrs = []
    for x, y in _batches()[:steps]:
        lrs.append(opt.param_groups[0]["lr"])
        loss = torch.nn.functional.mse_loss(model(x), y)
        assert torch.isfinite(loss)  # the contract: check BEFORE backward
        loss.backward()
        if fb is None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            assert fb.stepped == len(params)
            fb.finish_step()
            assert all(p.grad is None for p in params)
        sched.step()
    return model, lrs


@pytest.mark.parametrize("make", [_mlp, _lora], ids=["mlp", "peft-lora"])
@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_fused_equals_unfused_bitwise(make, name):
    cfg = _cfg(name)
    start = make()
    ref, lrs = _train(copy.deepcopy(start), cfg, fused=False)
    got, lrs_fused = _train(copy.deepcopy(start), cfg, fused=True)
    assert lrs == lrs_fused and lrs[0] < lrs[1] > lrs[-1]  # warmup, then cosine decay
    trained = 0
    for (n, a), b, s in zip(ref.named_parameters(), got.parameters(), start.parameters(), strict=True):
        assert torch.equal(a, b), n
        trained += not torch.equal(a, s)
    assert trained == sum(p.requires_grad for p in start.parameters())  # every trainable weight moved


def test_gradients_freed_as_soon_as_stepped():
    model = _mlp()
    params = list(model.parameters())
    live = []

    def count(p, state):
        live.append(sum(q.grad is not None for q in params))

    _train(model, _cfg("adamw"), fused=True, steps=2, hooks=[(count, None)])
    # A Linear's weight and bias get their gradients from one autograd node: at most those two exist at once.
    assert len(live) == 2 * len(params) and max(live) <= 2


def test_step_hooks_see_the_state_the_optimizer_uses():
    """A post hook that moves the state elsewhere (here: fresh copies) and a pre hook that finds it there must
    not change any number: the offload engineer's contract."""
    start = _mlp()
    ref, _ = _train(copy.deepcopy(start), _cfg("adamw"), fused=False)
    moved: dict[int, dict[str, torch.Tensor]] = {}
    calls = []

    def pre(p, state):
        calls.append("pre")
        if id(p) in moved:
            assert all(state[k] is t for k, t in moved[id(p)].items())
        else:
            assert state == {}  # before the first step the optimizer has not created it yet

    def post(p, state):
        calls.append("post")
        assert "exp_avg" in state
        for k, v in list(state.items()):
            if v.dim() > 0:
                state[k] = v.clone()
        moved[id(p)] = {k: v for k, v in state.items() if v.dim() > 0}

    got, _ = _train(copy.deepcopy(start), _cfg("adamw"), fused=True, hooks=[(pre, post)])
    assert calls == ["pre", "post"] * (STEPS * len(list(start.parameters())))
    for a, b in zip(ref.parameters(), got.parameters(), strict=True):
        assert torch.equal(a, b)


def test_state_offload_hooks_on_cpu_keep_results():
    start = _mlp()
    ref, _ = _train(copy.deepcopy(start), _cfg("adafactor"), fused=False)
    model = copy.deepcopy(start)
    offload = StateOffload(list(model.parameters()), pin=False)
    got, _ = _train(model, _cfg("adafactor"), fused=True, hooks=[(offload.pre, offload.post)])
    offload.synchronize()
    for a, b in zip(ref.parameters(), got.parameters(), strict=True):
        assert torch.equal(a, b)


def test_disable_leaves_grads_and_weights():
    model = _mlp()
    params = list(model.parameters())
    opt = build_optimizer(params, _cfg("adamw"))
    fb = FusedBackPass(opt)
    before = [p.detach().clone() for p in params]
    x, y = _batches()[0]
    with fb.paused():
        torch.nn.functional.mse_loss(model(x), y).backward()
    assert fb.enabled and fb.stepped == 0
    assert all(p.grad is not None for p in params)
    assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    opt.zero_grad(set_to_none=True)
    fb.disable()
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    opt.zero_grad(set_to_none=True)
    fb.enable()
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert all(not torch.equal(a, b) for a, b in zip(before, params, strict=True))
    assert fb.lr == 3e-2  # no scheduler attached here


def test_grad_norm_tracking_matches_global_norm():
    model = _mlp()
    x, y = _batches()[0]
    ref = copy.deepcopy(model)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()
    fb = FusedBackPass(build_optimizer(model.parameters(), _cfg("adamw")))
    fb.track_grad_norm = True
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert fb.finish_step() == pytest.approx(expected, rel=1e-5)
    fb.track_grad_norm = False
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert fb.finish_step() is None
    fb.remove()
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert all(p.grad is not None for p in model.parameters())  # hooks gone


def test_hooks_survive_data_swaps():
    """The offloader re-points streamed weights (`p.data = slot_view`); the hooks and state stay with p."""
    start = _mlp()
    ref, _ = _train(copy.deepcopy(start), _cfg("adamw"), fused=False)
    model = copy.deepcopy(start)

    def swap(p, state):
        p.data = p.data.clone()  # a new storage before each step, as a ring slot would be

    got, _ = _train(model, _cfg("adamw"), fused=True, hooks=[(swap, None)])
    for a, b in zip(ref.parameters(), got.parameters(), strict=True):
        assert torch.equal(a, b)


class _PackedStore:
    """The offload protocol on the CPU: state lives in a host 'arena' between steps; a block load copies it
    into a 'ring' slot; the step runs on the ring views; a write-back copies the slot to the arena."""

    def __init__(self, fb: FusedBackPass, params):
        self.fb = fb
        self.arena = {
            p: {n: torch.zeros(s, dtype=d) for n, (s, d) in fb.state_layout(p).items()} for p in params
        }
        self.ring: dict = {}

    def pre(self, p, state):
        self.ring[p] = {n: t.clone() for n, t in self.arena[p].items()}  # block load
        if not state:
            return  # first step: the optimizer creates its state; post packs it
        for n, slot in self.ring[p].items():
            if state[n] is not self.arena[p][n]:
                slot.copy_(state[n])  # state given by load_state_dict: adopt it
            state[n] = slot

    def post(self, p, state):
        for n, slot in self.ring[p].items():
            if state[n] is not slot:
                slot.copy_(state[n])
            self.arena[p][n].copy_(slot)  # write-back before the slot is reused
            state[n] = self.arena[p][n]
            slot.fill_(float("nan"))  # the slot is reused: any later read of it would poison the weights
        del self.ring[p]


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_packed_state_protocol_is_exact_and_resumable(name, tmp_path):
    from trainer.optim import load_optimizer_state, save_optimizer_state

    cfg = _cfg(name)
    start = _mlp()
    ref, _ = _train(copy.deepcopy(start), cfg, fused=False, steps=STEPS)

    def run(model, steps, resume=None, save_dir=None):
        params = list(model.parameters())
        opt = build_optimizer(params, cfg)
        sched = build_scheduler(opt, cfg, total_steps=STEPS + 2)
        fb = FusedBackPass(opt)
        store = _PackedStore(fb, params)
        fb.add_step_hooks(pre=store.pre, post=store.post)
        if resume is not None:
            load_optimizer_state(fb, resume[0])
            sched.load_state_dict(resume[1])
        for s in steps:
            x, y = _batches()[s]
            torch.nn.functional.mse_loss(model(x), y).backward()
            fb.finish_step()
            sched.step()
        for p in params:  # between steps the state dict holds the arena tensors
            assert all(fb.state_of(p)[n] is t for n, t in store.arena[p].items())
        if save_dir is not None:
            save_optimizer_state(fb, save_dir)
        fb.remove()
        return model, sched.state_dict()

    half, sched_state = run(copy.deepcopy(start), range(0, 2), save_dir=tmp_path)
    resumed, _ = run(half, range(2, STEPS), resume=(tmp_path, sched_state))
    for a, b in zip(ref.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_one_driver_per_parameter():
    model = _mlp()
    fb = FusedBackPass(build_optimizer(model.parameters(), _cfg("adamw")))
    with pytest.raises(ValueError, match="already stepped by another FusedBackPass"):
        FusedBackPass(build_optimizer(model.parameters(), _cfg("adamw")))
    fb.remove()
    FusedBackPass(build_optimizer(model.parameters(), _cfg("adamw")))
