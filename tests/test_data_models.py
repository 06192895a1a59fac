"""The data pipeline through the real adapters and tiny random models: `dittrain cache`, and batches per family."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from trainer.config import Config
from trainer.data import prepare_data, run_cache
from trainer.data.cache import encoder_loader
from trainer.models import get_adapter


def images(folder, sizes=((64, 64), (128, 64), (64, 128))):
    folder.mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(sizes):
        Image.new("RGB", s, (60 * i, 120, 250 - 60 * i)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(f"shape {i}")
    return folder


def cfg_for(tmp_path, model_path, family, **data):
    return Config.model_validate({
        "model": {"family": family, "path": str(model_path), "dtype": "fp32"},
        "train": {"batch_size": 2, "seed": 0, "device": "cpu"},
        "data": {"sources": [{"path": str(tmp_path / "imgs"), "caption_dropout": 0.5}], "resolutions": [64],
                 "cache_dir": str(tmp_path / "cache"), **data},
        "output": {"dir": str(tmp_path / "out")},
    })


@pytest.mark.parametrize("family", ["flux", "sd3", "qwen-image", "flux2"])
def test_batches_from_each_family(tmp_path, tiny_models, family):
    images(tmp_path / "imgs")
    cfg = cfg_for(tmp_path, tiny_models / family, family)
    adapter = get_adapter(cfg.model)
    calls = []

    def load():
        calls.append(1)
        return encoder_loader(cfg, adapter, "cpu")()

    data = prepare_data(cfg, adapter, load, progress=False)
    assert calls == [1] and data.report.bad == []
    for _ in range(data.batches_per_epoch):
        b = data.next_batch()
        h, w = b.size
        assert h % adapter.resolution_divisor == 0 and w % adapter.resolution_divisor == 0
        assert b.latents.shape[0] == len(b.files) and b.latents.shape[-2:] == (h // 8, w // 8)
        assert torch.isfinite(b.latents).all()
        assert all(v.shape[0] == len(b.files) for v in b.text.values())
    again = prepare_data(cfg, adapter, load, progress=False)
    assert calls == [1]  # everything cached: no encoder loaded
    assert torch.equal(again.batch_at(0).latents, data.batch_at(0).latents)


def test_run_cache_command(tmp_path, tiny_models, capsys):
    images(tmp_path / "imgs", sizes=((64, 64), (96, 64)))
    cfg = cfg_for(tmp_path, tiny_models / "flux", "flux")
    run_cache(cfg)
    out = capsys.readouterr().err  # status lines go to stderr (docs/training.md: Status)
    assert "latents 0 reused, 2 encoded" in out and "captions 0 reused, 3 encoded" in out
    assert "resolution 64" in out
    assert len(list((tmp_path / "cache" / "latents").rglob("*.safetensors"))) == 2
    assert len(list((tmp_path / "cache" / "text").rglob("*.safetensors"))) == 3
    run_cache(cfg)
    assert "latents 2 reused, 0 encoded; captions 3 reused, 0 encoded" in capsys.readouterr().err
