"""What the CLI prints besides its own lines: no library warnings the user can do nothing about."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: warnings diffusers printed on `make-tiny` and Chroma's plan / sample (the first), Krea 2's and Flux.3's plan
LIBRARY_WARNINGS = ("`FluxPosEmbed` is deprecated", "should be kept in float32")


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
