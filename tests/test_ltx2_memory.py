"""LTX-2's text connectors one prompt at a time (issue 45: the 16 GB preset ran out of its 15 GB cap caching
captions, bench/logs/2026-11-27-night/ltx2_text_caching_oom_trace.txt): the same embeddings as diffusers' batched
call, bitwise on the CPU; the masked per-layer norm never sees more than one prompt, in captions' caching and in
the pipeline's own call, and a sample's prompts go through it when they are encoded, not in the pipeline's call
(the same latents and sound); the planner's count of what encoding holds, checked against the allocations that
trace recorded for the batch of four before the change."""

from __future__ import annotations

import _family_checks as checks
import pytest
import torch
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2 import connectors as connectors_module

from trainer.models import adapter_class
from trainer.models.ltx2 import CONNECTORS_PARAMS, OnePromptConnectors, _stacked_bytes
from trainer.planner.meta import shared_sizes

FAMILY = "ltx2"
PROMPTS = ["a green square moving right", "  a dog runs along the beach at night  ", "x"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from trainer.models.tiny import make_tiny_models

    root = tmp_path_factory.mktemp("tiny-ltx2-memory")
    make_tiny_models(root, [FAMILY])
    return root


@pytest.fixture(scope="module")
def loaded(root) -> tuple:
    return checks.tiny_pipeline(FAMILY, root / FAMILY)


@pytest.fixture
def norm_batches(monkeypatch) -> list[int]:
    """The batch of every call of diffusers' `per_layer_masked_mean_norm` (the connectors' forward looks it up
    in its module at each call)."""
    seen, orig = [], connectors_module.per_layer_masked_mean_norm

    def spy(text_hidden_states, *a, **kw):
        seen.append(text_hidden_states.shape[0])
        return orig(text_hidden_states, *a, **kw)

    monkeypatch.setattr(connectors_module, "per_layer_masked_mean_norm", spy)
    return seen


def test_connectors_load_one_prompt_at_a_time_and_equal_the_batched_call(loaded):
    """Every step of the connectors is the prompt's own (norm statistics over its tokens, registers in its padding,
    attention among its tokens), so the rows equal diffusers' batched forward bit for bit on the CPU, in fp32 and
    in bf16."""
    adapter, comps, pipe = loaded
    conn = comps.extras["connectors"]
    assert isinstance(conn, OnePromptConnectors) and pipe.connectors is conn
    pe, pm, _, _ = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False, device="cpu")
    with torch.no_grad():
        text = adapter.encode_prompts(comps, PROMPTS)
        batched = LTX2TextConnectors.forward(conn, pe, pm, padding_side=pipe.tokenizer.padding_side)
        assert torch.equal(text["prompt_embeds"], batched[0])
        assert torch.equal(text["prompt_attention_mask"], batched[2])
        for ours, theirs in zip(conn(pe, pm, padding_side="left"), batched, strict=True):
            assert torch.equal(ours, theirs)
        # packed by `connect`, the outputs come back out of `forward` as they went in (the sample's path)
        for ours, theirs in zip(conn(conn.connect(pe, pm), pm), batched, strict=True):
            assert torch.equal(ours, theirs) and ours.dtype == theirs.dtype
        half = OnePromptConnectors.from_config(conn.config)
        half.load_state_dict(conn.state_dict())
        half = half.to(torch.bfloat16)
        pe16 = pe.to(torch.bfloat16)
        for ours, theirs in zip(half(pe16, pm), LTX2TextConnectors.forward(half, pe16, pm), strict=True):
            assert torch.equal(ours, theirs)


