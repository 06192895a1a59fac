"""Streamed loading from a single-file transformer (`model.transformer_file`, trainer/models/stream_load.py): every
tensor the conductor sees is bitwise what the whole-file path (from_single_file + quant.prepare_transformer)
gives, for bf16 and fp8 (unscaled / per-tensor `scale_weight`) files in diffusers layout, with or without a key
prefix; files in the original checkpoint layout load whole, and `loads_whole` / the planner agree."""

from __future__ import annotations

import pytest
import torch
from _offload_util import add_lora
from test_stream_load import _same_state

from trainer.config import ModelConfig
from trainer.errors import UserError
from trainer.models import get_adapter, stream_load
from trainer.offload import attach_offload
from trainer.quant import QuantizedLinear


def _write(tiny_models, family: str, path, kind: str, prefix: str = "") -> None:
    """The tiny `family` transformer as one file: bf16, or fp8 like users' files (every 2-D weight in
    float8_e4m3fn, `fp8-scaled`: with a per-tensor `scale_weight` each; one block weight left bf16 but made of fp8
    values, which adopt_fp8 adopts too)."""
    from safetensors.torch import save_file

    ad = get_adapter(ModelConfig(family=family, path=tiny_models / family))
    sd = ad.transformer_cls.from_pretrained(str(tiny_models / family), subfolder="transformer").state_dict()
    out, exact_left = {}, False
    for k, v in sd.items():
        if kind != "bf16" and v.ndim == 2 and k.endswith(".weight"):
            s = v.abs().max() / 448.0 * (1.5 if "proj_out" in k else 1.0) if kind == "fp8-scaled" else torch.tensor(1.0)
            w8 = (v / s).to(torch.float8_e4m3fn)
            if not exact_left and "blocks.0." in k and k.endswith("to_q.weight"):
                out[prefix + k] = w8.to(torch.bfloat16)  # fp8 values in a bf16 tensor, no scale
                exact_left = True
                continue
            out[prefix + k] = w8
            if kind == "fp8-scaled":
                out[prefix + k[: -len("weight")] + "scale_weight"] = s.reshape(1).float()
        else:
            out[prefix + k] = v.to(torch.bfloat16).contiguous()
    save_file(out, str(path))


def _cfg(tiny_models, family, f, quantize="none") -> ModelConfig:
    return ModelConfig(family=family, path=tiny_models / family, transformer_file=f, quantize=quantize, dtype="bf16")


CASES = [("flux", "bf16", "none"), ("flux", "bf16", "int8"), ("flux", "fp8", "fp8"), ("flux", "fp8", "none"),
         ("flux", "fp8-scaled", "fp8"), ("flux", "fp8-scaled", "none"), ("sd3", "fp8-scaled", "fp8"),
         ("qwen-image", "fp8-scaled", "fp8"), ("qwen-image", "bf16", "fp8"), ("flux2", "fp8", "fp8")]


@pytest.mark.parametrize(("family", "kind", "quantize"), CASES)
def test_streamed_single_file_equals_the_whole_file_path_bitwise(family, kind, quantize, tiny_models, tmp_path):
    f = tmp_path / "t.safetensors"
    _write(tiny_models, family, f, kind)
    mc = _cfg(tiny_models, family, f, quantize)
    assert stream_load.supported(mc) and stream_load.file_prefix(mc) == "" and stream_load.whole_file_note(mc) is None
    ad = get_adapter(mc)
    ref = ad.load(mc, parts={"transformer"}, dtype=torch.bfloat16).transformer
    if kind != "bf16" and quantize == "fp8":  # the file's own 8-bit values were adopted, modulation included
        assert sum(isinstance(m, QuantizedLinear) for m in ref.modules()) > 0
    torch.manual_seed(0)
    add_lora(ref)
    tr, loader = stream_load.load(ad, mc, torch.bfloat16, torch.device("cpu"), stream_blocks=True)
    torch.manual_seed(0)
    add_lora(tr)
    h = attach_offload(ad.blocks(tr), "cpu", 1.0, fill=loader.fill)
    assert h.plan.streamed or len(ad.blocks(tr)) == 2  # the tiny Qwen-Image: both blocks sit in the ring
    h.close()
    _same_state(ref, tr)
    assert {type(m) for m in ref.modules()} == {type(m) for m in tr.modules()}


