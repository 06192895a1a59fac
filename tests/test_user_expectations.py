"""What users of other trainers expect: `dittrain --version`, a smoothed loss, epoch and plain units in the
status, plain status lines instead of a bar when stderr is not a terminal, TensorBoard with step time, VRAM, the
run id and config, a log line per sample saved, and diffusers' empty 'kept in float32: []' notice gone."""

from __future__ import annotations

import json
import logging

import pytest
from typer.testing import CliRunner

from trainer import __version__
from trainer.cli import app
from trainer.config import Config
from trainer.train.monitor import Monitor


def test_version():
    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"dittrain {__version__}"


def test_diffusers_empty_float32_notice_is_silenced_and_a_real_one_is_not(caplog):
    log = logging.getLogger("diffusers.models.modeling_utils")
    with caplog.at_level(logging.WARNING):
        log.warning("There are modules in FluxTransformer2DModel that should be kept in float32: []. Casting ...")
        log.warning("There are modules in X that should be kept in float32: ['norm']. Casting ...")
    assert [r.getMessage()[-30:] for r in caplog.records] == ["kept in float32: ['norm']. Casting ..."[-30:]]


def _metrics(step: int, loss: float) -> dict:
    return {"loss": loss, "lr": 1e-3, "step_time": 0.5, "samples_per_s": 4.0, "grad_norm": 1.0, "vram_gb": 3.5}


def test_status_without_a_terminal_is_a_line_every_5_percent_with_smoothed_loss_and_epoch(tmp_path, capsys,
                                                                                          monkeypatch):
    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    m = Monitor(tmp_path, total=40, start=0, tensorboard=False, run_id="R", epoch=lambda: 3)
    for s in range(1, 41):
        m.log(s, _metrics(s, 1.0 if s % 2 else 2.0), write=True)
    m.close()
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 20 and "\r" not in err  # steps 2, 4, ..., 40; no progress bar
    assert lines[-1].startswith("step 40/40: loss 1.5") and "epoch 3, 0.50 s/step, 4.0 img/s" in lines[-1]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["loss_smoothed"] == pytest.approx(1.0) and rows[1]["loss_smoothed"] == pytest.approx((0.09 + 0.2) / 0.19)
    assert {r["run"] for r in rows} == {"R"} and {r["epoch"] for r in rows} == {3}


def test_tensorboard_gets_step_time_vram_run_id_and_config(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = Config.model_validate({"model": {"family": "flux", "path": "m"}, "output": {"dir": str(tmp_path)}})
    m = Monitor(tmp_path, total=2, start=0, tensorboard=True, run_id="R1", config=cfg)
    for s in (1, 2):
        m.log(s, _metrics(s, 1.0), write=True)
    m.images(2, [], [])
    m.close()
    assert f"saved 0 sample image(s) for step 2 in {tmp_path / 'samples'}" in capsys.readouterr().err
    ev = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    ev.Reload()
    scalars = set(ev.Tags()["scalars"]) | set(ev.Tags()["tensors"])
    assert {"train/step_time", "train/vram_gb", "train/loss_smoothed", "train/epoch"} <= scalars
    assert {"run/id/text_summary", "run/config/text_summary"} <= set(ev.Tags()["tensors"])
    config_text = ev.Tensors("run/config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "family: flux" in config_text
