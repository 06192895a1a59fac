"""The sharded stream (trainer/offload/gather.py) on the CPU over gloo: 2 and 4 processes each copy only their
slice of every load from the host arena and all-gather the rest, and train exactly what one resident process
trains.

The proof that the gather is what fills the rings: after attaching, each process overwrites every byte of its
host arena outside its own slices with 0xFF (NaN in fp32), so a load that read anything but its own slice would
poison the loss. The same poison without the gather does change the result (the last test), so the first
tests can fail."""

from __future__ import annotations

import json

import pytest
import torch
from _offload_util import add_lora, batch, blocks_of, run_ranks, tiny_flux, train_steps, trainable_state

from trainer.offload import attach_offload

STEPS = 3


def _poison_all_but(conductor, keep) -> None:
    """Fill each streamed block's host bytes with 0xFF, except the slice `keep(region)` (None: all of it)."""
    for b, off in conductor.host_off.items():
        region = conductor.arena.region(off, conductor.plan.sizes[b])
        if keep is None:
            region.fill_(255)
            continue
        mine = keep(region)
        saved = mine.clone()
        region.fill_(255)
        mine.copy_(saved)


def _steps(model) -> torch.Tensor:
    """STEPS training steps, an out-of-plan no-grad pass (sampling during training), one more step."""
    losses = train_steps(model, STEPS)
    with torch.no_grad():
        model(**batch(7)[0])
    return torch.cat([losses, train_steps(model, 1)])


def _worker(rank: int, world: int, store: str, result: str, fraction: float, checkpointing: bool = True) -> dict:
    import torch.distributed as tdist

    from trainer.offload.gather import SliceGather

    out: dict = {}
    ref = add_lora(tiny_flux(0))
    out["ref_losses"] = _steps(ref).tolist()
    want = trainable_state(ref)

    group = tdist.new_group(list(range(world)))
    gather = SliceGather(group, tdist.get_rank(group), world)
    m = add_lora(tiny_flux(0))
    h = attach_offload(blocks_of(m), "cpu", fraction, gather=gather, checkpointing=checkpointing)
    c = h._c
    _poison_all_but(c, gather.slice)
    losses = _steps(m)
    got = trainable_state(m)
    st = h.stats()
    out.update(
        losses=losses.tolist(),
        same=all(torch.equal(got[k], want[k]) for k in want) and got.keys() == want.keys(),
        streamed=len(c.plan.streamed),
        sizes_split=all(n % (256 * world) == 0 for n in c.plan.sizes),
        gathered_by=st["gathered_by"],
        per_step=st["h2d_bytes_per_step"],
        plan_per_step=c.plan.bytes_per_step(),
    )
    h.close()
    return out


@pytest.mark.parametrize(("world", "fraction", "checkpointing"), [(2, 1.0, True), (4, 0.5, True), (2, 1.0, False)])
def test_each_process_copies_its_slice_and_the_gather_fills_the_ring(tmp_path, world, fraction, checkpointing):
    """`checkpointing=False`: the streamed blocks keep their activations, their saved weights resolved where each
    block is gathered again for backward (conductor `saved_weights`)."""
    rs = run_ranks(_worker, world, tmp_path, fraction, checkpointing)
    for r in rs:
        assert r["error"] is None, r["error"]
    ref = rs[0]["ref_losses"]
    for r in rs:
        assert r["streamed"] > 0 and r["sizes_split"]
        assert r["losses"] == ref  # bitwise: the same bytes reach every ring
        assert r["same"], "LoRA weights differ from the resident run"
        assert r["gathered_by"] == world
        assert r["per_step"] == r["plan_per_step"] // world  # each process copies 1/N over its link
    assert len({json.dumps(r["losses"]) for r in rs}) == 1


