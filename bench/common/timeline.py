"""Issue 29: where a profiled step's device time goes, from the profiler's device events (kernels and copies).

Why. The streamed Flux steps ran 1.35-1.43 x their PCIe floor while the compute alone (offload 0) was below
it, so neither copies nor kernels bound them: something serialises the two. Per-op tables cannot show that;
the device timeline can. `bench/speed/bench_speed.py --profile` calls `summarize_profile` on every profiled row.

How. Every device event of torch.profiler's kineto results is a kernel, a memset or a memcpy (direction from
its name, "Memcpy HtoD (Pinned -> Device)", "Memcpy DtoH (Device -> Pinned)"), with a start, an end, a
stream (`device_resource_id`) and, for copies, the bytes where the event's metadata carries them. Each event
is given to the step and the part of the step (forward / backward / optimizer: `record_function` ranges the
bench opens on the host) whose host range holds its *launch*: the CUDA runtime call with the same correlation
id (the kernel itself may run later; launched from the autograd thread in backward, it still falls inside the
main thread's backward range). Events without a matching launch fall back to their own start. Per group, with
interval unions (the pure functions below, tested on synthetic intervals):

- wall: first to last device event of the group; compute: union of kernels on any stream;
- H2D / D2H: unions of the copies by direction; "under kernels": the part of it while some kernel runs;
- exposed copy: copy time with no kernel running; idle: wall minus the union of everything, split into short
  gaps (< 100 us: launch gaps) and long ones;
- bytes and GB/s over the busy time; per stream, counts and busy time of kernels and copies (are the copies
  on the conductor's streams or on the compute stream?); host time in CUDA synchronize calls.

Only `_KinetoEvent` methods present in torch 2.11 and 2.13 are called unguarded (name, device_type,
start_ns, end_ns, device_resource_id, correlation_id); activity_type, metadata_json and is_user_annotation are
read where present. Without activity types the names decide: "Memcpy ..." and "Memset ..." are copies and
memsets, a device event named like a host event is a range's projection (record_function, compiled regions),
anything else is a kernel; host calls named "cu..." are the launches.

The backward by block (`block_stalls`): bench/speed/speed_profile.py marks on the host where each block's recompute
starts (a `BLOCK` range around the conductor's `enter(BWD, i)`); the kernels launched from one mark to the next
are that block's recompute and backward. Per block: kernel busy, span, and the stall before its first kernel
(no kernel since the previous block's last): which blocks wait, and whether they are the double blocks (the
table groups them by their weights' bytes); and the host's side, its time from mark to mark and the least time a
kernel of the block queued between launch and start (near zero: the host paced the device). Run on the H100
(bench/history/2026-11-26.md, 2026-11-26 02:10). `idle_neighbours`: the long idle gaps grouped by the device events either
side, which says what the device waited between.

Left out: device-side user annotations (kineto's "gpu_user_annotation" events; their presence depends on
the kineto build), the dependency edges (which wait held which copy: only a trace viewer shows that).
"""

from __future__ import annotations

import re
import statistics
from bisect import bisect_right
from typing import NamedTuple

STEP, PARTS = "bench.step", ("bench.forward", "bench.backward", "bench.optimizer")
#: + the block's index: a host range around the conductor's `enter(BWD, i)`, where block i's recompute starts
#: (bench/speed/speed_profile.py puts it there)
BLOCK = "bench.block."
LONG_GAP_NS = 100_000  # idle gaps at least this long are not launch gaps
_BYTES = re.compile(r'"bytes"\s*:\s*(\d+)')
_SKIP_ACTIVITIES = ("gpu_user_annotation", "cuda_sync", "cuda_profiler_range", "user_annotation")