def test_a_prefixed_fp8_file_streams_like_the_unprefixed_one(tiny_models, tmp_path):
    """diffusers' from_single_file cannot read diffusers keys under a prefix at all; the streamed path strips it."""
    plain, pre = tmp_path / "plain.safetensors", tmp_path / "prefixed.safetensors"
    _write(tiny_models, "flux", plain, "fp8-scaled")
    _write(tiny_models, "flux", pre, "fp8-scaled", prefix="model.diffusion_model.")
    mc, mp = _cfg(tiny_models, "flux", plain, "fp8"), _cfg(tiny_models, "flux", pre, "fp8")
    assert stream_load.file_prefix(mp) == "model.diffusion_model."
    ad = get_adapter(mc)
    ref = ad.load(mc, parts={"transformer"}, dtype=torch.bfloat16).transformer
    tr, _ = stream_load.load(ad, mp, torch.bfloat16, torch.device("cpu"), stream_blocks=False)
    _same_state(ref, tr)


def test_an_fp8_file_refuses_int8_before_reading_weights(tiny_models, tmp_path):
    f = tmp_path / "t.safetensors"
    _write(tiny_models, "flux", f, "fp8")
    mc = _cfg(tiny_models, "flux", f, "int8")
    with pytest.raises(UserError, match="float8 weights: use model.quantize: fp8"):
        stream_load.load(get_adapter(mc), mc, torch.bfloat16, torch.device("cpu"), stream_blocks=True)


def test_an_original_layout_file_loads_whole_and_says_so(tiny_models, tmp_path):
    """Keys diffusers must convert (here the tiny Flux renamed into BFL names; its converter is not run): not
    streamable, one line says why, and loads_whole (the trainer's and the planner's rule) is True; a
    diffusers-layout file is False."""
    from safetensors.torch import save_file

    from trainer.config import Config

    good = tmp_path / "good.safetensors"
    _write(tiny_models, "flux", good, "bf16")
    bfl = tmp_path / "bfl.safetensors"
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(4, 4), "img_in.weight": torch.zeros(4, 4)},
              str(bfl))
    base = Config.model_validate({"model": {"family": "flux", "path": str(tiny_models / "flux")},
                                  "data": {"sources": [{"path": str(tmp_path)}]},
                                  "output": {"dir": str(tmp_path / "out")}})
    for f, whole in ((good, False), (bfl, True)):
        cfg = base.model_copy(update={"model": base.model.model_copy(update={"transformer_file": f})})
        assert stream_load.supported(cfg.model) is not whole
        assert stream_load.loads_whole(cfg) is whole
        note = stream_load.whole_file_note(cfg.model)
        assert (note is not None and "loads whole into RAM" in note and str(bfl) in note) is whole
    missing = _cfg(tiny_models, "flux", tmp_path / "nope.safetensors")
    assert not stream_load.supported(missing)  # the old path reports the missing file


@pytest.mark.slow
def test_fit_streams_an_fp8_single_file_and_trains_like_the_whole_file_path(tiny_models, tmp_path, monkeypatch):
    """`dittrain fit` (Trainer.fit) at offload 0.5 on an fp8 single file with quantize fp8: built from the file
    (stream_load.load), the same losses as the whole-file path (`supported` patched off, as before this change)."""
    from test_train_support import losses, make_config, write_images

    from trainer.train.trainer import Trainer

    f = tmp_path / "t.safetensors"
    _write(tiny_models, "flux", f, "fp8-scaled")
    images = write_images(tmp_path / "images")
    monkeypatch.setattr(Trainer, "_can_stream", lambda self: True)
    seen, real = [], stream_load.load
    monkeypatch.setattr(stream_load, "load", lambda *a, **k: seen.append(a[-1]) or real(*a, **k))

    def fit(name):
        cfg = make_config(tiny_models, images, tmp_path / name, tmp_path / "cache", "flux", train={"steps": 2},
                          offload={"transformer": 0.5})
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(
            update={"transformer_file": f, "quantize": "fp8", "dtype": "bf16"})})
        Trainer(cfg).fit()
        return losses(tmp_path / name)

    streamed = fit("streamed")
    assert seen == [True]
    monkeypatch.setattr(stream_load, "supported", lambda cfg: False)
    whole = fit("whole")
    assert seen == [True]  # the second run loaded whole
    assert len(streamed) == 2 and streamed == whole
