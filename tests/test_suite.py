"""The test session's own settings (conftest.py). Its garbage collector, in a test like any other: what lived before
the test is frozen, the trainer's own freeze and unfreeze do nothing (its close would make the ~0.5 M frozen objects
of the imports collectable again, and the next collection walk them all), and the run's objects are still
collected. Its order: the modules it runs first and last are the suite's."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import conftest
from test_train_support import make_config, write_images

from trainer.train import trainer as trainer_module
from trainer.train.trainer import Trainer


def test_a_trainer_leaves_the_frozen_imports_frozen_and_its_own_objects_collectable(tiny_models, tmp_path):
    assert isinstance(trainer_module.gc, conftest._TrainerGc) and trainer_module.gc.collect is gc.collect
    before = gc.get_freeze_count()
    assert before > 10_000  # the imports, frozen before this test
    cfg = make_config(tiny_models, write_images(tmp_path / "images", n=1), tmp_path / "out", tmp_path / "cache",
                      "flux", train={"steps": 1})
    t = Trainer(cfg)
    t.fit()
    model = weakref.ref(t.transformer)
    t.close()
    assert gc.get_freeze_count() > 10_000  # close unfroze nothing
    del t
    gc.collect()
    assert model() is None  # the run's model was never frozen: collected


def test_the_modules_run_first_and_last_exist():
    """conftest.FIRST and LAST name test modules of the suite (a renamed module would silently fall back to the file
    order), each once."""
    names = list(conftest.FIRST + conftest.LAST)
    assert len(set(names)) == len(names)
    missing = [n for n in names if not (Path(__file__).parent / f"{n}.py").is_file()]
    assert not missing, missing
