"""`bench/speed/bench_speed.py --profile`: where a dittrain eager step spends its time that the plain script's does not
(issue 29: dittrain eager was 1.10 x plain on Qwen-Image but 0.93 x on Flux, never profiled).

Two rows, both eager, resident, every block checkpointed, built as bench_speed builds them: the plain script (peft
bf16 LoRA, diffusers' checkpointing, torch AdamW) and dittrain offload 0 (StreamedBlock, the project's LoRA math
and AdamW). After --warmup steps, torch.profiler records --steps steps of each (CPU and CUDA activities) and prints:

- per row, before the profiler starts: the step's device time (CUDA events, median of --steps);
- per row, profiled: wall time per step, CUDA kernel time per step (the sum of every kernel's self time: where it
  is far below the wall time the GPU waits on the host's launches), kernel launches and `aten::_to_copy` calls
  (casts) per step;
- per row: the device timeline of the profiled steps (bench/common/timeline.py, issue 29: why the streamed steps are
  1.35-1.43 x their PCIe floor): compute, H2D and D2H busy time, how much of each copy runs under kernels, exposed
  copy time, idle time, bytes and GB/s, the streams the kernels and copies ran on, for the whole step and its
  forward / backward / optimizer parts (`record_function` ranges "bench.step", "bench.forward"... around each
  step's parts), the longest idle gaps grouped by the device events either side of them, and the backward block
  by block (a "bench.block.<i>" range where each recompute starts: the stall before each block's kernels, its
  kernel time and span, the host's time per block and how long its kernels queued, by block size; the JSON keeps
  every block, which bench/speed/ring_bound.py replays); no table without device events (the CPU profiler), a line
  that says so;
- per row: the top operators by self CUDA time and by self CPU time (`key_averages().table`);
- the operators whose self CUDA time differs most between the two rows, per step (the answer to "why").

    python -m bench.speed.bench_speed --profile --family qwen_image --out $OUT/prof    # ~3 min on an H100
    python -m bench.speed.bench_speed --profile --smoke --out /tmp/p                    # CPU: checks the script

With `--only` (and `--rows`), the rows it names are profiled instead, compiled ones included, in bench_speed's
order; every row is compared to the first:

    python -m bench.speed.bench_speed --profile --rows issue29 --family chroma --only "=plain + compile_repeated_blocks;=dittrain offload 0, compiled, checkpointing auto" --warmup 2 --steps 2 --out $OUT/prof

`--interleave` first builds every row's model at once and times their steps in turn (`--steps` rounds), so that
drift of the machine falls on every row alike (two full Qwen-Images need an H200, or `--layers 30`); `--layers N`
builds N blocks per model; `--no-mask` drops the text mask (Qwen-Image: the all-ones mask the pipeline and the
trainer drop at batch 1, where SDPA then may use flash attention):

    python -m bench.speed.bench_speed --profile --interleave --layers 30 --family qwen_image --warmup 2 --steps 6 --out $OUT/prof

Writes profile_<family>.txt under --out, and speed_<family>_profile.json (each row's numbers, its timeline per
step and their mean).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, record_function
from torch.profiler import profile as torch_profile

from bench.common import timeline
from bench.common.timing import step_seconds

ROWS = [
    dict(name="plain diffusers + peft, bf16 LoRA, eager, resident", kind="plain", compile=False),
    dict(name="dittrain offload 0, eager", kind="ours", fraction=0.0, act=False, compile=False, math="auto",
         quant="none", modulation=False, dynamic=False, ckpt="all", fp8mm=False),
]


def _self_device_us(e) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(e, attr):
            return float(getattr(e, attr))
    return 0.0


def _gist(r: dict) -> str:
    """The row's device timeline in one clause (bench/common/timeline.py; nothing without device events)."""
    m = (r["timeline"].get("mean") or {}).get("all") or {}
    floor = "" if r["pcie_floor_s"] is None else f"; PCIe floor {r['pcie_floor_s'] * 1e3:.0f} ms"
    if not m.get("events"):
        return floor
    return (f"; device per step: wall {m['wall_ms']:.0f} ms, compute {m['compute_ms']:.0f}, H2D {m['h2d_ms']:.0f}, "
            f"D2H {m['d2h_ms']:.0f}, exposed copy {m['exposed_copy_ms']:.0f}, idle {m['idle_ms']:.0f}" + floor)


