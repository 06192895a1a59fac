"""The planner's sampling phase and Qwen-Image 2.1's KV cache: the pipeline keeps every block's prompt keys and
values from its first denoising step to its return (`use_kv_cache`, on by default). Eager blocks store copies of
the prompt's part; compiled blocks (inductor) store views of the whole first-step keys and values, 2.15 GB at
1024 px, which the 16 GB preset's sampling phase left out (predicted 12.39 GB, measured 14.11 GB while denoising on
an H100: bench/RESULTS.md, 2026-11-25 21:40)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

from trainer import planner
from trainer.config import Config
from trainer.models import adapter_class
from trainer.planner import trace as ptrace
from trainer.planner.phases import predict_phases
from trainer.planner.sampling import kv_cache_bytes, predict_sampling

FAMILY, RES, TEXT = "qwen-image-2.1", 64, 7


def _cfg(tiny_models, family=FAMILY, folder=FAMILY, compile=False) -> Config:
    return Config.model_validate({
        "model": {"family": family, "path": str(tiny_models / folder), "dtype": "fp32"},
        "train": {"method": "lora", "compile": compile},
        "lora": {"rank": 4, "alpha": 4},
        "data": {"sources": [{"path": "unused"}], "resolutions": [RES]},
        "sample": {"prompts": ["a cat"], "every": 10, "width": RES, "height": RES, "steps": 2, "guidance": 1.0},
        "output": {"dir": "unused"},
    })


def test_the_trace_counts_each_blocks_keys_and_values_once_and_eager_caches_keep_the_prompts_share(tiny_models):
    """`Trace.block_kv` is the bytes of the keys and values each real block computes (its prefix attention takes a
    slice of the same key tensor: counted once), and the eager pipeline's cache keeps only the prompt's rows."""
    cls = adapter_class(FAMILY)
    tr_cls = cls.transformer_cls
    model = tr_cls.from_pretrained(tiny_models / FAMILY / "transformer", torch_dtype=torch.float32).eval()
    blocks = cls().blocks(model)
    inputs = cls.dummy_inputs(model, 1, RES, RES, TEXT, torch.float32, device="cpu")
    real = [0] * len(blocks)
    hooks = []
    for i, b in enumerate(blocks):
        def add(mod, args, out, i=i):
            real[i] += out.numel() * out.element_size()

        hooks += [b.attn.to_k.register_forward_hook(add), b.attn.to_v.register_forward_hook(add)]
    cache = QwenImage21KVCache(len(blocks))
    try:
        with torch.no_grad():
            model(**inputs, kv_cache=cache, kv_cache_mode="extract", return_dict=False)
    finally:
        for h in hooks:
            h.remove()
    meta = ptrace.meta_transformer(FAMILY, dict(model.config), torch.float32)
    traced = ptrace.trace_forward(meta, cls().blocks(meta), ptrace.forward_inputs(
        FAMILY, meta, 1, RES, RES, TEXT, torch.float32))
    assert traced.block_kv == real and all(real)
    tokens = TEXT + cls.full_image_tokens(RES, RES)
    for lc, kv in zip(cache.layer_caches, real, strict=True):  # eager: copies of the prompt's rows only
        kept = lc.k.untyped_storage().nbytes() + lc.v.untyped_storage().nbytes()
        assert kept == kv * TEXT // tokens


def test_sampling_counts_the_kv_cache_whole_for_compiled_blocks(tiny_models):
    eager = planner.analyze(_cfg(tiny_models))
    compiled = planner.analyze(_cfg(tiny_models, compile="auto"))  # auto: on for CUDA, which the planner plans
    assert compiled.compile_blocks and not eager.compile_blocks
    whole = sum(compiled.trace(RES).block_kv)
    assert whole > 0
    assert kv_cache_bytes(compiled, compiled.trace(RES), RES) == whole
    share = kv_cache_bytes(eager, eager.trace(RES), RES)
    assert 0 < share < whole
    a, b = predict_sampling(eager, 0.0, RES), predict_sampling(compiled, 0.0, RES)
    assert b.kv_cache == whole and b.peak_reserved - a.peak_reserved == pytest.approx(whole - share, rel=1e-9)
    assert b.decode_reserved - a.decode_reserved == pytest.approx(whole - share, rel=1e-9)  # kept through decode
    # the same trace, the blocks compiled or not: the phase differs by the cache alone
    cfg, phase = _cfg(tiny_models), {}
    for on in (False, True):
        facts = dataclasses.replace(eager, compile_blocks=on)
        phase[on] = next(p.vram for p in predict_phases(cfg, 0.0, facts) if p.name == "sampling")
    assert phase[True] - phase[False] == pytest.approx(whole - share, rel=1e-6)
    # classifier-free guidance: the negative prompt's pass keeps a cache of its own
    two = predict_sampling(dataclasses.replace(eager, compile_blocks=True), 0.0, RES, batch=2)
    assert two.kv_cache == 2 * whole

def test_families_without_a_kv_cache_sample_as_before(tiny_models):
    facts = planner.analyze(_cfg(tiny_models, family="flux", folder="flux", compile=True))
    assert not adapter_class("flux").sampling_kv_cache
    assert kv_cache_bytes(facts, facts.trace(RES), RES) == 0.0
    assert predict_sampling(facts, 0.0, RES).kv_cache == 0.0
