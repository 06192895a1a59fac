"""`dittrain caption --quantize fp8|int8` (trainer/captioning/vlm.py `quantize_decoder`) and `--offload auto`'s
estimate, on the tiny random Qwen2.5-VL and Qwen3-VL folders of tests/test_caption_command.py: the decoder layers'
Linears held as 8 bits are what the conductor packs and streams, the captions are the same streamed and resident,
auto counts the 8-bit bytes and the batch (KV cache, activations), and the batch that runs is never larger than
the files left."""

from __future__ import annotations

import pytest
import torch
from test_caption_command import BUILDERS, _captions, _data, _save_model
from typer.testing import CliRunner

from trainer import quant
from trainer.captioning import CaptionRequest, captioner, run_caption, vlm
from trainer.cli import app
from trainer.planner.prediction import ALLOCATOR_OVERHEAD, PREDICTION_MARGIN, WORKSPACE


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-quant")
    return {kind: _save_model(root / kind, kind) for kind in BUILDERS}


def _block_bytes(blocks) -> int:
    return sum(t.numel() * t.element_size() for b in blocks for t in (*b.parameters(), *b.buffers()))


@pytest.mark.parametrize(("kind", "mode"), [("qwen2.5-vl", "fp8"), ("qwen3-vl", "fp8"), ("qwen3-vl", "int8")])
def test_8bit_decoder_captions_the_same_streamed_as_resident(models, tmp_path, monkeypatch, kind, mode):
    """With --quantize the decoder layers reach placement as QuantizedLinears (8-bit weight, fp32 scale); at
    fraction 1 the conductor packs and streams those 8-bit bytes (block_bytes: the quantized sizes, well under
    the model dtype's), and the captions equal the resident 8-bit model's, byte for byte."""
    seen = {}
    place = vlm.place

    def spy(model, blocks, device, fraction):
        linears = [m for b in blocks for m in b.modules() if isinstance(m, torch.nn.Linear)]
        seen[fraction] = {"linears": linears, "bytes": _block_bytes(blocks)}
        handle = place(model, blocks, device, fraction)
        if handle is not None:
            seen[f"stats{fraction}"] = handle.stats()
        return handle

    monkeypatch.setattr(vlm, "place", spy)
    out = {}
    for f in (0.0, 1.0):
        data = _data(tmp_path / f"data{f}")
        summary = run_caption(CaptionRequest(data_dir=data, model=models[kind], offload=f, batch=3,
                                             max_new_tokens=5, quantize=mode))
        assert len(summary.written) == 4 and len(summary.failed) == 1  # broken.png, as without --quantize
        out[f] = _captions(data)
    assert out[0.0] == out[1.0] and len(out[0.0]) == 5
    want = quant._DTYPES[mode]
    for f in (0.0, 1.0):
        lin = seen[f]["linears"]
        assert lin and all(isinstance(m, quant.QuantizedLinear) and m.weight.dtype == want for m in lin)
    stats = seen["stats1.0"]
    assert stats["offloaded_bytes"] > 0 and stats["ring_bytes"] < stats["block_bytes"]  # it did stream
    model = vlm.load_model(models[kind], torch.float32)  # the same layers packed unquantized
    handle = place(model, vlm.decoder_blocks(model), torch.device("cpu"), 1.0)
    full = handle.stats()
    handle.close(keep_weights=False)
    assert stats["block_bytes"] < full["block_bytes"] and stats["offloaded_bytes"] < full["offloaded_bytes"]


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_auto_streams_less_with_an_8bit_decoder(models, kind):
    """Under the same budget auto keeps more of an fp8 decoder resident than of a bf16 one: never a larger
    fraction, a smaller one somewhere between all streamed and all resident."""
    say = [].append
    plain = vlm.load_model(models[kind], torch.bfloat16)
    fp8 = vlm.load_model(models[kind], torch.bfloat16)
    assert vlm.quantize_decoder(vlm.decoder_blocks(plain), "none") == 0
    assert vlm.quantize_decoder(vlm.decoder_blocks(fp8), "fp8") > 0
    assert _block_bytes(vlm.decoder_blocks(fp8)) < _block_bytes(vlm.decoder_blocks(plain))
    whole = sum(p.numel() * 2 for p in plain.parameters())
    # from the fixed part of the estimate (the batch's pixels and activations) up
    base = (WORKSPACE + ALLOCATOR_OVERHEAD * vlm.activation_bytes(plain, 2, 50)) / (1 - PREDICTION_MARGIN)
    budgets = [base + whole * k / 100 for k in range(0, 300, 2)]
    picked = {name: [vlm.auto_fraction(m, vlm.decoder_blocks(m), b, 2, 50, say) for b in budgets]
              for name, m in (("bf16", plain), ("fp8", fp8))}
    assert all(q <= p for q, p in zip(picked["fp8"], picked["bf16"], strict=True))
    assert any(q < p for q, p in zip(picked["fp8"], picked["bf16"], strict=True))


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_auto_counts_the_batch(models, kind):
    """The KV cache and the prefill's activations grow with the batch: under the same budget a larger batch never
    streams less, and somewhere more."""
    say = [].append
    model = vlm.load_model(models[kind], torch.float32)
    blocks = vlm.decoder_blocks(model)
    whole = sum(p.numel() * 4 for p in model.parameters())
    # from the fixed part of a batch of 1's estimate (its image's vision tower included) up
    base = (WORKSPACE + ALLOCATOR_OVERHEAD * vlm.activation_bytes(model, 1, 200)) / (1 - PREDICTION_MARGIN)
    budgets = [base + whole * k / 100 for k in range(0, 400, 2)]
    one = [vlm.auto_fraction(model, blocks, b, 1, 200, say) for b in budgets]
    many = [vlm.auto_fraction(model, blocks, b, 16, 200, say) for b in budgets]
    assert all(m >= o for m, o in zip(many, one, strict=True)) and any(m > o for m, o in zip(many, one, strict=True))