def _setup(spec, args, dev):
    """The row's model, optimizer and one-step function, built as bench_speed builds them; (step, handle)."""
    import bench.speed.bench_speed as bs

    adapter, m = bs.build(args.family, dev, args.smoke, getattr(args, "layers", None), getattr(args, "variant", None))
    kw = bs.model_inputs(adapter, m, dev, args.res, getattr(args, "size", None), getattr(args, "frames", None))
    if spec.get("nomask") or getattr(args, "no_mask", False):
        bs.drop_mask(kw)
    plain = spec["kind"] == "plain"
    params, handle = bs.plain_setup(adapter, m, args, spec) if plain else bs.ours_setup(adapter, m, args, spec, dev)
    if handle is not None:
        _mark_recomputes(handle._c)
        # the packed bytes a block streams (its parameters no longer hold them once the conductor has packed them)
        handle.block_bytes = {i: pk.nbytes for i, pk in enumerate(handle._c.packs)}
    opt = (torch.optim.AdamW(params, lr=1e-5) if plain
           else bs.build_optimizer(params, bs.OptimizerConfig(name="adamw", lr=1e-5)))

    def step():  # the ranges name the step and its parts on the profile's host timeline (bench/common/timeline.py)
        with record_function(timeline.STEP):
            with record_function("bench.forward"):
                loss = m(**kw)[0].float().square().mean()
            with record_function("bench.backward"):
                loss.backward()
            with record_function("bench.optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)

    return step, handle


def _mark_recomputes(conductor) -> None:
    """A host range `timeline.BLOCK + i` around the conductor's `enter(BWD, i)`, where block i's recompute starts
    in the backward: bench/common/timeline.py splits the backward's kernels by block at these marks."""
    from trainer.offload.plan import BWD

    enter = conductor.enter

    def marked(phase, i):
        if phase != BWD:
            return enter(phase, i)
        with record_function(f"{timeline.BLOCK}{i}"):
            return enter(phase, i)

    conductor.enter = marked


def _timed_step(step, dev) -> float:
    """Seconds of one step: CUDA events on a GPU (the device's time), else the wall clock. (The host's issue time
    says nothing here: with ~10^4 kernels a step the launch queue fills and the host waits on the GPU anyway; the
    profiled kernel time against the wall time is what tells a GPU waiting on the host.)"""
    import bench.speed.bench_speed as bs

    bs.sync(dev)
    return step_seconds(step, 1, dev.type == "cuda")[0]


def _record(spec, args, dev):
    import bench.speed.bench_speed as bs

    bs.compiled.reset()
    step, handle = _setup(spec, args, dev)
    try:
        for _ in range(args.warmup):
            step()
        timing = [_timed_step(step, dev) for _ in range(args.steps)]  # unprofiled: device and host time
        bs.sync(dev)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with torch_profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            bs.sync(dev)
            wall = (time.perf_counter() - t0) / args.steps
        h2d = handle.stats()["h2d_bytes_per_step"] if handle is not None else 0  # (synchronises)
    finally:
        if handle is not None:
            handle.close()
    try:
        tl = timeline.summarize_events(prof.profiler.kineto_results.events())
        tl["block_bytes"] = getattr(handle, "block_bytes", None)
    except Exception as e:  # noqa: BLE001 -- a GPU run's other tables must not be lost to this summary
        tl = {"steps": 0, "device_events": 0, "note": f"the timeline failed: {type(e).__name__}: {e}"}
    return prof.key_averages(), wall, timing, tl, h2d


def interleaved(args, dev, specs: list[dict]) -> list[dict]:
    """Every row's model at once (`--layers` to fit them), warmed up, then their steps in turn, `--steps`
    rounds: drift of the machine over a run (clocks, heat, the host's other work) falls on every row alike."""
    import bench.speed.bench_speed as bs

    bs.compiled.reset()
    made = [_setup(s, args, dev) for s in specs]
    try:
        for step, _ in made:
            for _ in range(args.warmup):
                step()
        times = [[] for _ in specs]
        for _ in range(args.steps):
            for i, (step, _) in enumerate(made):
                times[i].append(_timed_step(step, dev))
    finally:
        for _, handle in made:
            if handle is not None:
                handle.close()
    rows = []
    for spec, ts in zip(specs, times, strict=True):
        rows.append({"name": spec["name"], "step_s": statistics.median(ts), "steps_s": ts})
    return rows


def profile(args, dev, specs: list[dict] | None = None) -> list[dict]:
    import bench.speed.bench_speed as bs

    specs = specs or ROWS
    sort_dev = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    out, rows, per_op = [], [], {}
    rate = bs.pcie_rate(dev)  # pinned host-to-device bytes/s (None on the CPU): the streamed rows' floor
    head_extra = []
    if getattr(args, "interleave", False):
        inter = interleaved(args, dev, specs)
        bs.free(dev)
        ref = inter[0]["step_s"]
        head_extra = [f"interleaved ({args.steps} rounds, every model built at once"
                      + (f", {args.layers} blocks each" if getattr(args, "layers", None) else "") + "):", ""]
        head_extra += [f"- {r['name']}: step {r['step_s']:.3f} s ({r['step_s'] / ref:.3f} x the first; steps "
                       + " ".join(f"{t:.3f}" for t in r["steps_s"]) + ")" for r in inter] + [""]
    for spec in specs:
        avgs, wall, timing, tl, h2d = _record(spec, args, dev)
        bs.free(dev)
        # (the bench's own ranges are left out: kineto projects them onto the device as annotations spanning
        # the whole step, which would count every kernel again)
        kernel_s = sum(_self_device_us(e) for e in avgs if e.key not in (timeline.STEP, *timeline.PARTS)
                       and not getattr(e, "is_user_annotation", False)) / 1e6 / args.steps
        launches = sum(e.count for e in avgs if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel"))) / args.steps
        casts = sum(e.count for e in avgs if e.key == "aten::_to_copy") / args.steps
        rows.append({"name": spec["name"], "wall_s": wall, "kernel_s": kernel_s, "launches": launches,
                     "casts": casts, "step_s": statistics.median(timing), "timeline": tl,
                     "h2d_bytes": h2d, "pcie_floor_s": h2d / rate if rate and h2d else None})
        per_op[spec["name"]] = {e.key: (_self_device_us(e) / args.steps, e.self_cpu_time_total / args.steps,
                                        e.count / args.steps) for e in avgs}
        out += [f"## {spec['name']}: wall {wall:.3f} s/step, CUDA kernels {kernel_s:.3f} s/step, "
                f"{launches:.0f} kernel launches/step", "", timeline.markdown(tl), "",
                avgs.table(sort_by=sort_dev, row_limit=25), "",
                avgs.table(sort_by="self_cpu_time_total", row_limit=15), ""]
        print(f"{spec['name']}: step {rows[-1]['step_s']:.3f} s{_gist(rows[-1])}\n\n{timeline.markdown(tl)}\n",
              flush=True)
        _write(args, _head(args, dev, rate, head_extra, rows) + out, rows)  # so far: a run cut short keeps it
    a = per_op[specs[0]["name"]]
    for spec in specs[1:]:
        b = per_op[spec["name"]]
        diff = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, (0, 0, 0))[0] - a.get(k, (0, 0, 0))[0]))
        out += [f"## self CUDA time per step, '{spec['name']}' minus '{specs[0]['name']}' (ms), largest "
                "differences first", "",
                "| op | first ms | this ms | diff ms | first calls | this calls |", "|---|---|---|---|---|---|"]
        for k in diff[:25]:
            pa, pb = a.get(k, (0, 0, 0)), b.get(k, (0, 0, 0))
            out.append(f"| {k[:70]} | {pa[0] / 1e3:.2f} | {pb[0] / 1e3:.2f} | {(pb[0] - pa[0]) / 1e3:+.2f} | "
                       f"{pa[2]:.0f} | {pb[2]:.0f} |")
        out.append("")
    lines = _head(args, dev, rate, head_extra, rows) + out
    print("\n".join(lines))
    _write(args, lines, rows)
    return rows