def test_the_norm_never_sees_more_than_one_prompt(loaded, norm_batches):
    """Captions' caching (a batch of three) and the pipeline's own call from a prompt (its [negative, prompt]
    batch of two under guidance) run the connectors' norm on one prompt's stacked states at a time; a sample's
    prompts (`pipeline_embeds`) run it when they are encoded, and the pipeline's call from those embeddings not
    at all, with the same result as its call from the prompt."""
    adapter, comps, pipe = loaded
    with torch.no_grad():
        adapter.encode_prompts(comps, PROMPTS)
    assert norm_batches == [1, 1, 1]
    norm_batches.clear()
    call = {"height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 2, "output_type": "latent"}
    want = pipe(prompt=PROMPTS[0], generator=torch.Generator().manual_seed(0), **call)
    assert norm_batches == [1, 1]
    norm_batches.clear()
    with torch.no_grad():
        embeds = adapter.pipeline_embeds(pipe, PROMPTS[0], "", "cpu")
    assert norm_batches == [1, 1]
    got = pipe(**embeds, generator=torch.Generator().manual_seed(0), **call)
    assert norm_batches == [1, 1]  # none in the call
    assert embeds["prompt_embeds"].shape == (1, 1024, 32 + 32 + 1)
    assert not want.frames.isnan().any() and not want.audio.isnan().any()
    assert torch.equal(got.frames, want.frames) and torch.equal(got.audio, want.audio)


def test_planner_counts_what_the_oom_trace_measured():
    """The trace of the batch of four (before one prompt at a time): Gemma's ring 4.035 GB and resident embedding
    2.014 GB, the connectors 2.863 GB, the stacked states 1.541 GB and the norm's masked copy 1.541 GB live when
    its first fp32 copy of the batch, 3,082,813,440 bytes, was asked for. The planner's pieces are those bytes;
    one prompt at a time, the connectors' peak holds the batch's states and one prompt's norm."""
    cls = adapter_class(FAMILY)
    (gemma,) = shared_sizes(FAMILY, [("text_encoder", cls.text_encoder_params[0][1] * 2)])
    assert gemma.outside == pytest.approx(2.014e9, abs=1e6)
    assert gemma.on_gpu(0.8) - gemma.outside == pytest.approx(4.035e9, abs=1e6)
    assert _stacked_bytes(4, 2) == pytest.approx(1.541e9, abs=1e6)
    assert _stacked_bytes(4, 4) == 3_082_813_440  # the batch's fp32 copy the OOM asked for
    assert CONNECTORS_PARAMS * 2 == pytest.approx(2.863e9, abs=1e6)
    (_, gemma4), (weights, act4) = cls.text_encode_peaks(4, 2)
    (_, _), (_, act1) = cls.text_encode_peaks(1, 2)
    assert weights == CONNECTORS_PARAMS * 2
    assert act4 - act1 == 3 * _stacked_bytes(1, 2)  # more prompts add their states, never their norm
    assert act4 == 5 * _stacked_bytes(1, 2) + 2 * _stacked_bytes(1, 4)
    assert gemma4 >= 2 * _stacked_bytes(4, 2)  # the model's tuple of hidden states and the pipeline's stack


def test_text_caching_phase_uses_the_familys_count():
    """`_text_vram` for LTX-2: Gemma placed, then the larger of its peaks (the connectors' for a batch of four)
    with the allocator's overhead on the activations, not the generic T5-shaped estimate."""
    from types import SimpleNamespace

    from trainer.planner.phases import _text_vram
    from trainer.planner.prediction import ALLOCATOR_OVERHEAD, WORKSPACE

    cls = adapter_class(FAMILY)
    (gemma,) = shared_sizes(FAMILY, [("text_encoder", cls.text_encoder_params[0][1] * 2)])
    facts = SimpleNamespace(adapter=cls, family=FAMILY, dtype=torch.bfloat16, text_sizes=[gemma], text_tokens=1024)
    w, a = cls.text_encode_peaks(4, 2)[1]
    assert _text_vram(facts, 0.8, 4) == pytest.approx(gemma.on_gpu(0.8) + w + ALLOCATOR_OVERHEAD * a + WORKSPACE)


def test_sampling_counts_the_prompts_the_pipeline_call_holds():
    """`dittrain sample` and sampling during training: the call holds the connectors' packed outputs for the prompt
    and the negative prompt, their concatenation and the sound decoders from start to end (the connectors ran
    with the text encoder); a family that counts nothing of its own adds nothing."""
    from types import SimpleNamespace

    from trainer.models.ltx2 import SOUND_DECODER_PARAMS
    from trainer.planner.sampling import _prompt_bytes

    facts = SimpleNamespace(adapter=adapter_class(FAMILY), dtype=torch.bfloat16)
    assert _prompt_bytes(facts, 2) == 4 * 1024 * (3840 + 3840 + 1) * 2 + SOUND_DECODER_PARAMS * 2
    assert _prompt_bytes(SimpleNamespace(adapter=adapter_class("flux"), dtype=torch.bfloat16), 2) == 0.0
    cls = adapter_class(FAMILY)  # a sample's prompt and negative: Gemma alone for each, then connected in turn
    assert cls.text_encode_peaks(1, 2, "sample")[1] == (CONNECTORS_PARAMS * 2,
                                                        2 * _stacked_bytes(1, 2) + cls.text_encode_peaks(1, 2)[1][1]
                                                        - _stacked_bytes(1, 2))



def test_text_ram_of_a_folder_counts_the_connectors_loaded_with_gemma(root, loaded):
    """Text caching held 27.9 GB of RSS at full size against 24.4 predicted (bench/history/2026-11-28.md 01:27): the
    folder's Gemma was counted, not the connectors loaded beside it (2.86 GB). From a folder the planner now adds
    `extra_text_dirs`' parameters in the model dtype, as `load` holds them in CPU RAM with the text encoder."""
    from types import SimpleNamespace

    from trainer.planner.meta import _built_size, text_encoder_sizes
    from trainer.planner.phases import _text_ram

    cfg = SimpleNamespace(model=SimpleNamespace(family=FAMILY, path=str(root / FAMILY), dtype="bf16"))
    (gemma,) = text_encoder_sizes(cfg)
    alone = _built_size(cfg, 0, root / FAMILY / "text_encoder")
    connectors = sum(p.numel() for p in loaded[1].extras["connectors"].parameters())
    assert connectors > 0 and gemma.loaded == alone.loaded + connectors * 2
    assert (gemma.outside, gemma.blocks) == (alone.outside, alone.blocks)  # never placed with Gemma
    assert _text_ram(SimpleNamespace(text_sizes=[gemma])) == gemma.loaded


def _ltx2_cfg(root, every: int = 10):
    from trainer.config import Config

    return Config.model_validate({
        "model": {"family": FAMILY, "path": str(root / FAMILY), "dtype": "bf16"},
        "train": {"method": "lora", "gradient_checkpointing": True},
        "data": {"sources": [{"path": "/tmp"}], "resolutions": [64], "clip_frames": 9, "fps": 24.0},
        "offload": {"transformer": 1.0},
        "sample": {"prompts": ["a cat"], "every": every, "width": 64, "height": 64, "frames": 9},
        "output": {"dir": "/tmp/out"},
    })


def test_host_ram_of_the_caching_and_load_phases_names_every_term(root):
    """LTX-2's 16 GB preset on an H200 (bench/history/2026-11-28.md 01:27 and 03:50) held 27.9-28.5 GB of anonymous
    RSS in text caching and load against 24.4-27.2 / 21.1 predicted, 9.2-9.4 GB in latent caching against 4.8. On the tiny folder, each
    phase's RAM is the sum of its named terms: text caching the process (`HOST_BASE`) and the encoders as loaded
    (Gemma and the connectors beside it); latent caching the process, the VAE as read and the batch of clips as
    read and as stacked (`CLIP_RAM_PER_PIXEL`, 24 bytes a pixel of every frame); load the training step's, or the
    text caching's where a sample's prompts are encoded in it."""
    from trainer.planner import analyze
    from trainer.planner.phases import CLIP_RAM_PER_PIXEL, _text_ram, predict_phases
    from trainer.planner.prediction import HOST_BASE, predict

    cfg = _ltx2_cfg(root)
    facts = analyze(cfg)
    by = {p.name: p for p in predict_phases(cfg, 1.0, facts)}
    gemma_and_connectors = _text_ram(facts)
    assert gemma_and_connectors == sum(s.loaded for s in facts.text_sizes) > 0
    assert by["text caching"].ram == HOST_BASE + gemma_and_connectors
    w, h, frames = facts.size(64)
    batch = cfg.data.encode_batch_size
    assert CLIP_RAM_PER_PIXEL == 2 * 3 * 4  # fp32 RGB, twice
    assert by["latent caching"].ram == HOST_BASE + adapter_class(FAMILY).vae_params * 2 + batch * frames * w * h * 24
    step = predict(facts, 1.0, 64, False)
    assert by["training step"].ram == step.ram_peak
    between = step.ram_peak - step.act_checkpoint_host  # no offloaded activations before the first step
    assert by["load"].ram == max(between, by["text caching"].ram)  # the prompts' encoders load in the load phase
    quiet = {p.name: p for p in predict_phases(_ltx2_cfg(root, every=0), 1.0, facts)}
    assert quiet["load"].ram == between  # no sample prompts: the transformer's load alone


def test_the_latent_cache_holds_each_batch_as_read_and_as_stacked(root, loaded, monkeypatch):
    """What `CLIP_RAM_PER_PIXEL` counts, on the tiny LTX-2: when `_encode_latents` stacks a batch of clips, the clips
    as read (fp32, 12 bytes a pixel of every frame) and the stacked batch (12 more) are alive at once."""
    from trainer.data import cache as dcache
    from trainer.planner.phases import CLIP_RAM_PER_PIXEL

    cls = adapter_class(FAMILY)
    adapter = cls.__new__(cls)
    frames, h, w = 9, 64, 96
    clips = {f"k{i}": torch.rand(3, frames, h, w) * 2 - 1 for i in range(3)}
    monkeypatch.setattr(dcache, "_pixels_or_reason", lambda job: (clips[job.key].clone(), None))
    seen = []
    real_stack = torch.stack

    def stack(tensors, *a, **kw):
        out = real_stack(tensors, *a, **kw)
        seen.append(sum(t.nbytes for t in tensors) + out.nbytes)
        return out

    monkeypatch.setattr(dcache.torch, "stack", stack)
    monkeypatch.setattr(cls, "encode_videos", lambda self, vae, px: px[:, :4, ::8, ::32, ::32].clone())

    class Bar:
        def update(self, n):
            pass

    jobs = [dcache.LatentJob(key=k, file=f"{k}.mp4", bucket=(w, h), box=(0, 0), frames=frames) for k in clips]
    dcache._encode_latents(adapter, loaded[1].vae, dcache.MemoryStore(), jobs, 3, Bar(), dcache.EncodeResult())
    assert seen == [3 * frames * h * w * CLIP_RAM_PER_PIXEL]
