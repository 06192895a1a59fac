"""A run owns its output folder (trainer/train/run.py): a fresh fit into a used folder stops with one line,
--overwrite clears it, pruning touches only the run's own checkpoints, resume refuses another run's checkpoint,
every checkpoint and metrics line carries the run id, per-step LoRAs are kept, files follow the umask."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file
from test_train_support import make_config, write_images
from typer.testing import CliRunner

from trainer.cli import app
from trainer.errors import UserError
from trainer.train import checkpoint as ck
from trainer.train import run as runs
from trainer.train.trainer import Trainer


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("run-images"))


def _fake_checkpoint(out: Path, step: int, run_id: str | None) -> Path:
    folder = ck.checkpoint_root(out) / f"step-{step:06d}"
    folder.mkdir(parents=True)
    state = {"step": step} | ({"run_id": run_id} if run_id else {})
    ck.write_json(folder / "state.json", state)
    save_file({"objective": torch.zeros(4, dtype=torch.uint8)}, str(folder / "rng.safetensors"))
    ck.write_json(folder / ck.MARKER, {"step": step, "files": ["rng.safetensors", "state.json"]})
    return folder


def _fake_run(out: Path, run_id: str, steps: list[int]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    ck.write_json(out / runs.RUN_FILE, {"run_id": run_id})
    for s in steps:
        _fake_checkpoint(out, s, run_id)


# ---------------------------------------------------------------------------------------------- folder rules (fast)


def test_a_fresh_run_into_a_used_folder_stops_and_offers_the_three_ways_out(tmp_path):
    _fake_run(tmp_path, "A", [50, 100])
    with pytest.raises(UserError) as e:
        runs.claim(tmp_path, None)
    msg = str(e.value)
    assert "\n" not in msg and "run A" in msg and "step 100" in msg
    assert "--resume latest" in msg and "--overwrite" in msg and "output.dir" in msg
    assert [s for s, _ in ck.list_checkpoints(tmp_path / "checkpoints")] == [50, 100]  # nothing touched


def test_overwrite_clears_only_dittrains_outputs(tmp_path):
    _fake_run(tmp_path, "A", [100])
    (tmp_path / "lora.safetensors").write_bytes(b"x")
    (tmp_path / "lora-step-000050.safetensors").write_bytes(b"x")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "notes.txt").write_text("mine")
    run = runs.claim(tmp_path, None, overwrite=True)
    assert run.id != "A" and runs.folder_run_id(tmp_path) == run.id
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "run.json"]


def test_a_folder_whose_run_saved_nothing_is_taken_over(tmp_path):
    _fake_run(tmp_path, "A", [])
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    run = runs.claim(tmp_path, None)
    assert run.id != "A" and not (tmp_path / "metrics.jsonl").exists()


def test_pruning_touches_only_this_runs_checkpoints_at_or_below_the_step(tmp_path):
    root = ck.checkpoint_root(tmp_path)
    for s in (60, 80, 100):
        _fake_checkpoint(tmp_path, s, "old")
    for s in (10, 20, 30):
        _fake_checkpoint(tmp_path, s, "new")
    _fake_checkpoint(tmp_path, 40, "new")  # a later checkpoint of this run (from before a resume at step 30)
    gone = runs.prune(root, "new", step=30, keep=2)
    assert [p.name for p in gone] == ["step-000010"]
    assert [s for s, _ in ck.list_checkpoints(root)] == [20, 30, 40, 60, 80, 100]


def test_resume_refuses_a_checkpoint_of_another_run_unless_told(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _fake_run(a, "A", [10])
    _fake_run(b, "B", [10])
    ckpt = a / "checkpoints" / "step-000010"
    with pytest.raises(UserError, match=r"checkpoint is of run A, but .* holds run B.*--resume-other-run"):
        runs.claim(b, ckpt)
    assert runs.claim(b, ckpt, allow_other_run=True).id == "A"
    # Into an empty folder the checkpoint's run simply continues there.
    assert runs.claim(tmp_path / "c", ckpt).id == "A"
    with pytest.raises(UserError, match="--overwrite and --resume"):
        runs.claim(b, ckpt, overwrite=True)


def test_resume_latest_is_the_newest_checkpoint_of_the_folders_run(tmp_path):
    _fake_run(tmp_path, "A", [10, 20])
    _fake_checkpoint(tmp_path, 90, "B")  # another run's checkpoint at a higher step (kept with --resume-other-run)
    assert runs.resolve_resume(tmp_path, "latest").name == "step-000020"


def test_fit_cli_refuses_a_used_folder_with_one_line_and_exit_code_1(tmp_path):
    out = tmp_path / "out"
    _fake_run(out, "A", [100])
    cfg = {"model": {"family": "flux", "path": str(tmp_path / "nomodel")}, "output": {"dir": str(out)},
           "data": {"sources": [{"path": str(tmp_path)}], "cache_dir": str(tmp_path / "cache")}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    r = CliRunner().invoke(app, ["fit", str(tmp_path / "c.yaml")])
    assert r.exit_code == 1
    lines = [x for x in r.output.strip().splitlines() if not x.startswith("fit ")]  # fit first says what loads
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--overwrite" in lines[0]


# ---------------------------------------------------------------------------------------------- real runs


def test_a_rerun_with_fewer_steps_is_refused_then_overwrite_trains_cleanly(tiny_models, images, tmp_path):
    cache = tmp_path / "cache"
    first = make_config(tiny_models, images, tmp_path / "rep", cache, "flux",
                        train={"steps": 4, "checkpoint_every": 2, "keep_checkpoints": 5},
                        output={"dir": str(tmp_path / "rep"), "tensorboard": False, "save_every": 2, "name": "cat"})
    old = os.umask(0o027)
    try:
        Trainer(first).fit()
    finally:
        os.umask(old)
    out = tmp_path / "rep"
    rid = runs.folder_run_id(out)
    # The run id is in run.json, every checkpoint and every metrics line; a LoRA per save_every step is kept.
    for _, p in ck.list_checkpoints(out / "checkpoints"):
        assert json.loads((p / "state.json").read_text())["run_id"] == rid
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["run"] for r in rows} == {rid} and [r["epoch"] for r in rows] == [1, 1, 2, 2]
    assert (out / "cat-step-000002.safetensors").is_file() and (out / "cat-step-000004.safetensors").is_file()
    # Files follow the umask (safetensors alone writes -rw-------).
    for f in [out / "lora.safetensors", out / "checkpoints" / "step-000002" / "optimizer.safetensors"]:
        assert stat.S_IMODE(f.stat().st_mode) == 0o640, f

    lora_before = (out / "lora.safetensors").read_bytes()
    second = first.model_copy(update={"train": first.train.model_copy(update={"steps": 2})})
    with pytest.raises(UserError, match="--resume latest"):
        Trainer(second).fit()
    assert (out / "lora.safetensors").read_bytes() == lora_before
    assert [s for s, _ in ck.list_checkpoints(out / "checkpoints")] == [2, 4]
    # A resume past train.steps has nothing to train: refused, the final LoRA untouched.
    with pytest.raises(UserError, match="at step 4 and train.steps is 2"):
        Trainer(second, resume="latest").fit()
    assert (out / "lora.safetensors").read_bytes() == lora_before

    t = Trainer(second, overwrite=True)
    t.fit()
    assert t.run.id != rid and runs.folder_run_id(out) == t.run.id
    assert [s for s, _ in ck.list_checkpoints(out / "checkpoints")] == [2]
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert not (out / "cat-step-000004.safetensors").exists()


def test_a_resume_that_would_end_below_the_folders_weights_is_refused(tmp_path):
    _fake_run(tmp_path, "A", [20, 100])
    state = {"step": 20}
    ckpt = tmp_path / "checkpoints" / "step-000020"
    with pytest.raises(UserError, match="already holds this run's weights at step 100, beyond train.steps 40"):
        runs.check_target(state, 40, ckpt, tmp_path)
    runs.check_target(state, 100, ckpt, tmp_path)  # recomputing the same run to its end replaces nothing new
    runs.check_target(state, 40, ckpt, tmp_path / "elsewhere")  # into another folder
