"""bench/common/timeline.py (issue 29): the interval arithmetic on synthetic intervals, and the per-step / per-part
summary of the profiler's device events on fake kineto events (no GPU here)."""

from __future__ import annotations

import pytest
from test_train_support import bench_module

tl = bench_module("timeline")


def test_union_overlapping_nested_disjoint_empty():
    assert tl.union([]) == []
    assert tl.union([(5, 5), (7, 6)]) == []  # empty and reversed intervals count for nothing
    assert tl.union([(0, 4), (2, 6)]) == [(0, 6)]  # overlapping
    assert tl.union([(0, 10), (2, 3), (4, 9)]) == [(0, 10)]  # nested
    assert tl.union([(8, 9), (0, 1), (3, 4)]) == [(0, 1), (3, 4), (8, 9)]  # disjoint, unsorted
    assert tl.union([(0, 2), (2, 3)]) == [(0, 3)]  # touching
    assert tl.length([(0, 4), (2, 6), (10, 11), (3, 5)]) == 7


def test_intersect_subtract_gaps():
    k = [(0, 10), (12, 20)]
    assert tl.intersect([(5, 15)], k) == [(5, 10), (12, 15)]
    assert tl.intersect([(1, 2), (3, 4)], [(0, 10)]) == [(1, 2), (3, 4)]  # nested
    assert tl.intersect([(0, 1)], [(2, 3)]) == [] and tl.intersect([], k) == []
    assert tl.subtract([(5, 15)], k) == [(10, 12)]
    assert tl.subtract([(0, 30)], k) == [(10, 12), (20, 30)]
    assert tl.subtract([(2, 3)], [(0, 10)]) == []  # nested in what is taken away
    assert tl.subtract([(0, 5)], []) == [(0, 5)] and tl.subtract([], k) == []
    assert tl.gaps(k, 0, 25) == [2, 5] and tl.gaps([], 0, 4) == [4] and tl.gaps([(0, 4)], 0, 4) == []
    # length(x) = length(x & y) + length(x - y) for any x, y
    x, y = [(0, 3), (5, 9), (11, 30)], [(2, 6), (8, 12), (20, 21), (29, 40)]
    assert tl.length(tl.intersect(x, y)) + tl.length(tl.subtract(x, y)) == tl.length(x)


def _ev(kind, a, b, stream, nbytes=None, name=None):
    names = {"kernel": "gemm", "h2d": "Memcpy HtoD (Pinned -> Device)", "d2h": "Memcpy DtoH (Device -> Pinned)"}
    return tl.DevEvent(kind, a, b, stream, name or names[kind], nbytes)


def test_summarize_splits_busy_overlap_exposed_idle():
    ms = 1_000_000  # events in ns, the summary in ms
    evs = [_ev("kernel", 0, 10 * ms, 7), _ev("kernel", 12 * ms, 20 * ms, 7), _ev("kernel", 2 * ms, 4 * ms, 9),
           _ev("h2d", 5 * ms, 15 * ms, 13, nbytes=500_000_000), _ev("d2h", 18 * ms, 25 * ms, 14, nbytes=70_000_000),
           _ev("kernel", 30 * ms, 31 * ms, 7)]
    s = tl.summarize(evs, syncs=[(0, 3 * ms)])
    assert s["wall_ms"] == pytest.approx(31) and s["compute_ms"] == pytest.approx(19)  # the nested kernel once
    assert s["h2d_ms"] == pytest.approx(10) and s["h2d_under_kernels_ms"] == pytest.approx(8)
    assert s["exposed_h2d_ms"] == pytest.approx(2) and s["d2h_under_kernels_ms"] == pytest.approx(2)
    assert s["exposed_copy_ms"] == pytest.approx(2 + 5) and s["h2d_with_d2h_ms"] == 0
    assert s["idle_ms"] == pytest.approx(5) and s["idle_long_gaps"] == 1 and s["idle_short_ms"] == 0
    assert s["h2d_gbps"] == pytest.approx(50.0) and s["d2h_bytes"] == 70_000_000
    assert s["streams"]["7"]["kernel"] == 3 and s["streams"]["13"] == {"h2d": 1, "h2d_ms": pytest.approx(10),
                                                                        "h2d_bytes": 500_000_000}
    assert s["host_sync_ms"] == pytest.approx(3) and s["kernels"] == 4
    assert s["copy_sizes"] == {"h2d 500 MB": {"copies": 1, "gbps": pytest.approx(50.0)},
                               "d2h 70 MB": {"copies": 1, "gbps": pytest.approx(10.0)}}
    no_bytes = tl.summarize([_ev("h2d", 0, ms, 13)])
    assert no_bytes["h2d_bytes"] is None and no_bytes["h2d_gbps"] is None  # unknown, not zero
    assert tl.summarize([]) == {"events": 0}


