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
