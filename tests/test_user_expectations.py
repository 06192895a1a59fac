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


def test_a_status_line_gives_the_wall_seconds_per_step_since_the_last_one(tmp_path, capsys, monkeypatch):
    """Steps of 0.14 s of their own with a sample every 20 steps: the line says what the interval took per step
    (26 s for 20 steps: 1.30 s/step), not the last step's 0.14 s."""
    from trainer.train import monitor

    clock = [0.0]
    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    monkeypatch.setattr(monitor, "_now", lambda: clock[0])
    m = Monitor(tmp_path, total=400, start=200, tensorboard=False)  # a resume at step 200; a line every 20 steps
    for s in range(201, 221):
        clock[0] += 1.3
        m.log(s, {**_metrics(s, 1.0), "step_time": 0.14}, write=False)
    m.close()
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("step 220/400")][0]
    assert "1.30 s/step" in line and "0.14" not in line


def test_time_set_aside_between_steps_is_not_in_the_next_status_lines_seconds_per_step(tmp_path, capsys,
                                                                                       monkeypatch):
    """A line every step (a short run), steps of 0.5 s, and 1.7 s set aside after step 5 (the planner's check on the
    H200 host): step 6's line says 0.50 s/step, as every other, not 2.20."""
    from trainer.train import monitor

    clock = [0.0]
    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    monkeypatch.setattr(monitor, "_now", lambda: clock[0])
    m = Monitor(tmp_path, total=8, start=0, tensorboard=False)
    for s in range(1, 9):
        clock[0] += 0.5
        m.log(s, _metrics(s, 1.0), write=False)
        if s == 5:
            with m.aside():
                clock[0] += 1.7
    m.close()
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("step ")]
    assert len(lines) == 8 and all(", 0.50 s/step" in x for x in lines), lines


def test_the_trainers_plan_check_is_set_aside_from_the_status_lines_seconds_per_step(tiny_models, tmp_path, capsys,
                                                                                      monkeypatch):
    """The planner's check runs once, after step 5 (the first 4 steady steps), between two steps: on the GPU it took
    1.3-1.7 s for Flux.1 and the next line read "step 6/8 ... 2.27 s/step, 1.7 img/s" (a step of 0.59 s). Here the
    check (run as on a GPU) takes 100 s of the status clock and the steps none: no line may say 100."""
    from test_train_support import make_config, write_images

    from trainer.train import monitor, streaming
    from trainer.train.trainer import Trainer

    clock, checks = [0.0], []

    def check(*args, **kwargs):
        checks.append(kwargs["steps"])
        clock[0] += 100.0

    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    monkeypatch.setattr(monitor, "_now", lambda: clock[0])
    monkeypatch.setattr(streaming, "check_plan", check)
    monkeypatch.setattr(Trainer, "_checks_plan", lambda self: True)
    images = write_images(tmp_path / "images", n=2)
    cfg = make_config(tiny_models, images, tmp_path / "out", tmp_path / "cache", "flux", train={"steps": 6})
    Trainer(cfg).fit()
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("step ")]
    assert checks == [4] and len(lines) == 6 and lines[5].startswith("step 6/6")
    assert all(", 0.00 s/step" in x for x in lines), lines  # not "100.00 s/step" at step 6


def test_status_without_a_terminal_is_a_line_every_5_percent_with_smoothed_loss_and_epoch(tmp_path, capsys,
                                                                                          monkeypatch):
    from trainer.train import monitor

    clock = [0.0]
    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    monkeypatch.setattr(monitor, "_now", lambda: clock[0])
    m = Monitor(tmp_path, total=40, start=0, tensorboard=False, run_id="R", epoch=lambda: 3)
    for s in range(1, 41):
        clock[0] += 0.5  # each step takes its step_time of wall time
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
    assert f"saved 0 sample images for step 2 in {tmp_path / 'samples'}" in capsys.readouterr().err
    ev = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    ev.Reload()
    scalars = set(ev.Tags()["scalars"]) | set(ev.Tags()["tensors"])
    assert {"train/step_time", "train/vram_gb", "train/loss_smoothed", "train/epoch"} <= scalars
    assert {"run/id/text_summary", "run/config/text_summary"} <= set(ev.Tags()["tensors"])
    config_text = ev.Tensors("run/config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "family: flux" in config_text


@pytest.mark.parametrize("tty", [False, True])
def test_progress_bars_are_drawn_only_on_a_terminal_and_status_goes_to_stderr(capsys, monkeypatch, tty):
    """Caching, merging and sampling bars (trainer/progress.py) stay out of a log file; `dittrain cache`'s status
    lines go to stderr like every other status line."""
    import sys

    from trainer.progress import bar

    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty, raising=False)
    b = bar(total=200, desc="encoding captions", unit="cap", mininterval=0)
    for _ in range(200):
        b.update(1)
    b.close()
    for _ in bar(range(3), desc="off", enabled=False):
        pass
    out, err = capsys.readouterr()
    assert out == ""
    assert ("encoding captions" in err) is tty and "off" not in err


def test_cache_command_prints_its_status_on_stderr_only(tiny_models, tmp_path):
    import yaml
    from PIL import Image

    imgs = tmp_path / "imgs"
    imgs.mkdir()
    for i in range(2):
        Image.new("RGB", (64, 64), (40 * i, 90, 160)).save(imgs / f"{i}.png")
        (imgs / f"{i}.txt").write_text(f"a square number {i}")
    cfg = {"model": {"family": "flux", "path": str(tiny_models / "flux"), "dtype": "fp32"}, "train": {"device": "cpu"},
           "data": {"sources": [{"path": str(imgs)}], "resolutions": [64], "cache_dir": str(tmp_path / "cache")},
           "output": {"dir": str(tmp_path / "out")}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    r = CliRunner().invoke(app, ["cache", str(tmp_path / "c.yaml")])
    assert r.exit_code == 0, r.output
    assert r.stdout == "" and "latents 0 reused, 2 encoded" in r.stderr
