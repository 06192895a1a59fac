"""Every registered family (trainer/models/__init__.py `ADAPTERS`), from its facts alone: the tiny model its
`tiny_builders` wrote passes the adapter's folder checks, loads, and its transformer runs one forward on the
adapter's own `dummy_inputs`. A new family is tested here without a line of this file changing."""

from __future__ import annotations

import pytest
import torch

from trainer.config import ModelConfig
from trainer.models import ADAPTERS, adapter_class, get_adapter

CASES = [(f, folder) for f in ADAPTERS for folder in adapter_class(f).own_tiny_builders()]


@pytest.mark.parametrize(("family", "folder"), CASES, ids=[c[1] for c in CASES])
def test_each_tiny_model_loads_and_runs_the_dummy_forward(tiny_models, family, folder):
    mc = ModelConfig(family=family, path=tiny_models / folder, dtype="fp32")
    adapter = get_adapter(mc)
    assert adapter.family == family
    adapter._check(mc, {"transformer", "vae", "text", "scheduler"})  # every folder the family names is there
    tr = adapter.load(mc, parts={"transformer"}, dtype=torch.float32).transformer
    assert type(tr) is adapter.transformer_cls and adapter.blocks(tr)
    d = adapter.resolution_divisor
    torch.manual_seed(0)
    kw = adapter.dummy_inputs(tr, 1, 2 * d, 2 * d, 8, torch.float32, device="cpu")
    with torch.no_grad():
        out = tr(**kw, return_dict=False)[0]
    out = torch.stack(out) if isinstance(out, list) else out  # Z-Image: one tensor per sample
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(("family", "folder"), CASES, ids=[c[1] for c in CASES])
def test_each_family_offloads_every_grad_carrying_block_input(tiny_models, family, folder, monkeypatch):
    """Activation offloading takes every checkpoint input that carries a gradient, whatever its layout, in every
    family at batch 2 (none stays on the device), and the gradients are bitwise those without it. HunyuanVideo 1.5's
    transposed residual stream stayed on the device unnoticed until a GPU run at 480p x 121 frames ran out of memory
    (bench/history/2026-11-28.md 10:10); Flux's single blocks kept their text tokens, a slice of the joint batch."""
    from trainer.offload import attach_offload
    from trainer.offload.activations import ActivationOffloader

    mc = ModelConfig(family=family, path=tiny_models / folder, dtype="fp32")
    adapter = get_adapter(mc)
    kept, went = [], []
    pack = ActivationOffloader._pack

    def spy(self, t):
        out = pack(self, t)
        if t.requires_grad and t.device == self.device:
            (kept if out is t else went).append(tuple(t.shape))
        return out

    monkeypatch.setattr(ActivationOffloader, "_pack", spy)

    def grads(activations: bool) -> dict[str, torch.Tensor]:
        tr = adapter.load(mc, parts={"transformer"}, dtype=torch.float32).transformer
        tr.requires_grad_(True)  # a full fine-tune: every block input carries a gradient
        h = attach_offload(adapter.blocks(tr), "cpu", 0.0, activations=activations, activation_min_bytes=0,
                           checkpointing=True)
        d = adapter.resolution_divisor
        torch.manual_seed(0)
        kw = adapter.dummy_inputs(tr, 2, 2 * d, 2 * d, 8, torch.float32, device="cpu")
        out = tr(**kw, return_dict=False)[0]
        (torch.stack(out) if isinstance(out, list) else out).square().mean().backward()  # Z-Image: a list
        h.close()
        return {n: p.grad for n, p in tr.named_parameters() if p.grad is not None}

    g0, g1 = grads(False), grads(True)
    assert went and kept == []
    bad = {k: (g0[k] - g1[k]).abs().max().item() for k in g0 if not torch.equal(g0[k], g1[k])}
    assert g0.keys() == g1.keys() and not bad, (len(bad), len(g0), sorted(bad.items(), key=lambda kv: -kv[1])[:4])
