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
