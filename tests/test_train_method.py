"""The training method and the one optimizer object: the loop never branches on LoRA vs full, the optimizer the
loop calls is one class (no delegation chain), and out-of-memory advice under `offload.transformer: auto` names
the fraction the planner picked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from test_train_support import make_config, write_images

import trainer.train.trainer as trainer_module
from trainer.errors import UserError
from trainer.train import streaming
from trainer.train.faults import oom_error
from trainer.train.method import FullMethod, LoraMethod, method_for
from trainer.train.optimizer import Optim
from trainer.train.trainer import Trainer


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("method-images"))


def test_the_loop_never_branches_on_the_method():
    source = Path(trainer_module.__file__).read_text()
    code = "\n".join(line.split("#")[0] for line in source.splitlines())  # comments may name the methods
    assert not re.search(r"method\s*[!=]=", code)
    assert not re.search(r"""["'](lora|full)["']""", code)
    assert "train.method" not in code


def test_method_for_picks_the_configured_method(tiny_models, images, tmp_path):
    for method, cls, final in (("lora", LoraMethod, "lora.safetensors"), ("full", FullMethod, "transformer")):
        m = method_for(make_config(tiny_models, images, tmp_path / "out", tmp_path / "cache", "flux", method))
        assert type(m) is cls and m.name == method
        assert m.final_output(tmp_path / "out") == tmp_path / "out" / final
    assert FullMethod.streams_trainable and not LoraMethod.streams_trainable


@pytest.mark.parametrize("method", ["lora", "full"])
def test_one_optimizer_object_without_delegation(method, tiny_models, images, tmp_path):
    t = Trainer(make_config(tiny_models, images, tmp_path / "out", tmp_path / "cache", "flux", method,
                            train={"steps": 1}))
    t.setup()
    try:
        assert type(t.optim) is Optim
        assert not any("__getattr__" in vars(k) for k in type(t.optim).__mro__)
        assert (t.optim.fused is not None) == (method == "full")
    finally:
        t.close()


def test_oom_advice_names_a_higher_fraction_than_the_one_streamed():
    e = oom_error(7, 0.35)
    assert isinstance(e, UserError)
    assert "out of memory at step 7" in str(e) and "raise offload.transformer from 0.35 to 0.6" in str(e)
    assert "lower train.batch_size" in str(oom_error(7, 1.0))
    assert "lower train.batch_size" in str(oom_error(7, None))  # before the fraction was known
    assert str(oom_error(1, 0.0, "; LoRA needs far less")).endswith("; LoRA needs far less")


def test_oom_under_auto_suggests_a_fraction(tiny_models, images, tmp_path, monkeypatch):
    """offload.transformer: auto is resolved once into the planner's float, and that float reaches the advice."""
    cfg = make_config(tiny_models, images, tmp_path / "out", tmp_path / "cache", "flux",
                      offload={"transformer": "auto", "vram_budget_gb": 8})
    monkeypatch.setattr(Trainer, "_can_stream", lambda self: True)  # the conductor's CPU path
    monkeypatch.setattr(streaming, "resolve_fraction", lambda cfg: 0.4)  # the planner's pick for this "GPU"
    t = Trainer(cfg)
    t.setup()
    assert t.fraction == 0.4 and t.offload is not None

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(t.adapter, "predict", oom)
    with pytest.raises(UserError, match=r"out of memory at step 1: raise offload.transformer from 0.4 to 0.65"):
        t.fit()
