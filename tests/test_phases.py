"""Phases of a run: per-phase peaks, one-line out-of-memory errors naming the phase and the fix, caching with
one model group at a time, the planner's phase table."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_data_cache import FakeAdapter, config, make_images, make_model
from test_train_support import make_config, write_images

from trainer import phase_log
from trainer.data import cache as dcache
from trainer.data.pipeline import prepare_data
from trainer.errors import UserError
from trainer.models.base import Components
from trainer.phase_log import Phase, PhaseLog, PhaseOutOfMemory, parse_oom

ROOT = Path(__file__).resolve().parents[1]
TORCH_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 7.00 GiB of which 1.10 GiB "
    "is free. Including non-PyTorch memory, this process has 5.90 GiB memory in use."
)


def test_parse_oom_reads_torchs_message():
    tried, free, total = parse_oom(TORCH_OOM)
    assert (tried, free, total) == (2 * 2**30, pytest.approx(1.10 * 2**30), 7 * 2**30)
    assert parse_oom("CUDA out of memory") == (None, None, None)


@pytest.mark.parametrize(("phase", "knob"), [
    ("text caching", "offload.text_encoders"),
    ("latent caching", "data.resolutions"),
    ("sampling", "sample.every: 0"),
    ("training step", "offload.transformer"),
])
def test_out_of_memory_in_a_phase_is_one_line_naming_phase_need_free_and_fix(phase, knob):
    log = PhaseLog()
    with pytest.raises(PhaseOutOfMemory) as e, Phase(phase, log=log):
        raise torch.OutOfMemoryError(TORCH_OOM)
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, UserError) and e.value.exit_code != 0
    assert f"in phase {phase}:" in msg and "tried to allocate 2.00 GiB with 1.10 GiB free of 7.0 GiB" in msg
    assert knob in msg
    assert e.value.__suppress_context__  # `from None`: the CLI prints one line, no chained traceback
    assert log.peaks[phase].runs == 1


def test_host_memory_error_and_nested_phases():
    with pytest.raises(PhaseOutOfMemory, match=r"out of host RAM in phase checkpoint save: .*fix: free host RAM"):
        with Phase("checkpoint save", log=PhaseLog()):
            raise MemoryError
    # an inner phase's line passes through the outer one unchanged
    with pytest.raises(PhaseOutOfMemory, match=r"in phase text caching"), Phase("load", log=PhaseLog()):
        with Phase("text caching", log=PhaseLog()):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
    # other errors are not touched
    with pytest.raises(ValueError), Phase("load", log=PhaseLog()):
        raise ValueError("x")


def test_phase_records_peak_rss_of_what_it_allocates():
    log = PhaseLog()
    with Phase("load", log=log) as p:
        x = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched
        x += 1
    assert p.peak is log.peaks["load"]
    assert log.peaks["load"].rss >= 64 * 2**20
    assert "phase load: peak reserved VRAM 0.00 GB" in log.lines()[0]
    del x


def test_sampling_during_training_marks_its_denoising_peak_before_the_vae_decodes(tiny_models, tmp_path,
                                                                                 monkeypatch):
    import json

    from trainer.train.trainer import Trainer

    log = tmp_path / "phases.jsonl"
    monkeypatch.setenv("DITTRAIN_PHASE_LOG", str(log))
    cfg = make_config(tiny_models, write_images(tmp_path / "imgs"), tmp_path / "run", tmp_path / "cache", "flux",
                      train={"steps": 2, "batch_size": 1},
                      sample={"every": 1, "prompts": ["a cat", "a dog"], "steps": 1, "width": 64, "height": 64})
    Trainer(cfg).fit()
    names = [json.loads(line)["phase"] for line in log.read_text().splitlines()]
    # once per sampling call (two prompts, two decodes: the first one marks), and always just before its phase ends
    assert names.count("sampling (denoising)") == names.count("sampling") == 2
    assert all(names[i + 1] == "sampling" for i, n in enumerate(names) if n == "sampling (denoising)")


class StageLoader(dcache.EncoderStages):
    """Records which model group is loaded and checks the other is gone."""

    def __init__(self):
        super().__init__()
        self.events = []
        self.live = set()

    def _load_text(self):
        assert not self.live, "text encoders loaded beside another model group"
        self.events.append("text")
        self.live.add("text")
        self.handles.append(_Closer(self, "text"))
        return Components(text_encoders=[torch.nn.Linear(1, 1)], tokenizers=[None])

    def _load_vae(self):
        assert not self.live, "VAE loaded beside another model group"
        self.events.append("vae")
        self.live.add("vae")
        self.handles.append(_Closer(self, "vae"))
        return torch.nn.Linear(1, 1)


class _Closer:
    def __init__(self, loader, name):
        self.loader, self.name = loader, name

    def close(self, keep_weights=True):
        assert not keep_weights  # the stage's models are dropped: nothing is copied back out of an arena
        self.loader.live.discard(self.name)
        self.loader.events.append(f"free {self.name}")


def test_caching_loads_text_encoders_then_frees_them_then_the_vae(tmp_path):
    make_model(tmp_path / "model")
    make_images(tmp_path / "imgs")
    loader = StageLoader()
    data = prepare_data(config(tmp_path), FakeAdapter(), loader, progress=False)
    assert loader.events == ["text", "free text", "vae", "free vae"]
    assert data.encode.latents_new > 0 and data.encode.texts_new > 0
    assert {"text caching", "latent caching"} <= set(phase_log.LOG.peaks)
    # everything cached: nothing loaded
    again = StageLoader()
    prepare_data(config(tmp_path), FakeAdapter(), again, progress=False)
    assert again.events == []


def test_out_of_memory_while_encoding_latents_names_latent_caching(tmp_path):
    make_model(tmp_path / "model")
    make_images(tmp_path / "imgs")
    adapter = FakeAdapter()

    def oom(vae, pixels):
        raise torch.OutOfMemoryError(TORCH_OOM)

    adapter.encode_images = oom
    loader = StageLoader()
    with pytest.raises(PhaseOutOfMemory, match=r"in phase latent caching: tried to allocate 2.00 GiB.*data\.resolutions"):
        prepare_data(config(tmp_path), adapter, loader, progress=False)
    assert loader.events[-1] == "free vae"  # freed on the way out
    # the captions encoded before the error stay cached
    assert prepare_data(config(tmp_path), FakeAdapter(), StageLoader(), progress=False).encode.texts_new == 0


def test_vae_memory_modes(tiny_models):
    from diffusers import AutoencoderKL

    from trainer.sampling.placement import tile_decode

    vae = AutoencoderKL.from_pretrained(tiny_models / "flux", subfolder="vae")
    assert not dcache.vae_memory_mode(vae, 1024 * 1024) and vae.use_slicing and not vae.use_tiling
    assert dcache.vae_memory_mode(vae, 1024 * 1536) and vae.use_tiling
    assert not tile_decode(vae, 512, 512)
    assert tile_decode(vae, 1024, 1024) and vae.use_tiling and vae.tile_sample_min_size == 512
    assert vae.tile_latent_min_size == 512 // 2 ** (len(vae.config.block_out_channels) - 1)


def test_sample_decodes_untiled_where_it_fits_else_tiled(tiny_models, monkeypatch):
    """`dittrain sample` keeps the pipeline's untiled decode (images equal `pipe(...)`'s) unless it would not fit
    next to the placed transformer: Qwen-Image 2.1's 16 GB preset ran out of memory decoding 1024 px untiled."""
    from diffusers import AutoencoderKL

    from trainer.sampling import placement

    cuda = torch.device("cuda")
    vae = AutoencoderKL.from_pretrained(tiny_models / "flux", subfolder="vae")
    monkeypatch.setattr(placement, "cuda_headroom", lambda device: 8 * 2**30)
    assert placement.decode_for_sample(vae, torch.device("cpu"), 1024, 1024) is None  # the CPU: as the pipeline
    assert placement.decode_for_sample(vae, cuda, 512, 512) is None  # small: never tiled
    assert placement.decode_for_sample(vae, cuda, 1024, 1024) is None and not vae.use_tiling  # 4.1 GiB + 1 fits in 8
    monkeypatch.setattr(placement, "cuda_headroom", lambda device: 4 * 2**30)
    note = placement.decode_for_sample(vae, cuda, 1024, 1024)
    assert vae.use_tiling and vae.tile_sample_min_size == 512
    assert note.startswith("note: the VAE decodes in 512 px tiles") and "4.1 GiB" in note and "4.0 GiB is free" in note


