"""Config loading: unknown keys, wrong types, impossible combinations, --set overrides, and the CLI's exit code."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainer.cli import app
from trainer.config import load_config
from trainer.errors import ConfigError

BASE = """\
model:
  family: flux
  path: models/tiny/flux
train:
  steps: 5
data:
  sources:
    - path: data/shapes
output:
  dir: out/x
"""


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_valid_config_loads_with_defaults(tmp_path):
    cfg = load_config(_write(tmp_path, BASE))
    assert cfg.train.steps == 5
    assert cfg.train.method == "lora"
    assert cfg.offload.transformer == 0.0
    assert cfg.data.sources[0].path == Path("data/shapes")
    assert len(cfg.digest()) == 16


def test_unknown_key_names_file_line_and_suggestion(tmp_path):
    p = _write(tmp_path, BASE.replace("  steps: 5", "  stpes: 5"))
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert f"{p}:5" in msg
    assert "'train.stpes'" in msg
    assert "did you mean 'train.steps'" in msg


def test_unknown_key_inside_a_list_item(tmp_path):
    p = _write(tmp_path, BASE.replace("    - path: data/shapes", "    - path: data/shapes\n      repaets: 2"))
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "did you mean 'data.sources.0.repeats'" in str(e.value)
    assert f"{p}:9" in str(e.value)


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'optimizer'"):
        load_config(_write(tmp_path, BASE + "optimzer:\n  lr: 1\n"))


def test_wrong_type_is_one_clear_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, BASE.replace("steps: 5", "steps: five")))
    msg = str(e.value)
    assert "train.steps" in msg and "'five'" in msg and "\n" not in msg


def test_out_of_range_fraction(tmp_path):
    with pytest.raises(ConfigError, match="offload.transformer"):
        load_config(_write(tmp_path, BASE + "offload:\n  transformer: 1.5\n"))


@pytest.mark.parametrize(
    "extra, fix",
    [
        ("train:\n  method: full\noffload:\n  transformer: 0.5\n", "fused_back_pass: true"),
        ("offload:\n  transformer: auto\n", "vram_budget_gb"),
        ("optimizer:\n  fused_back_pass: true\n", "max_grad_norm: null"),
        ("optimizer:\n  fused_back_pass: true\n  max_grad_norm: null\ntrain:\n  grad_accum: 2\n", "grad_accum must be 1"),
        ("train:\n  method: full\n  gradient_checkpointing: false\noffload:\n  transformer: 0.5\noptimizer:\n"
         "  fused_back_pass: true\n  max_grad_norm: null\n", "gradient_checkpointing: true"),
    ],
)
def test_impossible_combinations_name_the_fix(tmp_path, extra, fix):
    text = BASE.replace("train:\n  steps: 5\n", "") + extra
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, text))
    assert fix in str(e.value)


def test_a_streamed_lora_may_keep_every_blocks_activations(tmp_path):
    text = BASE.replace("train:\n  steps: 5\n", "") + "train:\n  gradient_checkpointing: false\noffload:\n  transformer: 0.5\n"
    cfg = load_config(_write(tmp_path, text))
    assert cfg.train.gradient_checkpointing is False and cfg.offload.transformer == 0.5


def test_set_overrides_are_typed_and_validated(tmp_path):
    p = _write(tmp_path, BASE)
    cfg = load_config(p, ["train.steps=500", "offload.transformer=0.5", "sample.prompts=[a, b]"])
    assert cfg.train.steps == 500 and cfg.offload.transformer == 0.5 and cfg.sample.prompts == ["a", "b"]
    with pytest.raises(ConfigError, match=r"--set: unknown key 'train.lr'"):
        load_config(p, ["train.lr=1"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(p, ["train.steps"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "model: [\n"))


def test_cli_exits_2_with_suggestion(tmp_path):
    p = _write(tmp_path, BASE.replace("  steps: 5", "  stpes: 5"))
    result = CliRunner().invoke(app, ["fit", str(p)])
    assert result.exit_code == 2
    assert "did you mean 'train.steps'" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("cmd", ["fit", "sample", "plan", "cache", "presets", "make-tiny"])
def test_every_command_has_help(cmd):
    result = CliRunner().invoke(app, [cmd, "--help"])
    assert result.exit_code == 0
    assert len(result.output.splitlines()) > 5


def test_one_parse_gives_safe_loads_data_and_every_keys_line():
    """load_config parses a file once (libyaml's parser where PyYAML has it): the data is `yaml.safe_load`'s, and
    the line of each key and list item is where it stands (the error messages' `file:line`)."""
    import yaml

    from trainer.config import _read_yaml

    text = "model:\n  family: flux\n  path: /m\ndata:\n  sources:\n    - path: a\n      repeats: 2\n    - {path: b}\n" \
           "train:\n  lr: 1e-4\n  steps: 0x10\n  when: 2026-01-01\n"
    data, lines = _read_yaml(text)
    assert data == yaml.safe_load(text)
    assert lines == {("model",): 1, ("model", "family"): 2, ("model", "path"): 3, ("data",): 4,
                     ("data", "sources"): 5, ("data", "sources", 0): 6, ("data", "sources", 0, "path"): 6,
                     ("data", "sources", 0, "repeats"): 7, ("data", "sources", 1): 8,
                     ("data", "sources", 1, "path"): 8, ("train",): 9, ("train", "lr"): 10, ("train", "steps"): 11,
                     ("train", "when"): 12}
    assert _read_yaml("") == (None, {}) and _read_yaml("# only a comment\n") == (None, {})
