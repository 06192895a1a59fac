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


def test_the_sharded_stream_over_nccl_equals_whole_copies_and_one_gpu(tiny_models, tmp_path):
    """offload.sharded_stream on every GPU of the host (2 or 4): each process copies 1/N of every load and NCCL
    gathers the rest. The gathered rings hold the bytes whole copies would, so the LoRA equals the whole-copies run
    bitwise (fp32, eager, the math attention kernel: the same kernels on the same bytes), and one GPU at the same global batch within kernel
    tolerance; rank 0's sampling during training is joined by the others (no hang)."""
    world = 4 if torch.cuda.device_count() >= 4 else 2
    images = write_images(tmp_path / "images")
    cache = tmp_path / "cache"
    ref = _on_gpu(_cfg(tiny_models, images, tmp_path / "ref", cache, "lora", checkpoint_every=0), 0.0)
    ref = ref.model_copy(update={"train": ref.train.model_copy(update={"grad_accum": world})})
    Trainer(ref).fit()
    runs = {}
    for mode in (False, True):
        cfg = _on_gpu(_cfg(tiny_models, images, tmp_path / f"gather-{mode}", cache, "lora", world=2,
                           checkpoint_every=0), 1.0)
        cfg = cfg.model_copy(update={
            "train": cfg.train.model_copy(update={"grad_accum": 1, "attention": "math"}),  # deterministic backward
            "offload": cfg.offload.model_copy(update={"sharded_stream": mode}),
            "sample": cfg.sample.model_copy(update={"every": 2, "prompts": ["a red square"], "steps": 2,
                                                    "width": 64, "height": 64}),
        })
        rs = _run_two([{"cfg": cfg.model_dump(mode="json")}], tmp_path, timeout=300, backend="nccl", world=world)
        assert all(i["error"] is None for r in rs for i in r), rs
        runs[mode] = _weights(tmp_path / f"gather-{mode}", "lora")
    want = _weights(tmp_path / "ref", "lora")
    for k in want:
        assert torch.equal(runs[True][k], runs[False][k]), k
        torch.testing.assert_close(runs[True][k], want[k], rtol=1e-4, atol=1e-6, msg=k)