def test_a_batch_larger_than_the_files_left_plans_for_the_files(models, tmp_path, monkeypatch):
    """--batch 16 over 5 files: one generate of the 5 (4 captions, the broken file named), and auto plans for a
    batch of 5, not 16 (the estimate on a CPU, given a GPU's budget)."""
    asked, generated = [], []
    auto, generate = vlm.auto_fraction, vlm.generate

    def spy_auto(model, blocks, budget, batch, tokens, say):
        asked.append(batch)
        return auto(model, blocks, budget, batch, tokens, say)

    def spy_generate(model, processor, gc, inputs):
        generated.append(inputs["input_ids"].shape[0])
        return generate(model, processor, gc, inputs)

    monkeypatch.setattr(captioner, "_budget", lambda device: 1e12)  # all resident
    monkeypatch.setattr(vlm, "auto_fraction", spy_auto)
    monkeypatch.setattr(vlm, "generate", spy_generate)
    data = _data(tmp_path / "data")
    summary = run_caption(CaptionRequest(data_dir=data, model=models["qwen2.5-vl"], offload="auto", batch=16,
                                         max_new_tokens=3, quantize="fp8"))
    assert asked == [5] and summary.fraction == 0.0
    assert generated == [4] and len(summary.written) == 4 and len(summary.failed) == 1


def test_bad_quantize_is_one_line(models, tmp_path):
    data = _data(tmp_path / "data")
    for bad in ("fp4", "FP8", ""):
        res = CliRunner().invoke(app, ["caption", str(data), "--model", str(models["qwen3-vl"]), "--quantize", bad])
        assert res.exit_code == 1, res.output
        assert f"--quantize {bad}: one of none, fp8, int8" in res.output and res.output.count("\n") == 1, res.output
    assert _captions(data) == {"done.txt": "kept as it is\n"}  # refused before anything loads or is written
