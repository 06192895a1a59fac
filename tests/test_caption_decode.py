"""The decode placement of `dittrain caption` (trainer/captioning/vlm.py's essay, Decode placement): after a batch's
prefill the conductor holds more decoder layers for the decode steps (`Placement.decode_at`, the conductor's
`hold`) and gives them back before the next prefill. Greedy captions are the resident model's, each decode step
copies fewer bytes, and for the full-size models at a 7 GB cap auto's decode fraction is below the prefill's."""

from __future__ import annotations

import pytest
import torch
from test_caption_command import BUILDERS, _captions, _data, _save_model

from bench.program import bench_caption as bc
from trainer.captioning import CaptionRequest, captioner, run_caption, vlm
from trainer.errors import UserError
from trainer.offload.conductor import Conductor
from trainer.planner.prediction import GB, PREDICTION_MARGIN


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-decode")
    return {kind: _save_model(root / kind, kind) for kind in BUILDERS}


def _run(models, tmp_path, kind: str, mode: str, fraction: float, decode: float | None, tokens: int = 5) -> tuple:
    """Captions at `fraction`, the decode steps at `decode` (None: no decode placement); the bytes the decoder's
    conductor copied in each forward of the model (prefill or decode step) and in each switch (`hold`)."""
    passes: list[list] = []  # [decoding, bytes] per forward
    switches: list[int] = []
    load, hold, place = Conductor._load, Conductor.hold, vlm.place

    def spy_load(self, dst, src):
        if passes and self.blocks[0] in decoder:
            passes[-1][1] += dst.numel()
        return load(self, dst, src)

    def spy_hold(self, f):
        before = passes[-1][1]
        ok = hold(self, f)
        switches.append(passes[-1][1] - before)
        passes[-1][1] = before
        return ok

    def spy_place(model, blocks, device, f):
        decoder.extend(blocks)

        def count(module, args, kwargs):
            cache = kwargs.get("past_key_values")
            passes.append([cache is not None and cache.get_seq_length() > 0, 0])

        model.register_forward_pre_hook(count, with_kwargs=True)  # before `decode_at`'s: it runs first
        return place(model, blocks, device, f)

    decoder: list = []
    data = _data(tmp_path / f"data-{fraction}-{decode}")
    with pytest.MonkeyPatch.context() as mp:  # undone before the next run's spies wrap these
        mp.setattr(Conductor, "_load", spy_load)
        mp.setattr(Conductor, "hold", spy_hold)
        mp.setattr(vlm, "place", spy_place)
        mp.setattr(captioner, "_decode_fraction", lambda *a: fraction if decode is None else decode)
        summary = run_caption(CaptionRequest(data_dir=data, model=models[kind], offload=fraction, batch=3,
                                             max_new_tokens=tokens, quantize=mode))
    return _captions(data), passes, switches, summary


@pytest.mark.parametrize("mode", ["none", "fp8"])
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_decode_placement_captions_as_resident(models, tmp_path, kind, mode):
    """Streamed at 1 with the decode steps at 0.25 (one more of the 4 layers held) or 0 (every layer on the device
    once the prefill is done): the same greedy captions as streamed without it and as resident."""
    resident, _, _, _ = _run(models, tmp_path, kind, mode, 0.0, None)
    assert len(resident) == 5
    for decode in (None, 0.25, 0.0):
        got, passes, switches, summary = _run(models, tmp_path, kind, mode, 1.0, decode)
        assert got == resident and summary.decode_fraction == (1.0 if decode is None else decode), decode
        assert sum(d for d, _ in passes) > 2 * sum(not d for d, _ in passes)  # two batches, decode steps each


def test_decode_steps_copy_fewer_bytes(models, tmp_path):
    """The bytes the decoder's conductor copies per forward: every decode step at 0.25 copies one layer (of 4)
    fewer than at 1 (the held one, copied once per batch at the switch), at 0 none. A switch also restarts the
    ring's plan (its first two layers copied again): with 11 decode steps a batch the run copies fewer bytes in
    all, with 4 as many (each switch's cost, against one layer a step)."""
    _, before, none, _ = _run(models, tmp_path, "qwen2.5-vl", "fp8", 1.0, None, tokens=12)
    _, after, switches, _ = _run(models, tmp_path, "qwen2.5-vl", "fp8", 1.0, 0.25, tokens=12)
    _, zero, _, _ = _run(models, tmp_path, "qwen2.5-vl", "fp8", 1.0, 0.0, tokens=12)
    assert [d for d, _ in before] == [d for d, _ in after] == [d for d, _ in zero]
    layer = max(n for d, n in before if d) // 4  # every layer streams per step at 1: 4 of them
    decoding = [(b, a, z) for (d, b), (_, a), (_, z) in zip(before, after, zero, strict=True) if d]
    assert all(b == 4 * layer and a == 3 * layer and z == 0 for b, a, z in decoding), decoding
    # the switches copy only at a phase change (into batch 1's decode, back for batch 2's prefill, into its
    # decode: the held layer, the ring's first layers), and the run as a whole copies fewer bytes
    assert not none and len([s for s in switches if s]) == 3
    assert sum(switches) + sum(n for _, n in after) < sum(n for _, n in before)


