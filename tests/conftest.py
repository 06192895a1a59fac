"""Shared fixtures. `tiny_models`: every family's tiny random model, written once per test session.

The suite is hermetic: at import, before torch compiles anything, the caches a test could share with other runs
(inductor's FX graph / AOTAutograd caches and its C++ kernels, triton's kernels, the Hugging Face caches) are
pointed at one fresh folder per test session. pytest-xdist's workers inherit the controller's folder (so they
share what one of them compiled, all at the suite's thread count), and so does any process a test starts (they
inherit the environment). The controller removes it at the end. Nothing is ever downloaded: HF_HUB_OFFLINE."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

_SESSION = "DITTRAIN_TEST_CACHES"  # the session's cache folder, set by the controller, read by its workers


def _hermetic_caches() -> str:
    """The session's fresh cache folder, made by the controller (or a run without xdist); a worker takes its
    controller's. Points every machine-wide cache the suite touches there."""
    home = os.environ.get(_SESSION)
    if not (os.environ.get("PYTEST_XDIST_WORKER") and home and os.path.isdir(home)):
        home = tempfile.mkdtemp(prefix="dittrain-tests-")
        os.environ[_SESSION] = home
    os.environ.update(
        TORCHINDUCTOR_CACHE_DIR=os.path.join(home, "inductor"),  # torch's default: one per user in /tmp, shared
        TRITON_CACHE_DIR=os.path.join(home, "triton"),
        HF_HOME=os.path.join(home, "huggingface"),
        HF_HUB_OFFLINE="1",
        TORCH_HOME=os.path.join(home, "torch"),
    )
    return home


SESSION_CACHES = _hermetic_caches()


def _freeze_what_lives() -> None:
    import gc

    gc.collect()
    gc.freeze()


def pytest_collection_finish(session):
    """Everything imported by now (torch, dynamo, diffusers, transformers, every test module: ~0.5 M objects in a
    worker that collected the whole suite) lives to the end of the session: move it into the garbage collector's
    permanent generation, so that the trainer's, the cache's and the sampler's `gc.collect()` calls (about six per
    fit, to hand memory back) and Python's own full collections scan only what the tests made since, not the
    imports each time (~0.3-0.5 s a call on 2 cores, microseconds frozen). Objects made later are collected as
    before."""
    _freeze_what_lives()


# The order the suite runs in (`make test`: two xdist workers, --dist worksteal, each starting on one contiguous
# half of it and stealing the back half of the other's queue when its own is empty). The longest modules first
# (-n 0 wall seconds on the 2-core CPU, 2026-11-28, imports included: multi-process launches, compiles), so a
# worker's queue ends in short tests and no long one is left running alone at the end; the modules of many short
# tests last, so the second half is mostly theirs and its worker soon steals into the long ones. The others keep
# their file order between. A module's tests stay together and in their order (module-scoped fixtures built once).
FIRST = ("test_wan22_both", "test_ideogram4", "test_fsdp", "test_distributed", "test_bench_speed", "test_planner_kv",
         "test_sharded_stream", "test_chroma_attention", "test_stream_load", "test_more_families", "test_compile",
         "test_hunyuan_video15_tiles", "test_hidream", "test_validation", "test_nano_batches", "test_owners",
         "test_train_faults", "test_flux3", "test_flux3_pairs")
LAST = ("test_family_sizes", "test_lora_format", "test_layout", "test_docs", "test_presets")


def _module_rank(item) -> int:
    name = item.module.__name__ if getattr(item, "module", None) is not None else ""
    if name in FIRST:
        return FIRST.index(name)
    return len(FIRST) + 1 + LAST.index(name) if name in LAST else len(FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_module_rank)  # stable: the file order within each rank, each module's own order


class _TrainerGc:
    """The `gc` module as the trainer sees it in the tests: `freeze` and `unfreeze` do nothing, the rest is gc's."""

    def __getattr__(self, name):
        import gc

        return getattr(gc, name)

    def freeze(self):
        pass

    def unfreeze(self):
        pass


@pytest.fixture(autouse=True)
def _freeze_before_each_test(request, monkeypatch):
    """What lives when a test starts is frozen after one collection of what the tests made since the last freeze
    (the previous test's garbage: milliseconds, not the ~0.5 M frozen objects), so each test's collections scan
    only its own objects. The trainer's own freeze at setup and unfreeze at close do nothing here: its close
    unfroze the whole permanent generation, and the full collection that had to follow walked the imports again
    (~0.5 s a trainer on a busy 2-core CPU; test_train_fit 30.6 -> 23.3 CPU-s, -n 0). Only when and what the
    collector scans changes, not what the trainer computes or frees (its run's objects are collected, never
    frozen); tests/test_train_gc.py, which checks the trainer's own freeze and unfreeze, sets
    TRAINER_GC_AS_IT_IS and keeps them."""
    import sys

    _freeze_what_lives()
    mod = sys.modules.get("trainer.train.trainer")
    if mod is not None and not getattr(request.module, "TRAINER_GC_AS_IT_IS", False):
        monkeypatch.setattr(mod, "gc", _TrainerGc())
    yield


def pytest_unconfigure(config):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(SESSION_CACHES, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """Root folder with tiny diffusers-format models: root/flux (dev-like), root/flux-schnell, root/sd3 (SD3.5-like),
    root/qwen-image. Written by `make_tiny_models` (a few seconds); treat them as read-only."""
    from trainer.models.tiny import make_tiny_models

    root = tmp_path_factory.mktemp("tiny_models")
    make_tiny_models(root)
    return root


@pytest.fixture(scope="session")
def once_per_session(tmp_path_factory):
    """`once_per_session(name, make)`: `make(folder)`'s JSON-able result, computed once in the whole test session,
    by whichever pytest-xdist worker asks first; a worker asking later (the tests of one module may be spread over
    several) waits for it and reads it back. For a multi-process launch that several tests share: while it runs,
    its processes use the cores the waiting worker would."""
    import json

    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the workers' common folder

    def run(name: str, make):
        folder, done = root / name, root / f"{name}.json"
        with FileLock(str(root / f"{name}.lock")):
            if not done.exists():
                shutil.rmtree(folder, ignore_errors=True)  # a worker's failed try before this one
                folder.mkdir()
                done.write_text(json.dumps(make(folder)))
        return json.loads(done.read_text())

    return run


@pytest.fixture
def sdpa_masks(monkeypatch):
    """Every SDPA call's attention mask (None or its shape), in call order (the attention-processor tests)."""
    import torch.nn.functional as F

    seen, orig = [], F.scaled_dot_product_attention

    def spy(*a, **kw):
        mask = a[3] if len(a) > 3 else kw.get("attn_mask")
        seen.append(None if mask is None else tuple(mask.shape))
        return orig(*a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen
