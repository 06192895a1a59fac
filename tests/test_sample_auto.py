"""`dittrain sample` with offload auto: 0 on the CPU; on a GPU the sampling prediction's smallest fitting fraction."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import trainer.planner
import trainer.sample as sample
from trainer.cli import app
from trainer.config import Config
from trainer.models import get_adapter
from trainer.planner import GB, analyze
from trainer.planner.prediction import GRID, PREDICTION_MARGIN
from trainer.planner.sampling import cfg_batch, predict_sampling
from trainer.sample import SampleRequest, resolve


def _cfg(tiny_models: Path, out: Path, family: str = "flux", **offload) -> Config:
    return Config.model_validate(
        {
            "model": {"family": family, "path": str(tiny_models / family), "dtype": "fp32"},
            "sample": {"steps": 1, "width": 64, "height": 32, "prompts": ["x"], "guidance": 4.0},
            "train": {"device": "cpu"},
            "output": {"dir": str(out)},
            "offload": {"transformer": "auto", "vram_budget_gb": 8.0, **offload},
        }
    )


def test_auto_is_zero_on_the_cpu(tiny_models, tmp_path, capsys):
    cfg = _cfg(tiny_models, tmp_path)
    plan = resolve(cfg, SampleRequest(), get_adapter(cfg.model))
    assert plan.offload == 0.0 and plan.device.type == "cpu"
    assert "auto -> 0 on the CPU" in capsys.readouterr().err
    plan = resolve(cfg, SampleRequest(offload=0.5), get_adapter(cfg.model))  # a number on the flag still wins
    assert plan.offload == 0.5


def _on_fake_gpu(monkeypatch, budget_gb: float) -> None:
    monkeypatch.setattr(sample, "_device", lambda cfg: torch.device("cuda"))
    monkeypatch.setattr(sample, "vram_budget_gb", lambda cfg, device: budget_gb)


def test_auto_on_a_gpu_picks_the_smallest_fraction_the_sampling_prediction_fits(
        tiny_models, tmp_path, monkeypatch, capsys):
    family = "sd3"  # runs classifier-free guidance at guidance 4: a batch of two
    cfg = _cfg(tiny_models, tmp_path, family)
    cfg.offload.transformer = 0.0  # --offload auto overrides a number in the config
    adapter = get_adapter(cfg.model)
    batch = cfg_batch(adapter.family, cfg.sample.guidance)
    assert batch == 2
    facts = analyze(cfg)
    # the tiny blocks (150-180 kB) all round to one 2 MiB allocation: weigh them as a 100 x bigger model's so the
    # ring's size shows in the peak; resolve plans with these same facts
    facts.packed = [100 * p for p in facts.packed]
    monkeypatch.setattr(trainer.planner, "analyze", lambda c: facts)
    peaks = {f: predict_sampling(facts, f, 64, batch=batch).peak_reserved for f in GRID}
    assert peaks[1.0] < peaks[0.0]
    # a budget halfway between every block streamed and none: resident does not fit, so it must stream
    budget = (peaks[0.0] + peaks[1.0]) / 2 / GB / (1 - PREDICTION_MARGIN)
    want = next(f for f in GRID if peaks[f] <= budget * GB * (1 - PREDICTION_MARGIN))
    assert 0.0 < want
    _on_fake_gpu(monkeypatch, budget)
    plan = resolve(cfg, SampleRequest(offload="auto"), adapter)
    assert plan.offload == want
    err = capsys.readouterr().err
    assert f"offload: auto -> {want:g} for sampling 64x32 (predicted {peaks[want] / GB:.1f} GB of the" in err


def test_auto_falls_back_to_streaming_everything_when_nothing_fits(tiny_models, tmp_path, monkeypatch, capsys):
    cfg = _cfg(tiny_models, tmp_path)
    _on_fake_gpu(monkeypatch, 1e-6)
    plan = resolve(cfg, SampleRequest(), get_adapter(cfg.model))
    assert plan.offload == 1.0
    assert "exceeds the" in capsys.readouterr().err


def test_auto_streams_everything_when_the_planner_cannot_run(tiny_models, tmp_path, monkeypatch, capsys):
    def broken(cfg):
        raise RuntimeError("no trace for this model")

    cfg = _cfg(tiny_models, tmp_path)
    _on_fake_gpu(monkeypatch, 8.0)
    monkeypatch.setattr(trainer.planner, "analyze", broken)
    assert resolve(cfg, SampleRequest(), get_adapter(cfg.model)).offload == 1.0
    assert "auto could not plan sampling (RuntimeError: no trace for this model)" in capsys.readouterr().err


def test_budget_is_the_config_or_the_card_less_headroom_or_the_cap(tiny_models, tmp_path, monkeypatch):
    from trainer.planner.presets import HEADROOM_GB

    cfg = _cfg(tiny_models, tmp_path)
    assert sample.vram_budget_gb(cfg, torch.device("cuda")) == 8.0

    class Props:
        total_memory = 16 * GB

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    cfg.offload.vram_budget_gb = None
    fraction = [1.0]

    def get_fraction(device):  # as torch's: an index, not a bare torch.device("cuda") (the GPU run's failure)
        if not isinstance(device, int):
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        return fraction[0]

    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", get_fraction)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert sample.vram_budget_gb(cfg, torch.device("cuda")) == 16 - HEADROOM_GB
    # DITTRAIN_VRAM_CAP_GB=12: the CLI caps the process at 12 of the 16 GB (apply_vram_cap); the cap stands for the
    # card less its context (the benchmarks' card - 1 GB), so the budget is the cap itself
    fraction[0] = 12 / 16
    assert sample.vram_budget_gb(cfg, torch.device("cuda")) == pytest.approx(12)
    assert sample.vram_budget_gb(cfg, torch.device("cuda", 0)) == pytest.approx(12)
    # a cap above the card less its context leaves that
    fraction[0] = 15.5 / 16
    assert sample.vram_budget_gb(cfg, torch.device("cuda")) == 16 - HEADROOM_GB
    # `dittrain caption --offload auto` plans in the same budget
    from trainer.captioning import captioner

    fraction[0] = 7 / 16
    assert captioner._budget(torch.device("cuda")) == pytest.approx(7 * GB)
    assert captioner._budget(torch.device("cpu")) is None


def test_cli_offload_accepts_auto_and_rejects_nonsense(tiny_models, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(sample, "run_sample", lambda cfg, req: seen.append(req.offload))
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {{family: flux, path: '{tiny_models / 'flux'}'}}\noutput: {{dir: '{tmp_path}'}}\n")
    runner = CliRunner()
    for value, want in (("auto", "auto"), ("AUTO", "auto"), ("0.25", 0.25)):
        r = runner.invoke(app, ["sample", str(config), "--offload", value])
        assert r.exit_code == 0, r.output
        assert seen[-1] == want
    for bad in ("nonsense", "1.5", "-0.1"):
        r = runner.invoke(app, ["sample", str(config), "--offload", bad])
        assert r.exit_code != 0
        lines = [x for x in r.output.splitlines() if x.strip()]
        assert len(lines) == 1 and f"--offload {bad}" in lines[0] and "auto" in lines[0], r.output
