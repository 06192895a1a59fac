"""bench/program/bench_program.py's full-size folders of the families issues 42 and 45 ask measured (HiDream-I1,
Lumina-Image 2.0, ERNIE-Image, Anima, LTX-2 and its image-to-video face, HunyuanVideo 1.5 T2V and I2V): each family's `full_size_parts` at the
released sizes, counted on the meta device, and the folder `write_full_folder` plans without writing (every tensor
of every part, in the dtype it goes to disk in, and the folder's size): the CPU-side proof that the GPU run gets
past its first minute. The fp8 matrices of the two new encoder classes written so load as bf16. LTX-2's clips
carry the sound its audio stream trains on. The CPU end-to-end runs (`--smoke`) take a minute and a half a family
here: they are run by hand (bench/history), not in the suite."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import ModelMixin

from bench.program import bench_program as bp
from bench.program import program_video as pv
from trainer.models import adapter_class
from trainer.models import hunyuan_video15 as hv15

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
#: family -> (folder bytes on disk without / with --transformer-file fp8, {sub-folder: (parameters, dtype of its
#: matrices on disk)} of the text encoders and the diffusers parts beside them)
FAMILIES = {
    "hidream": ((48.0e9, 49.5e9), (31.5e9, 33e9), {
        "text_encoder": (123_650_304 + (248 - 77) * 768, BF16),  # CLIP-L with the release's 248 positions
        "text_encoder_2": (694_659_840 + (248 - 77) * 1280, BF16),  # CLIP-G
        "text_encoder_3": (4_762_310_656, FP8), "text_encoder_4": (8_030_261_248, FP8)}),
    "lumina2": ((10e9, 11e9), (7.5e9, 8.5e9), {"text_encoder": (2_614_341_888, BF16)}),
    "ernie-image": ((23.5e9, 24.5e9), (15.5e9, 16.5e9), {"text_encoder": (3_849_090_048, BF16)}),
    "anima": ((5.3e9, 6e9), (3.4e9, 4e9), {"text_encoder": (596_049_920, BF16), "text_conditioner": (134_663_680, BF16)}),
    "ltx2": ((55e9, 56e9), (36.5e9, 37.5e9), {
        "text_encoder": (12_187_325_040, FP8), "connectors": (1_431_475_200, BF16),
        "audio_vae": (53_248_146, BF16), "vocoder": (55_592_802, BF16)}),
    # Qwen2.5-VL-7B's language model (fp8 on disk), the Glyph ByT5 encoder (byt5-small's), for I2V SigLIP
    "hunyuan-video-1.5": ((26e9, 27.5e9), (18e9, 19e9), {
        "text_encoder": (7_070_619_136, FP8), "text_encoder_2": (217_657_472, BF16)}),
    "hunyuan-video-1.5-i2v": ((27e9, 28e9), (19e9, 20e9), {
        "text_encoder": (7_070_619_136, FP8), "text_encoder_2": (217_657_472, BF16),
        "image_encoder": (428_225_600, BF16)}),
}
#: parts beside the text encoders that `text_encoder_params` does not count (an image encoder: `cache_encoder_params`)
NOT_TEXT = ("audio_vae", "vocoder", "image_encoder")


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> dict[str, tuple[Path, int, int]]:
    """Per family: the tiny folder `write_full_folder(write=False)` leaves, and the planned folder's bytes without
    and with the fp8 transformer file."""
    root = tmp_path_factory.mktemp("full-plans")
    out = {}
    for family in FAMILIES:
        shards = bp.write_full_folder(family, root / family, None, write=False)
        single = bp.write_full_folder(family, root / family, "fp8", write=False)
        out[family] = root / family, shards, single
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_size_parts_are_the_released_sizes_and_the_folder_plans_every_tensor(family, planned):
    from transformers import AutoTokenizer

    folder, shards, single = planned[family]
    (lo, hi), (lo8, hi8), expected = FAMILIES[family]
    assert lo < shards < hi and lo8 < single < hi8
    cls = adapter_class(family)
    with torch.device("meta"):
        vae, parts = cls.full_size_parts(folder)
    assert _params(vae) == cls.vae_params
    assert {name for name, *_ in parts} == set(expected)
    for name, enc_cls, cfg, *disk in parts:
        params, matrices = expected[name]
        diffusers_part = issubclass(enc_cls, ModelMixin)
        enc = bp._meta(lambda c=enc_cls, cfg=cfg, d=diffusers_part: c.from_config(cfg) if d else c(cfg))
        assert _params(enc) == params, name
        assert (disk[0] if disk else BF16) == matrices
        if diffusers_part:
            continue
        plan = bp.disk_plan(enc, BF16, disk[0] if disk else None)
        # every tensor planned once (a tied one under its first name), matrices in their dtype on disk
        assert set(plan) <= set(enc.state_dict()) and sum(torch.Size(s).numel() for s, _ in plan.values()) >= params
        assert {dt for s, dt in plan.values() if len(s) == 2} == {matrices}
        assert {dt for s, dt in plan.values() if len(s) != 2 and dt.is_floating_point} == {BF16}
        if name == "image_encoder":  # HunyuanVideo 1.5 I2V's SigLIP: the 729 tokens of a 384 px image, its processor's
            from transformers import SiglipImageProcessor

            assert params == cls.cache_encoder_params
            side = enc.config.image_size // enc.config.patch_size
            assert side * side == 729 == hv15.RECIPE["vision_num_semantic_tokens"]
            proc = SiglipImageProcessor.from_pretrained(folder / cls.image_processor_dir)
            assert (proc.size["height"], proc.size["width"]) == (enc.config.image_size,) * 2
            continue
        text = enc.config.get_text_config()
        tok_dir = folder / name.replace("text_encoder", "tokenizer")
        if tok_dir.is_dir():  # the tiny tokenizer's ids all exist in the full embedding
            tok = AutoTokenizer.from_pretrained(tok_dir)
            assert len(tok) <= text.vocab_size and text.pad_token_id in (tok.pad_token_id, tok.eos_token_id)
    # the declared text-encoder sizes are those the folder holds (HiDream's CLIPs: SD3's 77 positions)
    declared = sum(n for _, n in cls.text_encoder_params)
    written = sum(p for name, (p, _) in expected.items() if name not in NOT_TEXT)
    assert written - declared == (171 * (768 + 1280) if family == "hidream" else 0)
    assert family in bp.writable()


def test_hunyuan_video15_folders_hold_what_the_released_pipelines_load(planned, capsys):
    """Both HunyuanVideo 1.5 families are `--families` choices and `--estimate` prints their folders; their text
    encoders are the classes the adapter loads (Qwen2.5-VL's language model without head, a T5 encoder) with the
    layers it counts; image-to-video adds SigLIP in its image encoder folder, text-to-video has none."""
    for family in ("hunyuan-video-1.5", "hunyuan-video-1.5-i2v"):
        assert family in bp.writable()
        cls = adapter_class(family)
        folder, shards, single = planned[family]
        with torch.device("meta"):
            _, parts = cls.full_size_parts(folder)
        names = [p[0] for p in parts]
        assert tuple(names[:2]) == cls.text_encoder_dirs
        assert tuple(p[1].__name__ for p in parts[:2]) == cls.text_encoder_classes
        assert (parts[0][2].num_hidden_layers, parts[1][2].num_layers) == cls.text_encoder_layers
        assert ("image_encoder" in names) == family.endswith("-i2v")
        capsys.readouterr()
        assert bp.main(["--estimate", "--families", family, "--work", str(folder.parent / "estimate")]) == 0
        line = capsys.readouterr().out.strip().splitlines()[-1]
        assert line.startswith(f"{family}: folder ~{shards / 1e9:.1f} GB on disk (transformer 16.65 GB"), line
        # the 720p model: the same shapes, the target size its image-to-video pipeline picks 1280x720 at
        assert f"{family}-720p" in bp.writable() and bp.split_variant(f"{family}-720p") == (family, "720p")
        assert {k: v for k, v in cls.full_variants["720p"].items() if cls.full_config[k] != v} == {"target_size": 960}
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    pick = HunyuanVideo15ImageProcessor(vae_scale_factor=16).calculate_default_height_width
    assert pick(720, 1280, 960) == (720, 1280) and pick(480, 816, 640) == (480, 816)
    assert pick(480, 832, 640) != (480, 832)  # 480p I2V rows train and sample at 816x480 (bench/program's essay)


def test_ltx2_image_to_video_writes_the_ltx2_folder():
    assert adapter_class("ltx2-i2v").full_size_parts.__func__ is adapter_class("ltx2").full_size_parts.__func__
    assert "ltx2-i2v" in bp.writable()


@pytest.mark.parametrize("kind", ["gemma3", "llama"])
def test_fp8_matrices_of_the_new_encoders_load_as_bf16(kind, tmp_path):
    """LTX-2's Gemma 3 (tied head: written once, tied again on load) and HiDream's Llama (own head), small, through
    the bench's writer with fp8 matrices: they load with every weight, in bf16."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, LlamaConfig, LlamaForCausalLM

    if kind == "gemma3":
        cls, cfg = Gemma3ForConditionalGeneration, Gemma3Config(
            text_config={"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "sliding_window": 8},
            vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "image_size": 28, "patch_size": 14, "vision_use_head": False},
            mm_tokens_per_image=4, image_token_index=63, boi_token_index=61, eoi_token_index=62)
    else:
        cls, cfg = LlamaForCausalLM, LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                                  tie_word_embeddings=False)
    meta = bp._meta(lambda: cls(cfg))
    total = bp._save(tmp_path / kind, meta, meta.config, "model", BF16, 1, FP8)
    assert total == bp.plan_bytes(bp.disk_plan(meta, BF16, FP8))
    enc = cls.from_pretrained(tmp_path / kind, dtype=BF16)
    assert {p.dtype for p in enc.parameters()} == {BF16}
    assert not any(p.is_meta for p in enc.parameters())
    head, embed = enc.get_output_embeddings().weight, enc.get_input_embeddings().weight
    assert (head is embed) == (kind == "gemma3")
    assert 0.01 < enc.get_input_embeddings().weight.float().std() < 0.03  # the written values, not a fresh init


