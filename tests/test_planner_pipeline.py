"""The planner's step-time replay (trainer/planner/replay.py) against cases worked by hand, and the
operation counts it takes host time from."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainer.offload.plan import capacity_for, make_plan
from trainer.planner.replay import REF_HOST_S_PER_OP, BlockCost, reference_costs, simulate


def _costs(n, host=(0.0, 0.0), gpu=(1.0, 2.0)):
    return [BlockCost(host[0], host[1], gpu[0], gpu[1]) for _ in range(n)]


def test_resident_step_is_the_slower_of_host_and_gpu_when_one_dominates_every_block():
    gpu_bound = simulate(_costs(4, host=(0.1, 0.2), gpu=(1.0, 2.0)), None, 1.0)
    assert gpu_bound.step_s == pytest.approx(12.0)  # 4 x (1 + 2)
    host_bound = simulate(_costs(4, host=(1.0, 2.0), gpu=(0.1, 0.2)), None, 1.0)
    # a block's kernels run while the host launches it: the step ends with the last launch
    assert host_bound.step_s == pytest.approx(12.0)
    assert (host_bound.host_s, host_bound.gpu_s) == (pytest.approx(12.0), pytest.approx(1.2))


def test_mixed_blocks_cost_more_than_either_sum():
    """Forward host-bound, backward GPU-bound: the GPU idles in forward, so the step exceeds both sums."""
    st = simulate(_costs(4, host=(2.0, 1.0), gpu=(1.0, 2.0)), None, 1.0)
    assert st.host_s == st.gpu_s == pytest.approx(12.0)
    # forward ends when the host has launched it (8 s); backward then runs 4 x 2 s on the GPU
    assert st.step_s == pytest.approx(16.0)


def test_blocks_that_sync_the_host_add_launches_and_kernels():
    """A block whose code waits on the GPU (HiDream's expert masks, `BlockCost.syncs`) cannot be launched ahead:
    4 blocks of host (1, 2) and GPU (1, 2) take 4 x (1 + 1 + 2 + 2) s, not 4 x (1 + 2); with the copies of a
    streamed plan behind them they still overlap (the copy stream does not wait for the host)."""
    syncing = [replace(c, syncs=True) for c in _costs(4, host=(1.0, 2.0), gpu=(1.0, 2.0))]
    assert simulate(_costs(4, host=(1.0, 2.0), gpu=(1.0, 2.0)), None, 1.0).step_s == pytest.approx(12.0)
    assert simulate(syncing, None, 1.0).step_s == pytest.approx(24.0)
    sizes = [1] * 4
    plan = make_plan(sizes, capacity_for(sizes, 0.5), "train")
    assert simulate(syncing, plan, 1e6).step_s == pytest.approx(24.0, rel=1e-3)
    assert syncing[0].without_recompute().syncs and syncing[0].scaled(2.0).syncs


def test_copies_that_fit_behind_compute_cost_nothing_and_slow_copies_set_the_pace():
    sizes = [10] * 6
    plan = make_plan(sizes, capacity_for(sizes, 0.5), "train")
    moved = plan.bytes_per_step()
    resident = simulate(_costs(6, gpu=(5.0, 10.0)), None, 1.0).step_s
    hidden = simulate(_costs(6, gpu=(5.0, 10.0)), plan, 1e6)
    assert hidden.step_s == pytest.approx(resident, rel=1e-3)
    assert hidden.copy_s == pytest.approx(moved / 1e6)
    starved = simulate(_costs(6, gpu=(1e-6, 1e-6)), plan, 1.0)
    assert starved.copy_s == pytest.approx(moved)
    assert moved <= starved.step_s <= moved * 1.05


def test_a_copy_waits_for_its_release_point_on_the_gpu():
    """Three blocks of 1 byte in a ring of 2, copies at 0.25 byte/s (4 s each), every pass 1 s on the GPU, no host
    cost. Worked by hand: the step starts with blocks 0 and 1 in the ring; F0 runs 0-1, then block 2's copy
    (replacing block 0) runs 1-5; F1 runs 1-2; F2 waits for it, 5-6; B2 6-7, then block 0's copy (replacing
    block 2) runs 7-11; B1 7-8; B0 waits for it, 11-12."""
    plan = make_plan([1, 1, 1], 2, "train")
    assert [(ld.block, ld.after, ld.use) for ld in plan.step_loads(plan.loop)] == [(2, 0, 2), (0, 3, 5)]
    st = simulate(_costs(3, gpu=(1.0, 1.0)), plan, 0.25)
    assert st.step_s == pytest.approx(12.0)
    assert st.copy_s == pytest.approx(8.0)


def test_host_costs_follow_the_traced_operations():
    costs = reference_costs([300, 100], [1.0, 1.0], [2.0, 2.0])
    assert costs[0].host_fwd + costs[0].host_bwd == pytest.approx(300 * REF_HOST_S_PER_OP)
    assert costs[0].host_fwd == pytest.approx(3 * costs[1].host_fwd)


def test_trace_counts_each_blocks_operations(tiny_models):
    """Identical blocks dispatch identical numbers of operations, LoRA adds operations to every adapted block."""
    from trainer import planner
    from trainer.config import Config

    def cfg(method):
        return Config.model_validate(
            {
                "model": {"family": "flux", "path": str(tiny_models / "flux")},
                "train": {"method": method},
                "data": {"sources": [{"path": "unused"}], "resolutions": [64]},
                "output": {"dir": "unused"},
            }
        )

    lora = planner.analyze(cfg("lora"))
    full = planner.analyze(cfg("full"))
    by_class: dict[str, set[int]] = {}
    for blk, ops in zip(lora.blocks, lora.trace(64).block_ops, strict=True):
        by_class.setdefault(type(blk).__name__, set()).add(ops)
    assert len(by_class) == 2 and all(len(v) == 1 for v in by_class.values())
    assert all(a > b > 0 for a, b in zip(lora.trace(64).block_ops, full.trace(64).block_ops, strict=True))
