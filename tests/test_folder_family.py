"""A model folder of another family is refused in one line before anything loads (trainer/models/folder.py): the
folder, the class found there, the family it belongs to (from the registry) and `model.family: X` as the fix; in
every command that reads model.path, and in the adapter's own load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from test_train_support import make_config, write_images
from typer.testing import CliRunner

from trainer.cli import app
from trainer.errors import UserError
from trainer.models import ADAPTERS, adapter_class, get_adapter
from trainer.models._diffusers import DiffusersAdapter
from trainer.models.folder import check_folder_family


def _fake_folder(root: Path, family: str) -> Path:
    """Only the JSON files the check reads, as the family's own pipeline would save them."""
    cls = adapter_class(family)
    index = {"_class_name": cls.pipeline_cls.__name__, "transformer": ["diffusers", cls.transformer_cls.__name__],
             "vae": ["diffusers", cls.vae_cls_name]}
    index.update({d: ["transformers", c] for d, c in zip(cls.text_encoder_dirs, cls.text_encoder_classes, strict=True)})
    folder = root / family
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps(index))
    (folder / "transformer" / "config.json").write_text(json.dumps({"_class_name": cls.transformer_cls.__name__}))
    return folder


@pytest.fixture(scope="module")
def fakes(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fake-folders")
    for family in ADAPTERS:
        _fake_folder(root, family)
    return root


def _twins(family: str, other: str) -> bool:
    """Families these files cannot tell apart: the same transformer and pipeline classes (a family of experts
    with its base model's classes, whose folder differs in what it holds)."""
    a, b = adapter_class(family), adapter_class(other)
    return a.transformer_cls is b.transformer_cls and a.pipeline_cls is b.pipeline_cls


def test_every_family_accepts_its_own_folder_and_refuses_every_other_naming_the_owner(fakes):
    for family in ADAPTERS:
        check_folder_family(fakes / family, family)
        for other in ADAPTERS:
            if other == family or _twins(family, other):
                continue
            with pytest.raises(UserError) as e:
                check_folder_family(fakes / other, family)
            line = str(e.value)
            owners = [f for f in ADAPTERS if f == other or _twins(f, other)]
            assert "\n" not in line
            assert line.startswith(f"model.path {fakes / other} holds a model of family {' or '.join(owners)} (")
            fix = f"set model.family: {other}," if len(owners) == 1 else "set model.family to the folder's family ("
            assert f"model.family is {family}: {fix}" in line


def test_families_sharing_a_transformer_class_are_told_apart_by_the_pipeline(fakes):
    shared = {}
    for family in ADAPTERS:
        shared.setdefault(adapter_class(family).transformer_cls, []).append(family)
    pairs = [(a, b) for group in shared.values() for a in group for b in group if a != b and not _twins(a, b)]
    assert pairs  # the registry has such families (e.g. an edit model of a text-to-image architecture)
    for family, other in pairs:
        with pytest.raises(UserError, match=rf"model_index\.json names {adapter_class(other).pipeline_cls.__name__}; "
                                            rf".*set model\.family(: | to the folder's family \(.*){other}"):
            check_folder_family(fakes / other, family)


def test_a_class_no_family_declares_and_a_community_pipeline(fakes, tmp_path):
    family = next(iter(ADAPTERS))
    cls = adapter_class(family)
    folder = tmp_path / "unet"
    shutil.copytree(fakes / family, folder)
    (folder / "transformer" / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))
    with pytest.raises(UserError, match=rf"names UNet2DConditionModel, which no dittrain family uses \(model\.family "
                                        rf"{family} needs {cls.transformer_cls.__name__}\)"):
        check_folder_family(folder, family)

    # A pipeline no family declares (a community folder) passes when its components are the family's own ...
    index = json.loads((fakes / family / "model_index.json").read_text())
    folder = tmp_path / "community"
    shutil.copytree(fakes / family, folder)
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "SomeCommunityPipeline"}))
    check_folder_family(folder, family)
    # ... and is refused when a text encoder is another family's
    other = next(f for f in ADAPTERS if adapter_class(f).text_encoder_classes[0] not in cls.text_encoder_classes)
    wrong = adapter_class(other).text_encoder_classes[0]
    index = {**index, "_class_name": "SomeCommunityPipeline", cls.text_encoder_dirs[0]: ["transformers", wrong]}
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match=rf"model_index\.json's {cls.text_encoder_dirs[0]} names {wrong}"):
        check_folder_family(folder, family)