@pytest.mark.parametrize(("name", "activity", "kind"), [
    ("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", "h2d"), ("Memcpy DtoH (Device -> Pinned)", None, "d2h"),
    ("Memcpy DtoD (Device -> Device)", "gpu_memcpy", "copy"), ("Memset (Device)", None, "memset"),
    ("triton_poi_fused_0", "kernel", "kernel"), ("ampere_bf16_gemm", None, "kernel"),
    ("bench.step", "gpu_user_annotation", None)])
def test_kind_of(name, activity, kind):
    assert tl.kind_of(name, activity) == kind


class _Fake:
    """The `_KinetoEvent` methods bench/common/timeline.py reads; `activity=False`: an event without activity_type
    (the names decide, as on a torch without it)."""

    def __init__(self, name, dev, a, b, corr=0, stream=0, activity=None, md=""):
        self._v = dict(name=name, dev=dev, a=a, b=b, corr=corr, stream=stream, md=md)
        if activity is not False:
            self.activity_type = lambda: activity

    def name(self):
        return self._v["name"]

    def device_type(self):
        return "DeviceType." + self._v["dev"]

    def start_ns(self):
        return self._v["a"]

    def end_ns(self):
        return self._v["b"]

    def device_resource_id(self):
        return self._v["stream"]

    def correlation_id(self):
        return self._v["corr"]

    def metadata_json(self):
        return self._v["md"]


def _trace(activities: bool):
    """Two steps: forward [0, 100), backward [100, 300), optimizer [300, 320) (host ns), step 2 shifted by 1000.
    Forward launches a kernel and a weight copy; backward a kernel that runs late, an activation copy back."""
    def a(x):
        return x if activities else False

    evs = []
    for s in (0, 1000):
        evs += [_Fake("bench.step", "CPU", s, s + 320, activity=a("user_annotation")),
                _Fake("bench.forward", "CPU", s, s + 100, activity=a("user_annotation")),
                _Fake("bench.backward", "CPU", s + 100, s + 300, activity=a("user_annotation")),
                _Fake("bench.optimizer", "CPU", s + 300, s + 320, activity=a("user_annotation")),
                _Fake("cudaLaunchKernel", "CPU", s + 10, s + 12, corr=s + 1, activity=a("cuda_runtime")),
                _Fake("cudaMemcpyAsync", "CPU", s + 20, s + 22, corr=s + 2, activity=a("cuda_runtime")),
                _Fake("cudaLaunchKernel", "CPU", s + 150, s + 152, corr=s + 3, activity=a("cuda_runtime")),
                _Fake("cudaMemcpyAsync", "CPU", s + 160, s + 162, corr=s + 4, activity=a("cuda_runtime")),
                _Fake("cudaStreamSynchronize", "CPU", s + 310, s + 318, corr=s + 5, activity=a("cuda_runtime")),
                _Fake("aten::mm", "CPU", s + 9, s + 13, corr=s + 1, activity=a("cpu_op")),  # a torch op's id
                # device: the forward kernel runs 40-90 (launched at 10), the weight copy 30-130 (past the
                # host's forward range, still forward's), the backward kernel 200-400, the activation copy
                # 380-420 on its own stream
                _Fake("gemm", "CUDA", s + 40, s + 90, corr=s + 1, stream=7, activity=a("kernel")),
                _Fake("Memcpy HtoD (Pinned -> Device)", "CUDA", s + 30, s + 130, corr=s + 2, stream=13,
                      activity=a("gpu_memcpy"), md='"device": 0, "stream": 13, "bytes": 5000'),
                _Fake("gemm_bwd", "CUDA", s + 200, s + 400, corr=s + 3, stream=7, activity=a("kernel")),
                _Fake("Memcpy HtoD (Pinned -> Device)", "CUDA", s + 380, s + 420, corr=s + 4, stream=21,
                      activity=a("gpu_memcpy"), md='"bytes": 800'),
                _Fake("bench.step", "CUDA", s + 30, s + 420, activity=a("gpu_user_annotation")),
                # a torch.compile region on the host and its projection onto the device (no kernel)
                _Fake("CompiledFunction", "CPU", s + 5, s + 95, activity=a("cpu_op")),
                _Fake("CompiledFunction", "CUDA", s + 40, s + 90, activity=a("gpu_user_annotation")),
                # an inductor kernel: its launch sits in a host range of its own name; it runs 90-100
                _Fake("triton_poi_fused_add_0", "CPU", s + 14, s + 18, activity=a("user_annotation")),
                _Fake("cuLaunchKernel", "CPU", s + 15, s + 16, corr=s + 6, activity=a("cuda_driver")),
                _Fake("triton_poi_fused_add_0", "CUDA", s + 90, s + 100, corr=s + 6, stream=7, activity=a("kernel"))]
    return evs


