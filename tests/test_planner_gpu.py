"""The planner's memory prediction against a real GPU run, on a full-width Flux cut to 2 + 4 blocks (so it builds
and trains in seconds): LoRA rank 16 at 512 px through the offload conductor, resident and half streamed.
Run with `make test-gpu` (CI skips it); bench/speed/bench_plan.py does the same at full size.

The allocated peak is the planner's arithmetic (weights, ring, LoRA state, activations traced on the meta
device); the reserved peak adds its allocator model. Tolerances: 10 % allocated; reserved at most 5 % under, 20 % over.

Both peaks are counted from what the process already held before this test built anything (after
`gc.collect()` and `empty_cache()`), because `max_memory_allocated()` includes every tensor still alive. Under
`pytest -m gpu tests` this test runs after tests/test_offload_gpu.py, whose full fine-tune runs leave their
models' GPU weights and AdamW state alive for good (the post-accumulate-grad hooks of `fused_adamw` and of
trainer.optim's FusedBackPass close over the offload handle, which holds the parameters: a cycle through C++
that `gc` cannot collect; ~0.43 GB of such tensors on a CPU dry run of that module). That is the 0.49 GB the
H200 run of 2026-11-22 01:06 UTC measured above the prediction (3.62 / 2.49 GB against 3.13 / 2.00 GB at
f = 0 / 0.5), memory no training run holds; a meta-device emulation of this very step puts its peak at
3.10 GB (bench/diag/diag_planner_gap.py, which also prints every stage on a GPU).
"""

from __future__ import annotations

import gc
import json

import pytest
import torch
import torch.nn.functional as F

from trainer import planner
from trainer.config import Config
from trainer.models.flux import FluxAdapter
from trainer.planner import trace as ptrace

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CONFIG = dict(FluxAdapter.full_config, num_layers=2, num_single_layers=4)
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


def _measure(fraction: float) -> tuple[int, int, int]:
    """(peak allocated, peak reserved) of the set-up and 3 steps, above what the process held before it; and
    that baseline (allocated)."""
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    from trainer.offload import attach_offload

    gc.collect()  # cyclic garbage of earlier tests (whatever is collectable) goes before the baseline
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base_allocated, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
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
        return (
            torch.cuda.max_memory_allocated() - base_allocated,
            torch.cuda.max_memory_reserved() - base_reserved,
            base_allocated,
        )
    finally:
        handle.close()
        del opt, inputs, target, m
        torch.cuda.empty_cache()


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_predicted_peak_matches_the_gpu(setup, fraction):
    _, facts = setup
    allocated, reserved, held_before = _measure(fraction)
    p = planner.predict(facts, fraction, RES)
    gb = (p.peak_allocated / 1e9, allocated / 1e9, f"held before the test: {held_before / 1e9:.3f} GB")
    assert p.peak_allocated == pytest.approx(allocated, rel=0.10), gb
    gb = (p.peak_reserved / 1e9, reserved / 1e9, f"held before the test: {held_before / 1e9:.3f} GB")
    # Reserved: never more than 5 % under, at most 20 % over. The planner's allocator factor (1.35) is measured on
    # full-size Flux; after other GPU tests in the same process the allocator reuses segments they left cached,
    # so this cut model's reserved growth can come out smaller (2.08 GB against 2.41 predicted at f=0.5 under
    # `pytest -m gpu tests`, 2026-11-22 02:37 UTC).
    assert 0.95 * reserved <= p.peak_reserved <= 1.20 * reserved, gb


def test_measurement_times_every_block_class_host_and_gpu_apart(setup):
    """`dittrain plan`'s GPU measurement: each block class at the bucket, host launch time and GPU time apart,
    and a step prediction that is at least as long as either alone."""
    from trainer.planner.measure import measure

    _, facts = setup
    rates = measure(facts)
    got = rates.blocks[RES]
    assert set(got) == {type(b).__name__ for b in facts.blocks}
    for cost, idx in got.values():
        assert cost.gpu_bwd > cost.gpu_fwd > 0 and cost.host_bwd > 0 and cost.host_fwd > 0, (cost, idx)
    assert rates.h2d > 5e9
    p = planner.predict(facts, 0.0, RES, rates=rates)
    assert p.step_s >= 0.99 * max(p.host_s, p.compute_s) > 0