def test_a_missing_folder_or_files_are_left_to_the_load(tmp_path):
    family = next(iter(ADAPTERS))
    check_folder_family(tmp_path / "nowhere", family)  # the load names what is missing
    (tmp_path / "empty").mkdir()
    check_folder_family(tmp_path / "empty", family)
    (tmp_path / "bad" / "transformer").mkdir(parents=True)
    (tmp_path / "bad" / "transformer" / "config.json").write_text("{oops")
    with pytest.raises(UserError, match=r"transformer/config\.json: not a readable JSON config"):
        check_folder_family(tmp_path / "bad", family)


def _other_folder(tiny_models: Path, family: str) -> tuple[str, Path]:
    """A tiny model folder of a family with another transformer class than `family`'s."""
    mine = adapter_class(family).transformer_cls
    other = next(f for f in ADAPTERS if adapter_class(f).transformer_cls is not mine)
    return other, tiny_models / next(iter(adapter_class(other).own_tiny_builders()))


@pytest.mark.parametrize("command", ["cache", "plan", "fit", "sample", "merge"])
def test_every_command_refuses_another_familys_folder_before_anything_loads(command, tiny_models, tmp_path,
                                                                          monkeypatch):
    family = next(iter(ADAPTERS))
    other, folder = _other_folder(tiny_models, family)
    cfg = make_config(tiny_models, write_images(tmp_path / "img", n=2), tmp_path / "out", tmp_path / "cache", family)
    data = cfg.model_dump(mode="json")
    data["model"]["path"] = str(folder)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))

    def no_load(*a, **k):
        raise AssertionError("loaded weights of another family's folder")

    monkeypatch.setattr(DiffusersAdapter, "load", no_load)
    r = CliRunner().invoke(app, [command, str(tmp_path / "c.yaml")])
    assert r.exit_code == 1, r.output
    lines = [x for x in r.output.strip().splitlines() if not x.startswith("fit ")]  # fit first says what loads
    assert len(lines) == 1 and lines[0].startswith(f"error: model.path {folder} holds a model of family {other} ("), \
        r.output
    assert f"set model.family: {other}," in r.output
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()


def test_the_adapters_own_load_checks_the_folder_too(tiny_models):
    family = next(iter(ADAPTERS))
    other, folder = _other_folder(tiny_models, family)
    cfg = make_config(tiny_models, tiny_models, tiny_models, tiny_models, family).model
    cfg = cfg.model_copy(update={"path": folder})
    import torch

    for parts in ({"text"}, {"vae"}, {"transformer"}):  # caching loads no transformer: the check is not its
        with pytest.raises(UserError, match=rf"holds a model of family {other} "):
            get_adapter(cfg).load(cfg, parts=parts, dtype=torch.float32)


def test_a_single_file_transformer_of_another_family_is_refused_and_its_own_passes(tiny_models):
    family = next(iter(ADAPTERS))
    other, folder = _other_folder(tiny_models, family)
    own = tiny_models / next(iter(adapter_class(family).own_tiny_builders()))
    check_folder_family(own, family, next((own / "transformer").glob("*.safetensors")))
    theirs = next((folder / "transformer").glob("*.safetensors"))
    with pytest.raises(UserError) as e:
        check_folder_family(own, family, theirs)
    assert str(e.value).startswith(f"model.transformer_file {theirs} holds a {other} transformer (its keys are "
                                   f"{adapter_class(other).transformer_cls.__name__}'s), but model.family is {family}: "
                                   f"set model.family: {other} with model.path at that family's config folder")
