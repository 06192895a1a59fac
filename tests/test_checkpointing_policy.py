"""Recompute only what must be (issue 29): per-block gradient checkpointing in the offload handle, and
`train.gradient_checkpointing: auto`'s choice by the planner.

Equivalence (fp32, CPU): keeping a block's activations instead of recomputing it gives bitwise the same losses and
LoRA weights, at fraction 0 for all, none or some blocks, and at fraction 0.5 for the blocks that never leave the
ring, and at fractions 0.25-1 for streamed blocks too (their saved weight views resolve to the region they are
loaded into for backward). A trainable streamed block without checkpointing is refused (it is stepped and written
back in its backward)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from _offload_util import add_lora, blocks_of, tiny_flux, train_steps, trainable_state

from trainer.offload import attach_offload
from trainer.offload.block import StreamedBlock


def _run(fraction, checkpointing, steps=2, layers=2, singles=2, race_detector=False):
    m = add_lora(tiny_flux(0, layers=layers, singles=singles))
    blocks = blocks_of(m)
    h = attach_offload(blocks, "cpu", fraction, checkpointing=checkpointing, race_detector=race_detector)
    recomputed = []
    for i, b in enumerate(blocks):  # recomputes: a block's submodules called under backward
        for sub in b.children():
            sub.register_forward_pre_hook(lambda mod, a, i=i: recomputed.append(i)
                                          if torch._C._current_graph_task_id() != -1 else None)
    losses = train_steps(m, steps)
    plan = h.plan
    h.close()
    return losses, trainable_state(m), sorted(set(recomputed)), plan


def _same(a, b):
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


@pytest.mark.parametrize("policy", [False, [False, True, False, True]])
def test_keeping_activations_is_bitwise_recomputing_at_offload_0(policy):
    ref = _run(0.0, True)
    assert ref[2] == [0, 1, 2, 3]  # every block recomputed in backward
    got = _run(0.0, policy)
    _same(got, ref)
    want = [] if policy is False else [i for i, c in enumerate(policy) if c]
    assert got[2] == want  # only the checkpointed blocks ran again


def test_resident_blocks_of_a_streamed_run_may_keep_activations():
    six = dict(layers=0, singles=6)  # equal blocks: at 0.25 the training plan leaves the middle ones resident
    ref = _run(0.25, True, **six)
    streamed = set(ref[3].streamed)
    assert streamed and len(streamed) < 6
    policy = [i in streamed for i in range(6)]
    got = _run(0.25, policy, **six)
    _same(got, ref)
    assert got[2] == sorted(streamed)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
@pytest.mark.parametrize("policy", ["none", "streamed kept"])
def test_streamed_blocks_may_keep_activations_and_train_bitwise(fraction, policy):
    """A streamed block that is not recomputed: autograd's saved views of its weights resolve to the region the
    block is loaded into for its backward (conductor `saved_weights`), under the race detector (a released region
    is NaN at once), bitwise the recomputed run."""
    six = dict(layers=1, singles=4)
    ref = _run(fraction, True, **six)
    streamed = set(ref[3].streamed)
    assert streamed
    checkpointing = False if policy == "none" else [i not in streamed for i in range(5)]
    got = _run(fraction, checkpointing, race_detector=True, **six)
    _same(got, ref)
    assert got[2] == ([] if policy == "none" else sorted(set(range(5)) - streamed))  # nothing streamed recomputes


def test_a_kept_streamed_block_without_the_saved_weight_hooks_reads_refilled_weights(monkeypatch):
    """Negative control: without `saved_weights`, backward reads the ring views autograd saved in forward after
    their regions were refilled (NaN under the race detector)."""
    import contextlib

    from trainer.offload.conductor import Conductor

    monkeypatch.setattr(Conductor, "saved_weights", lambda self, i: contextlib.nullcontext())
    losses, state, _, _ = _run(1.0, False, race_detector=True, layers=1, singles=4)
    assert not all(torch.isfinite(v).all() for v in state.values())


def test_trainable_streamed_blocks_must_be_recomputed():
    m = tiny_flux(0, layers=0, singles=4)
    with pytest.raises(ValueError, match="needs per-block checkpointing"):
        attach_offload(blocks_of(m), "cpu", 0.5, trainable=True, checkpointing=False)


def test_wrong_length_is_refused_and_close_restores_the_blocks():
    m = add_lora(tiny_flux(0, layers=1, singles=1))
    with pytest.raises(ValueError, match="3 flags for 2 blocks"):
        attach_offload(blocks_of(m), "cpu", 0.0, checkpointing=[True, True, True])
    assert not any(isinstance(b, StreamedBlock) for b in blocks_of(m))


# ------------------------------------------------------------------------------------------ the planner's choice


def _cfg(tiny_models, tmp_path, **train):
    from test_train_support import make_config, write_images

    return make_config(tiny_models, write_images(tmp_path / "img", n=1), tmp_path / "out", tmp_path / "cache", "flux",
                       train={"steps": 1, **train})


def test_auto_keeps_the_blocks_the_budget_allows_and_says_what_it_costs(tiny_models, tmp_path):
    from trainer.planner import analyze, predict
    from trainer.planner.checkpointing import choose_checkpointing

    cfg = _cfg(tiny_models, tmp_path, gradient_checkpointing="auto")
    facts = analyze(cfg)
    n = len(facts.blocks)
    res = max(facts.resolutions)
    all_ck = predict(facts, 0.0, res).peak_reserved
    none_ck = predict(facts, 0.0, res, kept=frozenset(range(n))).peak_reserved
    assert none_ck > all_ck  # keeping activations costs memory ...
    lines = []
    big = choose_checkpointing(cfg, 0.0, budget_bytes=none_ck + 1, facts=facts, log=lines.append)
    assert big.checkpointed == [False] * n and big.kept == n  # ... which a big card has: nothing recomputed
    assert big.extra_bytes > 0 and big.saved_s > 0
    assert "keeps the activations of" in lines[-1] and "recomputes" in lines[-1]
    small = choose_checkpointing(cfg, 0.0, budget_bytes=all_ck - 1, facts=facts, log=lines.append)
    assert small.checkpointed == [True] * n  # no room: every block recomputed, as before
    # at exactly the all-checkpointed peak, keeping the last block is free (its saved tensors replace its
    # recompute's at the same moment), so auto keeps it
    same = choose_checkpointing(cfg, 0.0, budget_bytes=all_ck, facts=facts, log=lines.append)
    assert same.kept >= 1 and same.peak_bytes <= all_ck and same.checkpointed[-1] is False
    mid = choose_checkpointing(cfg, 0.0, budget_bytes=(all_ck + none_ck) / 2, facts=facts, log=lines.append)
    assert 0 < mid.kept < n and mid.checkpointed[:n - mid.kept] == [True] * (n - mid.kept)  # the tail keeps
    assert predict(facts, 0.0, res, kept=frozenset(i for i in range(n) if not mid.checkpointed[i])).peak_reserved \
        <= (all_ck + none_ck) / 2


def test_auto_keeps_streamed_lora_blocks_but_recomputes_streamed_trainable_ones(tiny_models, tmp_path):
    from trainer.planner import analyze
    from trainer.planner.checkpointing import choose_checkpointing
    from trainer.planner.prediction import _train_plan

    cfg = _cfg(tiny_models, tmp_path, gradient_checkpointing="auto")
    facts = analyze(cfg)
    streamed = set(_train_plan(tuple(facts.packed), 0.5).streamed)
    assert streamed
    got = choose_checkpointing(cfg, 0.5, budget_bytes=1e15, facts=facts, log=lambda s: None)
    assert got.checkpointed == [False] * len(facts.blocks)  # a LoRA's streamed blocks may keep too
    full = dataclasses.replace(facts, method="full")
    got = choose_checkpointing(cfg, 0.5, budget_bytes=1e15, facts=full, log=lambda s: None)
    assert [i for i, c in enumerate(got.checkpointed) if c] == sorted(streamed)


def test_config_values_and_what_the_trainer_hands_the_handle(tiny_models, tmp_path):
    from trainer.config import TrainConfig
    from trainer.train import streaming

    assert TrainConfig().gradient_checkpointing is True  # the default is unchanged
    assert TrainConfig(gradient_checkpointing="auto").gradient_checkpointing == "auto"
    cfg = _cfg(tiny_models, tmp_path, gradient_checkpointing="auto")
    # on the CPU there is no VRAM to plan for: auto keeps every block checkpointed, as `true` does
    assert streaming.checkpoint_policy(cfg, torch.device("cpu"), 0.0) is True
    cfg2 = _cfg(tiny_models, tmp_path / "b", gradient_checkpointing=False)
    assert streaming.checkpoint_policy(cfg2, torch.device("cpu"), 0.0) is False
    ns = SimpleNamespace(train=SimpleNamespace(gradient_checkpointing="auto", compile=False),
                         offload=SimpleNamespace(activations=False, nano_batches=1))
    assert streaming.conducts(ns, 0.0, False, torch.device("cpu"))  # auto runs the handle


def test_fit_log_compares_steady_state_steps_only():
    """The planner check's measured step: the first step and every step that compiled are left out."""
    from trainer.train.streaming import SteadySteps

    s = SteadySteps(need=3)
    got = [s.add(t, c) for t, c in [(40.0, True), (30.0, True), (1.0, False), (29.0, True), (1.2, False),
                                    (1.1, False), (1.0, False)]]
    assert got == [None, None, None, None, None, 1.1, None]  # median of 1.0, 1.2, 1.1; said once
    first = SteadySteps(need=1)
    assert first.add(0.5, False) is None and first.add(0.7, False) == 0.7  # the first step warms up


