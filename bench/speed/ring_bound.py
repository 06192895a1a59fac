"""What a streamed step could take with the blocks' measured kernel times: the conductor's plan replayed (issue 29).

Why. The PCIe floor (every streamed byte at the measured rate, copies never idle) is the bound when every block
is copy-bound. A Flux step at offload 1.0 is not: the H100 profile of 2026-11-26 timed a double block's
recompute + backward at 7.9 ms of kernels against 12.3 ms to copy its 680 MB, and a single block's at 7.4 ms
against 5.1 ms for 283 MB. In the backward the singles come first and keep the copy engine waiting; a ring of two
double blocks cannot bank that slack for the doubles that follow. This replays the conductor's plan
(trainer/offload/plan.py) with those kernel times through the planner's simulator (trainer/planner/replay.py)
and prints what each ring would take: the bound a plan can reach, beside the floor and the measured step.

How. `--profile` is the JSON `bench_speed.py --profile` writes: per row, the backward block by block (kernel
busy ms and span ms, mean over the profiled steps) and the forward's kernel ms (split over the blocks in
proportion to their backward). Block sizes: the packed bytes the profile recorded (`block_bytes`: fp8 rows
stream fp8 blocks), else the family's full-size bf16 model built on the meta device; the rate is the bench's
measured pinned H2D rate. Host launch times are taken as zero (the host is never the
bound in this model); `--span` uses each block's span instead of its kernel time (the idle gaps inside a block
included), which bounds what removing them would save.

    python -m bench.speed.bench_speed --profile --rows issue29 ... --out $OUT/blk     # on the GPU
    python -m bench.speed.ring_bound --profile $OUT/blk/speed_flux.json --rate 55.3 --rings 2 3 4

(2026-11-26's Flux profile, bench/history/2026-11-26.md 02:10, is in git:
`git show d9b4303:bench/logs/2026-11-26o-profile-flux-all-kernels.json`.)

Left out: the embedders, loss and optimizer outside the blocks (a few ms), activation offloading's copies (30 ms
each way on the same engine), and the forward's per-block times (the forward is copy-bound: 163 ms of kernels
against 411 ms of copies). Profiles made with torch 2.11 before the timeline fix of 2026-11-26 02:50 (logs j-n)
left inductor's triton kernels out of the kernel times.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from trainer.offload.plan import capacity_for, plan_for
from trainer.planner.replay import BlockCost, simulate


def block_sizes(family: str) -> list[int]:
    """Bytes of each block's frozen bf16 weights, from the full-size model built on the meta device (as the
    planner builds it)."""
    from trainer.models import adapter_class
    from trainer.planner.meta import blocks_of, meta_transformer

    m = meta_transformer(family, adapter_class(family).full_config, torch.bfloat16)
    return [sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks_of(family, m)]


def row_costs(row: dict, key: str) -> tuple[list[float], list[float]]:
    """(forward s, recompute + backward s) per block, from one profiled row (means over its steps)."""
    tl = row["timeline"]
    per: dict[int, list[float]] = {}
    for step in tl["backward_blocks"]:
        for b in step:
            per.setdefault(b["block"], []).append(b[key])
    bwd = [statistics.mean(per[b]) * 1e-3 for b in sorted(per)]
    fwd_total = statistics.mean(s["bench.forward"]["compute_ms"] for s in tl["per_step"]) * 1e-3
    return [fwd_total * b / sum(bwd) for b in bwd], bwd


def bound(sizes: list[int], fwd: list[float], bwd: list[float], ring: int, rate: float, fraction: float = 1.0) -> dict:
    cap = capacity_for(sizes, fraction, min_blocks=ring)
    plan = plan_for(sizes, cap, "train", ring)
    costs = [BlockCost(0.0, 0.0, f, b) for f, b in zip(fwd, bwd, strict=True)]
    t = simulate(costs, plan, rate)
    return {"ring": ring, "ring_gb": cap / 1e9, "floor_s": plan.bytes_per_step() / rate, "step_s": t.step_s,
            "kernels_s": t.gpu_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="bench_speed.py --profile's JSON")
    ap.add_argument("--family", default="flux")
    ap.add_argument("--rate", type=float, required=True, help="pinned host-to-device GB/s the bench measured")
    ap.add_argument("--rings", type=int, nargs="+", default=[2, 3, 4], help="ring sizes in largest blocks")
    ap.add_argument("--fraction", type=float, default=1.0, help="offload fraction the plans are made for")
    ap.add_argument("--only", default=None, help="profiled rows whose name contains this")
    args = ap.parse_args(argv)
    rows = json.loads(Path(args.profile).read_text())
    model_sizes = None
    rate = args.rate * 1e9
    print(f"offload fraction {args.fraction:g}, {args.rate:g} GB/s")
    print("| profiled row | block times | ring (blocks) | ring GB | PCIe floor s | replayed step s | vs floor |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        if not row.get("timeline", {}).get("backward_blocks") or (args.only and args.only not in row["name"]):
            continue
        recorded = row["timeline"].get("block_bytes")
        # (profiles before 11-26 02:30 recorded zeros: not sizes)
        recorded = recorded if recorded and all(int(v) > 0 for v in recorded.values()) else None
        if recorded:
            sizes = [int(recorded[str(i)]) for i in range(len(recorded))]
        else:
            model_sizes = model_sizes or block_sizes(args.family)
            sizes = model_sizes
        if len(row["timeline"]["backward_blocks"][0]) != len(sizes):
            where = "the profile recorded" if recorded else f"the {args.family} model has"
            raise SystemExit(f"{row['name']}: {len(row['timeline']['backward_blocks'][0])} blocks profiled, "
                             f"{where} {len(sizes)} block sizes")
        for key, what in (("compute_ms", "kernels"), ("span_ms", "spans")):
            fwd, bwd = row_costs(row, key)
            for ring in args.rings:
                r = bound(sizes, fwd, bwd, ring, rate, args.fraction)
                print(f"| {row['name']} | {what} | {ring} | {r['ring_gb']:.2f} | {r['floor_s']:.3f} | "
                      f"{r['step_s']:.3f} | {r['step_s'] / r['floor_s'] if r['floor_s'] else float('nan'):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
