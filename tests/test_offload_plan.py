"""The pure schedule against the seed's three diagrams, and invariants on uneven (Flux-like) blocks."""

import pytest

from trainer.offload.plan import (
    PlanError,
    allocation_diagram,
    capacity_for,
    execution_diagram,
    held_plan,
    make_plan,
    plan_for,
    residency_rows,
    spread_fixed,
)

# Copied verbatim from seeds/000 (annotations in parentheses dropped).
SEED_SAMPLING_9_33 = """
->  ■ X X X X X _ _ _
->  _ ■ X X X X X _ _
->  _ _ ■ X X X X X _
->  _ _ _ ■ X X X X X
->  X _ _ _ ■ X X X X
->  X X _ _ _ ■ X X X
->  X X X _ _ _ ■ X X
->  X X X X _ _ _ ■ X
->  X X X X X _ _ _ ■
->  ■ X X X X X _ _ _
->  _ ■ X X X X X _ _
->  _ _ ■ X X X X X _
->  _ _ _ ■ X X X X X
->  X _ _ _ ■ X X X X
->  X X _ _ _ ■ X X X
->  X X X _ _ _ ■ X X
->  X X X X _ _ _ ■ X
->  X X X X X _ _ _ ■
"""

SEED_TRAINING_9_33 = """
->  ■ X X X X X _ _ _
->  _ ■ X X X X X _ _
->  _ _ ■ X X X X X _
->  _ _ _ ■ X X X X X
->  _ _ _ X ■ X X X X
->  _ _ _ X X ■ X X X
->  _ _ _ X X X ■ X X
->  _ _ _ X X X X ■ X
->  _ _ _ X X X X X ■
<-  _ _ _ X X X X X ■
<-  _ _ X X X X X ■ _
<-  _ X X X X X ■ _ _
<-  X X X X X ■ _ _ _
<-  X X X X ■ X _ _ _
<-  X X X ■ X X _ _ _
<-  X X ■ X X X _ _ _
<-  X ■ X X X X _ _ _
<-  ■ X X X X X _ _ _
"""

SEED_ALLOCATION_12_50 = """
->  *00* 01  02  03  04  05
->   06 *01* 02  03  04  05
->   06  07 *02* 03  04  05
->   06  07  08 *03* 04  05
->   06  07  08  09 *04* 05
->   06  07  08  09  10 *05*
->  *06* 07  08  09  10  11
->   06 *07* 08  09  10  11
->   06  07 *08* 09  10  11
->   06  07  08 *09* 10  11
->   06  07  08  09 *10* 11
->   06  07  08  09  10 *11*
<-   06  07  08  09  10 *11*
<-   06  07  08  09 *10* 05
<-   06  07  08 *09* 04  05
<-   06  07 *08* 03  04  05
<-   06 *07* 02  03  04  05
<-  *06* 01  02  03  04  05
<-   00  01  02  03  04 *05*
<-   00  01  02  03 *04* 05
<-   00  01  02 *03* 04  05
<-   00  01 *02* 03  04  05
<-   00 *01* 02  03  04  05
<-  *00* 01  02  03  04  05
"""


def _rows(text):
    return [r for r in text.strip("\n").splitlines()]


def test_seed_sampling_diagram_9_blocks_33_percent():
    plan = make_plan([100] * 9, capacity_for([100] * 9, 0.33), "sample")
    assert plan.capacity == 600
    assert execution_diagram(plan, steps=2) == _rows(SEED_SAMPLING_9_33)


def test_seed_training_diagram_9_blocks_33_percent():
    plan = make_plan([100] * 9, capacity_for([100] * 9, 0.33), "train")
    assert execution_diagram(plan, steps=1) == _rows(SEED_TRAINING_9_33)
    # and every later step is the same picture (the tail kept across the turn, start state restored)
    assert execution_diagram(plan, steps=3)[36:] == _rows(SEED_TRAINING_9_33)


def test_seed_allocation_diagram_12_blocks_50_percent():
    plan = make_plan([64] * 12, capacity_for([64] * 12, 0.5), "train")
    assert allocation_diagram(plan, steps=1) == _rows(SEED_ALLOCATION_12_50)
    assert allocation_diagram(plan, steps=2)[24:] == _rows(SEED_ALLOCATION_12_50)


def _check_invariants(plan, steps):
    """Replay with explicit release/claim bookkeeping: no overlap, in bounds, used only when resident,
    a region is reused only after the last use of what it held, and each load starts before its use."""
    L = len(plan.sequence)
    sizes = plan.sizes
    state = dict(plan.initial)
    last_use = {}
    for s in range(steps):
        by_after = {}
        for ld in plan.step_loads(s):
            assert ld.after < ld.use, ld
            by_after.setdefault(ld.after, []).append(ld)
        for i, (_, b) in enumerate(plan.sequence):
            assert b in state, f"step {s} position {i}: block {b} not resident"
            last_use[b] = s * L + i
            for ld in by_after.get(i, []):
                for x in ld.claims:
                    assert x in state
                    assert last_use.get(x, -1) <= s * L + i
                    del state[x]
                assert ld.block not in state
                state[ld.block] = ld.offset
            regions = sorted((off, off + sizes[x]) for x, off in state.items())
            assert all(0 <= a and e <= plan.capacity for a, e in regions)
            assert all(regions[k][1] <= regions[k + 1][0] for k in range(len(regions) - 1)), regions


FLUX_LIKE = [679] * 19 + [283] * 38  # MB of Flux's double and single blocks


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 0.75, 1.0])
@pytest.mark.parametrize("mode", ["train", "sample"])
def test_uneven_blocks_invariants(fraction, mode):
    cap = capacity_for(FLUX_LIKE, fraction)
    plan = make_plan(FLUX_LIKE, cap, mode)
    _check_invariants(plan, steps=len(plan.steps) + 3)
    if fraction == 0.0:
        assert plan.steps == () or all(not s for s in plan.steps)
    if fraction == 1.0:
        assert cap == 2 * 679


