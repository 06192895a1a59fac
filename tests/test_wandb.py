"""output.wandb: Weights & Biases logging, run offline (no network, no account), and its one-line errors."""

from __future__ import annotations

import json
import struct
import sys

import pytest
import yaml
from test_train_support import losses, make_config, write_images
from typer.testing import CliRunner

from trainer.cli import app


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("wandb-images"))


@pytest.fixture
def offline_home(tmp_path, monkeypatch):
    """W&B's settings, cache and data folders inside the test's folder, never the user's."""
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)


def _records(path):
    """The protobuf records of a W&B run file: a 7-byte header (':W&B', magic, version), then LevelDB-log records
    (crc32, little-endian length, type: 1 full, 2 first, 3 middle, 4 last) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little left in this block for a header: padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec


def test_offline_wandb_gets_the_runs_losses_config_and_id(tiny_models, images, tmp_path, offline_home):
    pytest.importorskip("wandb")  # `make test` installs it (the dev extra); only a hand-made env may lack it
    from trainer.train.trainer import Trainer

    out = tmp_path / "run"
    cfg = make_config(tiny_models, images, out, tmp_path / "cache", "flux", train={"steps": 3},
                      output={"dir": str(out), "tensorboard": False,
                              "wandb": {"project": "dittrain-test", "mode": "offline", "tags": ["tiny"]}})
    t = Trainer(cfg)
    t.fit()
    # run.finish() returns before W&B's service process has written the run's file (it only asks the service to
    # close the stream: right after it the file holds its 7-byte header alone); teardown waits for that process
    # to exit, files written. A CLI run gets the same at exit (W&B's atexit hook).
    import wandb

    wandb.teardown()
    files = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1 and files[0].name == f"run-{t.run.id}.wandb"  # the W&B run id is the dittrain run id
    logged, run = {}, None
    for rec in _records(files[0]):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            logged[items["_step"]] = items
        elif kind == "run":
            run = rec.run
    assert sorted(logged) == [1, 2, 3], [r.WhichOneof("record_type") for r in _records(files[0])]
    assert [logged[s]["train/loss"] for s in (1, 2, 3)] == pytest.approx(losses(out), rel=1e-6)
    assert all("train/lr" in v and "train/loss_smoothed" in v for v in logged.values())
    assert run is not None and run.project == "dittrain-test" and list(run.tags) == ["tiny"]
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["train"]["steps"] == 3 and config["model"]["family"] == "flux"


def test_wandb_set_without_the_package_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, installed or not
    data = write_images(tmp_path / "data", n=1)
    cfg = {"model": {"family": "flux", "path": str(tmp_path / "no-model")},
           "data": {"sources": [{"path": str(data)}], "resolutions": [64], "cache_dir": str(tmp_path / "cache")},
           "output": {"dir": str(tmp_path / "out"), "wandb": {"project": "x"}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    r = CliRunner().invoke(app, ["fit", str(tmp_path / "c.yaml")])
    lines = [x for x in r.output.strip().splitlines() if not x.startswith("fit ")]  # fit first says what loads
    assert r.exit_code != 0 and len(lines) == 1, r.output
    assert "pip install dittrain[wandb]" in lines[0] and "output.wandb" in lines[0]


def test_wandb_keys_are_checked_like_every_other_key(tmp_path):
    from trainer.config import load_config
    from trainer.errors import ConfigError

    base = {"model": {"family": "flux", "path": "m"}, "output": {"dir": "o", "wandb": {"mode": "offline"}}}
    (tmp_path / "ok.yaml").write_text(yaml.safe_dump(base))
    w = load_config(tmp_path / "ok.yaml").output.wandb
    assert (w.project, w.mode, w.name) == ("dittrain", "offline", None)
    base["output"]["wandb"] = {"mode": "ofline"}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(base))
    with pytest.raises(ConfigError, match="output.wandb.mode"):
        load_config(tmp_path / "bad.yaml")
