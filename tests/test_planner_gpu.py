"""The planner's memory prediction against a real GPU run, on a full-width Flux cut to 2 + 4 blocks (so it builds
and trains in seconds): LoRA rank 16 at 512 px through the offload conductor, resident and half streamed.
Run with `make test-gpu` (CI skips it); bench/bench_plan.py does the same at full size.

The allocated peak is the planner's arithmetic (weights, ring, LoRA state, activations traced on the meta
device); the reserved peak adds its allocator model. Tolerances: 10 % allocated, 15 % reserved.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from trainer.config import Config
from trainer.offload import _planner_trace as ptrace
from trainer.offload import planner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CONFIG = dict(ptrace.FULL_CONFIGS["flux"], num_layers=2, num_single_layers=4)
RES = 512


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux_cut")
    (root / "transformer").mkdir()
    (root / "transformer" / "config.json").write_text(json.dumps(CONFIG))
    cfg = Config.model_validate({
        "model": {"family": "flux", "path": str(root)},
        "train": {"method": "lora"}, "lora": {"rank": 16, "alpha": 16},
        "data": {"sources": [{"path": "unused"}], "resolutions": [RES]}, "output": {"dir": "unused"},
    })  # fmt: skip
    return cfg, planner.analyze(cfg)


def _measure(fraction: float) -> tuple[float, float]:
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    from trainer.offload import attach_offload

    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):  # random init on the GPU is fast; the blocks then go to the CPU
            m = FluxTransformer2DModel(**CONFIG)
    finally:
        torch.set_default_dtype(torch.float32)
    m.requires_grad_(False)
    m.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=list(ptrace.default_lora_targets("flux"))))
    params = [p for p in m.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    m.train()
    blocks = ptrace.blocks_of("flux", m)
    for b in blocks:  # as after loading: blocks on the CPU, the conductor decides where they go
        b.to("cpu")
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    handle = attach_offload(blocks, "cuda", fraction)
    for p in m.parameters():  # non-block modules are the caller's (the conductor's contract)
        if id(p) not in in_blocks:
            p.data = p.data.to("cuda")
    inputs = ptrace.forward_inputs("flux", m, 1, RES, RES, 512, torch.bfloat16, device="cuda")
    target = torch.randn(1, (RES // 16) ** 2, 64, device="cuda")
    opt = torch.optim.AdamW(params, lr=1e-5)
    try:
        for _ in range(3):
            out = m(**inputs, return_dict=False)[0]
            F.mse_loss(out.float(), target).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    finally:
        handle.close()
        del opt, inputs, target, m
        torch.cuda.empty_cache()


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_predicted_peak_matches_the_gpu(setup, fraction):
    _, facts = setup
    allocated, reserved = _measure(fraction)
    p = planner.predict(facts, fraction, RES)
    assert p.peak_allocated == pytest.approx(allocated, rel=0.10), (p.peak_allocated / 1e9, allocated / 1e9)
    assert p.peak_reserved == pytest.approx(reserved, rel=0.15), (p.peak_reserved / 1e9, reserved / 1e9)
