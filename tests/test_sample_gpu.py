"""Sampling with the transformer streamed by the conductor on a CUDA GPU: the same seed gives the same image at every
offload fraction (bitwise in fp32, within 1e-3 in bf16), and the whole `dittrain sample` path runs on the GPU.

CI has no GPU: these run with `make test-gpu` (pytest -m gpu)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.config import Config
from trainer.dtypes import DTYPES
from trainer.models import get_adapter
from trainer.sample import SampleRequest, run_sample
from trainer.sampling import SampleSettings, encode_prompts, generate, release_text_encoders
from trainer.sampling.placement import place_text_encoders, place_transformer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPT = "a red square on a blue background"
GUIDANCE = {"flux": 3.5, "sd3": 4.0, "qwen-image": 4.0}


def _cfg(tiny_models: Path, family: str, out: Path, dtype: str) -> Config:
    return Config.model_validate(
        {
            "model": {"family": family, "path": str(tiny_models / family), "dtype": dtype},
            "sample": {"steps": 3, "width": 64, "height": 64, "guidance": GUIDANCE[family]},
            "train": {"device": "cuda"},
            "output": {"dir": str(out)},
        }
    )


def _image(cfg: Config, fraction: float, text_fraction: float = 0.0) -> np.ndarray:
    """Float image in [0, 1] made on the GPU with the transformer streamed at `fraction`."""
    adapter = get_adapter(cfg.model)
    dtype = DTYPES[cfg.model.dtype]
    dev = torch.device("cuda")
    comps = adapter.load(
        cfg.model, parts={"transformer", "vae", "text", "scheduler"}, dtype=dtype, device="cpu"
    )
    pipe = adapter.pipeline(comps)
    del comps
    s = cfg.sample
    with place_text_encoders(pipe, dev, text_fraction):
        embeds = encode_prompts(pipe, adapter.family, [PROMPT], guidance=s.guidance, device=dev)
    release_text_encoders(pipe)
    pipe.vae.to(dev)
    settings = SampleSettings(s.steps, s.guidance, s.width, s.height)
    with place_transformer(adapter, pipe.transformer, dev, fraction):
        (img,) = generate(pipe, adapter, embeds, settings=settings, seeds=[5], output_type="np")
    torch.cuda.synchronize()
    return np.asarray(img, dtype=np.float32)


@pytest.mark.parametrize("family", list(GUIDANCE))
def test_offloaded_sampling_is_exact_in_fp32(tiny_models, tmp_path, family):
    cfg = _cfg(tiny_models, family, tmp_path, "fp32")
    ref = _image(cfg, 0.0)
    for f in (0.5, 1.0):
        np.testing.assert_array_equal(_image(cfg, f), ref, err_msg=f"offload {f}")


@pytest.mark.parametrize("family", list(GUIDANCE))
def test_offloaded_sampling_within_1e3_in_bf16(tiny_models, tmp_path, family):
    cfg = _cfg(tiny_models, family, tmp_path, "bf16")
    ref = _image(cfg, 0.0)
    for f in (0.5, 1.0):
        np.testing.assert_allclose(_image(cfg, f), ref, atol=1e-3, rtol=0, err_msg=f"offload {f}")


def test_streamed_text_encoders_give_the_same_image(tiny_models, tmp_path):
    cfg = _cfg(tiny_models, "flux", tmp_path, "fp32")
    np.testing.assert_array_equal(_image(cfg, 0.5, text_fraction=1.0), _image(cfg, 0.5))


def test_sample_command_on_the_gpu(tiny_models, tmp_path):
    cfg = _cfg(tiny_models, "flux", tmp_path, "bf16")
    written = run_sample(
        cfg, SampleRequest(prompts=[PROMPT, "a green circle"], offload=1.0, out=tmp_path / "s")
    )
    assert [p.name for p in written][-1] == "contact_sheet.png" and all(p.is_file() for p in written)
