"""What ComfyUI makes of the LoRA files dittrain writes, beyond the plain update (tests/test_lora_format.py): DoRA's
dora_scale in the comfy / kohya layouts, the family's advice on ComfyUI, the checkpoint's adapter file, and a LoKr the
layout cannot hold refused when the config is read."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from test_lora_format import adapted, save_checkpoint_file

from trainer import lora_format as lfm
from trainer.config import Config
from trainer.errors import UserError
from trainer.models import adapter_class, adapter_classes
from trainer.train import checkpoint as ck


def comfyui_weight_decompose(dora_scale, weight, lora_diff, alpha, strength=1.0):
    """RE-IMPLEMENTED HERE from ComfyUI's published definition (comfy/weight_adapter/base.py `weight_decompose`, after
    its PR #7727), not imported or copied: a dora_scale whose first axis matches the weight's outputs scales each
    output row, divided by the row norm of the *base* weight plus float eps; the result replaces the weight at
    strength 1, else weight + strength * (result - weight). (ComfyUI 0.3.64's and 0.19.3's own loaders, run outside
    this suite on such files, agreed with peft within 1.2e-7: docs/lora-files.md, "Checked with ComfyUI".)"""
    weight_calc = weight + alpha * lora_diff
    if dora_scale.shape[0] == weight_calc.shape[0]:
        norm = weight.reshape(weight.shape[0], -1).norm(dim=1, keepdim=True)
    else:
        norm = weight_calc.transpose(0, 1).reshape(weight_calc.shape[1], -1).norm(dim=1, keepdim=True).transpose(0, 1)
    weight_calc = weight_calc * (dora_scale / (norm + torch.finfo(weight.dtype).eps))
    return weight_calc if strength == 1.0 else weight + strength * (weight_calc - weight)


def peft_merged(t) -> dict[str, torch.Tensor]:
    """peft's own merge of every adapted module (DoRA: m * (W + dW) / ||W + dW||_row), by diffusers module name."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    out = {}
    for n, m in t.named_modules():
        if isinstance(m, BaseTunerLayer):
            m.merge(safe_merge=True)
            out[n] = m.get_base_layer().weight.detach().float().clone()
    return out


# one family per kind of fused layer the dora_scale rows are stacked into: Flux's q/k/v and linear1, SD3.5's joint
# q/k/v, Z-Image's q/k/v, Qwen-Image 2.1's gate / up, HunyuanVideo 1.5's q/k/v of its blocks and its text refiner;
# and Qwen-Image, which fuses nothing
@pytest.mark.parametrize(("family", "fmt"), [("flux", "comfy"), ("flux", "kohya"), ("qwen-image", "comfy"),
                                             ("sd3", "comfy"), ("z-image", "kohya"), ("qwen-image-2.1", "comfy"),
                                             ("hunyuan-video-1.5", "kohya")])
def test_dora_in_the_original_layout_merges_in_comfyui_as_peft(tiny_models, tmp_path, family, fmt):
    """A DoRA written in the comfy / kohya layout (dora_scale from the model files' base weights), merged the way
    ComfyUI merges it, gives peft's merged weight, fused q/k/v (Flux) included, within 1e-5."""
    t, _, cfg = adapted(tiny_models, family, "dora")
    src = save_checkpoint_file(t, cfg, tmp_path / "dora.safetensors")
    base = ck.base_weights(cfg.model)
    out = tmp_path / f"dora-{fmt}.safetensors"
    lf = lfm.convert_lora(src, out, fmt, family, base=base)
    assert lf.dora
    want = peft_merged(t)
    sd = {k: v.float() for k, v in load_file(str(out)).items()}
    kmap = adapter_class(family).lora_key_map
    prefix = "diffusion_model." if fmt == "comfy" else "lora_unet_"
    layers = {k.rsplit(".", 2 if k.endswith(".weight") else 1)[0] for k in sd}
    assert layers and all(f"{x}.dora_scale" in sd for x in layers)
    for x in layers:
        original = x.removeprefix(prefix) if fmt == "comfy" else kmap.from_kohya(x.removeprefix(prefix))
        _, names = kmap.parts(original)
        w = torch.cat([base(n) for n in names])
        scale = sd[f"{x}.dora_scale"]
        assert scale.shape == (w.shape[0], 1)
        up, down = sd[f"{x}.lora_up.weight"], sd[f"{x}.lora_down.weight"]
        merged = comfyui_weight_decompose(scale, w, up @ down, sd[f"{x}.alpha"].item() / down.shape[0])
        expected = torch.cat([want[n] if n in want else base(n) for n in names])
        ratio = merged.norm(dim=1) / expected.norm(dim=1)
        torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-5)
        torch.testing.assert_close(merged, expected, rtol=1e-5, atol=1e-5)


def test_convert_lora_dora_needs_the_model(tiny_models, tmp_path):
    """convert-lora refuses a DoRA to comfy / kohya without --model (one line saying why) and writes it with it."""
    from typer.testing import CliRunner

    from trainer.cli import app

    t, _, cfg = adapted(tiny_models, "flux", "dora")
    src = save_checkpoint_file(t, cfg, tmp_path / "dora.safetensors")
    with pytest.raises(UserError, match="needs the base model's weights.*--model PATH"):
        lfm.convert_lora(src, tmp_path / "x.safetensors", "comfy")
    res = CliRunner().invoke(app, ["convert-lora", str(src), str(tmp_path / "k.safetensors"), "--to", "kohya"])
    assert res.exit_code != 0 and "--model PATH" in res.output
    res = CliRunner().invoke(app, ["convert-lora", str(src), str(tmp_path / "k.safetensors"), "--to", "kohya",
                                   "--model", str(tiny_models / "flux")])
    assert res.exit_code == 0, res.output
    assert any(k.endswith(".dora_scale") for k in load_file(str(tmp_path / "k.safetensors")))
    with pytest.raises(UserError, match="dora_scale.*diffusers-layout file"):  # not read back without the base
        lfm.read_lora_file(tmp_path / "k.safetensors")


