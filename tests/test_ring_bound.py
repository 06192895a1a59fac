"""bench/speed/ring_bound.py: measured per-block times replayed through the conductor's plan (issue 29)."""

from __future__ import annotations

import json

import pytest
from test_train_support import bench_module

rb = bench_module("ring_bound")
RATE = 1e9  # bytes per second: a 1e8-byte block copies in 0.1 s
SIZES = [int(2e8)] * 2 + [int(1e8)] * 4  # two "double" blocks, then four "singles"


def test_copy_bound_blocks_step_at_the_pcie_floor():
    r = rb.bound(SIZES, [0.0] * 6, [1e-4] * 6, ring=2, rate=RATE)
    assert r["step_s"] == pytest.approx(r["floor_s"], rel=0.01)


def test_compute_bound_blocks_step_at_their_compute():
    fwd, bwd = [1.0] * 6, [3.0] * 6
    r = rb.bound(SIZES, fwd, bwd, ring=2, rate=RATE)
    assert r["step_s"] == pytest.approx(sum(fwd) + sum(bwd), rel=0.01)


def test_a_compute_bound_tail_before_copy_bound_blocks_costs_more_than_the_floor():
    """The Flux shape: the backward runs the singles (compute-bound) first, then the doubles (copy-bound); a
    two-double ring cannot bank the singles' slack, so the replay lands above both the floor and the compute."""
    fwd = [0.0] * 6
    bwd = [0.1, 0.1, 0.15, 0.15, 0.15, 0.15]  # doubles copy in 0.2 s, singles in 0.1 s
    r = rb.bound(SIZES, fwd, bwd, ring=2, rate=RATE)
    assert r["step_s"] > 1.02 * max(r["floor_s"], sum(bwd))


def test_row_costs_average_the_steps_and_split_the_forward_by_the_backward(tmp_path):
    row = {"name": "r", "timeline": {
        "backward_blocks": [[{"block": 1, "compute_ms": 2.0, "span_ms": 3.0}, {"block": 0, "compute_ms": 6.0, "span_ms": 7.0}],
                            [{"block": 1, "compute_ms": 4.0, "span_ms": 5.0}, {"block": 0, "compute_ms": 6.0, "span_ms": 9.0}]],
        "per_step": [{"bench.forward": {"compute_ms": 3.0}}, {"bench.forward": {"compute_ms": 5.0}}]}}
    fwd, bwd = rb.row_costs(row, "compute_ms")
    assert bwd == pytest.approx([6e-3, 3e-3]) and fwd == pytest.approx([4e-3 * 6 / 9, 4e-3 * 3 / 9])
    assert rb.row_costs(row, "span_ms")[1] == pytest.approx([8e-3, 4e-3])
    p = tmp_path / "profile.json"
    p.write_text(json.dumps([row]))
    with pytest.raises(SystemExit, match="2 blocks profiled"):  # a profile of another model is refused
        rb.main(["--profile", str(p), "--rate", "50", "--family", "flux"])


def test_the_profile_s_recorded_block_sizes_are_used(tmp_path, capsys):
    """fp8 rows stream fp8 blocks: the sizes the profile recorded, not the bf16 model's, make the floor."""
    blocks = [{"block": b, "compute_ms": 1.0, "span_ms": 1.0} for b in (2, 1, 0)]
    row = {"name": "fp8 row", "timeline": {"backward_blocks": [blocks], "per_step": [{"bench.forward": {"compute_ms": 1.0}}],
                                           "block_bytes": {"0": int(1e8), "1": int(1e8), "2": int(1e8)}}}
    p = tmp_path / "profile.json"
    p.write_text(json.dumps([row]))
    assert rb.main(["--profile", str(p), "--rate", "1", "--rings", "2"]) == 0  # 3 blocks: not Flux's 57, no error
    out = capsys.readouterr().out
    assert "| fp8 row | kernels | 2 | 0.20 |" in out


def test_recorded_zero_sizes_fall_back_to_the_model(tmp_path):
    """The first profiles recorded every streamed block as 0 bytes (read from emptied parameters): not sizes."""
    row = {"name": "old row", "timeline": {"backward_blocks": [[{"block": 1, "compute_ms": 1.0, "span_ms": 1.0},
                                                                {"block": 0, "compute_ms": 1.0, "span_ms": 1.0}]],
                                           "per_step": [{"bench.forward": {"compute_ms": 1.0}}],
                                           "block_bytes": {"0": 0, "1": 0}}}
    p = tmp_path / "profile.json"
    p.write_text(json.dumps([row]))
    with pytest.raises(SystemExit, match="the flux model has 57 block sizes"):
        rb.main(["--profile", str(p), "--rate", "50"])
