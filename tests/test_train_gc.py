"""The trainer freezes what setup built out of the garbage collector's reach for the run (a full collection inside
a step cost 0.56-0.79 s on the H200 host: bench/speed/bench_gc.py) and lets it go again when the run closes."""

from __future__ import annotations

import gc

from test_train_support import make_config, write_images

from trainer.train.trainer import Trainer

TRAINER_GC_AS_IT_IS = True  # conftest.py: no freeze again after close here


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



def test_the_suite_freezes_again_after_an_unfreeze_without_counting_each_time():
    """conftest.py notes each gc.unfreeze() (a trainer's close) and freezes again after it; with nothing unfrozen it
    does not ask gc.get_freeze_count(), which walks every frozen object (~80 ms a test)."""
    import conftest

    gc.unfreeze()
    assert gc.get_freeze_count() == 0 and conftest._UNFROZEN[0]
    conftest._freeze_again_if_unfrozen()
    assert gc.get_freeze_count() > 10_000 and not conftest._UNFROZEN[0]
    asked = []
    real = gc.get_freeze_count
    try:
        gc.get_freeze_count = lambda: asked.append(1) or real()
        conftest._freeze_again_if_unfrozen()
    finally:
        gc.get_freeze_count = real
    assert asked == [] and real() > 10_000
