"""The memory planner's arithmetic against real allocations on the CPU, and the automatic fraction.

- weights: the planner's per-block bytes (meta model from the folder's config) equal the real model's, and its
  ring / pinned / per-step bytes equal what the real conductor (`attach_offload` on the CPU) reports;
- activations: its checkpoint-input bytes equal what a checkpointed forward saves (counted with
  saved_tensors_hooks around reentrant checkpoints), and its per-block saved bytes, traced on meta tensors with
  the CPU kernel model, equal what the real CPU kernels save;
- auto: the smallest fitting fraction on synthetic budgets, monotonic, and the one-line error when nothing fits.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from trainer import planner
from trainer.config import Config
from trainer.errors import UserError
from trainer.planner import timing as ptime
from trainer.planner import trace as ptrace
from trainer.planner.prediction import PREDICTION_MARGIN

FAMILIES = ("flux", "sd3", "qwen-image", "flux2")  # flux2-klein: the same classes at another size


def _cfg(path, family, method="lora", **offload) -> Config:
    data = {
        "model": {"family": family, "path": str(path), "dtype": "fp32"},
        "train": {"method": method},
        "lora": {"rank": 4, "alpha": 4},
        "data": {"sources": [{"path": "unused"}], "resolutions": [64]},
        "offload": offload,
        "output": {"dir": "unused"},
    }
    if method == "full":
        data["optimizer"] = {"fused_back_pass": True, "max_grad_norm": None}
    return Config.model_validate(data)


def _real(tiny_models, family, cfg):
    """The tiny transformer loaded for real, LoRA added the way the trainer adds it."""
    from trainer.train.model import add_lora

    cls = ptrace.transformer_class(family)
    model = cls.from_pretrained(tiny_models / family / "transformer", torch_dtype=torch.float32)
    if cfg.train.method == "lora":
        torch.manual_seed(0)
        add_lora(model, cfg, ptrace.default_lora_targets(family))
    return model


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["lora", "full"])
def test_weight_bytes_and_streaming_equal_the_conductor(tiny_models, family, method):
    from trainer.offload import attach_offload

    cfg = _cfg(tiny_models / family, family, method)
    facts = planner.analyze(cfg)
    assert facts.source.endswith("transformer/config.json")
    model = _real(tiny_models, family, cfg)
    blocks = ptrace.blocks_of(family, model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    base = [
        sum(p.numel() * p.element_size() for n, p in b.named_parameters() if "lora_" not in n) for b in blocks
    ]
    assert facts.block_param_bytes == base
    nonblock = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_blocks)
    assert facts.nonblock_bytes == nonblock
    if method == "lora":
        assert facts.trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    layout = ()
    if method == "full":  # as fit wires it: the optimizer state packed beside each weight (trainer/train/method.py)
        from trainer.optim.build import build_optimizer
        from trainer.optim.fused import FusedBackPass

        fb = FusedBackPass(build_optimizer(list(model.parameters()), cfg.optimizer))
        layout = fb.state_layout
    for f in (0.25, 0.5, 1.0):
        ring, pinned, h2d = planner.streaming(facts.packed, f)
        handle = attach_offload(blocks, "cpu", f, trainable=method == "full", optimizer_state=layout)
        try:
            st = handle.stats()
        finally:
            handle.close()
        assert (ring, pinned, h2d) == (st["ring_bytes"], st["offloaded_bytes"], st["h2d_bytes_per_step"]), f
        assert sum(facts.packed) == st["block_bytes"]
    if method == "full":
        fb.remove()


def _counted_checkpoint_inputs(model, blocks, inputs) -> int:
    """Bytes autograd saves for the checkpointed blocks: reentrant checkpoint saves exactly the tensor
    arguments of each block call (nothing inside runs with grad), counted once per storage."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    inside = [False]

    def pack(t):
        s = t.untyped_storage()
        if inside[0] and s.data_ptr() not in weights and t.is_floating_point():
            saved[s.data_ptr()] = s.nbytes()
        return t

    def ckpt(block, *args):
        inside[0] = True
        try:
            return checkpoint(block.__call__, *args, use_reentrant=True)
        finally:
            inside[0] = False

    model.enable_gradient_checkpointing(ckpt)
    model.train()
    # A reentrant checkpoint records (and saves) only when an input requires grad: make the first one do.
    inputs = dict(inputs, hidden_states=inputs["hidden_states"].detach().requires_grad_(True))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**inputs, return_dict=False)
    return sum(saved.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_activation_bytes_equal_what_torch_saves(tiny_models, family):
    cfg = _cfg(tiny_models / family, family)
    facts = planner.analyze(cfg)
    meta_in = ptrace.forward_inputs(family, facts.model, 2, 64, 64, facts.text_tokens, torch.float32)
    traced = ptrace.trace_forward(facts.model, facts.blocks, meta_in, kernels="cpu")

    model = _real(tiny_models, family, cfg)
    blocks = ptrace.blocks_of(family, model)
    torch.manual_seed(0)
    real_in = ptrace.forward_inputs(family, model, 2, 64, 64, facts.text_tokens, torch.float32, device="cpu")
    real = ptrace.trace_forward(model, blocks, real_in, kernels="real")
    # meta + the CPU kernel model == real CPU kernels, block by block
    assert traced.block_saved == real.block_saved
    assert traced.block_inputs == real.block_inputs
    assert traced.checkpoint_inputs == real.checkpoint_inputs > 0
    # and the checkpoint inputs are what checkpointing really keeps
    assert _counted_checkpoint_inputs(model, blocks, real_in) == traced.checkpoint_inputs
    # a block saves more than its inputs: the recompute's working set is not negligible
    assert min(traced.block_saved) > max(traced.block_inputs)


@pytest.fixture(scope="module")
def flux_full_size():
    """Built-in full-size Flux.1-dev on the meta device (no weights), LoRA r16, buckets 512 and 1024."""
    data = {
        "model": {"family": "flux", "path": "/nonexistent/FLUX.1-dev"},
        "train": {"method": "lora"},
        "lora": {"rank": 16, "alpha": 16},
        "data": {"sources": [{"path": "unused"}], "resolutions": [512, 1024]},
        "output": {"dir": "unused"},
    }
    cfg = Config.model_validate(data)
    return cfg, planner.analyze(cfg)


def test_reference_flops_are_the_traced_reference(flux_full_size):
    _, facts = flux_full_size
    tr = facts.trace(1024)
    assert (tr.linear_flops, tr.attn_flops) == (ptime.REF_LINEAR_FLOPS, ptime.REF_ATTN_FLOPS)
    p = planner.predict(facts, 0.0, 1024)
    assert p.compute_s == pytest.approx(ptime.REF_STEP_S)
    # 11.9 B parameters in bf16
    assert (sum(facts.block_param_bytes) + facts.nonblock_bytes) / 2 == pytest.approx(11.9e9, rel=0.01)


def test_predictions_fall_with_the_fraction(flux_full_size):
    _, facts = flux_full_size
    preds = [planner.predict(facts, f, 1024) for f in planner.GRID]
    peaks = [p.peak_reserved for p in preds]
    assert all(a >= b for a, b in zip(peaks, peaks[1:], strict=False))
    assert peaks[0] > 25e9 and peaks[-1] < 8e9
    steps = [p.transfer_s for p in preds]
    assert steps[0] == 0 and steps[-1] > steps[len(steps) // 2] > 0
    # activation offloading moves the checkpoint inputs to the host
    on = planner.predict(facts, 1.0, 1024, activation_offload=True)
    assert on.act_checkpoint_host > 1e9
    assert on.peak_reserved < preds[-1].peak_reserved - 0.5 * on.act_checkpoint_host


def test_auto_picks_the_smallest_fitting_fraction(flux_full_size):
    cfg, facts = flux_full_size
    chosen = []
    for budget in (8, 10, 12, 16, 20, 24, 28, 40):
        f = planner.choose_fraction(cfg, budget, facts=facts, log=lambda s: None)
        limit = budget * planner.GB * (1 - PREDICTION_MARGIN)  # the margin left for prediction error
        assert planner.predict(facts, f, 1024).peak_reserved <= limit
        if f > 0:  # the grid point below does not fit at the largest bucket
            assert planner.predict(facts, round(f - 0.05, 2), 1024).peak_reserved > limit
        chosen.append(f)
    assert chosen == sorted(chosen, reverse=True)
    assert chosen[0] > 0.5 and chosen[-1] == 0.0


def test_auto_boundary_is_inclusive(flux_full_size):
    """A budget whose margin-reduced share equals the prediction exactly fits."""
    cfg, facts = flux_full_size
    exact = planner.predict(facts, 0.5, 1024).peak_reserved / planner.GB / (1 - PREDICTION_MARGIN)
    assert planner.choose_fraction(cfg, exact, facts=facts, log=lambda s: None) <= 0.5
    assert planner.choose_fraction(cfg, exact * 0.999, facts=facts, log=lambda s: None) > 0.5


def test_auto_logs_per_bucket_and_largest_decides(flux_full_size):
    cfg, facts = flux_full_size
    lines: list[str] = []
    f = planner.choose_fraction(cfg, 12, facts=facts, log=lines.append)
    assert any("bucket 512 px" in s for s in lines) and any("bucket 1024 px" in s for s in lines)
    assert f"fraction {f:.2f} (largest bucket decides)" in lines[-1]


def test_nothing_fits_is_one_line(flux_full_size):
    cfg, facts = flux_full_size
    with pytest.raises(UserError) as e:
        planner.choose_fraction(cfg, 3, facts=facts, log=lambda s: None)
    msg = str(e.value)
    assert "\n" not in msg and "needs at least" in msg and "activation offloading" in msg


def test_report_table(flux_full_size):
    cfg, facts = flux_full_size
    lines, chosen = planner.report(cfg, vram_gb=16, ram_gb=64, facts=facts)
    text = "\n".join(lines)
    assert chosen is not None and f"{chosen:.2f} <- chosen" in text
    for f in ("0.00", "0.25", "0.50", "0.75", "1.00"):
        assert f"\n{f}" in text
    assert "Assumptions" in text and "RAM 64 GB" in text


@pytest.mark.parametrize("width", [80, 100])
def test_report_fits_the_width_and_keeps_every_word(flux_full_size, width):
    """Fitted to `width` columns (`dittrain plan` passes the terminal's), no line is wider, but one holding a
    single unbreakable word (a long path); tables split into tables led by the row names, prose wraps at spaces:
    every word of the unfitted report is still there, and each fraction row still starts a line."""
    from collections import Counter

    cfg, facts = flux_full_size
    wide, chosen = planner.report(cfg, vram_gb=16, ram_gb=64, facts=facts)
    fitted, chosen2 = planner.report(cfg, vram_gb=16, ram_gb=64, facts=facts, width=width)
    assert chosen2 == chosen and max(map(len, wide)) > 200
    assert all(len(line) <= width or " " not in line.strip() for line in fitted), max(fitted, key=len)
    def words(lines):  # the tables' rules (dashes) change length with their columns
        return Counter(w for line in lines for w in line.split() if set(w) != {"-"})

    assert not words(wide) - words(fitted)
    assert any(line.startswith(f"{chosen:.2f} <- chosen") for line in fitted)


def test_cli_plan_fits_80_columns(tiny_models, tmp_path):
    """`dittrain plan` at COLUMNS=80 on the tiny models, LoRA and full fine-tuning with a budget: every line fits
    (but one holding a single word: a path longer than the terminal stays whole). It printed 322 columns."""
    import yaml
    from typer.testing import CliRunner

    from trainer.cli import app

    for method in ("lora", "full"):
        path = tmp_path / f"{method}.yaml"
        path.write_text(yaml.safe_dump(_cfg(tiny_models / "flux", "flux", method).model_dump(mode="json")))
        res = CliRunner().invoke(app, ["plan", str(path), "--vram", "8"], env={"COLUMNS": "80"})
        assert res.exit_code == 0, res.output
        lines = res.output.splitlines()
        assert all(len(line) <= 80 or " " not in line.strip() for line in lines), max(lines, key=len)
        assert "Per fraction" in res.output and "Assumptions" in res.output


def test_run_plan_without_budget_prints(tiny_models, capsys):
    planner.run_plan(_cfg(tiny_models / "flux", "flux"))
    out = capsys.readouterr().out
    assert "Per fraction" in out and "<- config" in out


def test_resolve_fraction_and_check_line(flux_full_size):
    cfg, facts = flux_full_size
    assert planner.resolve_fraction(cfg, facts=facts) == 0.0  # the config's own number
    auto = cfg.model_copy(
        update={"offload": cfg.offload.model_copy(update={"transformer": "auto", "vram_budget_gb": 12})}
    )
    f = planner.resolve_fraction(auto, facts=facts, log=lambda s: None)
    assert f == planner.choose_fraction(cfg, 12, facts=facts, log=lambda s: None) > 0
    pred = planner.expected(cfg, f, facts=facts)
    line = planner.check_line(pred, pred.peak_reserved * 0.8, pred.step_s * 2)
    assert "\n" not in line and "+25 %" in line and "-50 %" in line


@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_measurement_block_runs_on_cpu(tiny_models, family):
    """Every block class `dittrain plan` times on a GPU is rebuilt from the trace and trains (CPU here); torch's
    FlopCounterMode counts the same matmul FLOPs for it as the trace does."""
    from trainer.planner.measure import block_classes, block_pass

    facts = planner.analyze(_cfg(tiny_models / family, family))
    classes = block_classes(facts)
    assert set(classes) == {type(b).__name__ for b in facts.blocks}
    for cls in classes:
        step, idx, lin, _attn, forward = block_pass(facts, "cpu", cls=cls)
        assert type(facts.blocks[idx]).__name__ == cls
        forward()
        step()
        assert lin == facts.trace(64).block_linear_flops[idx] > 0


def test_cli_plan_nothing_fits_is_one_line_exit_1(tiny_models, tmp_path):
    import yaml
    from typer.testing import CliRunner

    from trainer.cli import app

    cfg = _cfg(tiny_models / "flux", "flux")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    res = CliRunner().invoke(app, ["plan", str(path), "--vram", "1.01"])  # the card: 0.01 GB after the 1 GB reserve
    assert res.exit_code == 1
    err = res.stderr.strip() if hasattr(res, "stderr") and res.stderr else res.output.strip()
    assert err.startswith("error: offload: flux lora at 64 px needs at least") and "\n" not in err
    ok = CliRunner().invoke(app, ["plan", str(path), "--vram", "8"])
    assert ok.exit_code == 0 and "auto chose transformer fraction 0.00" in ok.output


def test_sampling_prediction_uses_the_conductors_plan(flux_full_size):
    from trainer.offload.plan import capacity_for, make_plan, plan_for
    from trainer.planner import predict_sampling

    _, facts = flux_full_size
    resident = predict_sampling(facts, 0.0, 1024)
    assert resident.transfer_s == 0 and resident.compute_s == pytest.approx(ptime.REF_FORWARD_S, rel=0.02)
    half = predict_sampling(facts, 0.5, 1024)
    cap = capacity_for(facts.packed, 0.5)
    assert half.ring == cap
    moved = plan_for(facts.packed, cap, "sample").bytes_per_step()
    assert half.transfer_s == pytest.approx(moved / ptime.REF_H2D)
    # The spread-resident plan the conductor picks at 0.5 moves about half the weights a step, not all of them.
    assert moved < 0.7 * make_plan(facts.packed, cap, "sample").bytes_per_step()
    assert half.peak_reserved < resident.peak_reserved - 10e9


def test_sampling_prediction_counts_the_untiled_decode_beside_the_placed_transformer(flux_full_size):
    """An untiled decode next to the ring: what ran Qwen-Image 2.1's 16 GB `sample` out of memory (RESULTS.md)."""
    from trainer.models import adapter_class
    from trainer.planner import predict_sampling
    from trainer.planner.prediction import ALLOCATOR_OVERHEAD, WORKSPACE, _round2m
    from trainer.planner.sampling import VAE_ACT_DECODE

    _, facts = flux_full_size
    vae = adapter_class("flux").vae_params * 2
    for f in (0.0, 0.5):
        p, small = predict_sampling(facts, f, 1024), predict_sampling(facts, f, 512)
        static = _round2m(p.ring) + _round2m(facts.nonblock_bytes) + WORKSPACE
        assert p.decode_reserved - static - vae == pytest.approx(ALLOCATOR_OVERHEAD * 1024**2 * VAE_ACT_DECODE)
        assert p.decode_reserved - small.decode_reserved == pytest.approx(ALLOCATOR_OVERHEAD * 3 * 512**2 * VAE_ACT_DECODE)


def test_sampling_under_classifier_free_guidance_counts_a_batch_of_two(flux_full_size):
    from trainer.planner import predict_sampling
    from trainer.planner.sampling import cfg_batch

    _, facts = flux_full_size
    one, two = predict_sampling(facts, 0.5, 1024), predict_sampling(facts, 0.5, 1024, batch=2)
    assert two.ring == one.ring and two.compute_s == pytest.approx(2 * one.compute_s)
    from trainer.planner.prediction import WORKSPACE, _round2m

    act_one = one.peak_reserved - _round2m(one.ring) - _round2m(facts.nonblock_bytes) - WORKSPACE
    assert act_one > 1e8 and two.peak_reserved - one.peak_reserved == pytest.approx(act_one)  # activations doubled
    assert (cfg_batch("sd3", 3.5), cfg_batch("sd3", 1.0), cfg_batch("qwen-image", 4.0), cfg_batch("flux", 3.5)) == (
        2, 1, 2, 1)


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_full_fine_tune_packs_the_state_the_optimizer_reports(tiny_models, name):
    """The planner's packed block bytes for a streamed full fine-tune equal the conductor's packing with the real
    optimizer's state layout (FusedBackPass.state_layout), as `dittrain fit` packs it."""
    from trainer.offload.allocators import BlockPacking
    from trainer.optim.build import build_optimizer
    from trainer.optim.fused import FusedBackPass

    cfg = _cfg(tiny_models / "flux", "flux", "full")
    cfg = cfg.model_copy(update={"optimizer": cfg.optimizer.model_copy(update={"name": name})})
    facts = planner.analyze(cfg)
    model = _real(tiny_models, "flux", cfg)
    fb = FusedBackPass(build_optimizer(list(model.parameters()), cfg.optimizer))
    try:
        blocks = ptrace.blocks_of("flux", model)
        real = [BlockPacking.of(b, include_trainable=True, state_layout=fb.state_layout).nbytes for b in blocks]
    finally:
        fb.remove()
    weights_only = [BlockPacking.of(b, include_trainable=True).nbytes for b in blocks]
    assert facts.state_packed and facts.packed == real
    assert all(r > w for r, w in zip(real, weights_only, strict=True))


@pytest.mark.parametrize("preset", ["flux/lora-8gb", "flux/lora-12gb", "sd3/lora-16gb"])
def test_plan_vram_of_the_card_picks_the_presets_fraction(preset):
    """`dittrain plan PRESET --vram N` (N the card's GB) and the shipped N GB preset agree on the fraction."""
    import re
    from pathlib import Path

    import yaml
    from typer.testing import CliRunner

    from trainer.cli import app

    path = Path(__file__).resolve().parents[1] / "configs" / f"{preset}.yaml"
    card = re.search(r"(\d+)gb", preset).group(1)
    res = CliRunner().invoke(app, ["plan", str(path), "--vram", card])
    assert res.exit_code == 0, res.output
    chosen = re.search(r"^(\d\.\d\d) <- chosen", res.stdout, re.M)
    assert chosen and float(chosen.group(1)) == yaml.safe_load(path.read_text())["offload"]["transformer"]
    assert f"budget {int(card) - 1} GB" in res.stdout


def test_fp8_base_is_planned_with_the_loaders_quantized_layout(flux_full_size):
    """model.quantize: fp8 packs the blocks as the loader quantizes them (8-bit Linear weights + fp32 scales,
    modulation and norms in bf16): the same 15.08 GB the fp8 bench measured for Flux (bench/history/2026-11-23.md, issue 15),
    so pinned RAM, the ring and the chosen fraction all shrink."""
    cfg, facts = flux_full_size
    q = planner.analyze(cfg.model_copy(update={"model": cfg.model.model_copy(update={"quantize": "fp8"})}))
    bf16, fp8 = sum(facts.packed), sum(q.packed)
    assert fp8 / 1e9 == pytest.approx(15.08, abs=0.01) and bf16 / 1e9 == pytest.approx(23.67, abs=0.01)
    assert planner.predict(q, 1.0, 1024, True).pinned < planner.predict(facts, 1.0, 1024, True).pinned


def test_ram_is_the_arena_unless_the_transformer_loads_whole(flux_full_size):
    """fit reads blocks from the files into the arena (stream_load): RAM = arena + the process's base; a
    single-file or DoRA model is read whole first, which adds a pageable copy of it."""
    from trainer.planner.prediction import HOST_BASE

    cfg, facts = flux_full_size
    p = planner.predict(facts, 0.9, 1024, False)
    assert not facts.loads_whole and p.ram_peak == pytest.approx(p.pinned + HOST_BASE)
    dora = planner.analyze(cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"dora": True})}))
    assert dora.loads_whole
    whole = planner.predict(dora, 0.9, 1024, False).ram_peak - planner.predict(dora, 0.9, 1024, False).pinned - HOST_BASE
    assert whole == pytest.approx(sum(dora.block_param_bytes) + dora.nonblock_bytes)