@pytest.mark.parametrize("activities", [True, False])
def test_summarize_events_places_device_work_by_its_launch(activities):
    out = tl.summarize_events(_trace(activities))
    assert out["steps"] == 2 and out["device_events"] == 10 and out["unplaced"] == 0  # the projection left out
    assert out["placed_by_own_start"] == 0
    for step in out["per_step"]:
        assert step["all"]["wall_ms"] == pytest.approx(390e-6)  # 30 .. 420 ns
        fwd, bwd = step["bench.forward"], step["bench.backward"]
        assert fwd["kernels"] == 2 and fwd["h2d_ms"] == pytest.approx(100e-6) and fwd["h2d_bytes"] == 5000
        assert fwd["exposed_copy_ms"] == pytest.approx(40e-6)  # 30-40 and 100-130 (the triton kernel is compute)
        assert bwd["kernels"] == 1 and bwd["h2d_under_kernels_ms"] == pytest.approx(20e-6)
        assert step["bench.optimizer"] == {"events": 0}
        assert step["all"]["idle_ms"] == pytest.approx(70e-6)  # 130-200: nothing runs
        assert step["all"]["host_syncs"] == 1 and step["bench.optimizer"].get("host_syncs") is None
        assert set(step["all"]["streams"]) == {"7", "13", "21"}
    assert out["mean"]["all"]["compute_ms"] == pytest.approx(260e-6)
    md = tl.markdown(out)
    assert "| forward |" in md and "| optimizer | no device events |" in md and "| 13 | 0 |" in md and "| 7 (most kernel time) | 3 |" in md
    assert "Memcpy HtoD (Pinned -> Device) x2" in md and "h2d 0 MB x2 at 41.4 GB/s" in md


def test_summarize_events_without_device_events_says_so():
    out = tl.summarize_events([_Fake("bench.step", "CPU", 0, 10, activity="user_annotation")])
    assert out["device_events"] == 0 and out["steps"] == 1
    assert "no device events" in tl.markdown(out)


