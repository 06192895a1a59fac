"""bench/program/bench_caption.py (issue 43): the full-size configs are the released models' (parameter counts on
the meta device), `--estimate` prints auto's pick per row without a GPU, the rows a command line plans, and the CPU
smoke (`--small`) runs every kind of row end to end for one family, and the family-dependent `ours` row for the
other (SMOKE_ROWS)."""

from __future__ import annotations

import json

import pytest
import torch

from bench.program import bench_caption as bc


@pytest.mark.parametrize(("family", "params"), [("qwen2.5-vl", 8_292_166_656), ("qwen3-vl", 8_767_123_696)])
def test_full_size_models_are_the_released_sizes(family, params):
    """Qwen2.5-VL-7B as Qwen-Image's text encoder counts it (trainer/models/qwen_image.py), Qwen3-VL-8B-Instruct as
    Qwen-Image 2.1's (trainer/models/qwen_image_21.py QWEN3_VL_8B), with their released shapes."""
    cfg = bc.model_config(family, small=False)
    with torch.device("meta"):
        model = bc.model_class(family)(cfg)
    assert sum(p.numel() for p in model.parameters()) == params
    text = cfg.get_text_config()
    if family == "qwen3-vl":
        assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.num_attention_heads,
                text.num_key_value_heads, text.head_dim, text.vocab_size) == (4096, 12288, 36, 32, 8, 128, 151936)
        v = cfg.vision_config
        assert (v.depth, v.hidden_size, v.intermediate_size, v.num_heads, v.patch_size, v.out_hidden_size,
                list(v.deepstack_visual_indexes)) == (27, 1152, 4304, 16, 16, 4096, [8, 16, 24])
    from trainer.models.tiny import qwen_tokenizer

    assert text.eos_token_id == qwen_tokenizer().convert_tokens_to_ids("<|im_end|>")  # the tiny tokenizer's ids


def test_estimate_counts_8bit_layers_and_the_batch():
    rows = bc.estimate("qwen2.5-vl", ["none", "fp8"], [4, 16], [7, 15], 64)
    by = {(r["quantize"], r["batch"], r["cap_gb"]): r for r in rows}
    assert len(by) == 8
    assert by["fp8", 4, 7]["layers_gb"] == pytest.approx(by["none", 4, 7]["layers_gb"] / 2, rel=0.01)
    for b in (4, 16):
        for cap in (7, 15):
            assert by["fp8", b, cap]["fraction"] <= by["none", b, cap]["fraction"]
            assert by["none", 16, cap]["fraction"] >= by["none", 4, cap]["fraction"]
    assert any(by["fp8", b, c]["fraction"] < by["none", b, c]["fraction"] for b in (4, 16) for c in (7, 15))
    assert by["none", 4, 15]["tokens_per_row"] == 1024 * 1024 // 28 ** 2 + 128 + 64


def test_plan_rows_per_batch():
    plan = bc._plan(["ours", "auto", "resident"], ["none", "fp8"], [4, 16], [7.0])
    assert plan == [("ours", 7.0, 4, "none"), ("ours", 7.0, 4, "fp8"), ("auto", 7.0, 4, "none"),
                    ("resident", 0.0, 4, "none"),
                    ("ours", 7.0, 16, "none"), ("ours", 7.0, 16, "fp8"), ("auto", 7.0, 16, "none"),
                    ("resident", 0.0, 16, "none")]
    assert bc._label("ours", 7.0, 16, "fp8") == "ours-cap7-b16-fp8" and bc._label("auto", 7.0, 4, "none") == "auto-cap7-b4"


#: the rows each family's smoke runs: every kind for one family; for the other, the `ours` row alone (the one whose
#: code reads the family: its blocks, its quantized Linears, auto's estimate), since the `auto` and `resident` rows
#: load any family through transformers' AutoModelForImageTextToText by the same code (a row is a process of its
#: own: ~8 s of imports and loading on an idle 2-core machine, several times that under a test run's load)
SMOKE_ROWS = {"qwen2.5-vl": ("ours", "auto", "resident"), "qwen3-vl": ("ours",)}


def test_the_smoke_runs_every_family_and_every_row():
    assert set(SMOKE_ROWS) == set(bc.FAMILIES) and all("ours" in r for r in SMOKE_ROWS.values())
    assert {k for r in SMOKE_ROWS.values() for k in r} == {"ours", "auto", "resident"}


def _rows_forked(monkeypatch, logs) -> None:
    """bench_caption's rows (`python -m bench.program.bench_caption --row ...`, each a process of its own, as on a
    GPU) forked from tests/_ranks.py's server, which imported torch, transformers and the trainer once, instead of
    a fresh interpreter importing them (~7 s of one core a row): subprocess.run as the bench calls it, stdout and
    stderr in one stream (what the bench writes to the row's log), the row's timeout kept."""
    import subprocess
    import sys

    from _ranks import Command

    run = subprocess.run
    module = "bench.program.bench_caption"

    def fork_row(cmd, *, capture_output, text, timeout, env, cwd, **kw):
        if cmd[:3] != [sys.executable, "-m", module] or not (capture_output and text) or kw:
            return run(cmd, capture_output=capture_output, text=text, timeout=timeout, env=env, cwd=cwd, **kw)
        log = logs / f"row-{len(list(logs.iterdir()))}.log"
        row = Command(module, cmd[3:], env, cwd, str(log))
        rc = row.wait(timeout)
        if rc is None:
            row.kill()
            raise subprocess.TimeoutExpired(cmd, timeout, log.read_text(), "")
        return subprocess.CompletedProcess(cmd, rc, log.read_text(), "")

    monkeypatch.setattr(subprocess, "run", fork_row)


@pytest.mark.parametrize("family", bc.FAMILIES)
def test_cpu_smoke_runs_every_row(family, tmp_path, monkeypatch):
    kinds = SMOKE_ROWS[family]
    out = tmp_path / "out"
    (tmp_path / "rows").mkdir()
    _rows_forked(monkeypatch, tmp_path / "rows")
    bc.main(["--small", "--model-family", family, "--images", "2", "--px", "64", "--tokens", "3", "--caps", "0",
             "--batches", "2", "--quantize", "fp8", "--rows", ",".join(kinds), "--work", str(tmp_path / "work"),
             "--out", str(out), "--row-timeout", "300"])
    result = json.loads((out / "caption.json").read_text())
    rows = {(r["kind"], r["quantize"]): r for r in result["rows"]}
    assert set(rows) == {("ours", "fp8"), ("auto", "none"), ("resident", "none")} & {
        (k, "fp8" if k == "ours" else "none") for k in kinds}
    for r in rows.values():
        assert "error" not in r, r
        assert r["images"] == 2 and r["images_per_s"] > 0 and r["batch"] == 2
    assert rows["ours", "fp8"]["fraction"] == 0.0  # auto on the CPU
    assert "--quantize fp8: the 28 Linears of the 4 decoder layers" in (out / "ours-cap0-b2-fp8.log").read_text()
    assert (out / "caption.md").read_text().count("\n| ") == 2 + len(kinds)  # the header, its rule and a line a row
    assert "| peak reserved GB | auto's estimate GB |" in (out / "caption.md").read_text()
    assert "estimate_gb" in rows["ours", "fp8"]  # None here: auto is 0 on the CPU without an estimate