def _head(args, dev, rate, head_extra: list[str], rows: list[dict]) -> list[str]:
    head = [f"profile: {args.family}, {args.res} px, LoRA r{args.rank}, "
            f"{'cpu (smoke)' if dev.type == 'cpu' else torch.cuda.get_device_name()}, {args.steps} steps after "
            f"{args.warmup} warm-up" + (f", {args.layers} blocks" if getattr(args, "layers", None) else "")
            + (", no text mask" if getattr(args, "no_mask", False) else "")
            + (f", pinned H2D {rate / 1e9:.1f} GB/s (best of three 1 GiB copies)" if rate else ""), ""] + head_extra
    head += [f"- {r['name']}: step {r['step_s']:.3f} s; profiled: wall {r['wall_s']:.3f} s, kernels "
             f"{r['kernel_s']:.3f} s ({r['kernel_s'] / r['step_s']:.0%} of the unprofiled step: well below 100 % the GPU "
             f"waits on the host), launches {r['launches']:.0f}, aten::_to_copy {r['casts']:.0f} per step"
             + _gist(r) for r in rows]
    return head + [""]


def _write(args, lines: list[str], rows: list[dict]) -> None:
    if args.out is not None:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"profile_{args.family}.txt").write_text("\n".join(lines) + "\n")
        (Path(args.out) / f"speed_{args.family}_profile.json").write_text(json.dumps(rows, indent=1))