def test_the_poison_shows_when_nothing_gathers():
    """Without the gather a process reads whole blocks from its arena: the same poison reaches the loss."""
    torch.manual_seed(0)
    m = add_lora(tiny_flux(0))
    h = attach_offload(blocks_of(m), "cpu", 1.0)
    c = h._c
    _poison_all_but(c, lambda region: region[: region.numel() // 2])
    losses = train_steps(m, 2)
    assert not torch.isfinite(losses).all() or not torch.equal(losses, train_steps(add_lora(tiny_flux(0)), 2))
    h.close()


def test_a_trainable_stream_with_packed_state_refuses_the_gather():
    from trainer.offload.gather import SliceGather

    m = tiny_flux(0)
    with pytest.raises(ValueError, match="packs no optimizer state"):
        attach_offload(blocks_of(m), "cpu", 1.0, trainable=True, optimizer_state=("exp_avg",),
                       gather=SliceGather(None, 0, 2))


# ---------------------------------------------------------------------------------------------- the planner


def test_the_planner_shares_the_hosts_copies_and_the_sharded_stream_gathers():
    from trainer.planner import timing as ptime

    ref = ptime.reference_rates()
    assert ptime.for_processes(ref, 1, True) is ref
    whole4 = ptime.for_processes(ref, 4, False)
    assert whole4.h2d == pytest.approx(ptime.HOST_H2D_TOTAL / 4)  # 43.75 GB/s each: the host's total shared
    assert ptime.for_processes(ref, 2, False).h2d == pytest.approx(min(ref.h2d, ptime.HOST_H2D_TOTAL / 2))
    shard4 = ptime.for_processes(ref, 4, True)
    # a block of S bytes: S/4 over PCIe at 43.75 GB/s, 3S/4 gathered at the bus rate
    want = 1 / (1 / (4 * whole4.h2d) + 3 / (4 * ptime.GATHER_BUS_MORE))
    assert shard4.h2d == pytest.approx(want) and shard4.h2d > ref.h2d > whole4.h2d
    assert "sharded stream" in shard4.source


def test_the_fit_logs_check_compares_a_step_of_several_micro_batches_with_as_many_predictions():
    from types import SimpleNamespace

    from trainer.planner.prediction import check_line

    pred = SimpleNamespace(peak_reserved=10 * 2**30, step_s=1.0)
    assert "step predicted 1.00 s, measured 1.00 s (+0 %)" in check_line(pred, 10 * 2**30, 1.0)
    line = check_line(pred, 10 * 2**30, 2.1, micro_batches=2)
    assert "step of 2 micro-batches predicted 2.00 s, measured 2.10 s (-5 %)" in line


def test_plan_with_several_gpus_prints_each_processs_step_both_ways():
    from typer.testing import CliRunner

    from trainer.cli import app

    r = CliRunner().invoke(app, ["plan", "configs/flux/lora-24gb.yaml", "--gpus", "4",
                                 "--set", "offload.transformer=1.0"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    head = next(i for i, line in enumerate(r.output.splitlines()) if "4 GPUs of one host" in line)
    rows = [line.split() for line in r.output.splitlines()[head:] if line.startswith("1.00")]
    one, whole, shard = (float(x) for x in rows[0][1:4])
    assert shard < one < whole  # whole copies share the host; the sharded stream gathers the rest


def test_a_killed_runs_arena_file_is_removed_and_a_live_ones_kept(tmp_path):
    """A run killed while its owner filled the /dev/shm arena leaves the file (tmpfs keeps its pages): the next run's
    owner removes it; a live run's arena and files of other names stay."""
    import os
    import subprocess
    import sys

    from trainer.train.streaming import ARENA_PREFIX, remove_stale_arenas

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"{ARENA_PREFIX}{gone.pid}-abc"
    dead.write_bytes(b"x" * 8192)
    live = tmp_path / f"{ARENA_PREFIX}{os.getpid()}-def"
    live.write_bytes(b"y")
    other = tmp_path / "someone-else"
    other.write_bytes(b"z")
    assert remove_stale_arenas(tmp_path) >= 8192
    assert not dead.exists() and live.exists() and other.exists()
