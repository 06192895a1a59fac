"""Shared fixtures. `tiny_models`: every family's tiny random model, written once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """Root folder with tiny diffusers-format models: root/flux (dev-like), root/flux-schnell, root/sd3 (SD3.5-like),
    root/qwen_image. Written by `make_tiny_models` (a few seconds); treat them as read-only."""
    from trainer.models.tiny import make_tiny_models

    root = tmp_path_factory.mktemp("tiny_models")
    make_tiny_models(root)
    return root
