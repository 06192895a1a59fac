"""Every YAML shipped in configs/ loads and validates; presets carry the header `dittrain presets` prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import load_config
from trainer.models import ADAPTERS
from trainer.presets import find_presets, print_presets

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))


def test_there_are_configs():
    assert CONFIGS, "configs/ holds no YAML"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    assert cfg.model.family in ADAPTERS


def test_sized_presets_have_a_header_with_expectations():
    for p in find_presets(ROOT / "configs"):
        if p.vram_gb is None:
            continue
        assert p.title and p.trains and p.expects, f"{p.path}: header needs a title, 'trains:' and 'expects:' lines"
        cfg = load_config(p.path)
        assert cfg.train.method == p.method, f"{p.path}: file name says {p.method}, config says {cfg.train.method}"


def test_print_presets_lists_each_file(capsys):
    print_presets(ROOT / "configs")
    out = capsys.readouterr().out
    for p in find_presets(ROOT / "configs"):
        assert str(p.path) in out
