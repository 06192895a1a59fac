"""A family's other published size with presets of its own (issue 39): Wan2.1-T2V-1.3B's configs/wan-1.3b/, for the
8 GB cards the 14 B does not fit. The folder names the size (`preset_folder`, `preset_class`), the generator writes
it from the size's config (models/base.py `ModelAdapter.sized`), a plan of the preset without the folder counts the
size its model.path names (planner/meta.py `transformer_config`), `dittrain presets` lists it with the family, and
bench_program's `wan-1.3b` runs start from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import load_config
from trainer.errors import UserError
from trainer.models import adapter_class, preset_class, preset_folder

ROOT = Path(__file__).resolve().parents[1]
SIZE = ROOT / "configs" / "wan-1.3b"


def test_a_size_folder_is_its_family_at_that_size():
    wan = adapter_class("wan")
    assert preset_folder("wan-1.3b") == ("wan", "1.3b") and preset_folder("wan_i2v") == ("wan-i2v", None)
    assert preset_folder("wan2.2-a14b") == ("wan2.2-a14b", None)
    small = preset_class("wan-1.3b")
    assert small is preset_class("wan-1.3b") and issubclass(small, wan) and small.family == "wan"
    assert small.full_config == wan.full_variants["1.3b"] and small.full_config["num_layers"] == 30
    assert (small.full_name, small.preset_cards) == ("Wan2.1-T2V-1.3B", (8,))
    assert {r for r, _ in small.preset_clips} == {"480p"}  # a 480p model: no 720p rung
    assert wan.full_config["num_layers"] == 40 and wan.preset_clips is None and wan.measured_presets == {}
    assert adapter_class("wan-i2v").sizes() == {}  # a subclass family does not inherit the 1.3 B
    with pytest.raises(UserError, match="wan-1.3b"):
        preset_class("wan-2b")
    with pytest.raises(UserError, match="unknown family"):
        preset_folder("nosuch-1.3b")


def test_a_plan_without_the_folder_counts_the_size_model_path_names(tmp_path):
    from trainer.planner.meta import transformer_config

    wan = adapter_class("wan")
    cfg = load_config(SIZE / "lora-8gb.yaml")
    conf, source = transformer_config(cfg)
    assert conf == wan.full_variants["1.3b"] and "Wan2.1-T2V-1.3B config" in source
    conf, source = transformer_config(load_config(ROOT / "configs" / "wan" / "lora-12gb.yaml"))
    assert conf == wan.full_config and "full-size wan config" in source
    # a folder at hand is planned from its own config, whatever its name
    folder = tmp_path / "Wan2.1-T2V-1.3B-Diffusers"
    (folder / "transformer").mkdir(parents=True)
    (folder / "transformer" / "config.json").write_text('{"num_layers": 40}')
    cfg.model.path = folder
    assert transformer_config(cfg)[0] == {"num_layers": 40}


def test_the_8gb_presets_stream_umt5_for_text_caching_within_the_card():
    """The 14 B's 12 GB preset keeps most of UMT5-XXL (11.4 GB in bf16) on the GPU (offload.text_encoders 0.3,
    9.8 GB predicted): under a 7 GB cap its text caching ran out of memory. The 1.3 B's 8 GB presets stream it."""
    import re

    from trainer.planner.presets import HEADROOM_GB

    assert sorted(p.name for p in SIZE.glob("*.yaml")) == ["full-8gb.yaml", "lora-8gb.yaml"]
    for path in SIZE.glob("*.yaml"):
        cfg = load_config(path)
        head = path.read_text()
        assert cfg.model.family == "wan" and "Wan2.1-T2V-1.3B" in str(cfg.model.path) and "Wan2.1-T2V-1.3B " in head
        assert cfg.offload.text_encoders > 0 or cfg.model.quantize_text_encoders != "none", path
        caching = float(re.search(r"text caching ([\d.]+) GB", head).group(1))
        assert caching <= 8 - HEADROOM_GB, path
        assert (cfg.data.resolutions, cfg.data.clip_frames) == ([632], 81), path  # 480p x 81, as measured in 6.9 GB