def test_dittrain_plan_says_what_auto_chose(tiny_models, tmp_path):
    from trainer.planner import report

    cfg = _cfg(tiny_models, tmp_path, gradient_checkpointing="auto")
    lines, _ = report(cfg, vram_gb=1000)
    assert any(line.startswith("checkpointing: auto keeps the activations of") for line in lines)
    lines, _ = report(cfg)  # no budget: it says so
    assert any("auto has no VRAM budget" in line for line in lines)


def test_dittrain_plan_of_a_config_with_its_own_fraction_shows_it_and_counts_the_kept_blocks(
        tiny_models, tmp_path, monkeypatch):
    """A preset with gradient_checkpointing: auto names its fraction and the offload.vram_budget_gb auto keeps blocks
    in (planner/presets_auto.py): `dittrain plan` shows it at that fraction (no fraction of its own choosing, as for
    offload.transformer: auto) and predicts the training step's phase with the blocks auto keeps there."""
    import sys

    from trainer.planner import analyze, report

    cfg = _cfg(tiny_models, tmp_path, gradient_checkpointing="auto")
    cfg = cfg.model_copy(update={"offload": cfg.offload.model_copy(update={"transformer": 0.5,
                                                                           "vram_budget_gb": 1000.0})})
    mod = sys.modules["trainer.planner.report"]
    seen, real = [], mod.predict_phases
    monkeypatch.setattr(mod, "predict_phases", lambda *a, **k: seen.append(a[1:2] + a[5:]) or real(*a, **k))
    lines, chosen = report(cfg)
    assert chosen is None and not any(line.startswith("offload: auto chose") for line in lines)
    n = len(analyze(cfg).blocks)
    assert any(line.startswith(f"checkpointing: auto keeps the activations of {n} of {n}") for line in lines)
    assert seen == [(0.5, frozenset(range(n)))]


