"""The phase lines' RAM under several processes of one host (issue 40): one process's anonymous RSS, the shared
/dev/shm arena said once, owned optimizer state at 1/N; and a full fine-tune's checkpoint save as the code writes it
(safetensors copies only what the GPU holds). Full-size Flux.1-dev facts on the meta device, as the 4 x H200 runs of
2026-11-28 (full fine-tune, Adafactor with masters, every block streamed: measured per process load 1.8, training
step 13.9, checkpoint save 15.4 GB, /dev/shm 23.8 GB; the LoRA 48 GB preset: 2.1, 2.3, 2.7 GB, arena 11.67 GB)."""

from __future__ import annotations

import pytest
import torch

from trainer.config import load_config
from trainer.planner.phases import SAVE_FILE_BYTES, predict_phases, save_copies
from trainer.planner.prediction import (
    HOST_BASE,
    analyze,
    held_on_gpu,
    node_ram_of_processes,
    predict,
    shared_arena_bytes,
    streaming,
)

GB = 1e9


def _ram(cfg, fraction, facts, **kw) -> dict[str, float]:
    return {p.name: p.ram for p in predict_phases(cfg, fraction, facts, **kw)}


def flux_full():
    """Flux.1-dev's 24 GB full preset as the 4 x H200 run had it (bench/logs/2026-11-28g/x4-full-m4-flux.yaml):
    Adafactor with fp32 masters, every block streamed; the config and its full-size facts."""
    cfg = load_config("configs/flux/full-24gb.yaml", ["offload.transformer=1.0", "optimizer.name=adafactor",
                                                      "optimizer.master_weights=true", "optimizer.stochastic_rounding=false",
                                                      "sample.every=0"])
    return cfg, analyze(cfg)


@pytest.fixture(scope="module")
def full():
    return flux_full()


@pytest.fixture(scope="module")
def lora():
    cfg = load_config("configs/flux/lora-48gb.yaml", ["sample.every=0"])
    return cfg, analyze(cfg)


def test_a_full_fine_tune_with_owned_steps_predicts_one_of_four_processes(full):
    cfg, facts = full
    pred = predict(facts, 1.0, max(facts.resolutions), False)
    state = sum(facts.block_states)  # masters and Adafactor's factors of every (streamed) block
    one = _ram(cfg, 1.0, facts)
    four = _ram(cfg, 1.0, facts, processes=4, shared=True)
    assert one["training step"] == pred.ram_peak > 70 * GB  # one process: the arena with weights and state
    # one of four: no arena (the host's, in /dev/shm), a quarter of the state
    assert four["training step"] == pytest.approx(pred.ram_peak - pred.pinned + state / 4)
    assert 12 * GB < four["training step"] < 16 * GB  # measured 13.9
    assert four["load"] == pytest.approx(HOST_BASE)  # StateOffload makes the owned state at the first step
    arena = shared_arena_bytes(facts, 1.0, 4, True)
    assert arena == sum(facts.block_param_bytes)  # the weights alone: 23.67 GB logged
    assert 23 * GB < arena < 24.5 * GB
    # the node: the arena once and four processes' RAM, as `dittrain plan --gpus 4` counts owned steps
    assert arena + 4 * four["training step"] == pytest.approx(node_ram_of_processes(facts, pred, 1.0, 4)[1])
    # the save: what safetensors copies off the GPU on top (measured 1.5 GB over the step)
    assert four["checkpoint save"] - four["training step"] == pytest.approx(save_copies(facts, 1.0, 4))
    assert 0.5 * GB < four["checkpoint save"] - four["training step"] < 3 * GB


def test_a_lora_on_four_processes_leaves_the_shared_arena_out(lora):
    cfg, facts = lora
    pred = predict(facts, 0.2, max(facts.resolutions), False)
    four = _ram(cfg, 0.2, facts, processes=4, shared=True)
    assert four["training step"] == pytest.approx(pred.ram_peak - pred.pinned) == pytest.approx(HOST_BASE)
    assert four["load"] == pytest.approx(HOST_BASE)
    assert four["checkpoint save"] == pytest.approx(HOST_BASE + facts.trainable_params * 4 + facts.state_gpu)
    assert four["checkpoint save"] < 3.5 * GB  # measured 2.7; 14.8 predicted before
    arena = shared_arena_bytes(facts, 0.2, 4, True)
    assert arena == streaming(facts.packed, 0.2)[1] == pred.pinned
    assert 11 * GB < arena < 12.5 * GB  # 11.67 GB logged


