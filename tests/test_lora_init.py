"""lora.init_from: training starts from an existing LoRA in any layout, with the file's rank, alpha and kind; the
saved files follow output.lora_format; a file that does not fit stops with one line naming it."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from test_lora_format import ALPHA, RANK, adapted, bare_pipeline, base_model, save_checkpoint_file
from test_train_support import make_config, write_images

from trainer import lora_format as lfm
from trainer.config import Config
from trainer.errors import UserError
from trainer.train import checkpoint as ck
from trainer.train.method import LoraMethod


def _predict(adapter, transformer, seed=0):
    inputs = adapter.dummy_inputs(transformer, 1, 32, 32, 8, torch.float32, device="cpu")
    g = torch.Generator().manual_seed(seed)
    for k, v in inputs.items():
        if torch.is_tensor(v) and v.is_floating_point() and k not in ("img_ids", "txt_ids"):
            inputs[k] = torch.randn(v.shape, generator=g)
    with torch.no_grad():
        return transformer(**inputs, return_dict=False)[0]


def _init_method(cfg, path, **lora):
    cfg = Config.model_validate({**cfg.model_dump(mode="json"), "lora": {"init_from": str(path), **lora}})
    return LoraMethod(cfg)


@pytest.mark.parametrize(("family", "kind"), [("flux", "lora"), ("sd3", "lora"), ("qwen-image", "lokr")])
@pytest.mark.parametrize("fmt", ["diffusers", "comfy", "kohya"])
def test_init_from_any_layout_predicts_as_the_loaded_lora(tiny_models, tmp_path, family, kind, fmt):
    """A LoRA saved by dittrain, in each layout, put in by lora.init_from: the transformer predicts what the
    diffusers file loaded into the pipeline predicts; rank and alpha are the file's, not the config's."""
    from trainer.sampling.lora import load_peft_file

    t, adapter, cfg = adapted(tiny_models, family, kind)
    src = save_checkpoint_file(t, cfg, tmp_path / "ck.safetensors")
    lfm.convert_lora(src, tmp_path / "diffusers.safetensors", "diffusers")
    if fmt != "diffusers":  # (convert-lora refuses to write over a file)
        lfm.convert_lora(src, tmp_path / f"{fmt}.safetensors", fmt)

    reference = base_model(adapter, cfg)
    if kind == "lora":
        bare_pipeline(adapter, reference).load_lora_weights(str(tmp_path / "diffusers.safetensors"), adapter_name="x")
    else:
        load_peft_file(reference, tmp_path / "diffusers.safetensors", "lora0")
    method = _init_method(cfg, tmp_path / f"{fmt}.safetensors", rank=16, alpha=16, type="lora")
    started = base_model(adapter, cfg)
    params = method.trainable_params(started, adapter)
    assert params and all(p.requires_grad and p.dtype == torch.float32 for p in params)
    assert (method.lora.rank, method.lora.alpha, method.lora.type) == (RANK, pytest.approx(ALPHA), kind)
    torch.testing.assert_close(_predict(adapter, started), _predict(adapter, reference), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(_predict(adapter, started), _predict(adapter, base_model(adapter, cfg)), atol=1e-4)


def test_init_from_a_file_that_does_not_fit_is_one_line(tiny_models, tmp_path):
    t, adapter, cfg = adapted(tiny_models, "flux", "lora")
    flux_lora = save_checkpoint_file(t, cfg, tmp_path / "flux.safetensors")
    _, sd3_adapter, sd3_cfg = adapted(tiny_models, "sd3", "lora")
    with pytest.raises(UserError, match=r"lora.init_from .*flux.safetensors: single_transformer_blocks\.0\..* is not "
                                        r"a layer of this sd3 model") as e:
        _init_method(sd3_cfg, flux_lora).trainable_params(base_model(sd3_adapter, sd3_cfg), sd3_adapter)
    assert "\n" not in str(e.value)

    # The same module names with other widths (a LoRA for a bigger model of the family).
    sd = {k: torch.cat([v, v], dim=-1) if k.endswith("lora_A.weight") else v for k, v in load_file(str(flux_lora)).items()}
    wide = tmp_path / "wide.safetensors"
    lfm.write_lora_file(wide, lfm.lora_file_from(sd, lfm.lora_metadata(flux_lora)), "diffusers", "flux")
    with pytest.raises(UserError, match=r"wide.safetensors: .*lora_A.weight has shape \[4, 64\] in the file, this model "
                                        r"needs \[4, 32\]"):
        _init_method(cfg, wide).trainable_params(base_model(adapter, cfg), adapter)

    # Two ranks in one file.
    lf = lfm.read_lora_file(flux_lora)
    name = next(iter(lf.modules))
    m = lf.modules[name]
    lf.modules[name] = lfm.Module("lora", {"down": m.t["down"][:2], "up": m.t["up"][:, :2]}, m.scale)
    mixed = tmp_path / "mixed.safetensors"
    lfm.write_lora_file(mixed, lf, "comfy", "flux")
    with pytest.raises(UserError, match=r"mixed.safetensors: its modules have ranks"):
        _init_method(cfg, mixed).trainable_params(base_model(adapter, cfg), adapter)
    with pytest.raises(UserError, match="not found"):
        _init_method(cfg, tmp_path / "none.safetensors").trainable_params(base_model(adapter, cfg), adapter)


def test_fit_from_init_writes_the_chosen_layout(tiny_models, tmp_path):
    """A 1-step fit from a comfy file with output.lora_format: kohya writes kohya files (final and per step) with
    `.alpha` tensors and the file's alpha; a LoKr config with comfy output on Flux (fused q/k/v) stops before
    training."""
    from trainer.train.trainer import Trainer

    t, _, cfg = adapted(tiny_models, "flux", "lora")
    src = save_checkpoint_file(t, cfg, tmp_path / "ck.safetensors")
    lfm.convert_lora(src, tmp_path / "start.safetensors", "comfy")
    images = write_images(tmp_path / "images")
    run = make_config(tiny_models, images, tmp_path / "run", tmp_path / "cache", "flux", train={"steps": 2},
                      lora={"init_from": str(tmp_path / "start.safetensors")},
                      output={"lora_format": "kohya", "save_every": 1})
    Trainer(run).fit()
    for f in (tmp_path / "run" / "lora.safetensors", tmp_path / "run" / "lora-step-000001.safetensors"):
        sd, meta = load_file(str(f)), lfm.lora_metadata(f)
        assert meta[lfm.META_FORMAT] == "kohya" and float(meta["dittrain.alpha"]) == pytest.approx(ALPHA)
        assert all(k.startswith("lora_unet_") for k in sd) and any(k.endswith(".alpha") for k in sd)
    checkpoint = next((tmp_path / "run" / "checkpoints").glob("step-*"))
    assert lfm.file_format(checkpoint / ck.ADAPTER_STATE) == "diffusers"
    assert not (checkpoint / "lora.safetensors").exists()  # not a LoRA to load (ComfyUI: alpha = rank)

    with pytest.raises(ValidationError, match="cannot be written as one fused LoKr"):  # before anything loads
        make_config(tiny_models, images, tmp_path / "bad", tmp_path / "cache", "flux", train={"steps": 1},
                    lora={"type": "lokr"}, output={"lora_format": "comfy"})
