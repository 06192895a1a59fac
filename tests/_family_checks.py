"""The checks every new image family's test module runs on its tiny model (tests/test_lumina2.py,
tests/test_ernie_image.py): a LoRA changes the pipeline's prediction exactly as in the trainer, streamed training
is bitwise the resident one, and `dittrain sample` is pixel-identical to the family's pipeline (without guidance,
and with the fitted LoRA at 0.7, resident and streamed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from test_sample import PROMPT, _diffusers_image
from test_train_support import lora_predictions, losses, make_config, pixels

from trainer.config import Config, ModelConfig
from trainer.models import adapter_class, get_adapter
from trainer.sample import SampleRequest, run_sample


def lora_changes_the_pipeline_exactly(family: str, tiny_models: Path, images: Path, tmp_path: Path) -> None:
    from trainer.train.trainer import Trainer

    cfg = make_config(tiny_models, images, tmp_path / "out", tmp_path / "cache", family,
                      train={"steps": 2, "device": "cpu"}, optimizer={"lr": 1e-2}, lora={"rank": 4, "alpha": 2})
    t = Trainer(cfg)
    path = t.fit()
    ours, theirs, untrained = lora_predictions(t, path)
    assert torch.equal(ours, theirs)
    assert (theirs - untrained).abs().max() > 1e-4


def streamed_training_equals_resident(family: str, tiny_models: Path, images: Path, tmp_path: Path, monkeypatch,
                                      method: str, fraction: float) -> None:
    """Through the conductor's CPU path, fp32: bitwise the resident run's losses."""
    from trainer.train.trainer import Trainer

    runs = {}
    for f in (0.0, fraction):
        if f:
            monkeypatch.setattr(Trainer, "_can_stream", lambda self: True)
        cfg = make_config(tiny_models, images, tmp_path / f"f{f}", tmp_path / "cache", family, method,
                          train={"steps": 2, "device": "cpu"}, offload={"transformer": f})
        Trainer(cfg).fit()
        runs[f] = losses(tmp_path / f"f{f}")
    assert len(runs[0.0]) == 2 and all(np.isfinite(runs[0.0]))
    assert runs[fraction] == runs[0.0]


def sample_cfg(family: str, tiny_models: Path, out: Path, guidance: float) -> Config:
    return Config.model_validate({
        "model": {"family": family, "path": str(tiny_models / family), "dtype": "fp32"},
        "sample": {"steps": 2, "width": 32, "height": 48, "guidance": guidance},
        "train": {"device": "cpu"},
        "output": {"dir": str(out)},
    })


def sample_without_cfg_equals_the_pipeline(family: str, tiny_models: Path, tmp_path: Path) -> None:
    cfg = sample_cfg(family, tiny_models, tmp_path, 1.0)
    assert not adapter_class(family).runs_cfg(1.0) and adapter_class(family).runs_cfg(4.0)
    (png,) = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=7, out=tmp_path / "a"))
    np.testing.assert_array_equal(pixels(png), _diffusers_image(cfg, seed=7))


def sample_with_the_fitted_lora_equals_the_pipeline(family: str, tiny_models: Path, lora: Path,
                                                    tmp_path: Path) -> None:
    """Guidance 4, the LoRA `dittrain fit` wrote at weight 0.7; then the same with every block streamed."""
    cfg = sample_cfg(family, tiny_models, tmp_path, 4.0)
    (plain,) = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=1, out=tmp_path / "plain"))
    (ours,) = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=1, loras=[f"{lora}:0.7"], out=tmp_path / "l"))
    img = pixels(ours)
    assert img.shape == (48, 32, 3) and (img != pixels(plain)).mean() > 0.1, "the LoRA must change the image"
    np.testing.assert_array_equal(img, _diffusers_image(cfg, seed=1, lora=(lora, 0.7)))
    (streamed,) = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=1, loras=[f"{lora}:0.7"], offload=1.0,
                                                out=tmp_path / "s"))
    np.testing.assert_array_equal(img, pixels(streamed))


def fit_from_yaml(family: str, tiny_models: Path, images: Path, tmp: Path, steps: int) -> tuple[Path, Path]:
    """`dittrain fit` of a LoRA YAML config for the family's tiny model: (config path, output folder)."""
    import yaml
    from typer.testing import CliRunner

    from trainer.cli import app

    cfg = make_config(tiny_models, images, tmp / "out", tmp / "cache", family, train={"steps": steps, "device": "cpu"},
                      optimizer={"lr": 1e-2}, lora={"rank": 4, "alpha": 2})
    path = tmp / "fit.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=True)))
    r = CliRunner().invoke(app, ["fit", str(path)])
    assert r.exit_code == 0, r.output
    return path, tmp / "out"