# ---------------------------------------------------------------------------------------------- interval arithmetic
def union(iv) -> list[tuple[float, float]]:
    """Sorted, disjoint (start, end) intervals covering `iv` (empty and reversed intervals dropped)."""
    out: list[list[float]] = []
    for a, b in sorted((a, b) for a, b in iv if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(iv) -> float:
    """Time covered by `iv` (overlaps counted once)."""
    return sum(b - a for a, b in union(iv))


def intersect(x, y) -> list[tuple[float, float]]:
    """Time covered by both `x` and `y`, as disjoint intervals."""
    x, y = union(x), union(y)
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(x, y) -> list[tuple[float, float]]:
    """Time covered by `x` but not by `y`."""
    out = []
    y = union(y)
    for a, b in union(x):
        for c, d in y:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if b > a:
            out.append((a, b))
    return out


def gaps(iv, lo: float, hi: float) -> list[float]:
    """Lengths of the stretches of [lo, hi] that `iv` does not cover."""
    return [b - a for a, b in subtract([(lo, hi)], iv)]


def idle_neighbours(evs: list, min_ns: float, top: int = 8) -> list[dict]:
    """The device's idle gaps of at least `min_ns` (nothing on any stream), grouped by the event that ended just
    before and the one that started just after (names cut to 60 characters): what the device waited between, the
    longest total first. `evs`: DevEvents of one or more steps."""
    ordered = sorted(evs, key=lambda e: e.start)
    groups: dict[tuple[str, str], list[float]] = {}
    last = None  # the event ending last so far
    for e in ordered:
        if last is not None and e.start - last.end >= min_ns:
            groups.setdefault((last.name[:60], e.name[:60]), []).append(e.start - last.end)
        if last is None or e.end > last.end:
            last = e
    rows = [{"before": a, "after": b, "gaps": len(g), "ms": sum(g) * 1e-6} for (a, b), g in groups.items()]
    return sorted(rows, key=lambda r: -r["ms"])[:top]


# ---------------------------------------------------------------------------------------------- events
class DevEvent(NamedTuple):
    kind: str  # kernel | h2d | d2h | copy (device to device, peer) | memset
    start: int  # ns
    end: int
    stream: int
    name: str
    nbytes: int | None = None


def _get(e, method: str, default=None):
    f = getattr(e, method, None)
    try:
        return f() if f is not None else default
    except RuntimeError:  # a method bound but not implemented for this event type
        return default


def kind_of(name: str, activity: str | None) -> str | None:
    """A device event's kind from kineto's activity type where there is one, else from its name; None: not
    device work (annotations, synchronisation records)."""
    if activity in _SKIP_ACTIVITIES:
        return None
    if name.startswith("Memcpy") or activity == "gpu_memcpy":
        return "h2d" if "HtoD" in name else "d2h" if "DtoH" in name else "copy"
    if name.startswith("Memset") or activity == "gpu_memset":
        return "memset"
    if activity in (None, "kernel", "concurrent_kernel"):
        return "kernel"
    return None


def _is_device(e) -> bool:
    return str(e.device_type()).rsplit(".", 1)[-1] not in ("CPU",)


def _is_launch(e, activity: str | None) -> bool:
    """A host CUDA runtime / driver call (cudaLaunchKernel, cuLaunchKernel, cudaMemcpyAsync...)."""
    if activity is not None:
        return activity in ("cuda_runtime", "cuda_driver")
    return e.name().startswith("cu") and e.correlation_id() != 0


def read_events(events) -> dict:
    """Split kineto events into device events (with the host time of their launch) and the host ranges.

    Returns {"device": [(DevEvent, launch_ns or None)], "ranges": {name: [(start, end)]}, "syncs": [(start,
    end)], "blocks": [(start, block)]}; `ranges` holds the host `record_function` ranges named in STEP / PARTS,
    `blocks` the BLOCK markers."""
    launches: dict[int, int] = {}
    device, ranges, syncs, host_names, blocks = [], {n: [] for n in (STEP, *PARTS)}, [], set(), []
    for e in events:
        activity = _get(e, "activity_type")
        name = e.name()
        if _is_device(e):
            if _get(e, "is_user_annotation", False):
                continue  # the device projection of a host range (kineto's gpu_user_annotation)
            k = kind_of(name, activity)
            if k is None:
                continue
            md = (_get(e, "metadata_json", "") or "") if k != "kernel" else ""
            m = _BYTES.search(md)
            ev = DevEvent(k, e.start_ns(), e.end_ns(), e.device_resource_id(), name, int(m.group(1)) if m else None)
            device.append((ev, e.correlation_id(), activity))
            continue
        host_names.add(name)
        if name in ranges:
            ranges[name].append((e.start_ns(), e.end_ns()))
        elif name.startswith(BLOCK):
            blocks.append((e.start_ns(), int(name[len(BLOCK):])))
        elif _is_launch(e, activity):
            launches[e.correlation_id()] = e.start_ns()
            if "Synchronize" in name:  # cudaStreamSynchronize, cudaEventSynchronize, cudaDeviceSynchronize
                syncs.append((e.start_ns(), e.end_ns()))
    # Without kineto's activity types, a "kernel" named like a host event may be that host range's projection
    # onto the device (record_function, torch.compile's regions: it spans kernels, it is none) or a real kernel
    # whose launch inductor wraps in a range of the kernel's own name (every triton kernel when profiling): the
    # real one has a launch call with its correlation id. (Before 2026-11-26 02:50 both were dropped: the H100
    # timelines left inductor's triton kernels out of "compute" and counted them as idle.)
    device = [(ev, c) for ev, c, act in device
              if act is not None or ev.kind != "kernel" or ev.name not in host_names or c in launches]
    return {"device": [(ev, launches.get(c)) for ev, c in device],
            "ranges": {k: sorted(v) for k, v in ranges.items()}, "syncs": syncs, "blocks": sorted(blocks)}


def _which(ranges: list[tuple[int, int]], t: int) -> int | None:
    i = bisect_right([a for a, _ in ranges], t) - 1
    return i if i >= 0 and t <= ranges[i][1] else None


# ---------------------------------------------------------------------------------------------- summaries
def summarize(evs: list[DevEvent], syncs=()) -> dict:
    """One group's timeline in ms (see the module docstring); `syncs`: host synchronize calls in the group."""
    if not evs:
        return {"events": 0}
    by = {k: [(e.start, e.end) for e in evs if e.kind == k] for k in ("kernel", "h2d", "d2h", "copy", "memset")}
    K, H, D = union(by["kernel"]), union(by["h2d"]), union(by["d2h"])
    every = union(K + H + D + by["copy"] + by["memset"])
    lo, hi = min(e.start for e in evs), max(e.end for e in evs)
    idle = gaps(every, lo, hi)
    ms = 1e-6

    def nbytes(kind):
        got = [e.nbytes for e in evs if e.kind == kind]
        return None if any(b is None for b in got) else sum(got)

    out = {"events": len(evs), "kernels": len(by["kernel"]), "wall_ms": (hi - lo) * ms,
           "compute_ms": length(K) * ms, "h2d_ms": length(H) * ms, "d2h_ms": length(D) * ms,
           "h2d_under_kernels_ms": length(intersect(H, K)) * ms, "d2h_under_kernels_ms": length(intersect(D, K)) * ms,
           "h2d_with_d2h_ms": length(intersect(H, D)) * ms,
           "exposed_h2d_ms": length(subtract(H, K)) * ms, "exposed_d2h_ms": length(subtract(D, K)) * ms,
           "exposed_copy_ms": length(subtract(H + D, K)) * ms,
           "other_ms": length(by["copy"] + by["memset"]) * ms,
           "idle_ms": sum(idle) * ms, "idle_short_ms": sum(g for g in idle if g < LONG_GAP_NS) * ms,
           "idle_long_ms": sum(g for g in idle if g >= LONG_GAP_NS) * ms,
           "idle_long_gaps": sum(g >= LONG_GAP_NS for g in idle),
           "h2d_bytes": nbytes("h2d"), "d2h_bytes": nbytes("d2h"),
           "host_sync_ms": length(syncs) * ms, "host_syncs": len(syncs)}
    for d in ("h2d", "d2h"):
        b, t = out[f"{d}_bytes"], out[f"{d}_ms"]
        out[f"{d}_gbps"] = b / (t * 1e6) if b and t else None
    streams: dict[int, dict] = {}
    for e in evs:
        s = streams.setdefault(e.stream, {})
        s[e.kind] = s.get(e.kind, 0) + 1
    for sid, s in streams.items():
        for k in list(s):
            mine = [e for e in evs if e.stream == sid and e.kind == k]
            s[f"{k}_ms"] = length([(e.start, e.end) for e in mine]) * ms
            if k in ("h2d", "d2h") and all(e.nbytes is not None for e in mine):
                s[f"{k}_bytes"] = sum(e.nbytes for e in mine)
    out["streams"] = {str(k): v for k, v in sorted(streams.items())}
    names: dict[str, int] = {}
    sizes: dict[str, list] = {}  # "h2d 680 MB": [copies, bytes, ns]: each copy's own rate, not the union's
    for e in evs:
        if e.kind not in ("kernel",):
            names[e.name] = names.get(e.name, 0) + 1
        if e.kind in ("h2d", "d2h") and e.nbytes:
            c = sizes.setdefault(f"{e.kind} {e.nbytes / 1e6:.0f} MB", [0, 0, 0])
            c[0], c[1], c[2] = c[0] + 1, c[1] + e.nbytes, c[2] + (e.end - e.start)
    out["copy_names"] = names
    out["copy_sizes"] = {k: {"copies": n, "gbps": b / t if t else None} for k, (n, b, t) in sizes.items()}
    return out


def block_stalls(kernels: list[tuple[DevEvent, int]], markers: list[tuple[int, int]], end: int) -> list[dict]:
    """A backward block by block. `markers`: (host ns, block) where each block's recompute starts, in order;
    `kernels`: (kernel, launch ns). A block's kernels are those launched from its marker to the next one (the
    last: to `end`): its recompute and its backward. Per block, in ms: compute (kernel busy), span (its first
    kernel's start to its last one's end), and stall: the time between the previous block's last kernel and this
    one's first, when no kernel of either runs (None for the first block): what the block waited for, its weights
    or inputs, or the host. Host side: host_ms, the host's time from this block's mark to the next one (launching
    it, and any wait on the way), and lead_ms, the least time any of its kernels waited between launch and start:
    near 0, the device ran out of work at that kernel (the host paced it); large, the host was ahead."""
    out, prev_end = [], None
    for k, (t0, block) in enumerate(markers):
        t1 = markers[k + 1][0] if k + 1 < len(markers) else end
        launched = [(e, t) for e, t in kernels if t0 <= t < t1]
        mine = [e for e, _ in launched]
        host = (t1 - t0) * 1e-6
        if not mine:
            out.append({"block": block, "kernels": 0, "compute_ms": 0.0, "span_ms": 0.0, "stall_ms": None,
                        "host_ms": host, "lead_ms": None})
            continue
        first, last = min(e.start for e in mine), max(e.end for e in mine)
        stall = None if prev_end is None else max(0, first - prev_end) * 1e-6
        lead = min(e.start - t for e, t in launched) * 1e-6
        out.append({"block": block, "kernels": len(mine), "compute_ms": length([(e.start, e.end) for e in mine]) * 1e-6,
                    "span_ms": (last - first) * 1e-6, "stall_ms": stall, "host_ms": host, "lead_ms": lead})
        prev_end = last
    return out


def summarize_events(events) -> dict:
    """Per profiled step and per part of it (forward / backward / optimizer), from kineto events; the mean
    over the steps in `mean`. Without device events (the CPU profiler) {"steps": 0, "note": ...}."""
    got = read_events(events)
    steps = got["ranges"][STEP]
    if not got["device"]:
        return {"steps": len(steps), "device_events": 0, "note": "no device events in this profile (no GPU: "
                "kernels and copies are recorded only with ProfilerActivity.CUDA on a CUDA device)"}
    if not steps:  # no step ranges: the whole profile is one step
        steps = [(min(e.start for e, _ in got["device"]), max(e.end for e, _ in got["device"]))]
    parts = {p: got["ranges"][p] for p in PARTS}
    per_step = [{"all": [], **{p: [] for p in PARTS}} for _ in steps]
    unplaced = by_start = 0
    for ev, launch in got["device"]:
        t = launch if launch is not None else ev.start
        by_start += launch is None
        i = _which(steps, t)
        if i is None:
            unplaced += 1
            continue
        per_step[i]["all"].append(ev)
        for p, rs in parts.items():
            if _which(rs, t) is not None:
                per_step[i][p].append(ev)
                break
    sync_of = [[] for _ in steps]
    for a, b in got["syncs"]:
        i = _which(steps, a)
        if i is not None:
            sync_of[i].append((a, b))
    table, blocks = [], []
    for i, groups in enumerate(per_step):
        row = {"all": summarize(groups["all"], sync_of[i])}
        for p in PARTS:
            row[p] = summarize(groups[p], [s for s in sync_of[i] if _which(parts[p], s[0]) is not None])
        table.append(row)
        back = [r for r in parts["bench.backward"] if _which(steps, r[0]) == i]
        if back and got["blocks"]:
            lo, hi = back[0]
            kernels = [(e, t if t is not None else e.start) for e, t in got["device"] if e.kind == "kernel"]
            kernels = [(e, t) for e, t in kernels if lo <= t <= hi]
            blocks.append(block_stalls(kernels, [(t, b) for t, b in got["blocks"] if lo <= t <= hi], hi))
    idle = idle_neighbours([e for g in per_step for e in g["all"]], LONG_GAP_NS)
    for r in idle:
        r["ms"] /= len(steps)  # per step
    return {"steps": len(steps), "device_events": len(got["device"]), "unplaced": unplaced,
            "placed_by_own_start": by_start, "per_step": table, "mean": _mean(table), "backward_blocks": blocks,
            "idle_neighbours": idle}


def _mean(table: list[dict]) -> dict:
    out = {}
    for part in table[0]:
        rows = [r[part] for r in table if r[part].get("events")]
        if not rows:
            out[part] = {"events": 0}
            continue
        m = {}
        for k, v in rows[0].items():
            vals = [r.get(k) for r in rows]
            if isinstance(v, (int, float)) and not isinstance(v, bool) and all(x is not None for x in vals):
                m[k] = statistics.fmean(vals)
            elif k in ("streams", "copy_names", "copy_sizes"):
                m[k] = v  # the first step's (counts per step)
            else:
                m[k] = None
        out[part] = m
    return out


# ---------------------------------------------------------------------------------------------- markdown
def _f(v, fmt="{:.1f}") -> str:
    return "" if v is None else fmt.format(v)


def _gbs(b) -> str:
    return "" if b is None else f"{b / 1e9:.2f}"


def _gb(r: dict, d: str) -> str:
    b = r.get(f"{d}_bytes")
    return "" if b is None else f"{b / 1e9:.2f} ({_f(r.get(f'{d}_gbps'))})"


def markdown(summary: dict) -> str:
    """The per-row table (ms per step, mean over the profiled steps), the streams and the copy kinds."""
    if not summary.get("device_events"):
        return f"timeline: {summary.get('note', 'no device events')}"
    mean = summary["mean"]
    lines = [f"timeline: {summary['steps']} steps, {summary['device_events']} device events"
             f" ({summary['unplaced']} outside the steps, {summary['placed_by_own_start']} placed by their own "
             "start for want of a launch record); ms per step, mean over the steps; 'under kernels': while some "
             "kernel runs; exposed: copy with no kernel running; idle: nothing on the device (short: gaps "
             "< 0.1 ms)", "",
             "| part | wall | compute | H2D | H2D under kernels | D2H | D2H under kernels | H2D with D2H | exposed "
             "copy | idle short | idle long (gaps) | max(compute, H2D, D2H) | H2D GB (GB/s) | D2H GB (GB/s) | "
             "host sync | kernels |", "|" + "---|" * 16]
    bound = 0.0
    for part in ("all", *PARTS):
        r = mean.get(part, {})
        if not r.get("events"):
            lines.append(f"| {part.removeprefix('bench.')} | no device events |" + " |" * 14)
            continue
        big = max(r["compute_ms"], r["h2d_ms"], r["d2h_ms"])
        if part != "all":
            bound += big

        lines.append(
            f"| {'step' if part == 'all' else part.removeprefix('bench.')} | {r['wall_ms']:.1f} | "
            f"{r['compute_ms']:.1f} | {r['h2d_ms']:.1f} | {r['h2d_under_kernels_ms']:.1f} | {r['d2h_ms']:.1f} | "
            f"{r['d2h_under_kernels_ms']:.1f} | {r['h2d_with_d2h_ms']:.1f} | {r['exposed_copy_ms']:.1f} | "
            f"{r['idle_short_ms']:.1f} | {r['idle_long_ms']:.1f} ({r['idle_long_gaps']:.0f}) | {big:.1f} | "
            f"{_gb(r, 'h2d')} | {_gb(r, 'd2h')} | {r['host_sync_ms']:.1f} ({r['host_syncs']:.0f}) | {r['kernels']:.0f} |")
    lines += ["", f"sum over the parts of max(compute, H2D, D2H): {bound:.1f} ms (a bound for this schedule: each "
              "part waits for the slower of its kernels and its copies)"]
    walls = [s["all"].get("wall_ms") for s in summary["per_step"]]
    lines.append("step walls ms: " + " ".join(_f(w) for w in walls))
    streams = mean["all"].get("streams") or {}
    main = max(streams, key=lambda k: streams[k].get("kernel_ms", 0.0), default=None)
    lines += ["", "| stream (first step) | kernels | kernel ms | H2D | H2D ms | H2D GB | D2H | D2H ms | D2H GB | other "
              "copies, memsets |", "|---|---|---|---|---|---|---|---|---|---|"]
    for sid, s in streams.items():
        other = s.get("copy", 0) + s.get("memset", 0)
        label = f"{sid} (most kernel time)" if sid == main and s.get("kernel") else sid
        lines.append(f"| {label} | {s.get('kernel', 0)} | {_f(s.get('kernel_ms'))} | {s.get('h2d', 0)} | "
                     f"{_f(s.get('h2d_ms'))} | {_gbs(s.get('h2d_bytes'))} | {s.get('d2h', 0)} | "
                     f"{_f(s.get('d2h_ms'))} | {_gbs(s.get('d2h_bytes'))} | {other} |")
    names = mean["all"].get("copy_names") or {}
    if names:
        lines += ["", "copies and memsets (first step): " + "; ".join(f"{k} x{v}" for k, v in sorted(names.items()))]
    sizes = mean["all"].get("copy_sizes") or {}
    big = sorted(sizes.items(), key=lambda kv: -kv[1]["copies"] * float(kv[0].split()[1]))[:8]
    if big:
        lines.append("copies by size (first step; GB/s of each copy alone, the bulk first): " + "; ".join(
            f"{k} x{v['copies']} at {_f(v['gbps'])} GB/s" for k, v in big))
    idle = summary.get("idle_neighbours") or []
    if idle:
        lines += ["", "long idle gaps (nothing on the device) by the events around them, ms per step:", "",
                  "| before the gap | after it | gaps | ms |", "|---|---|---|---|"]
        lines += [f"| {r['before']} | {r['after']} | {r['gaps']} | {r['ms']:.1f} |" for r in idle]
    lines += backward_blocks_markdown(summary.get("backward_blocks") or [], summary.get("block_bytes"))
    return "\n".join(lines)


def backward_blocks_markdown(per_step: list[list[dict]], block_bytes: dict | None = None) -> list[str]:
    """The backward by block (`block_stalls`, mean over the steps): totals per block size (`block_bytes`: block
    -> bytes, e.g. double and single blocks), then the blocks that stalled longest."""
    if not per_step or not per_step[0]:
        return []
    by_block: dict[int, list[dict]] = {}
    for step in per_step:
        for r in step:
            by_block.setdefault(r["block"], []).append(r)

    def mean(rows, k):
        vals = [r[k] for r in rows if r[k] is not None]
        return statistics.fmean(vals) if vals else 0.0

    keys = ("compute_ms", "span_ms", "stall_ms", "host_ms", "lead_ms")
    rows = [{"block": b, **{k: mean(rs, k) for k in keys}} for b, rs in by_block.items()]
    size = (lambda b: f"{block_bytes[b] / 1e6:.0f} MB") if block_bytes else (lambda b: "all")
    classes: dict[str, list[dict]] = {}
    for r in rows:
        classes.setdefault(size(r["block"]) if not block_bytes or r["block"] in block_bytes else "?", []).append(r)
    out = ["", f"backward by block ({len(per_step)} steps, mean; a block's kernels: those launched from its "
           "recompute's start to the next block's; stall: no kernel between the previous block's last and its "
           "first; host: the host's time from its mark to the next; lead: the least time one of its kernels waited "
           "from launch to start, mean over the blocks)", "",
           "| blocks (size) | count | stall ms | compute ms | span ms | host ms | lead ms |", "|---|---|---|---|---|---|---|"]
    for c, rs in sorted(classes.items()):
        out.append(f"| {c} | {len(rs)} | {sum(r['stall_ms'] for r in rs):.1f} | "
                   f"{sum(r['compute_ms'] for r in rs):.1f} | {sum(r['span_ms'] for r in rs):.1f} | "
                   f"{sum(r['host_ms'] for r in rs):.1f} | {statistics.fmean(r['lead_ms'] for r in rs):.2f} |")
    worst = sorted(rows, key=lambda r: -r["stall_ms"])[:8]
    out.append("longest stalls: " + "; ".join(f"block {r['block']} {r['stall_ms']:.2f} ms" for r in worst))
    return out