def test_sample_decodes_a_clip_untiled_only_where_the_planners_count_fits(monkeypatch):
    """A video family's `dittrain sample` decode is judged by the planner's count of its VAE on the clip, not the
    image figure per pixel: Wan 2.2 TI2V-5B's 8 GB preset decoded 832x480 x 9 frames untiled next to its ring and ran
    out of memory on an H200 capped at 7 GB (about 4 GB live in the decode, its weights 1.4 GB, the ring 1 GB)."""
    import json

    from trainer.models import adapter_class
    from trainer.planner.vae import RESERVED_PER_COUNTED, _meta_vae, clip_peak
    from trainer.sampling import placement

    family = "wan2.2-ti2v-5b"
    config = dict(adapter_class(family).full_vae_config)
    vae = _meta_vae(family, json.dumps(config, sort_keys=True), torch.bfloat16)  # full size, on meta
    need = placement.untiled_decode_bytes(vae, 480, 832, 9, family)
    assert need == RESERVED_PER_COUNTED * clip_peak(family, config, torch.bfloat16, "decode", 832, 480, 9)
    assert need > 5 * 2**30 > 2 * 2**30 > 480 * 832 * placement.UNTILED_DECODE_PER_PIXEL  # the image figure let it
    cuda = torch.device("cuda")
    monkeypatch.setattr(placement, "cuda_headroom", lambda device: need + placement.DECODE_MARGIN)
    assert placement.decode_for_sample(vae, cuda, 480, 832, 9, family) is None and not vae.use_tiling
    monkeypatch.setattr(placement, "cuda_headroom", lambda device: need + placement.DECODE_MARGIN - 2**20)
    note = placement.decode_for_sample(vae, cuda, 480, 832, 9, family)
    assert vae.use_tiling and note.startswith("note: the VAE decodes in tiles (an untiled 832x480 decode needs")
    vae.disable_tiling()  # the meta VAE is the planner's cached one


