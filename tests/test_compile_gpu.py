"""Compiled (inductor) bf16 training on a CUDA GPU: how far offloaded runs are from resident ones, and why (issue 29).

Measured through the CLI (bf16, train.compile auto, attention auto, 6 steps on three buckets): the LoRA at offload
0.5 differed from offload 0 by max 2.8e-6, at 1.0 + activation offloading by 7.4e-6; eager fp32 was bitwise. Two
things changed between those runs, not one: the dtype and compilation. The likely cause is neither offloading nor
compilation but the attention kernel: in bf16 SDPA picks flash attention, whose backward accumulates dQ with
atomic adds in an order that varies from run to run (torch warns so under `use_deterministic_algorithms`); in
fp32 flash does not apply. Offloading itself changes no arithmetic: the ring views are 256-byte aligned, the
same compiled graphs serve resident and streamed blocks (tests/test_compile.py counts them), and the copies
only move bytes. A second candidate is compilation's own: inductor picks some reduction kernels' launch configs by
timing them on the device at their first run (split sizes change the order of the sums), and a run whose copies
share the GPU with its kernels times them differently; `torch._inductor.config.deterministic`
(env TORCHINDUCTOR_DETERMINISTIC=1) skips that benchmarking. Within one process the choice, once made, is reused
(and inductor's cache carries it to the next process).

Measured on an H100 (2026-11-26, six runs of the old form of these tests): compiled bf16 at offload 0.5 differed
from offload 0 *with the math kernel too*, by max |dW| 0.0009-0.002 after 6 AdamW steps at lr 1e-3 (an element
whose tiny gradient changed sign moves by up to 2 lr), with inductor's deterministic mode and with its caches
off as well, and with the activation fetches of either allocator; flash at offload 0 against itself differed
by 0.0019 in most runs and by 0 in one, and its offloaded difference was then 0 at 1.0 + activations. So the
bf16 compiled step is not reproducible run to run on that machine whatever the fraction; the cause is not
found (not atomics alone: the math kernel has none). The tests therefore ask that offloading add nothing beyond
that spread (print every number with -s):
- per attention kernel (math, flash): offload 0 against itself (the run-to-run spread) and against 0.5 / 1.0 +
  activations; an offloaded difference within TOL of the LoRA update's size (max |W_after - W_before|) or
  within SPREAD_X x the spread, and 0 where the spread was 0.
"""

from __future__ import annotations

import os

import pytest
import torch
from _offload_util import add_lora, blocks_of, place_non_blocks, tiny_flux, train_steps, trainable_state

from trainer.offload import CompileOptions, attach_offload, compiled

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN attention fails in backward on these machines (GPU.md)

SIZE = dict(layers=2, singles=4, dim_head=64, heads=4)
SIDE, TEXT, STEPS, LR = 32, 64, 6, 1e-3  # 1024 image + 64 text tokens: flash splits the keys into several tiles
#: offloaded vs resident (flash attention, bf16, compiled): max |difference| of the LoRA weights after STEPS steps,
#: as a share of the largest change any LoRA weight made in those steps
TOL = 0.02
#: ... or at most this multiple of two resident runs' difference (the measured spread: docstring)
SPREAD_X = 1.5


def _run(fraction, attention, act=False):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    compiled.reset()
    m = add_lora(tiny_flux(0, dtype=torch.bfloat16, **SIZE))
    for p in m.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # fp32 masters, as the trainer keeps them
    before = trainable_state(m)
    blocks = blocks_of(m)
    place_non_blocks(m, blocks, "cuda")
    h = attach_offload(blocks, "cuda", fraction, activations=act, compile=CompileOptions())
    kernel = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}[attention]
    with sdpa_kernel(kernel):
        losses = train_steps(m, STEPS, lr=LR, device="cuda", dtype=torch.bfloat16, side=SIDE, text=TEXT)
    torch.cuda.synchronize()
    h.close()
    after = trainable_state(m)
    update = max((after[k] - before[k]).abs().max().item() for k in after)
    return losses, after, update


def _max_diff(a, b) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("attention", ["math", "flash"])
def test_compiled_bf16_offload_within_its_run_to_run_spread(attention):
    ref_l, ref_w, update = _run(0.0, attention)
    _, again_w, _ = _run(0.0, attention)
    spread = _max_diff(ref_w, again_w)
    print(f"{attention} attention, compiled bf16: largest LoRA update {update:.3g}; offload 0 vs 0 (run to run) "
          f"max |dW| {spread:.3g}")
    for fraction, act in ((0.5, False), (1.0, True)):
        _, w, _ = _run(fraction, attention, act)
        d = _max_diff(ref_w, w)
        print(f"{attention} attention, compiled bf16: offload {fraction}{' + act' if act else ''} vs 0: max |dW| "
              f"{d:.3g} ({d / update:.2%} of the update; {d / spread if spread else float('inf'):.1f} x run to run)")
        assert d <= max(TOL * update, SPREAD_X * spread)
        if spread == 0.0:  # deterministic here: then offloading must be too
            assert d == 0.0


@pytest.mark.skipif(os.environ.get("DITTRAIN_DETERMINISTIC_CHECK") != "1",
                    reason="set DITTRAIN_DETERMINISTIC_CHECK=1 (needs CUBLAS_WORKSPACE_CONFIG=:4096:8)")
def test_flash_attention_deterministic_mode_makes_offload_bitwise():
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        ref_l, ref_w, _ = _run(0.0, "flash")
        got_l, w, _ = _run(0.5, "flash")
    finally:
        torch.use_deterministic_algorithms(False)
    print(f"flash attention, deterministic algorithms: offload 0.5 vs 0: max |dW| {_max_diff(ref_w, w):.3g}")
    assert torch.equal(got_l, ref_l) and _max_diff(ref_w, w) == 0.0
