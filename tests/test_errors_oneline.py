"""Problems a user can fix end in one line and a known exit code, never a traceback: broken checkpoints (naming
the last intact one), unwritable folders (before the model loads), a full disk during a save, a LoRA that is not
safetensors, `--set` typos, and other trainers' key names."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from safetensors import SafetensorError
from test_train_support import make_config, write_images
from typer.testing import CliRunner

from trainer.cli import app
from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.train.trainer import Trainer


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("oneline-images"))


def _cfg(tiny_models, images, out: Path, cache: Path, **sections):
    return make_config(tiny_models, images, out, cache, "flux",
                       **{"train": {"steps": 4, "checkpoint_every": 2, "keep_checkpoints": 3}, **sections})


def _yaml(cfg, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


def _one_line(r, code: int, alone: bool = True) -> str:
    """The one error line; `alone`: nothing else was printed (the error came before any work)."""
    assert r.exit_code == code, r.output
    # fit's first line says what loads, before anything does (cli.py): not work
    lines = [x for x in r.output.strip().splitlines() if not x.startswith("fit ")]
    errors = [x for x in lines if x.startswith("error: ")]
    assert len(errors) == 1 and (len(lines) == 1 or not alone), r.output
    assert "Traceback" not in r.output and "None" not in errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def trained(tiny_models, images, tmp_path_factory):
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("oneline-run")
    Trainer(_cfg(tiny_models, images, root / "out", root / "cache")).fit()
    return root


def _break(folder: Path, how: str) -> None:
    if how == "truncated lora":
        from trainer.train.checkpoint import ADAPTER_STATE

        f = folder / ADAPTER_STATE  # the checkpoint's LoRA (named so nobody takes it for a finished LoRA)
        f.write_bytes(f.read_bytes()[:-100])
    elif how == "garbage state.json":
        (folder / "state.json").write_text("{not json")
    else:
        (folder / "rng.safetensors").unlink()


@pytest.mark.parametrize("how", ["truncated lora", "garbage state.json", "missing rng"])
def test_a_broken_checkpoint_names_itself_and_the_last_intact_one(how, trained, tiny_models, images, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(trained / "out", out)
    _break(out / "checkpoints" / "step-000004", how)
    cfg = _cfg(tiny_models, images, out, trained / "cache", train={"steps": 6, "checkpoint_every": 2})
    r = CliRunner().invoke(app, ["fit", str(_yaml(cfg, tmp_path / "c.yaml")), "--resume", "latest"])
    line = _one_line(r, 1)
    assert f"checkpoint {out / 'checkpoints' / 'step-000004'} is broken" in line
    assert f"the last intact one is {out / 'checkpoints' / 'step-000002'}" in line
    if how == "truncated lora":  # and that one resumes fine
        t = Trainer(cfg, resume=str(out / "checkpoints" / "step-000002"))
        t.fit()
        assert t.step == 6


def test_unwritable_output_dir_and_cache_dir_fail_before_the_model_loads(tiny_models, images, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    loads = []
    import trainer.models

    monkeypatch.setattr(trainer.models, "get_adapter", lambda *a: loads.append(a))
    for key, sections in (("output.dir", {}), ("data.cache_dir", {})):
        out = blocker / "out" if key == "output.dir" else tmp_path / "out"
        cache = blocker / "cache" if key == "data.cache_dir" else tmp_path / "cache"
        cfg = _cfg(tiny_models, images, out, cache, **sections)
        r = CliRunner().invoke(app, ["fit", str(_yaml(cfg, tmp_path / "c.yaml"))])
        line = _one_line(r, 1)
        assert line.startswith(f"error: {key} ") and "is not writable" in line
    assert loads == []  # nothing was loaded


def test_sample_out_that_cannot_be_written_fails_before_loading(tiny_models, images, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    cfg = _cfg(tiny_models, images, tmp_path / "out", tmp_path / "cache")
    r = CliRunner().invoke(app, ["sample", str(_yaml(cfg, tmp_path / "c.yaml")), "-p", "a cat", "--out",
                                 str(blocker / "imgs")])
    assert "--out" in _one_line(r, 1) and "is not writable" in r.output


def test_sample_lora_that_is_not_safetensors(tiny_models, images, tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"PK\x03\x04 this is a zip, not safetensors")
    cfg = _cfg(tiny_models, images, tmp_path / "out", tmp_path / "cache")
    r = CliRunner().invoke(app, ["sample", str(_yaml(cfg, tmp_path / "c.yaml")), "-p", "a cat", "--lora", str(bad)])
    assert f"{bad}: not a readable safetensors LoRA file" in _one_line(r, 1)


def test_disk_full_during_a_save_says_how_much_was_needed(tiny_models, images, tmp_path, monkeypatch):
    from trainer.train import saving as saving_mod

    def full(*a, **k):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
                              'space left on device" })')

    monkeypatch.setattr(saving_mod, "save_file", full)  # the rng file of the first checkpoint
    cfg = _cfg(tiny_models, images, tmp_path / "out", tmp_path / "cache")
    r = CliRunner().invoke(app, ["fit", str(_yaml(cfg, tmp_path / "c.yaml"))])
    line = _one_line(r, 1, alone=False)  # after two training steps
    assert "No space left on device while saving to" in line
    assert "a checkpoint needs about" in line and "is free there" in line
    assert not list((tmp_path / "out" / "checkpoints").glob("step-*"))


def test_no_checkpoint_yet_is_said_in_words(tiny_models, images, tmp_path):
    t = Trainer(_cfg(tiny_models, images, tmp_path / "out", tmp_path / "cache"))
    assert t._newest_checkpoint() == "none (no checkpoint was saved yet)"


def test_set_typo_blames_set_not_the_file(tmp_path, tiny_models, images):
    cfg = _cfg(tiny_models, images, tmp_path / "out", tmp_path / "cache")
    r = CliRunner().invoke(app, ["fit", str(_yaml(cfg, tmp_path / "c.yaml")), "--set", "foo.bar=1"])
    assert _one_line(r, 2).startswith("error: --set: unknown key 'foo'")


@pytest.mark.parametrize("key, section, dittrain", [
    ("learning_rate", "optimizer", "optimizer.lr"),
    ("network_dim", "lora", "lora.rank"),
    ("network_alpha", "lora", "lora.alpha"),
    ("max_train_steps", "train", "train.steps"),
    ("gradient_accumulation_steps", "train", "train.grad_accum"),
    ("train_batch_size", "optimizer", "train.batch_size"),  # found in the wrong section too
    ("save_every_n_steps", "train", "output.save_every"),
])
def test_other_trainers_key_names_get_dittrains_name(key, section, dittrain, tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"model": {"family": "flux", "path": "m"}, "output": {"dir": "o"},
                                 section: {key: 1}}))
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert e.value.exit_code == 2
    assert f"unknown key '{section}.{key}'; did you mean '{dittrain}'?" in str(e.value)
    assert "\n" not in str(e.value)