def test_dora_config_is_accepted_in_every_layout(tiny_models):
    for fmt in lfm.FORMATS:
        Config.model_validate({"model": {"family": "flux", "path": str(tiny_models / "flux")}, "output": {
            "dir": "unused", "lora_format": fmt}, "lora": {"dora": True}})


def _config(tiny_models, family, fmt, **lora):
    return Config.model_validate({"model": {"family": family, "path": str(tiny_models / family)},
                                  "output": {"dir": "unused", "lora_format": fmt}, "lora": lora})


def test_lokr_the_layout_cannot_hold_is_refused_by_the_config(tiny_models):
    """A LoKr on a fused layer's part is refused when the config is read (before caching or loading); one that
    adapts no fused layer, the diffusers layout, and LoRA / LoHa pass."""
    for fmt in ("comfy", "kohya"):
        with pytest.raises(ValidationError, match="cannot be written as one fused LoKr.*output.lora_format: diffusers"):
            _config(tiny_models, "flux", fmt, type="lokr")
        with pytest.raises(ValidationError, match="fused LoKr"):
            _config(tiny_models, "flux", fmt, type="lokr", targets=["attn.to_k"])
        _config(tiny_models, "flux", fmt, type="lokr", targets=["to_out.0", "ff.net.2"])
        _config(tiny_models, "flux", fmt, type="loha")
    _config(tiny_models, "flux", "diffusers", type="lokr")
    assert lfm.check_targets(["to_q"], "lokr", "comfy", "flux")
    assert lfm.check_targets(["transformer_blocks.3.attn.to_q"], "lokr", "comfy", "flux")
    assert not lfm.check_targets(["to_qq"], "lokr", "comfy", "flux")


def test_comfyui_advice_is_the_familys_data():
    """The end of a fit and the LoKr refusal say what ComfyUI does per family, from the adapter's attributes: the
    families ComfyUI maps only in recent releases name the release, the others say to convert."""
    for cls in adapter_classes():
        note = cls.comfy_diffusers_lora_note()
        assert cls.family in note
        if cls.comfy_diffusers_lora_since:
            assert cls.comfy_reads_diffusers_lora and cls.comfy_diffusers_lora_since in note and "older" in note
        elif not cls.comfy_reads_diffusers_lora:
            assert "does not map" in note and "convert-lora" in note
    for family in ("flux2", "flux2-klein", "krea2", "qwen-image-2.1"):
        assert adapter_class(family).comfy_diffusers_lora_since, family
    hint = ck.lycoris_loading_hint("out/lora.safetensors", "lokr", "diffusers", adapter_class("flux2").comfy_diffusers_lora_note())
    assert "load_lora_weights does not take" in hint and "dittrain sample" in hint and "since" in hint
    assert "ComfyUI's LoRA loader" in ck.lycoris_loading_hint("x.safetensors", "loha", "kohya", "")


def test_checkpoint_adapter_is_not_named_as_a_lora(tmp_path):
    """The checkpoint's peft-layout file (alpha only in the header: ComfyUI would load it at alpha = rank) is named
    adapter-state; a checkpoint written before keeps resuming from its lora.safetensors."""
    new = tmp_path / "new"
    new.mkdir()
    assert ck.checkpoint_adapter(new) == new / ck.ADAPTER_STATE
    assert "lora" not in ck.ADAPTER_STATE
    old = tmp_path / "old"
    old.mkdir()
    (old / "lora.safetensors").write_bytes(b"")
    assert ck.checkpoint_adapter(old) == old / "lora.safetensors"


def test_fit_writes_dora_for_comfyui_from_the_model_files(tiny_models, tmp_path):
    """A DoRA fit with output.lora_format: comfy and streamed blocks (their base weights are placeholders between
    steps) writes dora_scale from the model's files: the same file convert-lora --model writes from the checkpoint."""
    from test_train_support import make_config, write_images

    from trainer.train.trainer import Trainer

    cfg = make_config(tiny_models, write_images(tmp_path / "images"), tmp_path / "run", tmp_path / "cache", "flux",
                      train={"steps": 1}, lora={"dora": True}, output={"lora_format": "comfy"},
                      offload={"transformer": 0.5})
    Trainer(cfg).fit()
    got = load_file(str(tmp_path / "run" / "lora.safetensors"))
    assert any(k.endswith(".dora_scale") for k in got)
    checkpoint = next((tmp_path / "run" / "checkpoints").glob("step-*"))
    lfm.convert_lora(ck.checkpoint_adapter(checkpoint), tmp_path / "c.safetensors", "comfy", base=ck.base_weights(cfg.model))
    want = load_file(str(tmp_path / "c.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_fused_lokr_refusal_never_advises_a_layout_comfyui_cannot_take():
    """For a family whose diffusers keys ComfyUI maps, the refusal says so; else it does not send the user to
    convert-lora --to comfy, which refuses the same LoKr."""
    for cls in adapter_classes():
        kmap = cls.lora_key_map
        rule = next((r for r in (kmap.rules if kmap else ()) if r.fused), None)
        if rule is None:
            continue
        msg = lfm.check_targets([rule.parts[0].rsplit(".", 1)[-1]], "lokr", "kohya", cls.family)
        assert msg and "fused LoKr" in msg
        assert ("convert-lora" not in msg) or cls.comfy_diffusers_lora_since, (cls.family, msg)