@pytest.mark.parametrize("family", bc.FAMILIES)
def test_full_size_decode_holds_more_layers_at_7gb(family):
    """On the meta device, fp8, a batch of 8, 1024 px images, 64 new tokens, a 7 GB cap: auto's decode fraction
    is below its prefill fraction, its decode estimate fits the cap's margin (and one layer more would not), and
    each new token streams fewer bytes."""
    (row,) = bc.estimate(family, ["fp8"], [8], [7], 64)
    assert row["decode_fraction"] < row["fraction"], row
    assert row["decode_streamed_gb_per_token"] < row["streamed_gb_per_token"], row
    with torch.device("meta"):
        model = bc.model_class(family)(bc.model_config(family, small=False)).to(torch.bfloat16)
    blocks = vlm.decoder_blocks(model)
    vlm.quantize_decoder(blocks, "fp8")
    vlm.quantize_outside(model, "fp8")
    need = vlm.estimate(model, blocks, 8, row["tokens_per_row"], decode=True)
    limit = 7 * GB * (1 - PREDICTION_MARGIN)
    assert need(row["decode_fraction"]) <= limit
    grid = vlm.block_grid(vlm.block_sizes(blocks))
    assert need(grid[grid.index(row["decode_fraction"]) - 1]) > limit


def test_out_of_memory_in_decode_goes_on_at_the_prefills_fraction(models, tmp_path, monkeypatch, capsys):
    """Out of memory in a decode step with the decode placement on (raised by a decoder layer, its layers held):
    one line, the placement ends (its layers given back, none held after), the batch runs again, and the run ends
    with the resident model's captions; out of memory again is the usual one-line error."""
    resident, _, _, _ = _run(models, tmp_path, "qwen3-vl", "fp8", 0.0, None)
    generate, calls = vlm.generate, []

    def oom_in_decode(once: bool):
        def gen(model, processor, gc, inputs):
            calls.append(1)
            if len(calls) == 2 or not once:  # the second batch, in its second decode step
                def boom(module, args, kwargs):
                    if kwargs["past_key_values"].get_seq_length() > inputs["input_ids"].shape[1]:
                        hook.remove()
                        raise torch.OutOfMemoryError("simulated")

                hook = vlm.decoder_blocks(model)[1].register_forward_pre_hook(boom, with_kwargs=True)
            return generate(model, processor, gc, inputs)

        return gen

    monkeypatch.setattr(vlm, "generate", oom_in_decode(True))
    got, passes, switches, summary = _run(models, tmp_path, "qwen3-vl", "fp8", 1.0, 0.25)
    assert got == resident and len(calls) == 3 and summary.decode_fraction == 1.0
    assert capsys.readouterr().err.count("offload: out of memory with the decode steps at 0.25: they run at 1") == 1
    # into batch 1's decode and back, into batch 2's decode, `decode_off` gives the layers back (the last call):
    # the rerun's forwards switch nothing
    assert len([s for s in switches if s]) == 4 and switches[-1] and len(switches) < len(passes)
    monkeypatch.setattr(vlm, "generate", oom_in_decode(False))
    with pytest.raises(UserError, match=r"out of memory captioning a batch of \d at --offload 1: lower --batch"):
        _run(models, tmp_path / "again", "qwen3-vl", "fp8", 1.0, 0.25)


def test_decode_placement_is_opt_in(monkeypatch, tmp_path):
    """`dittrain caption --offload auto` decodes at the prefill's fraction unless the request asks for the decode
    placement (measured slower on an H200, vlm.py's essay); asked, the decode steps get `vlm.decode_fraction`'s."""
    monkeypatch.setattr(captioner, "_budget", lambda device: 7 * GB)
    monkeypatch.setattr(vlm, "decode_fraction", lambda *a: 0.25)
    req = captioner.CaptionRequest(data_dir=tmp_path, model=tmp_path)
    assert captioner._decode_fraction(req, None, [], torch.device("cpu"), 64, 8, 0.5) == 0.5
    req.decode_placement = True
    assert captioner._decode_fraction(req, None, [], torch.device("cpu"), 64, 8, 0.5) == 0.25
    req.offload = 0.5  # a given fraction keeps its one placement
    assert captioner._decode_fraction(req, None, [], torch.device("cpu"), 64, 8, 0.5) == 0.5


@pytest.mark.parametrize(("offload", "quantize", "fraction", "said"), [
    ("auto", "none", 0.75, True), ("auto", "none", 0.25, False), ("auto", "fp8", 0.75, False), (0.75, "none", 0.75,
                                                                                                False)])
def test_streaming_most_of_a_bf16_decoder_suggests_fp8(tmp_path, capsys, offload, quantize, fraction, said):
    """`--offload auto` streaming at least half of a bf16 decoder says once that `--quantize fp8` halves the bytes
    each new token copies; not for a given fraction, a quantized model or a mostly resident one."""
    req = captioner.CaptionRequest(data_dir=tmp_path, model=tmp_path, offload=offload, quantize=quantize)
    captioner._hint_quantize(req, fraction)
    assert ("--quantize fp8 halves" in capsys.readouterr().err) == said