@pytest.mark.parametrize("n,k", [(9, 3), (12, 6), (10, 1), (8, 6)])
def test_training_moves_two_f_w_per_step(n, k):
    """The training floor: each offloaded block crosses PCIe once in forward and once in backward."""
    sizes = [10] * n
    plan = make_plan(sizes, 10 * (n - k), "train")
    assert plan.bytes_per_step() == 2 * 10 * k
    assert plan.steps[plan.loop] and plan.start_state(5) == plan.initial


def test_ring_smaller_than_a_block_is_refused():
    with pytest.raises(PlanError):
        make_plan([10, 30, 10], 20, "train")


def test_residency_rows_never_exceed_capacity():
    plan = make_plan([3, 5, 2, 7, 1, 4], 12, "sample")
    for _, _, state in residency_rows(plan, steps=len(plan.steps) + 2):
        assert sum(plan.sizes[b] for b in state) <= plan.capacity


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_sampling_with_a_spread_resident_part_moves_about_f_w(fraction):
    """Beyond the seed: keep part of the model resident, stream the rest through a two-block window."""
    cap = capacity_for(FLUX_LIKE, fraction)
    fixed = spread_fixed(FLUX_LIKE, cap)
    plan = make_plan(FLUX_LIKE, cap, "sample", fixed=fixed)
    _check_invariants(plan, steps=len(plan.steps) + 3)
    total = sum(FLUX_LIKE)
    cyclic = make_plan(FLUX_LIKE, cap, "sample").bytes_per_step()
    assert cyclic >= 0.95 * total  # the seed's cycle moves (nearly) everything
    assert plan.bytes_per_step() <= (fraction + 0.12) * total
    assert all(plan.initial[b] < sum(FLUX_LIKE[x] for x in fixed) for b in fixed)
    assert all(b not in fixed for ld in plan.steps[plan.loop] for b in (ld.block, *ld.claims))


def _replayed_step(plan, compute, rate, steps=8):
    """Steady-state step time of a plan on a compute stream and one copy stream (FIFO in issue order): a
    block starts when the previous one ends and its load has landed; a load starts when the copy stream is
    free and its release point has run. The conductor's waits, with block compute times `compute`."""
    L = len(plan.sequence)
    t = copy_free = 0.0
    ready, pending, starts = {}, {}, []
    for s in range(steps):
        starts.append(t)
        for ld in plan.step_loads(s):
            pending.setdefault(s * L + ld.after, []).append(ld)
        for i, (_, b) in enumerate(plan.sequence):
            t = max(t, ready.pop(b, 0.0)) + compute[b]
            for ld in pending.pop(s * L + i, []):
                copy_free = max(copy_free, t) + plan.sizes[ld.block] / rate
                ready[ld.block] = copy_free
    return (t - starts[steps // 2]) / (steps - steps // 2)


@pytest.mark.parametrize(
    "sizes,fraction",
    [(FLUX_LIKE, 0.5), (FLUX_LIKE, 0.3), (FLUX_LIKE, 0.55), ([300] * 38, 0.5), ([400] * 60, 0.4)],
)
def test_sampling_copies_hide_behind_compute_when_the_link_allows(sizes, fraction):
    """Flux's blocks do about the same work (5.2 ms each at 1024 px on an H200) while a double block holds
    2.4 x a single's bytes; the link moves 286 MB in one block's compute (55 GB/s). With the streamed bytes
    spread by position the copies hide (the step stays within 3 % of the compute); spread by bytes, 11 of
    the 19 double blocks streamed and the double blocks' stretch was copy-bound: 1.12 x replayed, 1.11 x
    measured (bench/history/2026-11-22.md run 3)."""
    from trainer.offload.plan import plan_for

    cap = capacity_for(sizes, fraction)
    plan = plan_for(sizes, cap, "sample")
    _check_invariants(plan, steps=len(plan.steps) + 3)
    rate = 286.0
    assert plan.bytes_per_step() / rate < 0.95 * len(sizes)  # the link could hide it all
    step = _replayed_step(plan, [1.0] * len(sizes), rate)
    assert step <= 1.03 * len(sizes)


@pytest.mark.parametrize("sizes", [[5] * 36, FLUX_LIKE])
@pytest.mark.parametrize(("fraction", "held_at"), [(0.555, 0.444), (0.75, 0.25), (1.0, 0.5), (0.5, 0.0)])
def test_held_plan_streams_the_rest_through_the_same_ring(sizes, fraction, held_at):
    """`held_plan` (the conductor's `hold`): the blocks it holds are streamed ones of the plan, at most the extra
    bytes; the fixed blocks keep their offsets; what it loads is what the plan streams less the held blocks, in
    the same ring; each step moves at least the held bytes fewer than the plan's (exactly, once periodic)."""
    plan = plan_for(sizes, capacity_for(sizes, fraction), "sample")
    extra = capacity_for(sizes, held_at) - plan.capacity
    alt = held_plan(plan, extra)
    held = sum(sizes[b] for b in alt.held)
    assert alt.capacity == plan.capacity and alt.fixed == plan.fixed and alt.held <= set(plan.streamed)
    assert 0 < held <= extra and extra - held < max(sizes[b] for b in plan.streamed)  # as many as fit
    assert set(alt.streamed) <= set(plan.streamed) - alt.held
    assert all(alt.initial[b] == plan.initial[b] for b in plan.fixed) and not alt.held & set(alt.initial)
    assert alt.bytes_per_step() <= plan.bytes_per_step() - held
    assert held_plan(plan, min(sizes) - 1) is plan