def test_block_stalls_split_the_backward_by_recompute_marks():
    """Kernels go to the block whose recompute mark precedes their launch; a block's stall is the kernel-free
    time since the previous block's last kernel (the first block has none)."""
    k = [(_ev("kernel", 100, 140, 7), 10), (_ev("kernel", 140, 150, 7), 12),  # block 5: 100-150
         (_ev("kernel", 170, 200, 7), 30), (_ev("kernel", 180, 190, 9), 31),  # block 4: 170-200, one nested
         (_ev("kernel", 200, 260, 7), 55)]  # block 3: right after block 4
    got = tl.block_stalls(k, [(0, 5), (20, 4), (50, 3), (70, 2)], end=100)
    assert [r["block"] for r in got] == [5, 4, 3, 2]
    assert got[0]["stall_ms"] is None and got[0]["compute_ms"] == pytest.approx(50e-6)
    assert got[1]["stall_ms"] == pytest.approx(20e-6) and got[1]["compute_ms"] == pytest.approx(30e-6)
    assert got[2]["stall_ms"] == 0 and got[2]["span_ms"] == pytest.approx(60e-6)
    assert got[3] == {"block": 2, "kernels": 0, "compute_ms": 0.0, "span_ms": 0.0, "stall_ms": None,
                      "host_ms": pytest.approx(30e-6), "lead_ms": None}
    # host: mark to mark; lead: the least launch-to-start wait (block 4: launched at 30, started at 170: 140 ns)
    assert got[1]["host_ms"] == pytest.approx(30e-6) and got[1]["lead_ms"] == pytest.approx(140e-6)


def test_summarize_events_gives_the_backward_by_block_and_its_table():
    evs = _trace(True)
    for s in (0, 1000):  # two blocks recompute in each backward: block 1 at 140, block 0 at 170 (host)
        evs += [_Fake(f"{tl.BLOCK}1", "CPU", s + 140, s + 141, activity="user_annotation"),
                _Fake(f"{tl.BLOCK}0", "CPU", s + 170, s + 171, activity="user_annotation"),
                _Fake("cudaLaunchKernel", "CPU", s + 175, s + 176, corr=s + 9, activity="cuda_runtime"),
                _Fake("gemm_bwd0", "CUDA", s + 450, s + 470, corr=s + 9, stream=7, activity="kernel")]
    out = tl.summarize_events(evs)
    assert [[r["block"] for r in step] for step in out["backward_blocks"]] == [[1, 0], [1, 0]]
    one, zero = out["backward_blocks"][0]
    assert one["compute_ms"] == pytest.approx(200e-6) and zero["stall_ms"] == pytest.approx(50e-6)  # 400 -> 450
    out["block_bytes"] = {0: 680e6, 1: 283e6}
    md = tl.markdown(out)
    assert "| 283 MB | 1 | 0.0 | 0.0 |" in md and "| 680 MB | 1 | 0.0 |" in md  # (ns-scale trace: 0.0 ms)
    assert "| host ms | lead ms |" in md
    assert "longest stalls: block 0 0.00 ms; block 1 0.00 ms" in md
    assert tl.summarize_events(_trace(True))["backward_blocks"] == []  # no marks: no table


def test_speed_profile_marks_each_recompute_on_the_host():
    from torch.profiler import profile

    sp = bench_module("speed_profile")
    seen = []

    class Conductor:
        def enter(self, phase, i):
            seen.append((phase, i))

    c = Conductor()
    sp._mark_recomputes(c)
    with profile() as prof:
        c.enter("F", 0)
        c.enter("B", 3)
    assert seen == [("F", 0), ("B", 3)]  # the conductor's own enter still runs, for both phases
    names = [e.name for e in prof.events()]
    assert f"{tl.BLOCK}3" in names and f"{tl.BLOCK}0" not in names


def test_idle_neighbours_names_what_the_device_waited_between():
    evs = [_ev("kernel", 0, 100, 7, name="a"), _ev("memset", 300, 310, 7, name="m"),  # a -> m: under the copy
           _ev("h2d", 50, 400, 13, name="copy"),
           _ev("kernel", 900, 1000, 7, name="b"), _ev("kernel", 1600, 1700, 7, name="b")]
    got = tl.idle_neighbours(evs, min_ns=300)  # idle: copy -> b (500 ns), b -> b (600 ns)
    assert got == [{"before": "b", "after": "b", "gaps": 1, "ms": pytest.approx(600e-6)},
                   {"before": "copy", "after": "b", "gaps": 1, "ms": pytest.approx(500e-6)}]
    assert tl.idle_neighbours(evs, min_ns=550) == [got[0]]
