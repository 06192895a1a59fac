"""LoRA math in the compute dtype (trainer/train/model.py `ComputeDtypeLora`): fp32 master weights, bf16
matmuls in a bf16 model; bitwise unchanged in an fp32 model; no fp32 copy of the activations."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from _offload_util import batch, tiny_flux
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.config import LoraConfig
from trainer.train.model import ComputeDtypeLora, add_lora, undo_lora_compute_dtype

TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "proj_mlp", "proj_out")


def _model(dtype, compute_dtype: str):
    m = tiny_flux(0, layers=1, singles=2, dtype=dtype)
    cfg = SimpleNamespace(lora=LoraConfig(rank=4, alpha=8, compute_dtype=compute_dtype))
    torch.manual_seed(1)
    params = add_lora(m, cfg, TARGETS)
    g = torch.Generator().manual_seed(2)
    for n, p in m.named_parameters():
        if "lora_B" in n:  # peft starts B at zero, which would hide the branch's arithmetic
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return m, params


def _loss(m, dtype, seed=0):
    kw, target = batch(seed, dtype=dtype)
    return F.mse_loss(m(**kw)[0].float(), target.float())


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}


def test_fp32_model_is_bitwise_unchanged():
    old, _ = _model(torch.float32, "fp32")
    new, _ = _model(torch.float32, "auto")
    assert not any(isinstance(x, ComputeDtypeLora) for x in old.modules())
    # 4 in the double block, 5 in each single block, the model's proj_out
    assert sum(isinstance(x, ComputeDtypeLora) for x in new.modules()) == 4 + 2 * 5 + 1
    a, b = _loss(old, torch.float32), _loss(new, torch.float32)
    a.backward()
    b.backward()
    assert torch.equal(a, b)
    ga, gb = _grads(old), _grads(new)
    assert ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)


def test_bf16_model_same_loss_within_bf16_tolerance_fp32_masters():
    old, _ = _model(torch.bfloat16, "fp32")
    new, params = _model(torch.bfloat16, "auto")
    assert all(p.dtype == torch.float32 for p in params)
    a, b = _loss(old, torch.bfloat16), _loss(new, torch.bfloat16)
    a.backward()
    b.backward()
    assert torch.allclose(a, b, rtol=2e-2), (a.item(), b.item())
    ga, gb = _grads(old), _grads(new)
    for k in ga:
        assert gb[k].dtype == torch.float32
        cos = F.cosine_similarity(ga[k].flatten(), gb[k].flatten(), dim=0)
        assert cos > 0.98, (k, cos.item())
    # and the two differ at all: the new math really runs in bf16
    assert any(not torch.equal(ga[k], gb[k]) for k in ga)


def test_bf16_training_steps_track_the_fp32_branch():
    losses = {}
    for mode in ("fp32", "auto"):
        m, params = _model(torch.bfloat16, mode)
        opt = torch.optim.AdamW(params, lr=1e-3)
        out = []
        for s in range(3):
            loss = _loss(m, torch.bfloat16, seed=10 + s)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.item())
        losses[mode] = torch.tensor(out)
    assert torch.allclose(losses["fp32"], losses["auto"], rtol=2e-2), losses


class _Fp32Casts(TorchDispatchMode):
    """Elements cast to fp32 by `_to_copy` while active."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            self.elements += out.numel()
        return out


def test_no_fp32_copy_of_activations():
    """peft's forward casts every targeted activation to fp32; the compute-dtype forward casts only the small
    LoRA matrices to bf16. (The model casts a few tensors to fp32 itself: rope, norms.)"""
    kw, _ = batch(0, dtype=torch.bfloat16)
    sizes = {}
    for mode in ("fp32", "auto"):
        m, params = _model(torch.bfloat16, mode)
        with torch.no_grad(), _Fp32Casts() as casts:
            m(**kw)
        sizes[mode] = casts.elements
    # 15 LoRA layers, each input at least 64 tokens x 32 features: peft copies them all to fp32, we copy none
    assert sizes["fp32"] - sizes["auto"] >= 15 * 64 * 32, sizes


def test_saved_weights_and_undo_keep_peft_classes():
    from peft import get_peft_model_state_dict
    from peft.tuners.lora import Linear as LoraLinear

    old, _ = _model(torch.bfloat16, "fp32")
    new, _ = _model(torch.bfloat16, "auto")
    so, sn = get_peft_model_state_dict(old), get_peft_model_state_dict(new)
    assert so.keys() == sn.keys() and all(sn[k].dtype == torch.float32 and torch.equal(so[k], sn[k]) for k in so)
    assert old.state_dict().keys() == new.state_dict().keys()
    undo_lora_compute_dtype(new)
    assert not any(isinstance(x, ComputeDtypeLora) for x in new.modules())
    assert sum(type(x) is LoraLinear for x in new.modules()) == 4 + 2 * 5 + 1
