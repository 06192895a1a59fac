"""`dittrain caption` (trainer/captioning/) on tiny random Qwen2.5-VL and Qwen3-VL folders built here from the
families' own tiny text-encoder builders (4 decoder layers, so that fraction 1 streams some of them): the files
written and left alone, the same captions with the layers resident and streamed by the conductor, `generate`'s
KV cache under the conductor's cyclic plan, Ctrl-C, and the one-line errors. Random weights caption gibberish,
which is fine: the mechanics and the exact equality are what is tested."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from trainer.captioning import CaptionRequest, run_caption, vlm
from trainer.cli import app
from trainer.data.video import write_video
from trainer.errors import Interrupted, UserError
from trainer.models.tiny import QWEN_VL_CHAT_TEMPLATE as CHAT_TEMPLATE

LAYERS = 4


def _qwen25_vl(tok):
    from transformers import Qwen2_5_VLProcessor

    from trainer.models.qwen_image import tiny_qwen2_5_vl

    return tiny_qwen2_5_vl(tok, layers=LAYERS), Qwen2_5_VLProcessor, 14  # Qwen-Image's tiny text encoder's


def _qwen3_vl(tok):
    from transformers import Qwen3VLProcessor

    from trainer.models.qwen_image_21 import tiny_qwen3_vl

    return tiny_qwen3_vl(tok, layers=LAYERS), Qwen3VLProcessor, 16  # Qwen-Image 2.1's tiny text encoder's


BUILDERS = {"qwen2.5-vl": _qwen25_vl, "qwen3-vl": _qwen3_vl}


def _save_model(folder, kind: str, chat_template: str | None = CHAT_TEMPLATE):
    from transformers import Qwen2VLImageProcessorPil
    from transformers.video_processing_utils import BaseVideoProcessor

    from trainer.models.tiny import qwen_tokenizer

    tok = qwen_tokenizer()
    model, proc_cls, patch = BUILDERS[kind](tok)
    image_processor = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, min_pixels=(2 * patch) ** 2,
                                               max_pixels=(4 * patch) ** 2)  # at most 4 image tokens
    proc = vlm.torchvision_free(proc_cls)(image_processor=image_processor, tokenizer=tok,
                                          video_processor=BaseVideoProcessor(), chat_template=chat_template)
    model.save_pretrained(folder)
    proc.save_pretrained(folder)
    for name in ("processor_config.json", "tokenizer_config.json"):  # the class a real folder names
        d = json.loads((folder / name).read_text())
        d["processor_class"] = proc_cls.__name__
        (folder / name).write_text(json.dumps(d))
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    return {kind: _save_model(root / kind, kind) for kind in BUILDERS}


def _image(path, w, h, seed):
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)
    return path


def _data(root):
    _image(root / "a.png", 64, 64, 0)
    _image(root / "b.jpg", 96, 48, 1)
    _image(root / "sub" / "c.webp", 40, 80, 2)
    _image(root / "done.png", 64, 64, 3)
    (root / "done.txt").write_text("kept as it is\n")
    _image(root / "masks" / "a.png", 64, 64, 4)  # fit's mask folder: not a training image
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    rng = np.random.default_rng(5)
    write_video([Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)) for _ in range(9)],
                root / "clip.mp4", fps=8)
    return root


def _captions(root):
    return {p.relative_to(root).as_posix(): p.read_text(encoding="utf-8") for p in sorted(root.rglob("*.txt"))}


def test_captions_every_uncaptioned_file_once_and_keeps_the_rest(models, tmp_path):
    data = _data(tmp_path / "data")
    res = CliRunner().invoke(app, ["caption", str(data), "--model", str(models["qwen2.5-vl"]), "--offload", "0",
                                   "--batch", "2", "--max-new-tokens", "6", "--trigger", "ohwx", "--style", "tags"])
    assert res.exit_code == 0, res.output
    got = _captions(data)
    assert set(got) == {"a.txt", "b.txt", "sub/c.txt", "clip.txt", "done.txt"}  # not masks/, not the broken file
    assert got["done.txt"] == "kept as it is\n"
    for name in ("a.txt", "b.txt", "sub/c.txt", "clip.txt"):
        text = got[name]
        assert text.startswith("ohwx, ") and text.endswith("\n") and text.count("\n") == 1
    assert f"skipped {data / 'broken.png'}:" in res.output
    assert "captions: 4 written, 1 skipped (caption exists), 1 failed" in res.output

    # a second run finds only the broken file; --overwrite redoes them all (the same greedy captions)
    again = CliRunner().invoke(app, ["caption", str(data), "--model", str(models["qwen2.5-vl"]), "--offload", "0",
                                     "--max-new-tokens", "6", "--trigger", "ohwx", "--style", "tags"])
    assert again.exit_code == 0 and "captions: 0 written, 5 skipped (caption exists), 1 failed" in again.output
    over = CliRunner().invoke(app, ["caption", str(data), "--model", str(models["qwen2.5-vl"]), "--offload", "0",
                                    "--max-new-tokens", "6", "--trigger", "ohwx", "--style", "tags", "--overwrite",
                                    "--batch", "2"])
    assert over.exit_code == 0 and "captions: 5 written, 0 skipped" in over.output
    assert _captions(data)["done.txt"].startswith("ohwx, ")


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_streamed_layers_caption_exactly_as_resident_ones(models, tmp_path, monkeypatch, kind):
    """Fraction 1 streams the decoder layers through the conductor's ring (in CPU RAM here: the same plan as on a
    GPU); generate's DynamicCache works unchanged, each layer runs once per forward pass (prefill, then one per new
    token) in order, and the captions are the same bytes as with the layers resident."""
    seen = {}
    place = vlm.place

    def spy(model, blocks, device, fraction):
        handle = place(model, blocks, device, fraction)
        calls = seen.setdefault(fraction, [[] for _ in blocks])
        for i, b in enumerate(blocks):
            b.register_forward_hook(lambda m, a, o, i=i: calls[i].append(1))
        if handle is not None:
            seen[f"stats{fraction}"] = handle.stats()
        return handle

    monkeypatch.setattr(vlm, "place", spy)
    out = {}
    for f in (0.0, 1.0):
        data = _data(tmp_path / f"data{f}")
        run_caption(CaptionRequest(data_dir=data, model=models[kind], offload=f, batch=3, max_new_tokens=5))
        out[f] = _captions(data)
    assert out[0.0] == out[1.0] and len(out[0.0]) == 5
    stats = seen["stats1.0"]
    assert stats["offloaded_bytes"] > 0 and stats["ring_bytes"] < stats["block_bytes"]  # it did stream
    for f in (0.0, 1.0):
        per_layer = [len(c) for c in seen[f]]
        assert len(set(per_layer)) == 1 and per_layer[0] >= 2  # prefill + new tokens, every layer alike
    assert [len(c) for c in seen[0.0]] == [len(c) for c in seen[1.0]]


def test_ctrl_c_keeps_the_captions_written_and_a_rerun_finishes(models, tmp_path, monkeypatch):
    data = _data(tmp_path / "data")
    generate, calls = vlm.generate, []

    def stop_on_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return generate(*a, **k)

    monkeypatch.setattr(vlm, "generate", stop_on_second)
    with pytest.raises(Interrupted) as e:
        run_caption(CaptionRequest(data_dir=data, model=models["qwen3-vl"], offload=0.0, batch=2, max_new_tokens=4))
    assert e.value.exit_code == 130 and "2 captions written are kept" in str(e.value)
    assert len(_captions(data)) == 1 + 2
    assert not list(data.rglob(".tmp-*"))
    monkeypatch.setattr(vlm, "generate", generate)
    summary = run_caption(CaptionRequest(data_dir=data, model=models["qwen3-vl"], offload=0.0, batch=2,
                                         max_new_tokens=4))
    assert len(summary.written) == 2 and summary.skipped == 3 and len(summary.failed) == 1


def test_prompt_and_video_frames_reach_the_model(models, tmp_path, monkeypatch):
    data = tmp_path / "data"
    _image(data / "a.png", 64, 64, 0)
    rng = np.random.default_rng(5)
    write_video([Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)) for _ in range(9)],
                data / "clip.mp4", fps=8)
    prepare, rows = vlm.prepare, []

    def spy(processor, device, dtype, pictures, prompts):
        rows.extend(zip([len(p) for p in pictures], prompts, strict=True))
        return prepare(processor, device, dtype, pictures, prompts)

    monkeypatch.setattr(vlm, "prepare", spy)
    run_caption(CaptionRequest(data_dir=data, model=models["qwen2.5-vl"], offload=0.0, prompt="Name the colours.",
                               frames=3, max_new_tokens=3))
    assert rows == [(1, "Name the colours."),
                    (3, "These 3 images are frames of one video, in order; caption the video. Name the colours.")]


def test_one_line_errors(models, tmp_path):
    data = _data(tmp_path / "data")
    no_template = _save_model(tmp_path / "florence-like", "qwen2.5-vl", chat_template=None)
    text_only = tmp_path / "t5"
    text_only.mkdir()
    (text_only / "config.json").write_text(json.dumps({"model_type": "t5"}))
    cases = [
        ([str(data), "--model", str(no_template)], "has no chat template"),
        ([str(data), "--model", str(text_only)], "model_type 't5' is not an image-text-to-text model"),
        ([str(data), "--model", str(tmp_path / "nowhere")], "no config.json there"),
        ([str(tmp_path / "missing"), "--model", str(models["qwen3-vl"])], "no such folder"),
        ([str(data), "--model", str(models["qwen3-vl"]), "--style", "poem"], "--style poem: one of"),
        ([str(data), "--model", str(models["qwen3-vl"]), "--offload", "2"], "--offload 2: give a fraction"),
    ]
    for args, expected in cases:
        res = CliRunner().invoke(app, ["caption", *args])
        assert res.exit_code == 1, (args, res.output)
        assert expected in res.output and res.output.count("\n") == 1, res.output
    with pytest.raises(UserError):
        run_caption(CaptionRequest(data_dir=data, model=no_template))


def test_an_image_the_processor_refuses_is_named_and_the_batch_goes_on(models, tmp_path, capsys):
    data = tmp_path / "data"
    _image(data / "a.png", 64, 64, 0)
    _image(data / "b.png", 600, 2, 1)  # aspect ratio 300: Qwen-VL's resize refuses more than 200
    _image(data / "c.png", 48, 64, 2)
    summary = run_caption(CaptionRequest(data_dir=data, model=models["qwen3-vl"], offload=0.0, max_new_tokens=3))
    assert sorted(p.name for p in summary.written) == ["a.png", "c.png"]
    assert [p.name for p, _ in summary.failed] == ["b.png"]
    assert f"skipped {data / 'b.png'}: the model's processor refused it" in capsys.readouterr().err


def _fit_config(tmp_path, source: str):
    from trainer.config import load_config

    p = tmp_path / "c.yaml"
    p.write_text(f"model: {{family: flux, path: {tmp_path / 'no-model'}}}\ntrain: {{steps: 5}}\n"
                 f"data:\n  sources:\n    - {source}\noutput: {{dir: {tmp_path / 'out'}}}\n")
    return load_config(p)


def test_caption_with_captions_a_source_before_fit_scans_it(models, tmp_path, monkeypatch):
    """data.sources[].caption_with: fit's prepare_data (and `dittrain cache`) caption the source's uncaptioned files
    first, into the same .txt files, before any model of the run loads; a metadata source refuses it."""
    from trainer.config import ConfigError
    from trainer.train import inputs

    data = tmp_path / "data"
    _image(data / "a.png", 64, 64, 0)
    _image(data / "deeper" / "b.png", 64, 64, 1)
    cfg = _fit_config(tmp_path, f"{{path: {data}, caption_with: {models['qwen3-vl']}, recursive: false}}")

    class Scanned(Exception):
        pass

    def stages(*a, **k):  # the first step after captioning: the captions are there by now
        assert (data / "a.txt").is_file()
        raise Scanned

    monkeypatch.setattr(inputs, "cache_stages", stages)
    with pytest.raises(Scanned):
        inputs.prepare_data(cfg, None, torch.device("cpu"), torch.float32)
    assert not (data / "deeper" / "b.txt").exists()  # the source's recursive: false holds
    with pytest.raises(ConfigError, match="caption_with writes .txt captions beside the images"):
        _fit_config(tmp_path, f"{{path: {data}, caption_with: {models['qwen3-vl']}, metadata: m.jsonl}}")


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_auto_fraction_estimate_picks_the_least_streaming_that_fits(models, kind):
    """--offload auto's estimate (used on a GPU only; its figures are not yet checked against a GPU run): the more
    budget, the less streams; from every layer streamed (1.0) through partial fractions to all resident (0.0), and
    1.0 with a warning where nothing fits."""
    from trainer.planner.prediction import ALLOCATOR_OVERHEAD, PREDICTION_MARGIN, WORKSPACE

    model = vlm.load_model(models[kind], torch.float32)
    blocks = vlm.decoder_blocks(model)
    lines = []
    assert vlm.auto_fraction(model, blocks, 1e6, 1, 50, lines.append) == 1.0
    assert "may run out of memory" in lines[-1]
    whole = sum(p.numel() * 4 for p in model.parameters())
    # from the fixed part of the estimate (the prefill's pixels and activations) up
    base = (WORKSPACE + ALLOCATOR_OVERHEAD * vlm.activation_bytes(model, 1, 50)) / (1 - PREDICTION_MARGIN)
    picked = [vlm.auto_fraction(model, blocks, base + whole * k / 100, 1, 50, lines.append) for k in range(0, 300, 3)]
    assert picked == sorted(picked, reverse=True) and picked[-1] == 0.0
    assert any(0.0 < f < 1.0 for f in picked)
