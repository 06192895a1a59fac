"""Prodigy (prodigyopt) and schedule-free AdamW (schedulefree) train a LoRA and resume exactly: a run stopped
at step 2 and resumed computes the losses of the uninterrupted run; schedule-free saves its averaged weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from test_train_support import losses, make_config, write_images

from trainer.config import Config
from trainer.errors import UserError
from trainer.optim.build import build_optimizer
from trainer.train.trainer import Trainer


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("optim-extra-images"))


@pytest.mark.parametrize("name, lr", [("prodigy", 1.0), ("adamw_schedulefree", 1e-3)])
def test_optimizer_trains_and_resumes_exactly(name, lr, tiny_models, images, tmp_path):
    def cfg(out, steps):
        return make_config(tiny_models, images, tmp_path / out, tmp_path / "cache", "flux",
                           train={"steps": steps, "checkpoint_every": 2}, optimizer={"name": name, "lr": lr})

    ref = Trainer(cfg("ref", 4))
    ref.fit()
    first = Trainer(cfg("run", 2))
    first.fit()
    Trainer(cfg("run", 4), resume="latest").fit()
    assert losses(tmp_path / "run") == losses(tmp_path / "ref")
    saved = load_file(str(tmp_path / "ref" / "lora.safetensors"))
    assert all(torch.isfinite(v).all() for v in saved.values())
    if name == "adamw_schedulefree":  # the file holds the averaged weights, not the training interpolation
        live = {k.removeprefix("transformer."): v for k, v in saved.items()}
        from trainer.train.checkpoint import lora_state_dict

        trained = lora_state_dict(ref.transformer)
        assert any(not torch.equal(trained[k], live[k]) for k in live)


def test_schedulefree_needs_a_constant_schedule_and_fp32_weights():
    base = {"model": {"family": "flux", "path": "m"}, "output": {"dir": "o"}}
    with pytest.raises(ValueError, match="scheduler: constant"):
        Config.model_validate({**base, "optimizer": {"name": "adamw_schedulefree", "scheduler": "cosine"}})
    cfg = Config.model_validate({**base, "optimizer": {"name": "adamw_schedulefree"}})
    with pytest.raises(UserError, match="fp32 trainable weights"):
        build_optimizer([torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))], cfg.optimizer)
