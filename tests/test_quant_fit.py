"""`model.quantize` end to end on the CPU: the loader quantizes the blocks, a tiny fit trains a LoRA that loads with
diffusers on the unquantized base, sampling works with a LoRA on an fp8 base, single-file fp8 checkpoints keep
their 8-bit values and scales, and the text encoders quantize on their own switch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_train_support import lora_predictions, losses, make_config, write_images

from trainer import quant
from trainer.errors import UserError
from trainer.models import adapter_class, get_adapter
from trainer.quant import QuantizedLinear


@pytest.fixture(scope="module")
def train_images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("quant-images"))


def _model_cfg(tiny_models, family="flux", **kw):
    from trainer.config import ModelConfig

    return ModelConfig(family=family, path=tiny_models / family, dtype="fp32", **kw)


@pytest.mark.parametrize("family", ["flux", "qwen-image-2.1", "krea2", "flux3"])
@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_loader_quantizes_block_linears_only(tiny_models, mode, family):
    cfg = _model_cfg(tiny_models, family, quantize=mode)
    a = get_adapter(cfg)
    tr = a.load(cfg, parts={"transformer"}, dtype=torch.float32).transformer
    qs = [m for m in tr.modules() if isinstance(m, QuantizedLinear)]
    in_blocks = {id(m) for b in a.blocks(tr) for m in b.modules()}
    assert qs and all(id(m) in in_blocks for m in qs)
    assert {m.weight.dtype for m in qs} == {quant._DTYPES[mode]}
    in_block_params = {id(p) for b in a.blocks(tr) for p in b.parameters()}
    outside = [p for p in tr.parameters() if id(p) not in in_block_params]
    assert outside and all(p.dtype == torch.float32 for p in outside) and tr.dtype == torch.float32


def test_fit_at_fp8_writes_a_lora_that_diffusers_loads_on_the_unquantized_base(tiny_models, train_images, tmp_path):
    from trainer.train.trainer import Trainer

    runs = {}
    for mode in ("none", "fp8"):
        cfg = make_config(tiny_models, train_images, tmp_path / mode, tmp_path / "cache", "flux",
                          model={"quantize": mode}, train={"steps": 4}, optimizer={"lr": 1e-2})
        t = Trainer(cfg)
        runs[mode] = (t, t.fit(), cfg)
    t, path, cfg = runs["fp8"]
    assert all(math.isfinite(x) for x in losses(tmp_path / "fp8"))
    q = t.transformer.transformer_blocks[0].attn.to_q
    assert q.base_layer.weight.dtype == torch.float8_e4m3fn and q.lora_A["default"].weight.dtype == torch.float32
    from safetensors.torch import load_file

    ours, plain = load_file(str(path)), load_file(str(runs["none"][1]))
    assert ours.keys() == plain.keys() and all(v.dtype == torch.float32 for v in ours.values())
    assert not any("scale" in k for k in ours)

    mine, theirs, untrained = lora_predictions(t, path)
    # The LoRA moves the bf16/fp32 base's output; on the fp8 base the same LoRA agrees up to fp8 weight rounding.
    lora_effect = (theirs - untrained).abs().max()
    assert lora_effect > 1e-3
    assert (mine - theirs).abs().max() / theirs.abs().max() < 0.1


def test_sampling_on_an_fp8_base_with_a_lora(tiny_models, tmp_path):
    from test_sample import PROMPT, _lora_transformer, _save_lora
    from test_train_support import pixels

    from trainer.config import Config
    from trainer.sample import SampleRequest, run_sample

    def cfg(mode):
        return Config.model_validate({
            "model": {"family": "flux", "path": str(tiny_models / "flux"), "dtype": "fp32", "quantize": mode},
            "sample": {"steps": 2, "width": 32, "height": 32}, "train": {"device": "cpu"},
            "output": {"dir": str(tmp_path)},
        })

    lora = _save_lora(_lora_transformer(cfg("none")), tmp_path / "lora.safetensors")
    imgs = {}
    for mode, off in (("none", 0.0), ("fp8", 0.0), ("fp8", 1.0)):
        out = run_sample(cfg(mode), SampleRequest(prompts=[PROMPT], loras=[str(lora)], seed=1, offload=off,
                                                  out=tmp_path / f"{mode}-{off}"))
        imgs[mode, off] = pixels(out[0]).astype(np.int16)
    np.testing.assert_array_equal(imgs["fp8", 0.0], imgs["fp8", 1.0])  # streamed fp8 == resident fp8
    # noise images of a random model: fp8 rounding moves pixels a little, not wholesale
    assert np.abs(imgs["fp8", 0.0] - imgs["none", 0.0]).mean() < 20


def _fp8_file(tiny_models, path, scaled: bool):
    """The tiny Flux as a single diffusers-named file with every 2-D weight in float8_e4m3fn, as users' fp8 files
    have them; with `scaled`, per-tensor `scale_weight` keys (weight = fp8 * scale)."""
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    sd = FluxTransformer2DModel.from_pretrained(str(tiny_models / "flux"), subfolder="transformer").state_dict()
    out, truth = {}, {}
    for k, v in sd.items():
        if v.ndim == 2 and k.endswith(".weight"):
            s = (v.abs().max() / 448.0) if scaled else torch.tensor(1.0)
            w8 = (v / s).to(torch.float8_e4m3fn)
            out[k] = w8
            if scaled:
                out[k[: -len("weight")] + "scale_weight"] = s.reshape(1).float()
            truth[k] = (w8, float(s))
        else:
            out[k] = v
    save_file(out, str(path))
    return truth


@pytest.mark.parametrize("scaled", [False, True])
def test_fp8_single_file_is_kept_as_its_own_8_bit_values(tiny_models, tmp_path, scaled):
    f = tmp_path / "flux-fp8.safetensors"
    truth = _fp8_file(tiny_models, f, scaled)
    assert quant.is_fp8_file(f)
    cfg = _model_cfg(tiny_models, quantize="fp8", transformer_file=f)
    tr = get_adapter(cfg).load(cfg, parts={"transformer"}, dtype=torch.float32).transformer
    mods = dict(tr.named_modules())
    n_kept = 0
    for k, (w8, s) in truth.items():
        m = mods[k[: -len(".weight")]]
        if isinstance(m, QuantizedLinear):
            # the file's bytes, not a re-quantization of them
            assert torch.equal(m.weight.view(torch.uint8), w8.view(torch.uint8)), k
            assert torch.equal(m.weight_scale, torch.full((m.out_features,), s)), k
            n_kept += 1
        else:  # outside the blocks: model dtype, scale applied
            assert torch.equal(m.weight, w8.float() * s), k
    assert n_kept == 2 * 12 + 2 * 5 + 2 * 2 + 2  # the tiny Flux's block Linears, modulation included

    plain = _model_cfg(tiny_models, quantize="none", transformer_file=f)
    tr0 = get_adapter(plain).load(plain, parts={"transformer"}, dtype=torch.float32).transformer
    assert not any(isinstance(m, QuantizedLinear) for m in tr0.modules())
    sd0 = tr0.state_dict()
    assert all(torch.equal(sd0[k], w8.float() * s) for k, (w8, s) in truth.items())

    with pytest.raises(UserError, match="float8 weights: use model.quantize: fp8"):
        bad = _model_cfg(tiny_models, quantize="int8", transformer_file=f)
        get_adapter(bad).load(bad, parts={"transformer"}, dtype=torch.float32)


def test_text_encoders_quantize_on_their_own_switch(tiny_models):
    base = _model_cfg(tiny_models)
    qcfg = _model_cfg(tiny_models, quantize_text_encoders="fp8")
    a = get_adapter(base)
    plain = a.load(base, parts={"text"}, dtype=torch.float32)
    qd = a.load(qcfg, parts={"text"}, dtype=torch.float32)
    assert not any(isinstance(m, QuantizedLinear) for e in plain.text_encoders for m in e.modules())
    for e in qd.text_encoders:
        assert any(isinstance(m, QuantizedLinear) for m in e.modules())
    prompts = ["a red square on a blue background", "a cat"]
    want = a.encode_prompts(plain, prompts)
    got = a.encode_prompts(qd, prompts)
    for k in want:
        rel = (got[k] - want[k]).abs().max() / want[k].abs().max()
        assert 0 < rel < 0.1, (k, rel)


@pytest.mark.parametrize("modulation", [False, True])
def test_fp8_file_with_full_precision_modulation(tiny_models, tmp_path, modulation):
    """An fp8 file whose blocks' modulation weights are not fp8 values (kept in higher precision, as some files
    do): they keep the model dtype unless model.quantize_modulation, then they are quantized per channel like a
    folder's; the file's fp8 weights are adopted as they are either way."""
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    sd = FluxTransformer2DModel.from_pretrained(str(tiny_models / "flux"), subfolder="transformer").state_dict()
    mod_keys = {k for k, v in sd.items() if k.endswith(".weight") and v.ndim == 2 and "transformer_blocks." in k
                and quant.is_modulation(k[: -len(".weight")], adapter_class("flux").modulation_linears)}
    assert len(mod_keys) == 2 * 2 + 2
    out = {k: v.to(torch.float8_e4m3fn) if v.ndim == 2 and k.endswith(".weight") and k not in mod_keys else v
           for k, v in sd.items()}
    f = tmp_path / "flux-fp8.safetensors"
    save_file(out, str(f))
    cfg = _model_cfg(tiny_models, quantize="fp8", transformer_file=f, quantize_modulation=modulation)
    tr = get_adapter(cfg).load(cfg, parts={"transformer"}, dtype=torch.float32).transformer
    mods = dict(tr.named_modules())
    for k in mod_keys:
        m = mods[k[: -len(".weight")]]
        if modulation:
            q, s = quant.quantize(sd[k], "fp8")
            assert isinstance(m, QuantizedLinear) and torch.equal(m.weight.view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(m.weight_scale, s)
        else:
            assert type(m) is torch.nn.Linear and torch.equal(m.weight, sd[k])
    q = mods["transformer_blocks.0.attn.to_q"]
    assert torch.equal(q.weight.view(torch.uint8), out["transformer_blocks.0.attn.to_q.weight"].view(torch.uint8))
    assert torch.equal(q.weight_scale, torch.ones(q.out_features))


def test_fit_at_fp8_with_quantized_modulation(tiny_models, train_images, tmp_path):
    from trainer.train.trainer import Trainer

    cfg = make_config(tiny_models, train_images, tmp_path / "run", tmp_path / "cache", "flux",
                      model={"quantize": "fp8", "quantize_modulation": True}, train={"steps": 2})
    t = Trainer(cfg)
    t.fit()
    assert all(math.isfinite(x) for x in losses(tmp_path / "run"))
    blk = t.transformer.transformer_blocks[0]
    assert blk.norm1.linear.weight.dtype == torch.float8_e4m3fn
    assert t.transformer.norm_out.linear.weight.dtype != torch.float8_e4m3fn  # outside the blocks: model dtype
