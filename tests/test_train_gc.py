"""The trainer freezes what setup built out of the garbage collector's reach for the run (a full collection inside
a step cost 0.56-0.79 s on the H200 host: bench/speed/bench_gc.py) and lets it go again when the run closes."""

from __future__ import annotations

import gc

from test_train_support import make_config, write_images

from trainer.train.trainer import Trainer

TRAINER_GC_AS_IT_IS = True  # conftest.py: the trainer's own freeze and unfreeze here


def test_setup_freezes_what_it_built_and_close_unfreezes(tiny_models, tmp_path):
    cfg = make_config(tiny_models, write_images(tmp_path / "images"), tmp_path / "out", tmp_path / "cache", "flux",
                      train={"steps": 1})
    t = Trainer(cfg)
    t.setup()
    try:
        assert gc.get_freeze_count() > 10_000  # the model, the libraries, the data
        frozen = gc.get_freeze_count()
        t.train_step()
        assert gc.get_freeze_count() <= frozen  # steps add nothing to the frozen generation (some of it is freed)
    finally:
        t.close()
    assert gc.get_freeze_count() == 0


def test_setups_collections_skip_what_was_alive_before(tiny_models, tmp_path, monkeypatch):
    """Every gc.collect() of setup (caching, releasing the encoders) runs with the libraries already frozen."""
    cfg = make_config(tiny_models, write_images(tmp_path / "images"), tmp_path / "out", tmp_path / "cache", "flux",
                      train={"steps": 1})
    gc.unfreeze()  # as a fresh `dittrain fit` process starts
    seen, inner = [], gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: (seen.append(gc.get_freeze_count()), inner(*a))[1])
    t = Trainer(cfg)
    try:
        t.setup()
    finally:
        t.close()
    assert seen and min(seen) > 10_000
