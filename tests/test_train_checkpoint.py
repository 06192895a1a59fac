"""Checkpoint folders: atomic, complete-only, pruned after the new one is in place, resume paths checked."""

from __future__ import annotations

import os

import pytest

from trainer.errors import UserError
from trainer.train import checkpoint as ck


def _writer(payload: str):
    def write(tmp):
        (tmp / "a.txt").write_text(payload)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.txt").write_text(payload * 2)

    return write


def test_write_list_and_prune(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30):
        ck.write_checkpoint(root, step, _writer(str(step)), keep=2)
    found = ck.list_checkpoints(root)
    assert [s for s, _ in found] == [20, 30]
    assert (found[-1][1] / "a.txt").read_text() == "30"
    assert ck.is_complete(found[-1][1])
    assert sorted(p.name for p in root.iterdir()) == ["step-000020", "step-000030"]  # no temp left


def test_interrupted_write_leaves_previous_checkpoint_loadable(tmp_path):
    root = tmp_path / "checkpoints"
    ck.write_checkpoint(root, 10, _writer("ten"), keep=1)

    def dies_midway(tmp):
        (tmp / "a.txt").write_text("half")
        raise KeyboardInterrupt  # a second Ctrl-C, or a kill, in the middle of writing

    with pytest.raises(KeyboardInterrupt):
        ck.write_checkpoint(root, 20, dies_midway, keep=1)
    assert [s for s, _ in ck.list_checkpoints(root)] == [10]
    assert ck.resolve_resume(tmp_path, "latest") == root / "step-000010"
    assert (root / "step-000010" / "a.txt").read_text() == "ten"


def test_hard_kill_leaves_temp_folder_that_is_ignored_and_cleaned(tmp_path):
    root = tmp_path / "checkpoints"
    ck.write_checkpoint(root, 10, _writer("ten"), keep=1)
    # What a SIGKILL during a write leaves: a temp folder and a folder without the marker.
    (root / ".tmp-step-000020-123").mkdir()
    (root / ".tmp-step-000020-123" / "a.txt").write_text("half")
    (root / "step-000030").mkdir()
    assert ck.resolve_resume(tmp_path, "latest").name == "step-000010"
    with pytest.raises(UserError, match="incomplete"):
        ck.resolve_resume(tmp_path, str(root / "step-000030"))
    ck.remove_partial(root)
    assert not (root / ".tmp-step-000020-123").exists()


def test_kill_between_the_two_renames_restores_the_old_folder(tmp_path):
    root = tmp_path / "checkpoints"
    ck.write_checkpoint(root, 10, _writer("ten"), keep=1)
    os.replace(root / "step-000010", root / ".old-step-000010-99")
    ck.remove_partial(root)
    assert ck.resolve_resume(tmp_path, "latest").name == "step-000010"


def test_rewriting_a_step_replaces_it(tmp_path):
    root = tmp_path / "checkpoints"
    ck.write_checkpoint(root, 10, _writer("old"), keep=2)
    ck.write_checkpoint(root, 10, _writer("new"), keep=2)
    assert (root / "step-000010" / "a.txt").read_text() == "new"
    assert [p.name for p in root.iterdir()] == ["step-000010"]


def test_missing_resume_is_an_error_never_a_fresh_start(tmp_path):
    with pytest.raises(UserError, match="no complete checkpoint"):
        ck.resolve_resume(tmp_path, "latest")
    with pytest.raises(UserError, match="no such checkpoint"):
        ck.resolve_resume(tmp_path, str(tmp_path / "nope"))


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    p = tmp_path / "lora.safetensors"
    p.write_text("good")

    def fails(tmp):
        tmp.write_text("partial")
        raise OSError("disk full")

    with pytest.raises(OSError):
        ck.atomic_write(p, fails)
    assert p.read_text() == "good"
    assert [x.name for x in tmp_path.iterdir()] == ["lora.safetensors"]
