"""EMA of the trained weights (train.ema): the shadow follows shadow.lerp_(w, 1 - decay) every `every` steps,
unfused after the step and fused inside backward (streamed blocks included), is saved in checkpoints and resumed
bitwise, and ends as lora-ema.safetensors / transformer-ema/."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from test_train_support import make_config, write_images

from trainer.config import Config
from trainer.lora_format import lora_metadata, peft_state_dict, read_lora_file
from trainer.train import checkpoint as ck
from trainer.train.ema import FILE
from trainer.train.trainer import Trainer


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("ema-images"))


def _cfg(tiny_models, images, out, cache, method="lora", steps=4, fraction=0.0, family="flux", **train):
    return make_config(tiny_models, images, out, cache, family, method,
                       train={"steps": steps, "ema": {"decay": 0.7, "every": 2, "device": "cpu"}, **train},
                       offload={"transformer": fraction})


def _expected(t: Trainer, steps: int, decay: float = 0.7, every: int = 2) -> dict[str, torch.Tensor]:
    """Train `steps` steps by hand and compute the EMA from the weights after each step."""
    names = list(t.ema.params)
    shadow = {n: t.ema.params[n].detach().float().clone() for n in names}
    for _ in range(steps):
        t.train_step()
        t.ema.after_step(t.step)
        if t.step % every == 0:
            for n in names:
                shadow[n].lerp_(t.ema.params[n].detach().float(), 1.0 - decay)
    return shadow


def test_config_keeps_a_streamed_full_fine_tunes_ema_in_ram(tiny_models, images, tmp_path):
    with pytest.raises(ValueError, match="train.ema.device: cpu"):
        make_config(tiny_models, images, tmp_path, tmp_path, "flux", "full",
                    train={"ema": {"device": "gpu"}}, offload={"transformer": 0.5})
    c = Config.model_validate({"model": {"family": "flux", "path": "m"}, "output": {"dir": "o"},
                               "train": {"ema": {}}})
    assert (c.train.ema.decay, c.train.ema.every, c.train.ema.device) == (0.999, 1, "cpu")


@pytest.mark.parametrize(("family", "method"), [("flux", "lora"), ("flux", "full"), ("z-image", "full"), ("chroma", "lora"),
                                                ("qwen-image-2.1", "lora"), ("qwen-image-2.1", "full"), ("krea2", "lora"), ("flux3", "lora")])
def test_shadow_is_the_moving_average(family, method, tiny_models, images, tmp_path):
    """LoRA updates after the step (unfused), full inside backward (fused back pass hooks): both bitwise the
    average of the weights after steps 2 and 4."""
    t = Trainer(_cfg(tiny_models, images, tmp_path / "o", tmp_path / "cache", method, family=family))
    t.setup()
    try:
        assert t.ema.fused == (method == "full")
        want = _expected(t, 4)
        assert all(torch.equal(t.ema.shadow[n], want[n]) for n in want)
        assert any(not torch.equal(t.ema.shadow[n], t.ema.params[n].float()) for n in want)
    finally:
        t.close()


def test_lora_ema_file_and_bitwise_resume(tiny_models, images, tmp_path):
    cache = tmp_path / "cache"
    ref = Trainer(_cfg(tiny_models, images, tmp_path / "ref", cache, checkpoint_every=2))
    ref.fit()
    ema_file = tmp_path / "ref" / "lora-ema.safetensors"
    meta = lora_metadata(ema_file)
    assert meta["dittrain.step"] == "4" and "lora_adapter_metadata" in meta  # loads like the LoRA itself
    sd = load_file(str(ema_file))
    saved = peft_state_dict(read_lora_file(ema_file))  # the scale (alpha / r = 2) divided back out: exact
    with ref.ema.swapped_in():
        assert all(torch.equal(saved[k], v) for k, v in ck.lora_state_dict(ref.transformer).items())
    final = load_file(str(tmp_path / "ref" / "lora.safetensors"))
    assert set(final) == set(sd) and any(not torch.equal(sd[k], final[k]) for k in sd)  # not the last weights

    Trainer(_cfg(tiny_models, images, tmp_path / "run", cache, steps=3, checkpoint_every=2)).fit()
    t = Trainer(_cfg(tiny_models, images, tmp_path / "run", cache, checkpoint_every=2), resume=str(
        tmp_path / "run" / "checkpoints" / "step-000002"))
    t.fit()
    a = load_file(str(tmp_path / "run" / "checkpoints" / "step-000004" / FILE))
    b = load_file(str(tmp_path / "ref" / "checkpoints" / "step-000004" / FILE))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    resumed = load_file(str(tmp_path / "run" / "lora-ema.safetensors"))  # (the header names another output.dir)
    assert all(torch.equal(resumed[k], sd[k]) for k in sd)


def test_streamed_full_fine_tune_ema_in_ram_resumes_and_saves_a_folder(tiny_models, images, tmp_path, monkeypatch):
    """offload 0.5 on the conductor's CPU path: each weight's EMA updates in the fused pass's post-step hook while
    its block is in place; it matches the resident run's (to the last bits, as the weights do), resumes bitwise,
    and ends as transformer-ema/."""
    from diffusers import FluxTransformer2DModel

    cache = tmp_path / "cache"
    resident = Trainer(_cfg(tiny_models, images, tmp_path / "res", cache, "full", checkpoint_every=2))
    resident.fit()
    monkeypatch.setattr(Trainer, "_can_stream", lambda self: True)
    Trainer(_cfg(tiny_models, images, tmp_path / "off", cache, "full", fraction=0.5, steps=2,
                 checkpoint_every=2)).fit()
    t = Trainer(_cfg(tiny_models, images, tmp_path / "off", cache, "full", fraction=0.5, checkpoint_every=2),
                resume="latest")
    t.fit()
    whole = Trainer(_cfg(tiny_models, images, tmp_path / "whole", cache, "full", fraction=0.5, checkpoint_every=2))
    whole.fit()
    for n, s in whole.ema.shadow.items():
        assert s.device.type == "cpu"
        assert torch.equal(t.ema.shadow[n], s)  # resumed == uninterrupted, streamed
        torch.testing.assert_close(s, resident.ema.shadow[n], rtol=1e-5, atol=1e-7)
    folder = tmp_path / "off" / "transformer-ema"
    loaded = FluxTransformer2DModel.from_pretrained(str(folder))
    got = dict(loaded.named_parameters())
    assert all(torch.equal(got[n], s) for n, s in t.ema.shadow.items())  # fp32 model: the shadow itself
