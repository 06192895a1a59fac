"""Data parallel on 2 GPUs over NCCL with the real offload conductor (tiny Flux, fp32): the same numbers as one GPU
at the same global batch, within GPU-kernel tolerance. Needs 2 CUDA devices (marked gpu; CI skips it)."""

from __future__ import annotations

import pytest
import torch
from test_distributed import _cfg, _run_two, _weights
from test_train_support import write_images

from trainer.train.trainer import Trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


def _on_gpu(cfg, fraction):
    return cfg.model_copy(update={
        "train": cfg.train.model_copy(update={"device": "cuda"}),
        "offload": cfg.offload.model_copy(update={"transformer": fraction}),
    })


@pytest.mark.parametrize("method", ["lora", "full"])
def test_two_gpus_train_like_one_with_offloading(method, tiny_models, tmp_path):
    images = write_images(tmp_path / "images")
    cache = tmp_path / "cache"
    # Reference: 1 GPU, grad_accum 2, resident (full fine-tuning unfused: it accumulates).
    ref = _on_gpu(_cfg(tiny_models, images, tmp_path / "ref", cache, method, checkpoint_every=0), 0.0)
    Trainer(ref).fit()
    two = _on_gpu(_cfg(tiny_models, images, tmp_path / "two", cache, method, world=2, checkpoint_every=0), 0.5)
    r0, r1 = _run_two([{"cfg": two.model_dump(mode="json")}], tmp_path, timeout=300, backend="nccl")
    assert all(i["error"] is None for i in r0 + r1), (r0, r1)
    a, b = _weights(tmp_path / "two", method), _weights(tmp_path / "ref", method)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=k)
