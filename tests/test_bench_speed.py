"""bench/bench_speed.py --smoke: the GPU benchmark's script runs end to end on the CPU (measures nothing)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path


def test_bench_speed_smoke(tmp_path):
    path = Path(__file__).resolve().parents[1] / "bench" / "bench_speed.py"
    spec = importlib.util.spec_from_file_location("bench_speed", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.main(["--smoke", "--backend", "eager", "--only", "offload 0.5, compiled;sample: dittrain resident, compiled",
                     "--out", str(tmp_path)])
    names = [r["name"] for r in rows]
    assert names == ["plain diffusers + peft, bf16 LoRA, eager, resident", "dittrain offload 0.5, compiled",
                     "sample: dittrain resident, compiled"]
    assert rows[1]["graphs"] >= 2 and rows[0]["compile_s"] is None
    md = (tmp_path / "speed_flux.md").read_text()
    assert "| dittrain offload 0.5, compiled |" in md and "<= 0.85" in md
    assert len(json.loads((tmp_path / "speed_flux.json").read_text())) == 3


def test_bench_speed_smoke_fp8_rows(tmp_path):
    """The fp8 + modulation rows, training and sampling (CPU smoke)."""
    path = Path(__file__).resolve().parents[1] / "bench" / "bench_speed.py"
    spec = importlib.util.spec_from_file_location("bench_speed", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.main(["--smoke", "--backend", "eager", "--only", "modulation", "--out", str(tmp_path)])
    names = [r["name"] for r in rows]
    assert names[1:] == ["dittrain offload 1.0 + act, fp8 base + modulation, compiled",
                         "sample: dittrain offload 1.0, fp8 + modulation, compiled"]
    assert all(r["spec"]["modulation"] and r["spec"]["quant"] == "fp8" for r in rows[1:])
    specs = {s["name"] for s in mod.row_specs("flux")}
    assert {"sample: dittrain offload 1.0, fp8, compiled", "dittrain offload 1.0 + act, fp8 base, compiled"} <= specs


def _bench():
    path = Path(__file__).resolve().parents[1] / "bench" / "bench_speed.py"
    spec = importlib.util.spec_from_file_location("bench_speed", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_speed_smoke_issue29_rows(tmp_path):
    """Issue 29's table (CPU smoke): checkpointing auto from the planner, fp8 matmul rows, ratios to plain
    compiled, the PCIe-floor columns."""
    mod = _bench()
    rows = mod.main(["--smoke", "--backend", "eager", "--rows", "issue29", "--only",
                     "compile_repeated_blocks;checkpointing auto;fp8 base, fp8 matmul", "--out", str(tmp_path)])
    names = [r["name"] for r in rows]
    assert names == ["plain diffusers + peft, bf16 LoRA, eager, resident", "plain + compile_repeated_blocks",
                     "dittrain offload 0, compiled, checkpointing auto",
                     "dittrain offload 1.0 + act, fp8 base, fp8 matmul, compiled",
                     "plain + compile_repeated_blocks, no checkpointing"]
    assert rows[3]["spec"]["fp8mm"] and "h2d_bytes" in rows[3]  # (the smoke ring may hold all three blocks)
    md = (tmp_path / "speed_flux_issue29.md").read_text()
    assert "| vs plain compiled |" in md and "<= 0.8 x plain compiled" in md
    every = {s["name"] for s in mod.issue29_specs("flux")}
    assert {"dittrain offload 0, compiled, checkpointing none", "dittrain offload 1.0 + act, compiled"} <= every
    assert "dittrain offload 1.0 + act, compiled" not in {s["name"] for s in mod.issue29_specs("qwen_image")}


def test_bench_speed_smoke_profile(tmp_path):
    mod = _bench()
    rows = mod.main(["--smoke", "--profile", "--out", str(tmp_path)])
    assert [r["name"] for r in rows] == ["plain diffusers + peft, bf16 LoRA, eager, resident",
                                         "dittrain offload 0, eager"]
    text = (tmp_path / "profile_flux.txt").read_text()
    assert "dittrain minus plain" in text and "Self CPU" in text
