"""What the CLI prints besides its own lines: no library warnings the user can do nothing about."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: warnings diffusers printed on `make-tiny` and Chroma's plan / sample (the first), Krea 2's and Flux.3's plan;
#: transformers' note that an image processor falls back to PIL without torchvision (any pipeline import on the CPU)
LIBRARY_WARNINGS = ("`FluxPosEmbed` is deprecated", "should be kept in float32", "requires torchvision (not installed)")


def test_make_tiny_and_plan_print_no_library_warnings(tiny_models, tmp_path):
    """In a fresh interpreter (a warning shows once per process, and pytest catches the in-process ones):
    make-tiny of Chroma, then plan of Chroma, Krea 2 and Flux.3 on their tiny models; stderr has none of them."""
    runs = [["make-tiny", "--family", "chroma", "--out", str(tmp_path / "tiny")]]
    runs += [["plan", str(ROOT / "configs" / "tiny" / f"{family}-lora.yaml"), "--set",
              f"model.path={tiny_models / family}"] for family in ("chroma", "krea2", "flux3")]
    script = ("import sys\nfrom trainer.cli import app\n"
              f"for args in {runs!r}:\n"
              "    try:\n        app(args)\n    except SystemExit as e:\n"
              "        assert not e.code, (args, e.code)\n")
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("dittrain plan:") == 3 and "wrote" in r.stdout
    assert not [line for line in r.stderr.splitlines() if any(w in line for w in LIBRARY_WARNINGS)], r.stderr


def test_help_names_every_family_whole_and_counts_them():
    """`dittrain --help` lists every registered family, none broken at its hyphens (click wrapped
    `qwen-\\nimage-edit`), and its first line counts them rather than naming three."""
    from typer.testing import CliRunner

    from trainer.cli import app
    from trainer.models import ADAPTERS

    for columns in ("80", "60"):
        out = CliRunner().invoke(app, ["--help"], env={"COLUMNS": columns}).output
        words = {w.strip(",.") for w in out.split()}
        assert set(ADAPTERS) <= words, set(ADAPTERS) - words
        assert not [line for line in out.splitlines() if line.rstrip().endswith("-")]
        assert f"({len(ADAPTERS)} families of image and video models" in " ".join(out.split())


def test_no_help_shows_a_python_type_as_metavar():
    """`sample --help` showed `--image <list[Path]>`; no command's help shows a Python type."""
    from typer.testing import CliRunner

    from trainer.cli import app

    for cmd in ("fit", "sample", "plan", "cache", "merge", "convert-lora", "presets", "make-tiny"):
        out = CliRunner().invoke(app, [cmd, "--help"], env={"COLUMNS": "80"}).output
        assert "list[" not in out and "Path]" not in out, (cmd, out)
    assert "--image PATH" in CliRunner().invoke(app, ["sample", "--help"], env={"COLUMNS": "80"}).output
