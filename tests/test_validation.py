"""Validation loss (data.validation, train.validate_every): a held-out set scored with fixed noise at fixed
timesteps, without gradients, through the streamed blocks; it never moves the training numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_train_support import make_config, write_images

from trainer.config import Config
from trainer.data.pipeline import plan_data
from trainer.data.sources import Item
from trainer.data.validation import holdout
from trainer.errors import UserError
from trainer.models import get_adapter
from trainer.train.trainer import Trainer


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("val-train"))


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("val-held"), n=2, size=80)  # other content than `images`


def _lines(out: Path) -> tuple[list[float], list[dict]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


def _cfg(tiny_models, images, out, cache, method="lora", validation=None, every=2, family="flux", **sections):
    train = {"steps": 4, **sections.pop("train", {})}
    d = make_config(tiny_models, images, out, cache, family, method, train=train, **sections).model_dump(mode="json")
    if validation is not None:
        d["data"]["validation"], d["train"]["validate_every"] = validation, every
    return Config.model_validate(d)


def test_config_checks():
    base = {"model": {"family": "flux", "path": "m"}, "output": {"dir": "o"},
            "data": {"sources": [{"path": "d"}]}}
    with pytest.raises(ValueError, match="go together"):
        Config.model_validate({**base, "train": {"validate_every": 10}})
    with pytest.raises(ValueError, match="go together"):
        Config.model_validate({**base, "data": {**base["data"], "validation": {"fraction": 0.1}}})
    with pytest.raises(ValueError, match="either sources"):
        Config.model_validate({**base, "train": {"validate_every": 10},
                               "data": {**base["data"], "validation": {"fraction": 0.1, "sources": [{"path": "v"}]}}})
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        Config.model_validate({**base, "train": {"validate_every": 10},
                               "data": {**base["data"], "validation": {"fraction": 0.1, "timesteps": [0.0, 0.5]}}})
    c = Config.model_validate({**base, "train": {"validate_every": 10},
                               "data": {**base["data"], "validation": {"fraction": 0.1}}})
    assert c.data.validation.timesteps == [0.1, 0.3, 0.5, 0.7, 0.9]


def test_holdout_is_seeded_by_content_not_order():
    items = [Item(file=f"f{i}", caption="", source=0, width=64, height=64, sha=f"{i:064x}") for i in range(10)]
    train, held = holdout(items, 0.2, seed=3)
    assert len(held) == 2 and len(train) == 8 and not {h.sha for h in held} & {t.sha for t in train}
    _, held_rev = holdout(items[::-1], 0.2, seed=3)
    assert {h.sha for h in held_rev} == {h.sha for h in held}
    assert len(holdout(items, 0.01, seed=3)[1]) == 1  # at least one
    with pytest.raises(UserError, match="leaves none to train on"):
        holdout(items[:1], 0.5, seed=3)


def test_fraction_holds_images_out_of_training(tiny_models, images, tmp_path):
    cfg = _cfg(tiny_models, images, tmp_path / "o", tmp_path / "cache", validation={"fraction": 0.25})
    plan = plan_data(cfg, get_adapter(cfg.model), progress=False)
    assert len(plan.items) == 3 and len(plan.validation.items) == 1
    assert plan.validation.items[0].sha not in {it.sha for it in plan.items}
    assert not plan.validation.overlap
    keys = {j.key for j in plan.latent_jobs()}
    assert plan.validation.latent_key(plan.validation.entries[0]) in keys  # encoded with the training set


def test_overlap_by_content_is_reported(tiny_models, images, tmp_path, capsys):
    copy = tmp_path / "copy"  # the same bytes as two training images, under other names
    copy.mkdir()
    for i in range(2):
        (copy / f"other{i}.png").write_bytes((images / f"img{i}.png").read_bytes())
        (copy / f"other{i}.txt").write_text("a caption")
    cfg = _cfg(tiny_models, images, tmp_path / "o", tmp_path / "cache", validation={"sources": [{"path": str(copy)}]})
    plan = plan_data(cfg, get_adapter(cfg.model), progress=False)
    assert len(plan.validation.overlap) == 2
    assert "2 of them are also training images" in plan.validation.summary()


@pytest.mark.parametrize(("family", "method"), [("flux", "lora"), ("flux", "full"), ("z-image", "lora"), ("chroma", "lora"),
                                                ("qwen-image-2.1", "lora"), ("flux3", "lora")])
def test_validation_leaves_training_bitwise_and_streams(family, method, tiny_models, images, held, tmp_path,
                                                        monkeypatch):
    """Training losses with validation on are those without it; the validation losses are finite, logged at
    steps 2 and 4, and the same (to rounding) with blocks streamed at 0.5 through the conductor's CPU path."""
    cache = tmp_path / "cache"
    val = {"sources": [{"path": str(held)}]}
    Trainer(_cfg(tiny_models, images, tmp_path / "plain", cache, method, family=family)).fit()
    Trainer(_cfg(tiny_models, images, tmp_path / "val", cache, method, validation=val, family=family)).fit()
    plain, _ = _lines(tmp_path / "plain")
    train, vals = _lines(tmp_path / "val")
    assert train == plain
    assert [v["step"] for v in vals] == [2, 4]
    assert all(math.isfinite(v["val_loss"]) and "val_loss_t0.5" in v for v in vals)
    assert vals[0]["val_loss"] != vals[1]["val_loss"]  # the weights moved in between

    monkeypatch.setattr(Trainer, "_can_stream", lambda self: True)
    Trainer(_cfg(tiny_models, images, tmp_path / "off", cache, method, validation=val, family=family,
                 offload={"transformer": 0.5})).fit()
    off_train, off_vals = _lines(tmp_path / "off")
    assert off_train == pytest.approx(train, rel=1e-6)
    for a, b in zip(off_vals, vals, strict=True):
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)


def test_validation_is_repeatable_and_draws_no_training_randomness(tiny_models, images, held, tmp_path):
    t = Trainer(_cfg(tiny_models, images, tmp_path / "o", tmp_path / "cache",
                     validation={"sources": [{"path": str(held)}], "timesteps": [0.2, 0.8]}, lora={"dropout": 0.1}))
    t.setup()
    try:
        rng, obj = torch.get_rng_state(), t.objective.state()
        first = t.validate()
        assert torch.equal(torch.get_rng_state(), rng) and torch.equal(t.objective.state(), obj)
        assert t.transformer.training  # back in training mode
        assert t.validate() == first  # fixed noise, fixed timesteps, dropout off: the same number
        assert set(first) == {"val_loss", "val_loss_t0.2", "val_loss_t0.8"}
        assert first["val_loss"] == pytest.approx((first["val_loss_t0.2"] + first["val_loss_t0.8"]) / 2)
        assert first["val_loss_t0.8"] != first["val_loss_t0.2"]
    finally:
        t.close()