def test_fp8_matrices_of_qwen25_vl_text_model_load_as_bf16(tmp_path):
    """HunyuanVideo 1.5's text encoder as its folder holds it (Qwen2.5-VL's language model alone, no head), small,
    written with fp8 matrices: it loads as the adapter's class with every weight, in bf16 (the written values)."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    cfg = Qwen2_5_VLTextConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1,
                               rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                "rope_theta": 1000000.0})
    meta = bp._meta(lambda: Qwen2_5_VLTextModel(cfg))
    total = bp._save(tmp_path / "qwen", meta, meta.config, "model", BF16, 1, FP8)
    assert total == bp.plan_bytes(bp.disk_plan(meta, BF16, FP8))
    enc = Qwen2_5_VLTextModel.from_pretrained(tmp_path / "qwen", dtype=BF16)
    assert {p.dtype for p in enc.parameters()} == {BF16} and not any(p.is_meta for p in enc.parameters())
    assert 0.01 < enc.get_input_embeddings().weight.float().std() < 0.03
    assert 0.01 < enc.layers[1].mlp.down_proj.weight.float().std() < 0.03


def test_ltx2_clips_have_the_frames_and_the_sound_it_trains_on(tmp_path):
    """The clips LTX-2 reads: 8k + 1 frames (the smoke's 9 and the GPU run's 81), at its 24 fps, with an audio
    track that its reader decodes under the clip (stereo, at the audio VAE's 16 kHz, not silence)."""
    from trainer.data.video import has_audio, probe_video, read_audio

    cls = adapter_class("ltx2")
    assert cls.valid_frames(cls.frame_step + 1) and cls.valid_frames(81) and cls.valid_frames(9)
    clips = pv.Clips(96, 64, 9, 9, fps=cls.default_fps, sound=cls.sound)
    pv.write_clips(tmp_path, 1, clips)
    path = tmp_path / "clip0.mp4"
    assert probe_video(path, clips.fps) == (96, 64, 13) and has_audio(path)
    wave = read_audio(path, clips.fps, 0, 9, 16000)
    assert wave.shape == (2, 6000) and 0.2 < float(wave[:, 1000:].abs().max()) < 0.6
    assert not torch.allclose(wave[0], wave[1])  # a fifth apart
    # Wan's clips stay silent (no audio stream: its families train no sound)
    pv.write_clips(tmp_path / "wan", 1, pv.Clips(96, 64, 5, 5))
    assert not has_audio(tmp_path / "wan" / "clip0.mp4")


def test_ltx2_config_reads_the_clips_at_its_rate(tmp_path):
    """The run's config for LTX-2's clips loads (its positions are in seconds at 24 fps: another data.fps is
    refused) and trains one bucket of the clips' size (sides divisible by 32)."""
    from trainer.config import load_config

    clips = pv.Clips(832, 480, 81, 9, fps=24.0, sound=True)
    path = bp.write_config("ltx2", tmp_path / "model", tmp_path / "clips", tmp_path / "run", None, 4, False, 16,
                           "fp8", clips=clips)
    cfg = load_config(str(path), [])
    assert cfg.data.fps == 24.0 and cfg.data.bucket_step == 32 and cfg.data.clip_frames == 81
    assert (cfg.sample.width, cfg.sample.height, cfg.sample.frames) == (832, 480, 9) and cfg.model.quantize == "fp8"


def test_an_audio_vae_is_built_for_real_and_loads_as_the_adapter_loads_it(tmp_path):
    """A diffusers part beside the text encoders (LTX-2's audio VAE; here at the full one's layout with 4 base
    channels: the full 53 M takes ~10 s to initialise on 2 CPU cores) is written by `_write_built`: its own
    initialisation, so its latent statistics are a usable normalisation (random shards would give a zero std),
    loaded from the folder as trainer/models/ltx2.py loads it."""
    from diffusers import AutoencoderKLLTX2Audio

    meta = bp._meta(lambda: AutoencoderKLLTX2Audio.from_config({"base_channels": 4}))
    total = bp._write_built(tmp_path / "audio_vae", meta)
    assert total == 2 * _params(meta)
    vae = AutoencoderKLLTX2Audio.from_pretrained(str(tmp_path), subfolder="audio_vae", torch_dtype=torch.float32,
                                                 local_files_only=True)
    assert torch.all(vae.latents_std > 0) and vae.config.sample_rate == 16000 and vae.config.mel_bins == 64
