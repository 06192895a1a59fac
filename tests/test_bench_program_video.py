"""bench/program/bench_program.py for the video families (issue 39): the Wan families' full-size parts at their published
sizes (counted on the meta device), the folder estimates, tied embeddings written once, the clips and the config
that trains them in one bucket of their own size. The CPU end-to-end run is tests/test_phases.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.program import bench_program as bp
from bench.program import program_video as pv
from trainer.models import adapter_class

WAN = ("wan", "wan-i2v", "wan2.2-a14b", "wan2.2-a14b-i2v", "wan2.2-ti2v-5b", "wan2.2-ti2v-5b-i2v")


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory) -> dict[str, Path]:
    from trainer.models.tiny import make_tiny_models

    root = tmp_path_factory.mktemp("tiny-wan-all")
    return {f: make_tiny_models(root / f, [f])[0] for f in WAN}


@pytest.mark.parametrize("family", WAN)
def test_full_size_parts_are_the_published_sizes(family, tiny_wan, tmp_path):
    import shutil

    folder = tmp_path / family
    shutil.copytree(tiny_wan[family], folder)
    cls = adapter_class(family)
    with torch.device("meta"):
        vae, parts = cls.full_size_parts(folder)
        encs = {name: (c(cfg), rest) for name, c, cfg, *rest in parts}
    assert sum(p.numel() for p in vae.parameters()) == cls.vae_params
    enc, (matrices,) = encs.pop("text_encoder")
    assert sum(p.numel() for p in enc.parameters()) == cls.text_encoder_params[0][1]  # UMT5-XXL, 5.68 B
    assert matrices == torch.float8_e4m3fn
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder / "tokenizer")
    assert len(tok) <= enc.config.vocab_size and enc.config.pad_token_id == tok.pad_token_id
    if getattr(cls, "image_encoder_dir", None):  # Wan 2.1 I2V: open-clip ViT-H/14 and its 224 px processor
        from transformers import CLIPImageProcessor

        clip, _ = encs.pop("image_encoder")
        assert sum(p.numel() for p in clip.parameters()) == 630_766_080
        crop = CLIPImageProcessor.from_pretrained(folder / "image_processor").crop_size
        assert (crop["height"], crop["width"]) == (224, 224)
    assert not encs


def test_variants_and_the_folder_estimates(tmp_path, capsys):
    assert bp.split_variant("wan-1.3b") == ("wan", "1.3b") and bp.split_variant("wan2.2-a14b") == ("wan2.2-a14b", None)
    assert {"wan", "wan-1.3b", "wan-i2v", "wan2.2-ti2v-5b"} <= set(bp.writable())
    with torch.device("meta"):
        small = adapter_class("wan").transformer_cls.from_config(adapter_class("wan").full_variants["1.3b"])
    assert 1.41e9 < sum(p.numel() for p in small.parameters()) < 1.43e9
    # two 14 B experts: the file serves both (transformer_2 gets its config), else transformer_2's matrices in fp8
    with_file = bp.write_full_folder("wan2.2-a14b", tmp_path / "a", "fp8", write=False)
    bf16 = bp.write_full_folder("wan2.2-a14b", tmp_path / "b", None, write=False)
    lines = capsys.readouterr().out.splitlines()
    assert 20e9 < with_file < 21e9 and 48e9 < bf16 < 50e9
    assert "transformer_2" not in lines[0] and "transformer_2 14.29 GB" in lines[1] and "s to write" in lines[1]


def test_tied_embeddings_are_written_once_and_tied_again_on_load(tmp_path):
    from transformers import UMT5Config, UMT5EncoderModel

    cfg = UMT5Config(vocab_size=300, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, is_encoder_decoder=False,
                     feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    meta = bp._meta(lambda: UMT5EncoderModel(cfg))
    plan = bp.disk_plan(meta, torch.bfloat16, torch.float8_e4m3fn)
    assert "shared.weight" in plan and "encoder.embed_tokens.weight" not in plan
    assert plan["shared.weight"][1] == torch.float8_e4m3fn and plan["encoder.final_layer_norm.weight"][1] == torch.bfloat16
    total = bp._save(tmp_path / "te", meta, meta.config, "model", torch.bfloat16, 1, torch.float8_e4m3fn)
    assert total == bp.plan_bytes(plan)
    enc = UMT5EncoderModel.from_pretrained(tmp_path / "te", dtype=torch.bfloat16)
    assert enc.shared.weight is enc.encoder.embed_tokens.weight and enc.shared.weight.dtype == torch.bfloat16


@pytest.mark.parametrize(("spec", "div", "size", "res"), [
    ("480p", 16, (832, 480), 632), ("720p", 16, (1280, 720), 960), ("720p", 32, (1280, 704), 949),
    ("96x64", 16, (96, 64), 78),
])
def test_video_sizes_train_in_one_bucket_of_their_own_size(spec, div, size, res):
    from trainer.data.buckets import bucket_sizes, nearest_bucket

    assert pv.video_size(spec, div) == size
    r = pv.bucket_resolution(*size, div)
    assert r == res and nearest_bucket(*size, bucket_sizes(r, div, step=div)) == size


def test_clips_move_and_have_the_frames_a_clip_needs(tmp_path):
    import numpy as np

    from trainer.data.video import probe_video, read_clip

    clips = pv.Clips(96, 64, 9, 5)
    pv.write_clips(tmp_path, 2, clips)
    assert probe_video(tmp_path / "clip1.mp4", clips.fps) == (96, 64, 13)
    frames = [np.asarray(f, dtype=np.int16) for f in read_clip(tmp_path / "clip0.mp4", clips.fps, 0, 9)]
    assert all(np.abs(a - b).mean() > 2 for a, b in zip(frames, frames[1:], strict=False))
    assert (tmp_path / "clip0.txt").read_text().startswith("a test clip")


@pytest.mark.parametrize("family", ["wan", "wan2.2-a14b-i2v"])
def test_config_trains_the_clips_at_their_size_and_samples_a_short_video(family, tmp_path):
    from trainer.config import load_config

    image = pv.first_frame(tmp_path / "first.png", pv.Clips(832, 480, 81, 9))
    path = bp.write_config(family, tmp_path / "model", tmp_path / "clips", tmp_path / "run", None, 4, False, 16,
                           "fp8", ["offload.activations=true"], clips=pv.Clips(832, 480, 81, 9), image=image)
    cfg = load_config(str(path), [])
    assert cfg.data.resolutions == [632] and cfg.data.bucket_step == 16 and cfg.data.clip_frames == 81
    assert (cfg.sample.width, cfg.sample.height, cfg.sample.frames) == (832, 480, 9) and cfg.sample.image == image
    assert cfg.model.quantize == "fp8" and cfg.model.transformer_file.name == bp.FILES["fp8"]
    # a family of experts keeps its preset's `model.expert` (the Wan 2.2 A14B LoRA presets train both experts)
    assert cfg.model.expert == ("both" if family != "wan" else None) and cfg.offload.activations


def test_a_family_without_presets_gets_a_streaming_config_and_another_card_the_nearest_preset():
    d, source = bp.base_config("no-such-family", 16, False)
    assert source.startswith("built here") and d["offload"] == {"transformer": 1.0, "text_encoders": 1.0,
                                                                "activations": True}
    d, source = bp.base_config("flux", 20, False)
    assert "lora-16gb.yaml" in source and "nearest" in source and d["model"]["family"] == "flux"


def test_method_full_starts_from_the_full_presets():
    """`--method full` runs a family's full fine-tune presets (issue 40's Flux.1-dev full fine-tune with fp32
    master weights through `fit`): the card's own, else the nearest card's; a family without any says so."""
    d, source = bp.base_config("flux", 24, False, "full")
    assert source.endswith("configs/flux/full-24gb.yaml") and d["train"]["method"] == "full"
    d, source = bp.base_config("flux", 20, False, "full")
    assert "full-16gb.yaml" in source and "nearest" in source and d["train"]["method"] == "full"
    d, source = bp.base_config("flux", 24, True, "full")
    assert source.endswith("configs/tiny/flux-full.yaml")
    with pytest.raises(SystemExit, match="no-such-family has no full-"):
        bp.base_config("no-such-family", 16, False, "full")