@pytest.mark.parametrize("which", ["full", "lora"])
def test_one_process_and_whole_copies_keep_the_one_process_figures(which, request):
    """Each process with its own arena (one process, whole copies, no /dev/shm): the one-process prediction,
    its training step the step's `ram_peak`, as before."""
    cfg, facts = request.getfixturevalue(which)
    f = 1.0 if which == "full" else 0.2
    one = _ram(cfg, f, facts)
    assert _ram(cfg, f, facts, processes=4, shared=False) == one
    assert _ram(cfg, f, facts, processes=1, shared=True) == one
    assert one["training step"] == predict(facts, f, max(facts.resolutions), cfg.offload.activations).ram_peak
    assert shared_arena_bytes(facts, f, 4, False) == shared_arena_bytes(facts, f, 1, True) == 0


def test_a_full_fine_tunes_save_adds_what_the_gpu_holds_not_the_whole_model_and_state(full):
    """One process: the weights and state of streamed blocks are written from their host copies; only the GPU's
    tensors are copied (the larger of the weights' file and the optimizer's), so the save is the step's RAM plus
    a little, not plus the whole model and its state (144.7 GB predicted before for one of four processes)."""
    cfg, facts = full
    one = _ram(cfg, 1.0, facts)
    weights, state = held_on_gpu(facts, 1.0)
    assert one["checkpoint save"] - one["training step"] == pytest.approx(max(weights, state))
    assert one["checkpoint save"] - one["training step"] < 3 * GB
    # nothing streamed: every weight on the GPU, written a file at a time; the state in one file, all of it
    w0, s0 = held_on_gpu(facts, 0.0)
    assert w0 == sum(facts.block_param_bytes) + facts.nonblock_bytes
    assert s0 == facts.state_gpu + sum(facts.block_states)
    assert save_copies(facts, 0.0) == max(min(w0, SAVE_FILE_BYTES), s0) == s0  # masters: 4 bytes a parameter
    assert save_copies(facts, 0.0, owners=4) == max(min(w0, SAVE_FILE_BYTES), s0 / 4)


@pytest.mark.parametrize(("world", "shared"), [(1, False), (4, True)])
def test_the_trainers_phase_line_compares_one_process_and_says_the_node_arena_once(full, monkeypatch, world, shared):
    """`Trainer._phase_done` (on CUDA; here its device faked): one process's line as before; one of four sharing
    the arena: that process's figure, and the load line says the host's arena once."""
    import types

    from trainer.phase_log import PhasePeak
    from trainer.planner import presets
    from trainer.train import trainer as tmod
    from trainer.train.distributed import Dist

    cfg, _ = full
    lines = []
    monkeypatch.setattr(tmod, "say", lines.append)
    monkeypatch.setattr(presets, "process_fraction", lambda device: 1.0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=141e9))
    t = tmod.Trainer.__new__(tmod.Trainer)
    t.cfg, t.device, t.fraction, t.offload = cfg, torch.device("cuda", 0), 1.0, None
    t.dist, t.arena_shared = Dist(world=world, local_world=world), shared
    peak = PhasePeak(vram_reserved=int(6.69e9), rss=int(39.7e9), anon=int(13.9e9))
    for name in ("load", "training step", "checkpoint save"):
        t._phase_done(name, peak)
    said = {ln.split(":")[0]: ln for ln in lines if ln.startswith("phase ")}
    if world == 1:
        assert said["phase load"].endswith("(planner: 4.47 GB VRAM, 73.6 GB RAM)")
        assert said["phase training step"].endswith("(planner: 8.97 GB VRAM, 73.6 GB RAM)")
        assert said["phase checkpoint save"].endswith("(planner: 8.97 GB VRAM, 75.0 GB RAM)")  # 144.7 before
    else:
        # owned steps: the ring holds the weights alone (8.97 GB VRAM before, measured 6.69 in the step)
        assert said["phase load"].endswith("(planner: 1.78 GB VRAM, 2.5 GB RAM per process; node: 23.7 GB shared "
                                           "arena in /dev/shm, once for the host's 4 processes)")
        assert said["phase training step"].endswith("(planner: 6.97 GB VRAM, 14.3 GB RAM per process)")
        assert said["phase checkpoint save"].endswith("(planner: 6.97 GB VRAM, 15.8 GB RAM per process)")
