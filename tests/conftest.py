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
