"""`dittrain merge`: LoRAs baked into the transformer give the outputs of base + LoRAs loaded by diffusers; the output
keeps the base's shard layout; a LoRA for another model is refused before anything is written."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_train_support import make_config
from typer.testing import CliRunner

from trainer.cli import app
from trainer.errors import UserError
from trainer.merge import INDEX, merge_loras
from trainer.models import get_adapter
from trainer.sampling.request import LoraSpec
from trainer.train import checkpoint as ck
from trainer.train.model import add_lora


def _lora(tiny_models, tmp_path, family, name, rank, alpha, seed):
    """A LoRA file as `fit` writes it, with random (non-zero) B."""
    cfg = make_config(tiny_models, tmp_path, tmp_path / "o", tmp_path / "c", family, lora={"rank": rank, "alpha": alpha})
    adapter = get_adapter(cfg.model)
    tr = adapter.load(cfg.model, parts={"transformer"}, dtype=torch.float32).transformer
    torch.manual_seed(seed)
    params = add_lora(tr, cfg, adapter.default_lora_targets)
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.2)
    path = tmp_path / f"{name}.safetensors"
    ck.save_lora(path, tr, {"rank": rank, "alpha": alpha})
    return path


def _reference(adapter, cfg, specs):
    """The base transformer with the LoRAs loaded through the diffusers pipeline's load_lora_weights / set_adapters."""
    from trainer.sampling.lora import load_loras

    comps = adapter.load(cfg.model, parts={"transformer", "vae", "text", "scheduler"}, dtype=torch.float32)
    pipe = adapter.pipeline(comps)
    load_loras(pipe, specs, adapter.family)
    return pipe.transformer


def _inputs(adapter, cfg):
    comps = adapter.load(cfg.model, parts={"text"}, dtype=torch.float32)
    text = adapter.encode_prompts(comps, ["a red square", "a blue circle"])
    g = torch.Generator().manual_seed(0)
    lat = torch.randn(2, adapter.latent_channels, 8, 8, generator=g)
    return lat, torch.tensor([0.3, 0.8]), text


def test_merged_transformer_equals_base_plus_loras_in_diffusers(tiny_models, tmp_path):
    family = "flux"
    a = _lora(tiny_models, tmp_path, family, "a", 4, 8, 1)
    b = _lora(tiny_models, tmp_path, family, "b", 2, 2, 2)
    # the base with sharded weights, to check the layout is kept
    model = tmp_path / "model"
    shutil.copytree(tiny_models / family, model)
    cfg = make_config(tiny_models, tmp_path, tmp_path / "o", tmp_path / "c", family)
    cfg.model.path = model
    adapter = get_adapter(cfg.model)
    cls = adapter.transformer_cls
    base = cls.from_pretrained(str(model / "transformer"))
    shutil.rmtree(model / "transformer")
    base.save_pretrained(str(model / "transformer"), max_shard_size="60KB")
    index = json.loads((model / "transformer" / INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 2

    out = merge_loras(model, [LoraSpec(a, 0.7), LoraSpec(b, 1.0)], tmp_path / "merged", single=tmp_path / "m.safetensors",
                      progress=False)
    assert json.loads((out / INDEX).read_text()) == index
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(set(index["weight_map"].values()))

    ref = _reference(adapter, cfg, [LoraSpec(a, 0.7), LoraSpec(b, 1.0)])
    merged = cls.from_pretrained(str(out))
    lat, t, text = _inputs(adapter, cfg)
    with torch.no_grad():
        want = adapter.predict(ref.eval(), lat, t, text)
        got = adapter.predict(merged.eval(), lat, t, text)
        plain = adapter.predict(base.eval(), lat, t, text)
    assert (want - plain).abs().max() > 1e-2  # the LoRAs do change the output
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    single = load_file(str(tmp_path / "m.safetensors"))
    assert set(single) == set(merged.state_dict())
    for k, v in merged.state_dict().items():
        assert torch.equal(single[k], v), k


def test_merge_in_bf16_stays_within_bf16_tolerance(tiny_models, tmp_path):
    a = _lora(tiny_models, tmp_path, "flux", "a", 4, 4, 3)
    cfg = make_config(tiny_models, tmp_path, tmp_path / "o", tmp_path / "c", "flux")
    adapter = get_adapter(cfg.model)
    model = tmp_path / "model"
    shutil.copytree(tiny_models / "flux", model)
    shutil.rmtree(model / "transformer")
    adapter.transformer_cls.from_pretrained(str(tiny_models / "flux" / "transformer"), torch_dtype=torch.bfloat16
                                            ).save_pretrained(str(model / "transformer"))
    out = merge_loras(model, [LoraSpec(a, 1.0)], tmp_path / "merged", progress=False)
    stored = load_file(str(out / "diffusion_pytorch_model.safetensors"))
    assert {v.dtype for v in stored.values()} == {torch.bfloat16}  # the base's dtype is kept
    merged = adapter.transformer_cls.from_pretrained(str(out))
    ref = _reference(adapter, cfg, [LoraSpec(a, 1.0)])  # the fp32 base
    lat, t, text = _inputs(adapter, cfg)
    with torch.no_grad():
        want = adapter.predict(ref.eval(), lat, t, text)
        got = adapter.predict(merged.float().eval(), lat, t, text)
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)


def test_merge_command_from_yaml_and_a_foreign_lora(tiny_models, tmp_path):
    a = _lora(tiny_models, tmp_path, "flux", "a", 2, 2, 4)
    other = _lora(tiny_models, tmp_path, "sd3", "other", 2, 2, 5)
    raw = {"model": {"family": "flux", "path": str(tiny_models / "flux"), "dtype": "fp32"},
           "output": {"dir": str(tmp_path / "out")}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    res = CliRunner().invoke(app, ["merge", str(tmp_path / "c.yaml"), "--lora", f"{a}:0.5"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "out" / "merged" / "config.json").is_file()
    assert (tmp_path / "out" / "merged" / "diffusion_pytorch_model.safetensors").is_file()
    with pytest.raises(UserError, match="other.safetensors.*match no weight|other.safetensors.*in the model"):
        merge_loras(tiny_models / "flux", [LoraSpec(other)], tmp_path / "bad", progress=False)
    assert not (tmp_path / "bad" / "diffusion_pytorch_model.safetensors").exists()
    res = CliRunner().invoke(app, ["merge", str(tmp_path / "c.yaml")])
    assert res.exit_code != 0 and "at least one --lora" in res.output
