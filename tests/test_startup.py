"""Where a command's first seconds go (issue 46 item 7): the cyclic collector is paused while the first config
validation imports torch and diffusers, what they built is frozen, and the CLI freezes again at exit, so no
collection walks the libraries' ~0.7 M objects, during the imports or after; the demo's report reads its config
without importing the family's module at all. These tests check the mechanism, never the clock."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest

from trainer import cli, config
from trainer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def freezes(monkeypatch):
    """gc.freeze calls, each with whether the collector was on then (recorded, not made: the suite's own freezing
    stays as conftest.py sets it)."""
    calls = []
    monkeypatch.setattr(gc, "freeze", lambda: calls.append(gc.isenabled()))
    return calls


def test_the_first_load_pauses_the_collector_then_freezes_and_restarts_it(monkeypatch, freezes):
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as in a fresh `dittrain` process, which has not imported torch yet
    with config._libraries_loading():
        on_inside = gc.isenabled()
    assert (on_inside, freezes, gc.isenabled()) == (False, [False], True)  # frozen while paused, then back on
    with pytest.raises(ConfigError), config._libraries_loading():  # a config error on the way: the same
        raise ConfigError("x")
    assert (freezes, gc.isenabled()) == ([False, False], True)


def test_once_torch_is_imported_the_collector_is_left_alone(freezes):
    import torch  # noqa: F401 - a second load in one process, or a test
    with config._libraries_loading():
        assert gc.isenabled()
    gc.disable()  # a caller that runs with the collector off keeps it off
    try:
        with config._libraries_loading():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert freezes == []


def test_load_config_validates_inside_the_pause(monkeypatch):
    seen = []

    class Pause:
        def __enter__(self):
            seen.append("paused")

        def __exit__(self, *exc):
            seen.append("resumed")

    validate = config.Config.model_validate
    monkeypatch.setattr(config, "_libraries_loading", Pause)
    monkeypatch.setattr(config.Config, "model_validate", lambda data, **kw: (seen.append("validate"), validate(data, **kw))[1])
    config.load_config(ROOT / "configs/tiny/flux-lora.yaml")
    assert seen == ["paused", "validate", "resumed"]


def test_the_cli_freezes_the_heap_as_the_process_ends(monkeypatch, freezes):
    monkeypatch.setattr(cli, "app", lambda **kw: sys.exit(3))  # what typer does after any command
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 3 and freezes == [True]


def test_the_demo_report_reads_its_config_without_the_family_adapter(monkeypatch, tmp_path):
    """`make demo`'s last step draws PNGs: its config's checks leave out the family's facts, whose module imports
    diffusers and transformers (most of the report's start-up); every other check still runs."""
    import trainer.models
    from trainer.demo import write_report

    class AdapterAsked(Exception):  # not a ValueError: pydantic would make it a config error
        pass

    def no_adapter(family):
        raise AdapterAsked(f"the report asked for the {family} adapter")

    monkeypatch.setattr(trainer.models, "adapter_class", no_adapter)
    monkeypatch.chdir(ROOT)  # the config's data/ path is relative to the repository
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.0}\n')
    picture, plot = write_report(ROOT / "configs/tiny/flux-demo.yaml", [f"output.dir={tmp_path}"])
    assert picture.is_file() and plot.is_file()
    with pytest.raises(AdapterAsked, match="flux adapter"):  # a command's load still checks the family's facts
        config.load_config(ROOT / "configs/tiny/flux-demo.yaml")
    with pytest.raises(ConfigError, match="train.stepz"):  # and the report's, everything else
        config.load_config(ROOT / "configs/tiny/flux-demo.yaml", ["train.stepz=1"], family_checks=False)
