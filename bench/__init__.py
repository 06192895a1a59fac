"""The GPU benchmarks and diagnostics, one package run from the repository root (`python -m bench.<group>.<name>`),
grouped by what they measure:

    bench/speed/      a training or sampling step's time and memory against plain diffusers + peft (bench_speed),
                      the offload conductor's rows (bench_offload), the planner against measured steps (bench_plan),
                      the fp8 / int8 base (bench_quant), edit pairs (bench_kontext, bench_flux2_pairs), the full
                      fine-tune (bench_fullft), the garbage collector (bench_gc), attention with masks
                      (attn_mask_speed), the streamed step's bound and profile (ring_bound, speed_profile)
    bench/program/    the whole program as a user runs it on full-size random-weight folders (bench_program, its
                      video clips: program_video), `dittrain caption` (bench_caption), `dittrain cache` over 10 and
                      100 video clips (bench_video_cache)
    bench/multi_gpu/  several GPUs of one host: ddp (bench_ddp), fsdp (bench_fsdp), the sharded stream and owned
                      steps (bench_sharded)
    bench/diag/       one-question diagnostics: where a planner gap, an activation peak, a step's time, text
                      caching's RSS, a VAE's peak come from; what fills the GPU at an out-of-memory
                      (diag_oom_snapshot); what fp8 does to a block and to a loss curve
    bench/common/     timing (CUDA-event step times, bf16 model builds) and timeline (a profiled step's device
                      timeline), shared by the others

Their results: bench/RESULTS.md (the current figures) and bench/history/ (the notebooks, by day).
"""

from __future__ import annotations

import importlib

#: group of every bench module, by module name (`module("bench_speed")`)
GROUPS = {
    "speed": ("bench_speed", "bench_offload", "bench_plan", "bench_quant", "bench_kontext", "bench_flux2_pairs",
              "bench_fullft", "bench_gc", "attn_mask_speed", "ring_bound", "speed_profile"),
    "program": ("bench_program", "program_video", "bench_caption", "bench_video_cache"),
    "multi_gpu": ("bench_ddp", "bench_fsdp", "bench_sharded"),
    "diag": ("diag_act_peak", "diag_oom_snapshot", "diag_planner_gap", "diag_step_cpu", "diag_step_time",
             "diag_text_rss", "diag_vae_peak", "quant_block_error", "quant_loss_curve"),
    "common": ("timing", "timeline"),
}


def module(name: str):
    """The bench module `name` (e.g. "bench_speed"), imported from its group."""
    for group, names in GROUPS.items():
        if name in names:
            return importlib.import_module(f"bench.{group}.{name}")
    raise KeyError(f"no bench module {name!r}: {sorted(n for ns in GROUPS.values() for n in ns)}")