def test_quantized_modulation_is_planned_smaller(flux_full_size):
    """model.quantize_modulation: the planner packs the blocks as the loader quantizes them, so the modulation
    Linears (3.2 B parameters in Flux) count 1 byte per weight: 15.08 GB -> 11.85 GB pinned at 1.0."""
    cfg, _ = flux_full_size
    q = cfg.model.model_copy(update={"quantize": "fp8"})
    fp8 = planner.analyze(cfg.model_copy(update={"model": q}))
    mod = planner.analyze(cfg.model_copy(update={"model": q.model_copy(update={"quantize_modulation": True})}))
    assert sum(mod.packed) / 1e9 == pytest.approx(11.85, abs=0.01)
    assert sum(fp8.packed) - sum(mod.packed) == pytest.approx(3.22e9, rel=0.01)
    assert planner.predict(mod, 1.0, 1024, True).pinned < planner.predict(fp8, 1.0, 1024, True).pinned


def test_attention_backward_counts_the_calls_that_share_q_k_v_together():
    """trace.py `attention_backward`: one flash-attention call's backward holds the gradients of its q, k and v
    (the whole tensors a slice was read from) and a float32 dq; calls on the same tensors hold theirs together
    until summed (HunyuanVideo 1.5's video and text queries on one joint k, v), calls on other tensors do not (a
    self-attention and a cross-attention): the block's figure is its largest group. Calls inside token-wise MLPs
    are counted apart (`chunk_mlps` divides them by the chunks)."""
    mode = ptrace._KernelModel("cuda")
    q, k, v = (torch.empty(1, 2, 100, 8, device="meta") for _ in range(3))
    x, kt, vt = torch.empty(1, 2, 100, 8, device="meta"), *(torch.empty(1, 2, 7, 8, device="meta") for _ in range(2))
    one = 3 * q.numel() * 4  # fp32 q, k, v
    with mode:
        torch.nn.functional.scaled_dot_product_attention(q[:, :, :90], k, v)  # video queries
        torch.nn.functional.scaled_dot_product_attention(q[:, :, 90:], k, v)  # text queries, the same k, v
        mode.in_mlp = lambda: True
        torch.nn.functional.scaled_dot_product_attention(x, kt, vt)  # a cross-attention in a token-wise MLP
    accum = 90 * 2 * 8 * 4
    assert ptrace.attention_backward(mode.calls, in_mlp=False) == 2 * one + accum
    assert ptrace.attention_backward(mode.calls, in_mlp=True) == x.numel() * 4 + 2 * kt.numel() * 4 + x.numel() * 4
    mode.calls[1] = (frozenset({-1}), *mode.calls[1][1:])  # the text queries on tensors of their own
    assert ptrace.attention_backward(mode.calls, in_mlp=False) == one + accum
