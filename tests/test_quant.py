"""The 8-bit frozen base (trainer/quant.py) on the CPU: error bounds per format, a quantized block against the fp32
block, LoRA gradients through it, streamed == resident bitwise, the config refusal, fp8 single files."""

from __future__ import annotations

import pytest
import torch
from _offload_util import add_lora, blocks_of, flux_modulation, tiny_flux, train_steps, trainable_state
from torch import nn

from trainer import quant
from trainer.models import adapter_class
from trainer.quant import QuantizedLinear


def _weight(seed=0, out=64, inp=96):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * torch.rand(out, 1, generator=g) * 0.2
    w[3] = 0.0  # an all-zero row
    w[5, 7] = 3.0  # an outlier row
    return w


@pytest.mark.parametrize("mode", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_gives_quantize_bitwise(mode, dtype):
    """`quantize_rows` (stream_load's loader: a weight read from bf16 files, cast and quantized a slice of rows at a
    time) gives exactly `quantize` of the whole weight cast to the model dtype, also where the slices do not
    divide the rows; a zero row keeps scale 1."""
    torch.manual_seed(0)
    w = (torch.randn(11, 7) * torch.logspace(-3, 2, 11)[:, None]).to(torch.bfloat16)
    w[4] = 0
    q, s = quant.quantize_rows(w, mode, dtype, rows=3)
    want_q, want_s = quant.quantize(w.to(dtype), mode)
    assert q.dtype == want_q.dtype and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s) and s[4] == 1


def test_int8_error_is_at_most_half_a_step():
    w = _weight()
    q, s = quant.quantize(w, "int8")
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (64,)
    err = (quant.dequantize(q, s, torch.float32) - w).abs()
    assert (err <= s[:, None] / 2 * (1 + 1e-6)).all()
    assert q.abs().amax(dim=1)[w.abs().amax(dim=1) > 0].eq(127).all()  # each row uses the full range
    assert torch.equal(quant.dequantize(q, s, torch.float32)[3], torch.zeros(96))


def test_fp8_error_is_within_e4m3_rounding():
    w = _weight(1)
    q, s = quant.quantize(w, "fp8")
    assert q.dtype == torch.float8_e4m3fn
    err = (quant.dequantize(q, s, torch.float32) - w).abs()
    # 3 mantissa bits: relative error <= 2^-4 for normal values; below the smallest normal (2^-6 of the scale
    # unit) the absolute error is at most half the subnormal step 2^-9, times the row's scale.
    bound = torch.maximum(w.abs() * 2**-4, s[:, None] * 2**-10)
    assert (err <= bound * (1 + 1e-6)).all()
    assert (err > 0).any()  # it really rounds
    assert not torch.isnan(q.float()).any() and q.float().abs().max() <= 448


def test_dequantize_to_bf16_is_exact_upcast_then_one_rounding():
    w = _weight(2)
    for mode in ("fp8", "int8"):
        q, s = quant.quantize(w, mode)
        exact = q.double() * s.double()[:, None]
        got = quant.dequantize(q, s, torch.bfloat16)
        # bf16 keeps 8 significant bits: one rounding of a product of a bf16-rounded scale
        assert ((got.double() - exact).abs() <= exact.abs() * 2**-7 + 1e-30).all()


def test_quantize_on_the_meta_device_gives_the_real_shapes_and_dtypes_without_arithmetic():
    """A meta weight (the planner's model, the streamed loader's skeleton) gets what a real one gets: the 8-bit weight
    and the fp32 scales, same shapes, dtypes and strides; only the two outputs are made (torch's meta kernels of
    the arithmetic run in Python: ~10 ms a Linear)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    for dtype in (torch.bfloat16, torch.float32):
        w = _weight(2).to(dtype)
        for mode in ("fp8", "int8"):
            real, on_meta = quant.quantize(w, mode), w.to("meta")
            with Ops() as seen:
                meta = quant.quantize(on_meta, mode)
            assert all(op is torch.ops.aten.empty.memory_format for op in seen.ops) and len(seen.ops) == 2
            for r, m in zip(real, meta, strict=True):
                assert m.is_meta and (m.shape, m.dtype, m.stride()) == (r.shape, r.dtype, r.stride())


@pytest.mark.parametrize("mode,tol", [("fp8", 0.08), ("int8", 0.02)])
def test_quantized_block_matches_the_fp32_block(mode, tol):
    """A tiny Flux's quantized blocks vs the same blocks in fp32: max |diff| / max |ref| below `tol` (fp8 rounds
    weights by up to 6%, int8 by half a step of 1/127 of the row's largest weight)."""
    m = tiny_flux(0)
    ref = tiny_flux(0)
    n = quant.quantize_blocks(blocks_of(m), mode, False, flux_modulation())
    # double blocks: to_q/k/v, to_out.0, add_q/k/v_proj, to_add_out, ff and ff_context 2 each; singles: q k v,
    # proj_mlp, proj_out
    assert n == 2 * 12 + 4 * 5
    # modulation and everything outside the blocks keep the model dtype
    assert type(m.transformer_blocks[0].norm1.linear) is nn.Linear
    assert type(m.single_transformer_blocks[0].norm.linear) is nn.Linear
    assert type(m.proj_out) is nn.Linear and type(m.x_embedder) is nn.Linear
    from _offload_util import batch

    kw, _ = batch(0)
    with torch.no_grad():
        got, want = m(**kw)[0], ref(**kw)[0]
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert 0 < rel < tol, rel


