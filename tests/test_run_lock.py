"""One live `fit` per output.dir (trainer/train/lock.py): a second process is refused in one line naming the first
(pid, host, start), and a lock left by a killed run (SIGKILL) blocks nothing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_train_support import make_config, write_images
from typer.testing import CliRunner

from trainer.cli import app
from trainer.errors import UserError
from trainer.train.lock import LOCK_FILE, RunLock

ROOT = Path(__file__).resolve().parents[1]
HOLD = ("import sys, time\nfrom trainer.train.lock import RunLock\nRunLock(sys.argv[1]).acquire()\n"
        "print('locked', flush=True)\ntime.sleep(120)\n")


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock of tmp_path/out; killed with SIGKILL at the end (or by the test)."""
    out = tmp_path / "out"
    out.mkdir()
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    yield out, p
    p.kill()
    p.wait()


def test_a_second_process_is_refused_naming_the_first_and_a_killed_ones_lock_blocks_nothing(holder):
    out, p = holder
    with pytest.raises(UserError) as e:
        RunLock(out).acquire()
    line = str(e.value)
    started = time.strftime("%Y-%m-%d %H:%M", time.localtime(json.loads((out / LOCK_FILE).read_text())["started"]))
    assert line.startswith(f"{out} is in use by another dittrain fit (pid {p.pid} on {socket.gethostname()}, "
                           f"started {started}")
    assert line.endswith("wait for it to end or stop it, or train into another output.dir (--set output.dir=...)")
    assert "\n" not in line

    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == p.pid  # its file is left behind ...
    lock = RunLock(out).acquire()  # ... and locks again at once
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (out / LOCK_FILE).exists()


def test_a_lock_held_on_another_host_says_so(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    lock = RunLock(out).acquire()
    try:
        info = json.loads((out / LOCK_FILE).read_text())
        (out / LOCK_FILE).write_text(json.dumps({**info, "host": "elsewhere"}))
        import trainer.train.lock as lk

        monkeypatch.setattr(lk, "_HELD", {})  # as if another process held it
        with pytest.raises(UserError, match=rf"\(pid {os.getpid()} on elsewhere, started .*; that is another machine: "
                                            rf"if it is down, .* delete {out / LOCK_FILE} once you are sure"):
            RunLock(out).acquire()
    finally:
        lock.release()


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("lock-images"), n=2)


def test_fit_refuses_a_folder_another_fit_holds_before_touching_it(holder, tiny_models, images, tmp_path):
    out, p = holder
    (out / "run.json").write_text(json.dumps({"run_id": "theirs"}))
    (out / "tensorboard").mkdir()
    cfg = make_config(tiny_models, images, out, tmp_path / "cache", "flux", train={"steps": 2})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    for extra in ([], ["--overwrite"]):
        r = CliRunner().invoke(app, ["fit", str(tmp_path / "c.yaml"), *extra])
        assert r.exit_code == 1, r.output
        error = r.output.split("\n", 1)[1]  # after fit's first line, which says what loads (cli.py)
        assert error.startswith(f"error: {out} is in use by another dittrain fit (pid {p.pid} "), r.output
        assert json.loads((out / "run.json").read_text()) == {"run_id": "theirs"} and (out / "tensorboard").is_dir()
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    r = CliRunner().invoke(app, ["fit", str(tmp_path / "c.yaml"), "--overwrite"])  # the killed run's lock: no obstacle
    assert r.exit_code == 0, r.output
    assert not (out / LOCK_FILE).exists()  # let go at the end