@pytest.mark.slow
def test_the_shipped_size_presets_are_the_generators_output(tmp_path, capsys):
    """`python -m trainer.planner.presets --families wan-1.3b` writes configs/wan-1.3b/ byte for byte (the 14 B's
    configs/wan/ are written by `--families wan` too; that run takes minutes)."""
    from trainer.planner.presets import main

    assert main(["--out", str(tmp_path), "--families", "wan-1.3b"]) == 0
    assert "wan/" not in capsys.readouterr().out  # the size alone
    made = sorted(p.name for p in (tmp_path / "wan-1.3b").glob("*.yaml"))
    assert made == sorted(p.name for p in SIZE.glob("*.yaml"))
    for name in made:
        assert (tmp_path / "wan-1.3b" / name).read_text() == (SIZE / name).read_text(), name


def test_dittrain_presets_lists_a_size_with_its_family_and_alone():
    from typer.testing import CliRunner

    from trainer.cli import app
    from trainer.preset_files import find_presets, pick

    every = find_presets(ROOT / "configs")
    assert {p.family for p in pick(every, "wan")} == {"wan", "wan-1.3b"}  # not wan-i2v: a family of its own
    assert {p.family for p in pick(every, "wan-1.3b")} == {"wan-1.3b"}
    with pytest.raises(UserError, match="no presets folder wan-2b .wan's sizes with presets: wan-1.3b"):
        pick(every, "wan-2b")
    eight = pick(every, "wan", 8)
    assert {(p.family, p.method, p.vram_gb) for p in eight} == {("wan-1.3b", "lora", 8), ("wan-1.3b", "full", 8)}
    r = CliRunner().invoke(app, ["presets", "wan", "--vram", "8", "--dir", str(ROOT / "configs")])
    assert r.exit_code == 0 and "configs/wan-1.3b/" in r.output and "lora-8gb.yaml" in r.output, r.output


def test_bench_program_runs_the_13b_from_its_own_presets(tmp_path, capsys):
    """`--families wan-1.3b --card 8` started from configs/wan/lora-12gb.yaml (the 14 B's, the nearest card) and its
    text caching ran out of memory under the 7 GB cap; now from configs/wan-1.3b/ (the nearest of its cards on a
    larger one); a size without presets (HunyuanVideo 1.5's 720p) from its family's, and --smoke as the family's."""
    from bench.program import bench_program as bp
    from bench.program import program_video as pv

    def source(family, preset, card, smoke=False):
        path = bp.write_config(family, tmp_path / "model", tmp_path / "clips", tmp_path / "run", None, 4, smoke, card,
                               clips=pv.Clips(832, 480, 81, 9), preset=preset)
        return load_config(path), capsys.readouterr().out

    cfg, out = source("wan", "wan-1.3b", 8)
    assert "config from " + str(SIZE / "lora-8gb.yaml") + "\n" in out
    assert cfg.offload.text_encoders == load_config(SIZE / "lora-8gb.yaml").offload.text_encoders > 0
    assert "config from " + str(SIZE / "lora-8gb.yaml") + " (no lora-12gb preset: the nearest card's)" in source(
        "wan", "wan-1.3b", 12)[1]
    assert "configs/wan/lora-12gb.yaml (no lora-8gb preset" in source("wan", "wan", 8)[1]  # the 14 B: as before
    cfg, out = source("wan", "wan-1.3b", 8, smoke=True)  # the family's tiny config, or one built for the family
    assert "config from built here (no tiny config)" in out and cfg.model.family == "wan"
    cfg, out = source("hunyuan-video-1.5", "hunyuan-video-1.5-720p", 8)
    assert "configs/hunyuan-video-1.5/lora-8gb.yaml" in out and cfg.model.family == "hunyuan-video-1.5"
