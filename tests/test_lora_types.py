"""LoKr, LoHa and DoRA (lora.type, lora.dora) through peft: they train on the tiny model, streamed like resident,
resume from their checkpoint file, and load where users load them (diffusers for DoRA, peft and `dittrain sample
--lora` for LoKr / LoHa) with the trained layer's outputs."""

from __future__ import annotations

import pytest
import torch
from test_train_support import losses, make_config, write_images

from trainer.config import Config
from trainer.errors import ConfigError
from trainer.lora_format import lora_kind, lora_metadata
from trainer.models import get_adapter
from trainer.sampling.lora import load_loras
from trainer.sampling.request import LoraSpec
from trainer.train import checkpoint as ck
from trainer.train.trainer import Trainer

KINDS = {"lokr": {"type": "lokr"}, "loha": {"type": "loha"}, "dora": {"dora": True}}
MODULE = "transformer_blocks.0.attn.to_q"  # a default Flux target


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("lora-types-images"))


@pytest.fixture(scope="module")
def trained(tiny_models, images, tmp_path_factory):
    """One 3-step run per kind: kind -> (trainer, output folder)."""
    root = tmp_path_factory.mktemp("lora-types")
    runs = {}
    for kind, lora in KINDS.items():
        t = Trainer(make_config(tiny_models, images, root / kind, root / "cache", "flux", train={"steps": 3},
                                lora={"rank": 4, "alpha": 8, **lora}))
        t.fit()
        runs[kind] = (t, root / kind)
    return runs


def _layer_out(transformer, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return transformer.get_submodule(MODULE)(x)


def test_config_keys():
    base = {"model": {"family": "flux", "path": "m"}, "output": {"dir": "o"}}
    assert Config.model_validate(base).lora.type == "lora"
    with pytest.raises(ValueError, match="lora.dora: true is a variant of lora.type: lora"):
        Config.model_validate({**base, "lora": {"type": "lokr", "dora": True}})
    with pytest.raises(ValueError):
        Config.model_validate({**base, "lora": {"type": "lycoris"}})
    assert ConfigError  # the CLI reports the same errors through load_config


@pytest.mark.parametrize("kind", list(KINDS))
def test_kind_trains_and_saves_its_own_keys(kind, trained):
    t, out = trained[kind]
    sd = ck.lora_state_dict(t.transformer)
    want = {"lokr": ".lokr_w1", "loha": ".hada_w1_a", "dora": ".lora_magnitude_vector"}[kind]
    assert any(want in k for k in sd)
    meta = lora_metadata(out / "lora.safetensors")
    assert lora_kind(meta) == ("lora" if kind == "dora" else kind)
    assert meta["dittrain.type"] == KINDS[kind].get("type", "lora")
    assert len(losses(out)) == 3 and all(torch.isfinite(torch.tensor(losses(out))))
    # The update moved off zero (peft starts every kind at a zero update).
    base = get_adapter(t.cfg.model).load(t.cfg.model, parts={"transformer"}, dtype=torch.float32,
                                         device="cpu").transformer
    x = torch.randn(2, base.get_submodule(MODULE).in_features, generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(_layer_out(base, x), _layer_out(t.transformer, x))


@pytest.mark.parametrize("kind", ["lokr", "dora"])
def test_kind_streams_like_resident_and_resumes(kind, trained, tiny_models, images, tmp_path, monkeypatch):
    """Offload 0.5 on the conductor's CPU path: the same losses as resident; and a run resumed from the 2-step
    checkpoint's file computes the 3rd step's loss bitwise."""
    ref_t, ref_out = trained[kind]
    monkeypatch.setattr(Trainer, "_can_stream", lambda self: True)
    cfg = make_config(tiny_models, images, tmp_path / "run", tmp_path / "cache", "flux",
                      train={"steps": 2, "checkpoint_every": 2}, lora={"rank": 4, "alpha": 8, **KINDS[kind]},
                      offload={"transformer": 0.5})
    Trainer(cfg).fit()
    assert losses(tmp_path / "run") == losses(ref_out)[:2]
    t = Trainer(cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 3})}), resume="latest")
    t.fit()
    assert losses(tmp_path / "run") == losses(ref_out)
    assert all(torch.equal(a, b) for a, b in zip(ck.lora_state_dict(t.transformer).values(),
                                                 ck.lora_state_dict(ref_t.transformer).values(), strict=True))


def _pipe(cfg):
    adapter = get_adapter(cfg.model)
    return adapter.pipeline(adapter.load(cfg.model, parts={"transformer", "vae", "text", "scheduler"},
                                         dtype=torch.float32, device="cpu"))


@pytest.mark.parametrize("kind", list(KINDS))
def test_sample_loads_the_file_with_the_trained_layer_outputs(kind, trained):
    """`dittrain sample --lora` (load_loras): DoRA through diffusers' load_lora_weights, LoKr / LoHa through
    peft; the loaded layer computes what the trained one does, and --lora PATH:0.5 halves the update."""
    t, out = trained[kind]
    pipe = _pipe(t.cfg)
    x = torch.randn(3, pipe.transformer.get_submodule(MODULE).in_features, generator=torch.Generator().manual_seed(1))
    base = _layer_out(pipe.transformer, x)
    load_loras(pipe, [LoraSpec(out / "lora.safetensors")], "flux")
    torch.testing.assert_close(_layer_out(pipe.transformer, x), _layer_out(t.transformer, x), rtol=1e-5, atol=1e-6)
    if kind != "dora":  # DoRA's update is not linear in the weight
        half = _pipe(t.cfg)
        load_loras(half, [LoraSpec(out / "lora.safetensors", 0.5)], "flux")
        torch.testing.assert_close(_layer_out(half.transformer, x) - base,
                                   (_layer_out(t.transformer, x) - base) / 2, rtol=1e-4, atol=1e-6)


def test_lycoris_file_is_refused_beside_other_loras(trained):
    from trainer.errors import UserError

    t, out = trained["lokr"]
    with pytest.raises(UserError, match="cannot be combined with other --lora files"):
        load_loras(_pipe(t.cfg), [LoraSpec(out / "lora.safetensors"), LoraSpec(trained["dora"][1] / "lora.safetensors")],
                   "flux")


def test_merge_refuses_dora_and_lokr(trained):
    from trainer.errors import UserError
    from trainer.merge import read_lora

    with pytest.raises(UserError, match="DoRA file"):
        read_lora(trained["dora"][1] / "lora.safetensors")
    with pytest.raises(UserError, match="no lora_A / lora_B weights"):
        read_lora(trained["lokr"][1] / "lora.safetensors")