def test_auto_plans_in_the_processs_vram_cap_where_one_is_set(tiny_models, tmp_path, monkeypatch):
    """Under `set_per_process_memory_fraction` (DITTRAIN_VRAM_CAP_GB) the auto policy's budget is the cap's share,
    not the whole card's."""
    from trainer.planner import checkpointing
    from trainer.train import streaming

    cfg = _cfg(tiny_models, tmp_path, gradient_checkpointing="auto")
    seen = []
    monkeypatch.setattr(checkpointing, "choose_checkpointing",
                        lambda cfg, fraction, budget, log=None: seen.append(budget) or SimpleNamespace(checkpointed=[]))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80e9))
    for frac in (1.0, 0.5):
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i, f=frac: f)
        streaming.checkpoint_policy(cfg, torch.device("cuda", 0), 1.0)
    assert seen == [checkpointing.CARD_SHARE * 80e9, checkpointing.CARD_SHARE * 40e9]


def test_fit_streaming_a_lora_that_keeps_every_blocks_activations_trains_bitwise_like_recomputing(
        tiny_models, tmp_path, monkeypatch):
    """Through the trainer (config validation, the handle's checkpointing, the loop): `offload.transformer: 0.5` with
    `gradient_checkpointing: false` (streamed blocks keep their activations) against `true`."""
    from test_train_support import losses, make_config, write_images

    from trainer.train import streaming
    from trainer.train.trainer import Trainer

    monkeypatch.setattr(Trainer, "_can_stream", lambda self: True)
    handles, place = [], streaming.place_blocks
    monkeypatch.setattr(streaming, "place_blocks", lambda *a, **k: handles.append(place(*a, **k)) or handles[-1])
    images, runs = write_images(tmp_path / "img", n=2), {}
    for ck in (True, False):
        cfg = make_config(tiny_models, images, tmp_path / f"out-{ck}", tmp_path / "cache", "flux",
                          train={"steps": 3, "gradient_checkpointing": ck}, offload={"transformer": 0.5})
        t = Trainer(cfg)
        t.fit()
        h = handles[-1]
        assert h.stats()["h2d_bytes_per_step"] > 0 and h.checkpointed == [ck] * len(h.checkpointed)
        runs[ck] = losses(tmp_path / f"out-{ck}"), {k: v.detach().clone() for k, v in t.transformer.state_dict().items()
                                                   if "lora" in k}
    assert runs[False][0] == runs[True][0]
    assert runs[False][1].keys() == runs[True][1].keys() and all(torch.equal(runs[False][1][k], runs[True][1][k])
                                                                 for k in runs[True][1])


def test_a_run_predicted_over_its_vram_cap_is_warned_before_step_1():
    """The load line's prediction for the training step against the process's cap: a Wan 2.1 I2V 14B at 81 frames
    on its 16 GB preset (17.96 GB predicted, 15 GB cap) ran out at step 2 with only the after-the-fact line."""
    from trainer.train.streaming import over_cap_warning

    GB = 1e9
    assert over_cap_warning(14.2 * GB, 15 * GB) is None
    assert over_cap_warning(15 * GB, 15 * GB) is None
    line = over_cap_warning(17.96 * GB, 15 * GB, video=True)
    assert line.startswith("warning: the planner predicts 17.96 GB") and "15.00 GB" in line
    assert "dittrain plan CONFIG --vram" in line and "data.clip_frames" in line
    assert "clip_frames" not in over_cap_warning(17.96 * GB, 15 * GB)  # images have no clips