def test_state_dict_keeps_names_and_the_class_is_still_a_linear():
    m = tiny_flux(0)
    names = set(m.state_dict())
    quant.quantize_blocks(blocks_of(m), "fp8", False, flux_modulation())
    sd = m.state_dict()
    lin = m.transformer_blocks[0].attn.to_q
    assert isinstance(lin, nn.Linear) and isinstance(lin, QuantizedLinear)
    added = set(sd) - names
    assert names <= set(sd) and added and all(k.endswith(".weight_scale") for k in added)
    assert sd["transformer_blocks.0.attn.to_q.weight"].dtype == torch.float8_e4m3fn


def test_lora_on_a_quantized_base_gets_gradients_and_stays_fp32():
    m = tiny_flux(0)
    quant.quantize_blocks(blocks_of(m), "fp8", False, flux_modulation())
    add_lora(m)
    lora = [p for p in m.parameters() if p.requires_grad]
    for p in lora:
        p.data = p.data.float()
    assert lora and all(p.dtype == torch.float32 for p in lora)
    q = m.transformer_blocks[0].attn.to_q
    assert q.base_layer.weight.dtype == torch.float8_e4m3fn and not q.base_layer.weight.requires_grad
    from _offload_util import batch

    kw, target = batch(0)
    (m(**kw)[0] - target).square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora)
    assert q.base_layer.weight.grad is None


def test_peft_makes_the_lora_in_the_compute_dtype_not_fp8():
    m = tiny_flux(0, dtype=torch.bfloat16)
    quant.quantize_blocks(blocks_of(m), "fp8", False, flux_modulation())
    add_lora(m)
    q = m.transformer_blocks[0].attn.to_q
    assert q.lora_A["default"].weight.dtype == torch.bfloat16


@pytest.mark.parametrize("mode", ["fp8", "int8"])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_streamed_quantized_training_is_bitwise_resident(mode, fraction):
    from trainer.offload import attach_offload

    def run(frac):
        m = tiny_flux(0)
        quant.quantize_blocks(blocks_of(m), mode, False, flux_modulation())
        add_lora(m)
        h = attach_offload(blocks_of(m), "cpu", frac) if frac else None
        losses = train_steps(m, 3)
        st = h.stats() if h else None
        return losses, trainable_state(m), st, m

    ref_losses, ref_state, _, _ = run(0.0)
    losses, state, st, m = run(fraction)
    assert torch.equal(losses, ref_losses)
    assert ref_state.keys() == state.keys() and all(torch.equal(ref_state[k], state[k]) for k in state)
    assert st["ring_bytes"] < st["block_bytes"]
    # the packed block bytes are the quantized ones: 1 byte per quantized weight element
    q = m.transformer_blocks[0].attn.to_q.base_layer
    assert q.weight.dtype == quant._DTYPES[mode] and q.weight.element_size() == 1


