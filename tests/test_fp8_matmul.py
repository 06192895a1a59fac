"""`model.fp8_matmul` (trainer/quant.py, issue 29) on the CPU, where torch has an fp8 `_scaled_mm` kernel: the switch
routes fp8 Linears to it (counted), the output stays within e4m3 rounding of dequantize-then-matmul and the input
gradient is that path's exactly, it falls back where no fp8 matmul applies, it composes with the packed ring (a
streamed run is bitwise the resident one) and with torch.compile, and the loaders set it from the config. The
CUDA numbers (speed, error on a full-width layer) are tests/test_quant_gpu.py's and bench/speed/bench_speed.py's."""

from __future__ import annotations

import pytest
import torch
from _offload_util import add_lora, blocks_of, flux_modulation, tiny_flux, train_steps, trainable_state

from trainer import quant
from trainer.quant import QuantizedLinear


@pytest.fixture
def mm_calls(monkeypatch):
    """Count the calls of torch._scaled_mm (the real kernel still runs)."""
    calls = []
    real = torch._scaled_mm

    def counted(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", counted)
    return calls


def _layer(out=64, inp=48, mode="fp8", bias=True, dtype=torch.bfloat16):
    torch.manual_seed(0)
    lin = torch.nn.Linear(inp, out, bias=bias, dtype=dtype).requires_grad_(False)
    quant.quantize_linear(lin, mode)
    return lin


def _grad(lin, x, w):
    x = x.clone().requires_grad_(True)
    out = lin(x)
    (g,) = torch.autograd.grad((out.float() * w).sum(), x)  # a fixed upstream gradient w
    return out, g


def test_switch_routes_to_the_fp8_matmul_within_e4m3_rounding_and_keeps_the_input_gradient(mm_calls):
    lin = _layer()
    x = torch.randn(2, 5, 48, dtype=torch.bfloat16)
    w = torch.randn(2, 5, 64)
    ref, gref = _grad(lin, x, w)
    assert not mm_calls and lin.scaled_mm is None  # off by default: dequantize-then-matmul
    assert quant.use_scaled_mm(lin, True) == 1
    got, g = _grad(lin, x, w)
    assert len(mm_calls) == 1 and mm_calls[0] == (10, 48)  # activations flattened to rows
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    assert not torch.equal(got, ref)  # the activations were rounded to e4m3: a different path
    # each activation rounds to e4m3 (relative error <= 2^-4); summed over 48 products the error stays well below
    assert ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item() < 0.08
    assert torch.equal(g, gref)  # backward multiplies by the dequantized weight, as the default path does
    quant.use_scaled_mm(lin, False)
    assert torch.equal(_grad(lin, x, w)[0], ref) and len(mm_calls) == 1


@pytest.mark.parametrize("case", ["fp32 input", "int8 weight", "width not a multiple of 16", "switch off"])
def test_falls_back_to_dequantize_where_no_fp8_matmul_applies(mm_calls, case):
    dtype = torch.float32 if case == "fp32 input" else torch.bfloat16
    lin = _layer(out=40 if case == "width not a multiple of 16" else 64, mode="int8" if case == "int8 weight" else "fp8",
                 dtype=dtype)
    quant.use_scaled_mm(lin, case != "switch off")
    x = torch.randn(3, 48, dtype=dtype)
    out = lin(x)
    assert not mm_calls
    want = torch.nn.functional.linear(x, quant.dequantize(lin.weight, lin.weight_scale, dtype), lin.bias)
    assert torch.equal(out, want)
    if case == "int8 weight":
        assert quant.use_scaled_mm(lin, True) == 0  # only fp8 layers are counted (and routed)


def test_process_default_applies_to_layers_the_config_did_not_set(mm_calls):
    lin = _layer()
    x = torch.randn(4, 48, dtype=torch.bfloat16)
    quant.set_scaled_mm(True)
    try:
        lin(x)
        assert len(mm_calls) == 1
        quant.use_scaled_mm(lin, False)  # the layer's own setting wins
        lin(x)
        assert len(mm_calls) == 1
    finally:
        quant.set_scaled_mm(False)


def _train(fraction, compile=False, steps=2):
    from trainer.offload import attach_offload

    m = tiny_flux(0, layers=1, singles=2, dtype=torch.bfloat16)
    quant.quantize_blocks(blocks_of(m), "fp8", False, flux_modulation())
    add_lora(m)
    assert quant.use_scaled_mm(m, True) > 0
    h = attach_offload(blocks_of(m), "cpu", fraction, compile=compile)
    losses = train_steps(m, steps, dtype=torch.bfloat16, side=4)
    h.close()
    return losses, trainable_state(m)


def test_streamed_from_the_packed_ring_is_bitwise_resident(mm_calls):
    """fp8 weights as views of the uint8 ring (256-byte aligned) go to the fp8 matmul as they are."""
    ref_l, ref_w = _train(0.0)
    n = len(mm_calls)
    assert n > 0
    got_l, got_w = _train(0.5)
    assert len(mm_calls) == 2 * n  # the same layers took the fp8 path in the streamed run
    assert torch.equal(got_l, ref_l)
    assert all(torch.equal(got_w[k], ref_w[k]) for k in ref_w)


def test_composes_with_compiled_blocks():
    from trainer.offload import CompileOptions, compiled

    compiled.reset()
    try:
        eager_l, _ = _train(0.5, steps=1)
        got_l, _ = _train(0.5, compile=CompileOptions(backend="aot_eager", shapes=2), steps=1)
        assert compiled.stats()["graphs"] >= 2
    finally:
        compiled.reset()
    torch.testing.assert_close(got_l, eager_l, rtol=2e-2, atol=1e-3)  # bf16; the same kernels, traced


def test_config_switch_needs_fp8_and_the_loader_sets_it(tiny_models):
    from pydantic import ValidationError

    from trainer.config import ModelConfig
    from trainer.models import get_adapter, stream_load

    with pytest.raises(ValidationError, match="model.fp8_matmul: true needs model.quantize: fp8"):
        ModelConfig(family="flux", path="x", quantize="int8", fp8_matmul=True)
    assert not ModelConfig(family="flux", path="x", quantize="fp8").fp8_matmul  # off by default
    for on in (False, True):
        cfg = ModelConfig(family="flux", path=tiny_models / "flux", dtype="bf16", quantize="fp8", fp8_matmul=on)
        a = get_adapter(cfg)
        tr = a.load(cfg, parts={"transformer"}, dtype=torch.bfloat16).transformer
        streamed = stream_load.empty_transformer(a, cfg, torch.bfloat16)  # the streamed loader's model
        for model in (tr, streamed):
            qs = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
            assert qs and all(m.scaled_mm is (True if on else None) for m in qs)
