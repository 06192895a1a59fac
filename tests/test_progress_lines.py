"""Without a terminal (a log file, a pipe), long phases still speak: `fit` says what it loads before the config's and the trainer's slow imports,
and caching prints a line as each stage starts and at least every LINES_EVERY_S while it runs (trainer/progress.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from PIL import Image
from typer.testing import CliRunner

from trainer import progress
from trainer.cli import app


def _config(tiny_models, tmp_path) -> str:
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    for i in range(2):
        Image.new("RGB", (64, 64), (40 * i, 90, 160)).save(imgs / f"{i}.png")
        (imgs / f"{i}.txt").write_text(f"a square number {i}")
    cfg = {"model": {"family": "flux", "path": str(tiny_models / "flux"), "dtype": "fp32"},
           "train": {"device": "cpu", "steps": 3},
           "data": {"sources": [{"path": str(imgs)}], "resolutions": [64], "cache_dir": str(tmp_path / "cache")},
           "output": {"dir": str(tmp_path / "out")}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    return str(tmp_path / "c.yaml")


def test_without_a_terminal_a_lines_bar_prints_at_its_start_and_then_at_most_every_interval(capsys, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(progress, "_now", lambda: clock[0])
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    with progress.bar(total=5, desc="encoding latents", unit="img", lines=True) as b:
        b.update(1)  # at once: no line
        clock[0] += progress.LINES_EVERY_S
        b.update(1)
        b.update(1)  # right after a line: none
    assert capsys.readouterr().err.splitlines() == ["encoding latents 0/5 img", "encoding latents 2/5 img"]
    with progress.bar(total=5, desc="off", lines=True, enabled=False) as b:
        b.update(5)
    assert capsys.readouterr().err == ""  # not asked for: silent, as a plain bar


def test_a_piped_cache_run_says_what_it_encodes(tiny_models, tmp_path):
    r = CliRunner().invoke(app, ["cache", _config(tiny_models, tmp_path)])  # CliRunner's stderr is no terminal
    assert r.exit_code == 0, r.output
    err = r.stderr.splitlines()
    # each stage's line comes before its encoders load, then the summary
    assert err.index("encoding captions 0/3 cap") < err.index("encoding latents 0/2 img") < len(err) - 1
    assert "latents 0 reused, 2 encoded" in err[-1]


def test_fit_says_what_it_loads_before_the_config_and_the_trainer(tiny_models, tmp_path, monkeypatch):
    from trainer.errors import UserError
    from trainer.train import trainer

    class Stop:
        def __init__(self, *a, **kw):
            raise UserError("the trainer was built here")

    monkeypatch.setattr(trainer, "Trainer", Stop)
    config = _config(tiny_models, tmp_path)
    r = CliRunner().invoke(app, ["fit", config])
    err = r.stderr.splitlines()
    assert err[0] == f"fit {config}: loading torch, diffusers and the trainer"
    assert any("the trainer was built here" in e for e in err[1:])
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(config).read_text().replace("steps: 3", "stpes: 3"))
    r = CliRunner().invoke(app, ["fit", str(bad)])  # before the config is read, too
    assert r.exit_code == 2 and r.stderr.splitlines()[0] == f"fit {bad}: loading torch, diffusers and the trainer"