def test_packed_blocks_are_smaller_when_quantized():
    from trainer.offload.allocators import ALIGN, BlockPacking

    m = tiny_flux(0, dtype=torch.bfloat16).requires_grad_(False)
    before = sum(BlockPacking.of(b, False).nbytes for b in blocks_of(m))
    quant.quantize_blocks(blocks_of(m), "fp8", False, flux_modulation())
    after = sum(BlockPacking.of(b, False).nbytes for b in blocks_of(m))
    qs = [x for x in m.modules() if isinstance(x, QuantizedLinear)]
    # each quantized weight: 2 bytes -> 1 byte per element, plus 4 bytes of scale per output channel
    expected = before - sum(x.weight.numel() for x in qs) + sum(4 * x.out_features for x in qs)
    assert abs(after - expected) <= ALIGN * len(qs), (before, after, expected)


def test_full_finetune_with_quantize_is_a_config_error():
    from pydantic import ValidationError

    from trainer.config import Config

    base = {"model": {"family": "flux", "path": "x", "quantize": "fp8"}, "train": {"method": "full"},
            "optimizer": {"fused_back_pass": True, "max_grad_norm": None}, "output": {"dir": "o"}}
    with pytest.raises(ValidationError, match="model.quantize: fp8 is for a frozen base"):
        Config.model_validate(base)
    base["train"]["method"] = "lora"
    assert Config.model_validate(base).model.quantize == "fp8"
    with pytest.raises(ValidationError):
        Config.model_validate({**base, "model": {**base["model"], "quantize": "fp4"}})


def _bfl_flux_rows(d=3072, mlp=12288, guidance=True):
    """Output rows of every tensor of an original-format (BFL) Flux file with one double and one single block."""
    rows = {"img_in.weight": d, "img_in.bias": d, "txt_in.weight": d, "txt_in.bias": d,
            "final_layer.linear.weight": 64, "final_layer.linear.bias": 64,
            "final_layer.adaLN_modulation.1.weight": 2 * d, "final_layer.adaLN_modulation.1.bias": 2 * d}
    for emb in ("time_in", "vector_in", *(("guidance_in",) if guidance else ())):
        for layer in ("in_layer", "out_layer"):
            rows[f"{emb}.{layer}.weight"] = rows[f"{emb}.{layer}.bias"] = d
    b = "double_blocks.0"
    for s in ("img", "txt"):
        for lin, n in (("mod.lin", 6 * d), ("attn.qkv", 3 * d), ("attn.proj", d), ("mlp.0", mlp), ("mlp.2", d)):
            rows[f"{b}.{s}_{lin}.weight"] = rows[f"{b}.{s}_{lin}.bias"] = n
        rows[f"{b}.{s}_attn.norm.query_norm.scale"] = rows[f"{b}.{s}_attn.norm.key_norm.scale"] = 128
    b = "single_blocks.0"
    for lin, n in (("linear1", 3 * d + mlp), ("linear2", d), ("modulation.lin", 3 * d)):
        rows[f"{b}.{lin}.weight"] = rows[f"{b}.{lin}.bias"] = n
    rows[f"{b}.norm.query_norm.scale"] = rows[f"{b}.norm.key_norm.scale"] = 128
    return rows


def test_scales_of_an_original_format_file_follow_diffusers_key_conversion():
    """A BFL-named scaled fp8 Flux file: each per-tensor scale lands on the diffusers modules its weight becomes,
    split like the weight (fused qkv -> to_q/to_k/to_v; linear1 -> to_q/k/v + proj_mlp) and reordered like it
    (the final layer's shift/scale swap). Only row counts are needed, so this runs at full Flux width."""
    from diffusers import FluxTransformer2DModel

    rows = _bfl_flux_rows()
    fp8 = {k for k in rows if k.endswith(".weight") and "_in." not in k and "final_layer" not in k}
    fp8.add("final_layer.adaLN_modulation.1.weight")
    per_tensor = {k[: -len(".weight")]: 0.001 * (i + 1) for i, k in enumerate(sorted(fp8))}
    got = quant.convert_scales(FluxTransformer2DModel, {}, rows, fp8, per_tensor)
    s = per_tensor
    assert torch.equal(got["transformer_blocks.0.attn.to_k"],
                       torch.full((3072,), s["double_blocks.0.img_attn.qkv"]))
    assert torch.equal(got["transformer_blocks.0.attn.add_v_proj"],
                       torch.full((3072,), s["double_blocks.0.txt_attn.qkv"]))
    assert torch.equal(got["transformer_blocks.0.ff_context.net.2"],
                       torch.full((3072,), s["double_blocks.0.txt_mlp.2"]))
    assert torch.equal(got["single_transformer_blocks.0.proj_mlp"],
                       torch.full((12288,), s["single_blocks.0.linear1"]))
    assert torch.equal(got["single_transformer_blocks.0.norm.linear"],
                       torch.full((9216,), s["single_blocks.0.modulation.lin"]))
    assert torch.equal(got["norm_out.linear"], torch.full((6144,), s["final_layer.adaLN_modulation.1"]))
    # tensors that were not fp8 get no scale at all (they are not touched)
    assert "x_embedder" not in got and "proj_out" not in got
    # double: 8 attention Linears, 2 modulation, ff 2 + ff_context 2; single: q k v, proj_mlp, proj_out, modulation;
    # norm_out
    assert len(got) == 14 + 6 + 1