def test_training_step_out_of_memory_keeps_its_advice_and_names_the_phase(tiny_models, tmp_path, monkeypatch):
    from trainer.train.trainer import Trainer

    images = write_images(tmp_path / "imgs")
    cfg = make_config(tiny_models, images, tmp_path / "run", tmp_path / "cache", "flux", "lora",
                      train={"steps": 4, "checkpoint_every": 2})
    t = Trainer(cfg)
    t.setup()
    calls = {"n": 0}
    real = t.adapter.predict

    def oom_at_step_3(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError(TORCH_OOM)
        return real(*a, **k)

    monkeypatch.setattr(t.adapter, "predict", oom_at_step_3)
    with pytest.raises(PhaseOutOfMemory) as e:
        t.fit()
    msg = str(e.value)
    assert "out of memory at step 3: raise offload.transformer from 0 to 0.25" in msg
    assert "in phase training step: tried to allocate 2.00 GiB" in msg and "\n" not in msg
    assert (tmp_path / "run" / "checkpoints").exists() and t.last_checkpoint is not None  # step 2's checkpoint kept
    assert t.last_checkpoint.name == "step-000002" and t.last_checkpoint.is_dir()


def test_planner_predicts_every_phase_and_fits_text_encoders_to_the_budget():
    from trainer.config import load_config
    from trainer.planner import analyze
    from trainer.planner.phases import fit_text_fraction, predict_phases, table

    cfg = load_config("configs/flux/lora-8gb.yaml", [])
    facts = analyze(cfg)
    preds = predict_phases(cfg, 0.9, facts)
    names = [p.name for p in preds]
    assert set(names) == set(phase_log.PHASES) - {"sampling"} | ({"sampling"} if cfg.sample.every else set())
    assert all(p.vram > 0 and p.ram > 0 for p in preds)
    by = {p.name: p for p in preds}
    # the T5-XXL (9.5 GB) must stream on a 7 GB budget, less of it on a larger one, none on 24 GB
    f7, f12, f24 = (fit_text_fraction(facts, b) for b in (7, 12, 24))
    assert f7 > f12 >= f24 == 0.0
    assert predict_phases(cfg, 0.9, facts, f7)[0].vram <= 7e9 < predict_phases(cfg, 0.9, facts, 0.0)[0].vram
    if "sampling" in by:  # sampling during training reuses the training ring: it costs less than a step
        assert by["sampling"].vram <= by["training step"].vram + 0.5e9
    lines = table(preds, 7)
    assert any("largest:" in line for line in lines) and any("text caching" in line for line in lines)


def test_planner_leaves_out_what_qwen_drops_of_its_text_encoder_and_counts_its_embedding():
    """Qwen2.5-VL: the head and vision tower never reach the GPU for text-to-image (slim_text_encoder), and its
    embedding (6.6 %, not the 3 % of T5) stays beside the streamed layers. Measured on the GPU: the 3 % share put
    text caching at 10.5 GB where it needed 11.4 (bench/history/2026-11-23.md, 2026-11-23 evening)."""
    import dataclasses

    from trainer.config import load_config
    from trainer.models.qwen_image import QWEN_VL_EMBED, QWEN_VL_LM_HEAD, QWEN_VL_VISUAL
    from trainer.planner import analyze
    from trainer.planner.phases import _text_vram

    facts = analyze(load_config("configs/qwen-image/lora-12gb.yaml", []))
    (_, nbytes), params = facts.text_encoders[0], 8_292_166_656
    whole, act = _text_vram(facts, 0.0, 4), _text_vram(dataclasses.replace(facts, text_encoders=[]), 0.0, 4)
    assert whole - act == pytest.approx(nbytes * (1 - (QWEN_VL_LM_HEAD + QWEN_VL_VISUAL) / params), rel=1e-6)
    # streaming every layer leaves the embedding resident beside the ring
    assert _text_vram(facts, 1.0, 4) - act >= nbytes * QWEN_VL_EMBED / params


def test_bench_writes_sharded_random_weights_that_diffusers_loads(tmp_path, monkeypatch):
    """bench/program/bench_program.py writes full-size folders tensor by tensor from a meta model; here a small
    transformer goes through the same writer (several shards) and loads with from_pretrained."""

    from diffusers import FluxTransformer2DModel

    from bench.program import bench_program as bp

    monkeypatch.setattr(bp, "SHARD_BYTES", 20_000)  # force several shards
    cfg = {"patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
           "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32,
           "guidance_embeds": True, "axes_dims_rope": (4, 4, 8)}
    meta = bp._meta(lambda: FluxTransformer2DModel.from_config(cfg))
    total = bp._save(tmp_path / "transformer", meta, meta, "diffusion_pytorch_model", torch.bfloat16, 1)
    assert len(list((tmp_path / "transformer").glob("*.safetensors"))) > 1
    model = FluxTransformer2DModel.from_pretrained(tmp_path / "transformer", torch_dtype=torch.bfloat16)
    assert total == sum(p.numel() * 2 for p in model.parameters())
    norms = [p for n, p in model.named_parameters() if p.ndim == 1 and "norm" in n and n.endswith("weight")]
    assert norms and all(torch.equal(p, torch.ones_like(p)) for p in norms)
    w = model.transformer_blocks[0].attn.to_q.weight.float()
    assert 0.015 < w.std() < 0.025


def test_bench_program_keeps_each_commands_measurement_lines():
    """What bench_program echoes and keeps in results.json of a command's log: its phase, step and offload lines
    (a GPU machine that returns only some of the log files still returns them)."""

    from bench.program import bench_program as bp

    log = ["loading...", "phase load: peak reserved VRAM 5.01 GB", "  step 2/3: loss 1.0, 0.77 s/step",
           "offload: 24.31 GB of blocks in CPU RAM", "100%|####| 3/3", "error: out of GPU memory sampling 1024x1024",
           "threads: torchrun set OMP_NUM_THREADS=1; each of this host's 4 processes uses 16 CPU threads"]
    assert bp.key_lines(log) == [log[1], log[2].strip(), log[3], log[5], log[6]]


def test_bench_writes_one_fp8_transformer_file_that_streams(tiny_models, tmp_path):
    """bench/program/bench_program.py --transformer-file fp8: one safetensors file written tensor by tensor from a meta
    model (block Linears float8_e4m3fn with a per-tensor scale_weight, the rest bf16) that safetensors reads, that
    stream_load takes in diffusers layout, and whose weights load as the file's fp8 values times the scale."""
    import shutil

    from safetensors import safe_open

    from bench.program import bench_program as bp
    from trainer.config import ModelConfig
    from trainer.models import adapter_class, get_adapter, stream_load

    model = tmp_path / "flux"
    shutil.copytree(tiny_models / "flux", model)
    ad = adapter_class("flux")
    tcls = ad.transformer_cls
    meta = bp._meta(lambda: tcls.from_config(tcls.load_config(model / "transformer")))
    total = bp.write_transformer_file(model, meta, ad)
    f = model / bp.FILES["fp8"]
    assert total == f.stat().st_size and not list((model / "transformer").glob("*.safetensors"))
    with safe_open(str(f), framework="pt") as h:
        keys = set(h.keys())
        w = h.get_tensor("transformer_blocks.0.attn.to_q.weight")
        s = h.get_tensor("transformer_blocks.0.attn.to_q.scale_weight")
        assert h.get_tensor("proj_out.weight").dtype == torch.bfloat16
        assert h.get_tensor("transformer_blocks.0.norm1.linear.weight").dtype == torch.float8_e4m3fn
    assert keys - {k for k in keys if k.endswith(".scale_weight")} == set(meta.state_dict())
    assert w.dtype == torch.float8_e4m3fn and 0.015 < (w.float() * s).std() < 0.025
    mc = ModelConfig(family="flux", path=model, transformer_file=f, quantize="fp8", dtype="bf16")
    assert stream_load.supported(mc)
    tr, _ = stream_load.load(get_adapter(mc), mc, torch.bfloat16, torch.device("cpu"), stream_blocks=False)
    q = tr.transformer_blocks[0].attn.to_q
    assert torch.equal(q.weight.view(torch.uint8), w.view(torch.uint8)) and torch.all(q.weight_scale == s)


def _bench_program(argv: list[str], capsys, monkeypatch) -> str:
    """bench_program's main in this process; asserts it returned 0; its printed output. Its cache / fit / sample
    commands (`python -m trainer ...`) are each a process of their own, as on a GPU, forked from tests/_ranks.py's
    server, which imported torch, diffusers and the trainer once, instead of a fresh interpreter importing them
    (~7 s of one core a command); the bench's own start-up (~4 s of imports) is saved too."""
    import subprocess
    import sys

    from _ranks import Command

    from bench.program import bench_program as bp

    popen = subprocess.Popen

    def fork_trainer(cmd, *, env, stdout, stderr, cwd, **kw):
        if cmd[:3] != [sys.executable, "-m", "trainer"] or stderr != subprocess.STDOUT or kw:
            return popen(cmd, env=env, stdout=stdout, stderr=stderr, cwd=cwd, **kw)
        return Command("trainer", cmd[3:], env, cwd, stdout.name)

    monkeypatch.setattr(subprocess, "Popen", fork_trainer)
    rc = bp.main(argv)
    out = capsys.readouterr().out
    assert rc == 0, out[-4000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("transformer_file", [None, "fp8"])
def test_bench_program_smoke_runs_cache_fit_sample_and_reports_phases(tmp_path, transformer_file, capsys,
                                                                      monkeypatch):
    extra = ["--transformer-file", transformer_file] if transformer_file else []
    out = _bench_program(["--smoke", "--families", "flux", "--work", str(tmp_path), *extra], capsys, monkeypatch)
    for phase in ("text caching", "latent caching", "load", "training step", "sampling", "checkpoint save"):
        assert f"| {phase} |" in out
    assert (tmp_path / "flux" / "8gb" / "out" / "lora.safetensors").exists()


@pytest.mark.slow
def test_bench_program_smoke_trains_and_samples_video_families(tmp_path, capsys, monkeypatch):
    """bench_program --smoke on Wan 2.1 text-to-video and Wan 2.1 image-to-video: tiny models, mp4 clips at a
    size of their own (one bucket of 96x64 x 5 frames, uncropped), fit (caching, training, sampling during it)
    under the phase log; the samples are videos, the image-to-video one's from the first frame. (`dittrain sample`
    of the same families: tests/test_wan*.py.)"""
    import yaml

    out = _bench_program(["--smoke", "--families", "wan", "wan-i2v", "--commands", "fit", "--work", str(tmp_path)],
                         capsys, monkeypatch)
    for phase in ("text caching", "latent caching", "load", "training step", "sampling"):
        assert f"| {phase} |" in out
    for family in ("wan", "wan-i2v"):
        run = tmp_path / family / "8gb"
        assert "96x64x5f         3 clips" in (run / "fit.log").read_text()
        assert (run / "out" / "lora.safetensors").exists() and list((run / "out" / "samples").glob("step-*.mp4"))
    cfg = yaml.safe_load((tmp_path / "wan-i2v" / "8gb" / "wan-i2v.yaml").read_text())
    assert cfg["sample"]["image"] == str(tmp_path / "wan-i2v" / "first-frame.png") and cfg["sample"]["frames"] == 5


@pytest.mark.gpu
def test_a_real_cuda_out_of_memory_is_parsed_into_need_and_free():
    with pytest.raises(PhaseOutOfMemory) as e, Phase("latent caching", log=PhaseLog(), device=torch.device("cuda")):
        torch.empty(2**44, dtype=torch.uint8, device="cuda")  # 16 TiB
    assert "in phase latent caching: tried to allocate 16384.00 GiB with" in str(e.value)
    assert "GiB free of" in str(e.value)


@pytest.mark.gpu
@pytest.mark.parametrize("own_cache", [False, True])
def test_a_phase_with_its_own_cache_does_not_reserve_beside_what_the_step_left_cached(own_cache):
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")  # the "training step" leaves 1 GiB cached
    del x
    with Phase("sampling", log=PhaseLog(), device=torch.device("cuda"), own_cache=own_cache) as p:
        y = torch.empty(3 * 2**29, dtype=torch.uint8, device="cuda")  # 1.5 GiB: does not fit the cached 1 GiB
        del y
    extra = (p.peak.vram_reserved - base) / 2**30
    assert extra == pytest.approx(1.5 if own_cache else 2.5, abs=0.1)
    assert own_cache == (torch.cuda.memory_reserved() - base < 2**20)


@pytest.mark.gpu
def test_fit_on_cuda_logs_every_phase_and_sampling_adds_at_most_half_a_gb(tiny_models, tmp_path, capsys):
    from trainer.train.trainer import Trainer

    images = write_images(tmp_path / "imgs")
    peaks = {}
    for every in (0, 2):
        phase_log.LOG.peaks.clear()
        cfg = make_config(tiny_models, images, tmp_path / f"run{every}", tmp_path / "cache", "flux", "lora",
                          train={"steps": 4, "device": "cuda"},
                          sample={"every": every, "prompts": ["a cat"], "steps": 2, "width": 64, "height": 64})
        Trainer(cfg).fit()
        peaks[every] = max(p.vram_reserved for p in phase_log.LOG.peaks.values())
        assert ("sampling" in phase_log.LOG.peaks) == bool(every)
    assert peaks[2] <= peaks[0] + 0.5e9
    err = capsys.readouterr().err
    assert "phase training step: peak reserved VRAM" in err and "(planner:" in err


def test_choose_fraction_needs_sampling_during_training_to_fit_too(monkeypatch):
    from trainer.config import load_config
    from trainer.planner import analyze, choose_fraction
    from trainer.planner import prediction as pred

    cfg = load_config("configs/flux/lora-8gb.yaml", [])
    facts = analyze(cfg)
    base = choose_fraction(cfg, 7, facts=facts, log=lambda s: None)
    assert base == pytest.approx(float(cfg.offload.transformer))  # the preset's fraction, sampling on
    # sampling that needs more than the training step at every fraction, by more than the preset's fraction
    # leaves under the budget: a higher fraction is chosen
    real = pred.predict
    extra = 7e9 - real(facts, base, max(facts.resolutions), False).peak_reserved + 0.1e9
    monkeypatch.setattr(pred, "_sampling_peak", lambda c, f, fr, r: real(f, fr, r, False).peak_reserved + extra)
    assert choose_fraction(cfg, 7, facts=facts, log=lambda s: None) > base
    monkeypatch.setattr(pred, "_sampling_peak", lambda c, f, fr, r: float("inf"))
    with pytest.raises(UserError, match=r"sampling during training needs inf GB .*set sample.every: 0"):
        choose_fraction(cfg, 7, facts=facts, log=lambda s: None)


def test_text_encoders_are_not_copied_back_out_of_the_arena_when_their_stage_ends(tiny_models):
    """Measured on the GPU (issue 14): `dittrain cache` held 17.1 GB anonymous RAM for a 9.5 GB T5-XXL because
    closing the streamed encoder copied every block out of the arena (arena + copies) just before the encoder was
    dropped. Leaving the stage must leave the streamed blocks empty (meta) instead, after the same embeddings."""
    from trainer.config import ModelConfig
    from trainer.data.cache import StagedLoader, place_encoder
    from trainer.models import get_adapter
    from trainer.models.base import text_encoder_blocks

    mc = ModelConfig(family="flux", path=tiny_models / "flux", dtype="fp32")
    adapter = get_adapter(mc)
    want = adapter.encode_prompts(adapter.load(mc, parts={"text"}, dtype=torch.float32, device="cpu"), ["a cat"])

    cfg = type("C", (), {"model": mc, "train": type("T", (), {"device": "cpu"})()})()
    loader = StagedLoader(cfg, adapter, place_text=lambda enc, dev: place_encoder(enc, dev, 0.5))
    with loader.text() as comps:
        encoders = list(comps.text_encoders)
        got = adapter.encode_prompts(comps, ["a cat"])
    assert all(torch.equal(got[k], want[k]) for k in want)
    frozen = [p for enc in encoders for b in text_encoder_blocks(enc) for p in b.parameters()]
    assert frozen and all(p.device.type == "meta" for p in frozen)


def test_latent_caching_counts_the_qwen_image_vaes_own_encode():
    """Every family on AutoencoderKLQwenImage (Qwen-Image, Anima, Krea 2) caches latents at the VAE's own bytes per
    pixel, not Flux's: at 1024 px the planner said 2.68 GB where Anima's 8 GB preset reserved 3.62
    (bench/logs/2026-11-27-night/anima_card8.log; Qwen-Image's and Krea 2's presets the same). Flux's VAE keeps its
    figure."""
    from trainer.config import load_config
    from trainer.models import adapter_class
    from trainer.models.qwen_image import QWEN_VAE_ENCODE_PER_PIXEL
    from trainer.planner import analyze
    from trainer.planner.phases import CACHE_TILE_PIXELS, VAE_ACT_ENCODE, predict_phases
    from trainer.planner.prediction import ALLOCATOR_OVERHEAD, WORKSPACE

    for family in ("anima", "qwen-image", "krea2"):
        assert adapter_class(family).vae_encode_bytes_per_pixel == QWEN_VAE_ENCODE_PER_PIXEL
    assert adapter_class("flux").vae_encode_bytes_per_pixel is None
    cfg = load_config("configs/anima/lora-8gb.yaml", ["sample.every=0"])
    facts = analyze(cfg)
    res = max(facts.resolutions)
    assert res == 1024
    (lat,) = [p for p in predict_phases(cfg, 0.0, facts) if p.name == "latent caching"]
    vae = facts.adapter.vae_params * 2
    assert lat.vram == pytest.approx(vae + ALLOCATOR_OVERHEAD * CACHE_TILE_PIXELS * QWEN_VAE_ENCODE_PER_PIXEL
                                     + WORKSPACE)
    flux_figure = vae + ALLOCATOR_OVERHEAD * CACHE_TILE_PIXELS * VAE_ACT_ENCODE + WORKSPACE
    assert flux_figure < 3.62e9 <= lat.vram  # the old figure was under the measured reserve; this one is not


def test_bench_program_reports_a_multi_process_phase_as_its_slowest_process_not_the_sum():
    """A torchrun launch writes each phase once per process, side by side: the 4-GPU table said "load 88.6 s"
    (the sum of four ~22 s loads) beside one GPU's 16.3 s. The cell is the slowest process's time."""
    from bench.program import bench_program as bp

    class Poll:
        def peak(self, t0=0.0, t1=0.0):
            return 0

    def rec(phase, rank, start, end):
        return {"phase": phase, "rank": rank, "start": start, "end": end, "vram_reserved": 0, "anon_rss": 0}

    recs = [rec("load", r, 0.0, 20.0 + r) for r in range(4)]
    recs += [rec("training step", r, 30.0 + 10 * i, 31.0 + 10 * i + (5 if i == 0 else 0)) for i in range(3)
             for r in range(4)]
    phases = bp._per_phase(recs, Poll())
    row = {"label": "flux 24gb", "command": "fit", "rc": 0, "gpus": 4, "anon_peak": 0, "shmem_peak": 0,
           "wall_s": 80.0, "phases": phases, "last_line": ""}
    lines = bp.report([row])
    assert "the slowest process's" in lines[2]
    assert lines[3].endswith("| 23.0 |")  # not 86.0
    assert lines[4].endswith("| median 1.00 of 12 |")  # each process's first step left out, not only rank 0's


def test_bench_program_counts_torchs_compile_workers_apart_in_a_process_tree():
    """A 4-GPU `fit` summed 3.9 GB of anonymous memory a process where the trainer's own line read 2.3 GB: the rest
    was below it, torch's compile workers. The tree sampler counts the processes whose command line is inductor's
    compile worker apart (`workers`), and the table says how much of the sum they were."""
    import subprocess
    import sys
    import time

    from bench.program import bench_program as bp

    hold = "import time; x = b'x' * 60_000_000; time.sleep(4)"  # 60 MB written: anonymous, resident
    # the parent's own command line must not name it: 'compile' + '_worker' is joined in the parent
    code = (f"import subprocess, sys; w = subprocess.Popen([sys.executable, '-c', {hold!r}, 'compile' + '_worker']); "
            f"x = b'y' * 30_000_000; w.wait()")
    p = subprocess.Popen([sys.executable, "-c", code])
    poll = bp.AnonPoller(p.pid, tree=True)
    p.wait()
    time.sleep(0.1)
    poll.stop()
    workers = max(b for _, b in poll.workers)
    assert 55e6 < workers < 90e6  # the worker's 60 MB (and its interpreter), not the parent's
    assert poll.peak() > workers + 25e6  # the sum has the parent's 30 MB too
    row = {"label": "flux 48gb", "command": "fit", "rc": 0, "gpus": 4, "anon_peak": 15.6e9, "shmem_peak": 11.8e9,
           "workers_peak": 6.4e9, "wall_s": 93.0, "phases": {}, "last_line": ""}
    assert "torch's compile workers 6.4 GB of it at their peak; node shmem peak 11.8 GB" in bp.report([row])[2]


def test_bench_program_commands_none_writes_the_folder_and_config_and_runs_nothing(tmp_path, capsys, monkeypatch):
    out = _bench_program(["--smoke", "--families", "flux", "--commands", "none", "--work", str(tmp_path)], capsys,
                         monkeypatch)
    run = tmp_path / "flux" / "8gb"
    assert (run / "flux.yaml").exists() and not list(run.glob("*.log")), out
    # the model folder stays for the invocation that runs it (`none` implies --keep)
    assert (tmp_path / "flux" / "tiny" / "flux" / "model_index.json").exists(), out
    from bench.program import bench_program as bp

    with pytest.raises(SystemExit):
        bp.main(["--smoke", "--families", "flux", "--commands", "fit,smaple", "--work", str(tmp_path)])
    assert "smaple is not cache, fit, sample or none" in capsys.readouterr().err
