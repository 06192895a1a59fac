"""`dittrain sample` on a full fine-tune config samples what the run trained (output.dir/transformer), says so,
and samples the base model with --base."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from test_train_support import pixels

from trainer.config import Config
from trainer.sample import SampleRequest, run_sample


def _cfg(tiny_models: Path, out: Path, method: str) -> Config:
    opt = {"fused_back_pass": True, "max_grad_norm": None} if method == "full" else {}
    return Config.model_validate({
        "model": {"family": "flux", "path": str(tiny_models / "flux"), "dtype": "fp32"},
        "sample": {"steps": 2, "width": 32, "height": 32},
        "train": {"device": "cpu", "method": method},
        "optimizer": opt,
        "output": {"dir": str(out)},
    })


def _pixels(paths: list[Path]) -> np.ndarray:
    return pixels(paths[0])


def test_full_finetune_config_samples_the_runs_transformer_unless_base(tiny_models, tmp_path, capsys):
    from diffusers import FluxTransformer2DModel

    out = tmp_path / "run"
    t = FluxTransformer2DModel.from_pretrained(str(tiny_models / "flux" / "transformer"))
    with torch.no_grad():
        for p in t.parameters():
            p.mul_(1.5)  # a "fine-tuned" transformer that samples visibly differently
    t.save_pretrained(str(out / "transformer"), safe_serialization=True)

    def sample(method: str, name: str, base: bool = False) -> np.ndarray:
        req = SampleRequest(prompts=["a cat"], out=tmp_path / name, base=base)
        return _pixels(run_sample(_cfg(tiny_models, out, method), req))

    trained = sample("full", "trained")
    assert f"sampling with the fine-tuned transformer {out / 'transformer'}" in capsys.readouterr().err
    base = sample("full", "base", base=True)
    assert "sampling with the base transformer" in capsys.readouterr().err
    lora_cfg = sample("lora", "lora")  # a LoRA config never picks up a transformer/ folder
    assert np.array_equal(base, lora_cfg)
    assert not np.array_equal(trained, base)