def _quantized_names(m) -> set[str]:
    return {n for n, x in m.named_modules() if isinstance(x, QuantizedLinear)}


@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_modulation_switch_adds_exactly_the_modulation_linears(mode):
    """model.quantize_modulation: the blocks' `norm*.linear` join the quantized Linears; nothing else changes
    (norm weights, biases, embedders and the final layer's modulation keep the model dtype)."""
    base, mod = tiny_flux(0, dtype=torch.bfloat16), tiny_flux(0, dtype=torch.bfloat16)
    n0 = quant.quantize_blocks(blocks_of(base), mode, False, flux_modulation())
    n1 = quant.quantize_blocks(blocks_of(mod), mode, True, flux_modulation())
    added = _quantized_names(mod) - _quantized_names(base)
    assert _quantized_names(base) <= _quantized_names(mod)
    # 2 double blocks: norm1.linear and norm1_context.linear; 4 single blocks: norm.linear
    assert n1 - n0 == len(added) == 2 * 2 + 4
    assert all(quant.is_modulation(n.split(".", 2)[2], flux_modulation()) for n in added), added
    assert {n.rsplit(".", 1)[0].split(".", 2)[2] for n in added} == {"norm1", "norm1_context", "norm"}
    lin = mod.transformer_blocks[0].norm1.linear
    assert lin.weight.dtype == quant._DTYPES[mode] and lin.bias.dtype == torch.bfloat16
    assert type(mod.norm_out.linear) is nn.Linear and mod.norm_out.linear.weight.dtype == torch.bfloat16
    assert mod.transformer_blocks[0].attn.norm_q.weight.dtype == torch.bfloat16
    # modulation error acts on every token: the block output moves more, but stays within fp8 / int8 rounding
    from _offload_util import batch

    kw, _ = batch(0, dtype=torch.bfloat16)
    with torch.no_grad():
        a, b = base(**kw)[0].float(), mod(**kw)[0].float()
    assert 0 < (a - b).abs().max() / a.abs().max() < 0.1


def test_modulation_switch_on_qwen_image_blocks():
    from diffusers import QwenImageTransformer2DModel

    def tiny():
        torch.manual_seed(0)
        return QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                           attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                           axes_dims_rope=(4, 6, 6))

    base, mod = tiny(), tiny()
    pattern = adapter_class("qwen-image").modulation_linears
    quant.quantize_blocks(list(base.transformer_blocks), "fp8", False, pattern)
    quant.quantize_blocks(list(mod.transformer_blocks), "fp8", True, pattern)
    added = _quantized_names(mod) - _quantized_names(base)
    assert added == {f"transformer_blocks.{i}.{s}_mod.1" for i in range(2) for s in ("img", "txt")}
    assert not any("mod" in n for n in _quantized_names(base))


def test_quantize_modulation_needs_an_8_bit_base_when_set():
    from pydantic import ValidationError

    from trainer.config import ModelConfig

    with pytest.raises(ValidationError, match="quantize_modulation: true needs model.quantize: fp8 or int8"):
        ModelConfig(family="flux", path="x", quantize_modulation=True)
    assert ModelConfig(family="flux", path="x", quantize="fp8", quantize_modulation=True).quantize_modulation
    assert not ModelConfig(family="flux", path="x", quantize="fp8").quantize_modulation  # off by default
    # the default never refuses quantize: none, whatever it is (the coordinator may flip it)
    fields = dict(ModelConfig.model_fields)
    try:
        fields["quantize_modulation"].default = True
        ModelConfig.model_rebuild(force=True)
        m = ModelConfig(family="flux", path="x")
        assert m.quantize == "none" and m.quantize_modulation
    finally:
        fields["quantize_modulation"].default = False
        ModelConfig.model_rebuild(force=True)