def tiny_pipeline(family: str, path: Path):
    """(adapter, components, pipeline) of a family's tiny folder in fp32, the pipeline's progress bar off: what the
    "as the pipeline does" tests compare with."""
    mc = ModelConfig(family=family, path=path, dtype="fp32")
    adapter = get_adapter(mc)
    comps = adapter.load(mc, parts={"transformer", "vae", "text", "scheduler"}, dtype=torch.float32)
    pipe = adapter.pipeline(comps)
    pipe.set_progress_bar_config(disable=True)
    return adapter, comps, pipe


def streamed_fit_equals_the_fit(path: Path, out: Path, monkeypatch) -> None:
    """A fitted config (`path`, its `out`put folder) again with the transformer streamed at fraction 1.0 (the
    conductor's CPU path, fp32): bitwise the fit's losses; its LoRA file through the pipeline's `load_lora_weights`
    predicts exactly what the trainer's model does."""
    from trainer.config import load_config
    from trainer.train.trainer import Trainer

    monkeypatch.setattr(Trainer, "_can_stream", lambda self: True)
    cfg = load_config(path, ["offload.transformer=1.0", f"output.dir={out.parent / 'streamed'}"])
    t = Trainer(cfg)
    lora = t.fit()
    assert losses(out.parent / "streamed") == losses(out)
    ours, theirs, untrained = lora_predictions(t, lora)
    assert torch.equal(ours, theirs)
    assert (theirs - untrained).abs().max() > 1e-4



def compiled_fit_with_ema_and_validation_equals_eager(family: str, tiny_models: Path, images: Path, tmp_path: Path,
                                                      monkeypatch) -> None:
    """train.compile (aot_eager on the CPU) with EMA and a held-out validation set: the eager run's losses; each run
    writes its validation losses and its EMA weights. Batch size 1: every step the same shape (batch 2 of the 3
    training images made a batch of 2 and a remainder of 1, each compiled again: HiDream's test 57 -> 34 s
    on 2 cores); EMA, validation and compiled-vs-eager losses are what this checks, not batch shapes."""
    import json

    from trainer.train.trainer import Trainer

    monkeypatch.setenv("DITTRAIN_COMPILE_BACKEND", "aot_eager")
    runs = {}
    for name, extra in (("eager", {}), ("compiled", {"compile": True})):
        d = make_config(tiny_models, images, tmp_path / name, tmp_path / "cache", family,
                        train={"steps": 2, "batch_size": 1, "device": "cpu", "ema": {"decay": 0.9}, **extra},
                        offload={"transformer": 0.0}).model_dump(mode="json", exclude_unset=True)
        d["data"]["validation"], d["train"]["validate_every"] = {"fraction": 0.25, "timesteps": [0.5]}, 2
        Trainer(Config.model_validate(d)).fit()
        lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = [x["loss"] for x in lines if "loss" in x]
        assert any(np.isfinite(x.get("val_loss", np.nan)) for x in lines)
        assert (tmp_path / name / "lora-ema.safetensors").is_file()
    torch.testing.assert_close(torch.tensor(runs["compiled"]), torch.tensor(runs["eager"]), rtol=1e-5, atol=1e-6)
