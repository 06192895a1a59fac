"""The 8-bit base on a CUDA GPU: the `_scaled_mm` path against dequantize-then-matmul, and streamed fp8 training
bitwise equal to resident fp8 training. Run with `make test-gpu`."""

import pytest
import torch
from _offload_util import add_lora, blocks_of, flux_modulation, tiny_flux, train_steps, trainable_state

from trainer import quant

pytestmark = pytest.mark.gpu


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU with fp8 (sm89+)")
def test_scaled_mm_matches_dequantize_and_gives_input_gradients():
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 512, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    quant.quantize_linear(lin, "fp8")
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref = lin(x)
    (gref,) = torch.autograd.grad(ref.float().square().sum(), x)
    quant.set_scaled_mm(True)
    try:
        got = lin(x)
        (g,) = torch.autograd.grad(got.float().square().sum(), x)
    finally:
        quant.set_scaled_mm(False)
    # the activations are rounded to e4m3 as well (relative error <= 2^-4 each)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 0.08
    assert ((g - gref).abs().max() / gref.abs().max()).item() < 0.1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_streamed_quantized_lora_training_is_bitwise_resident_on_the_gpu(mode):
    from trainer.offload import attach_offload

    def run(fraction):
        m = tiny_flux(0, dtype=torch.bfloat16, device="cuda")
        quant.quantize_blocks(blocks_of(m), mode, False, flux_modulation())
        add_lora(m)
        h = attach_offload(blocks_of(m), "cuda", fraction) if fraction else None
        losses = train_steps(m, 3, device="cuda", dtype=torch.bfloat16)
        if h:
            h.close()
        return losses, trainable_state(m)

    a, b = run(0.0), run(1.0)
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(a[1][k], b[1][k]) for k in a[1])


@pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU with fp8 (sm89+)")
@pytest.mark.parametrize("compile", [False, True])
def test_fp8_matmul_streamed_is_bitwise_resident_and_close_to_dequantize(compile):
    """model.fp8_matmul (issue 29) from the packed ring, eager and compiled (inductor): streamed == resident
    bitwise (math attention), and the loss stays near the dequantize-then-matmul path's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trainer.offload import CompileOptions, attach_offload, compiled, move_outside_blocks

    def run(fraction, fp8mm):
        compiled.reset()
        m = tiny_flux(0, dtype=torch.bfloat16, device="cuda", dim_head=64, heads=4)
        quant.quantize_blocks(blocks_of(m), "fp8", False, flux_modulation())
        add_lora(m)
        assert quant.use_scaled_mm(m, fp8mm) > 0
        if fraction:
            m.to("cpu")
        h = attach_offload(blocks_of(m), "cuda", fraction, compile=CompileOptions() if compile else False)
        move_outside_blocks(m, blocks_of(m), "cuda")  # non-block modules: the caller's
        with sdpa_kernel(SDPBackend.MATH):
            losses = train_steps(m, 3, device="cuda", dtype=torch.bfloat16, side=16)
        h.close()
        return losses, trainable_state(m)

    a, b = run(0.0, True), run(1.0, True)
    assert torch.equal(a[0], b[0]) and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    ref = run(0.0, False)
    assert ((a[0] - ref[0]).abs() / ref[0].abs()).max() < 0.05, (a[0], ref[0])
