#!/usr/bin/env python3
"""train.distributed: fsdp against ddp and one GPU, through `dittrain fit` under torchrun, on a full-size
random-weight Flux.1-dev folder (bench_program.py writes it). Issue 31's measurements.

    python -m bench.multi_gpu.bench_fsdp --work /dev/shm/fsdp --out $OUT                     # 2+ GPUs
    python -m bench.multi_gpu.bench_fsdp --work /dev/shm/fsdp --out $OUT --runs lora-fsdp-2-f1 lora-ddp-2-f1
    python -m bench.multi_gpu.bench_fsdp --work /dev/shm/fsdp --out $OUT --runs lora-fsdp-2-f1 lora-fsdp-2-f1-act  # act. offload

Each run is `torchrun --standalone --nproc_per_node N -m trainer fit cfg.yaml` (N = 1: plain `python -m trainer
fit`) of configs/flux/lora-24gb.yaml (or the full fine-tune preset) with --set overrides: 1024 px, batch 1 per
GPU, eager (train.compile: false, the same for every row: FSDP2 + compile is not measured here), every block
checkpointed, no sampling, `--steps` steps. Reported per run: the median step time of steps 2.. (rank 0's
metrics.jsonl), samples/s = N / step, peak reserved VRAM per rank (DITTRAIN_PHASE_LOG records carry the rank),
peak anonymous RSS: per rank (max) and for the node (sum over the torchrun's processes, polled every 0.2 s),
and the host-to-device copy bandwidth of one pinned 1 GiB buffer per GPU, all GPUs at once (the PCIe floor of a
streamed step is the bytes it copies divided by that). Writes fsdp.json and fsdp.md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: name -> (method, processes, distributed, offload fraction, offload.activations); "-act": activations offloaded
RUNS = {
    "lora-1-f0": ("lora", 1, "ddp", 0.0, False),
    "lora-ddp-2-f0": ("lora", 2, "ddp", 0.0, False),
    "lora-fsdp-2-f0": ("lora", 2, "fsdp", 0.0, False),
    "lora-1-f1": ("lora", 1, "ddp", 1.0, False),
    "lora-ddp-2-f1": ("lora", 2, "ddp", 1.0, False),
    "lora-fsdp-2-f1": ("lora", 2, "fsdp", 1.0, False),
    "full-fsdp-2-f0": ("full", 2, "fsdp", 0.0, False),
    "full-ddp-2-f1": ("full", 2, "ddp", 1.0, False),
    "full-fsdp-2-f1": ("full", 2, "fsdp", 1.0, False),
    "lora-fsdp-2-f0-act": ("lora", 2, "fsdp", 0.0, True),
    "lora-fsdp-2-f1-act": ("lora", 2, "fsdp", 1.0, True),
    "lora-ddp-2-f1-act": ("lora", 2, "ddp", 1.0, True),
    "full-fsdp-2-f1-act": ("full", 2, "fsdp", 1.0, True),
    "full-fsdp-2-f1-fused": ("full", 2, "fsdp", 1.0, False),  # each shard steps in backward (fused back pass)
}


class TreePoller:
    """RssAnon of a process and all its descendants, every `every` s: per-process and summed peaks."""

    def __init__(self, pid: int, every: float = 0.2):
        self.pid, self.every = pid, every
        self.node_peak, self.rank_peak = 0, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(d.name))
        out, todo = [], [self.pid]
        while todo:
            p = todo.pop()
            out.append(p)
            todo += children.get(p, [])
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            per = []
            for p in self._tree():
                try:
                    for line in Path(f"/proc/{p}/status").read_text().splitlines():
                        if line.startswith("RssAnon:"):
                            per.append(int(line.split()[1]) * 1024)
                except OSError:
                    pass
            if per:
                self.node_peak = max(self.node_peak, sum(per))
                self.rank_peak = max(self.rank_peak, max(per))
            time.sleep(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def h2d_gbps(gpus: int) -> list[float]:
    """Pinned 1 GiB host-to-device copy, on every GPU at once (one thread each), GB/s per GPU."""
    import torch

    n = 2**30
    bufs = [(torch.empty(n, dtype=torch.uint8).pin_memory(), torch.empty(n, dtype=torch.uint8, device=f"cuda:{g}"))
            for g in range(gpus)]
    out = [0.0] * gpus

    def copy(g: int) -> None:
        host, dev = bufs[g]
        with torch.cuda.device(g):
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(4):
                dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            out[g] = 4 * n / (time.perf_counter() - t) / 1e9

    threads = [threading.Thread(target=copy, args=(g,)) for g in range(gpus)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def run_one(name: str, model: Path, images: Path, work: Path, steps: int, smoke: bool = False) -> dict:
    from bench.program.bench_program import write_config

    method, nproc, mode, f, act = RUNS[name]
    run_dir = work / name
    sets = [f"train.distributed={mode}", f"offload.transformer={f}", "train.compile=false",
            "train.gradient_checkpointing=true", f"offload.activations={str(act).lower()}", "train.batch_size=1",
            "train.grad_accum=1", "sample.every=0", f"train.method={method}", "model.quantize=none"]
    if method == "full":
        fused = (mode == "ddp" and f > 0) or name.endswith("-fused")
        sets += [f"optimizer.fused_back_pass={str(fused).lower()}", "optimizer.max_grad_norm=null",
                 "optimizer.name=adamw", "train.ema=null"]
    sets.append(f"data.cache_dir={work / 'cache'}")  # one cache for every run: the first fills it
    if smoke:
        sets += ["train.device=cpu", "data.resolutions=[64]"]
    cfg = write_config("flux", model, images, run_dir, 64 if smoke else 1024, steps, False, 24, None, sets)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               DITTRAIN_PHASE_LOG=str(run_dir / "phases.jsonl"), OMP_NUM_THREADS="8")
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
           if nproc > 1 else [sys.executable]) + ["-m", "trainer", "fit", str(cfg)]
    t0 = time.time()
    with open(run_dir / "fit.log", "w") as log:
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        poll = TreePoller(p.pid)
        rc = p.wait()
    poll.stop()
    row = {"run": name, "method": method, "processes": nproc, "distributed": mode, "fraction": f,
           "activations": act, "rc": rc,
           "wall_s": time.time() - t0, "node_anon_peak": poll.node_peak, "rank_anon_peak": poll.rank_peak}
    metrics = run_dir / "out" / "metrics.jsonl"
    if metrics.exists():
        times = [json.loads(line)["step_time"] for line in metrics.read_text().splitlines()]
        row["step_s"] = statistics.median(times[1:]) if len(times) > 1 else None
        row["step_times"] = times
    vram: dict[int, int] = {}
    for line in (run_dir / "phases.jsonl").read_text().splitlines() if (run_dir / "phases.jsonl").exists() else []:
        r = json.loads(line)
        vram[r.get("rank", 0)] = max(vram.get(r.get("rank", 0), 0), r["vram_reserved"])
    row["vram_per_rank"] = [vram[k] for k in sorted(vram)]
    row["log_tail"] = (run_dir / "fit.log").read_text().strip().splitlines()[-3:]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/dev/shm/dittrain-fsdp"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", nargs="*", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="the tiny Flux on the CPU (gloo): the commands run")
    args = ap.parse_args()
    import torch

    from bench.program.bench_program import write_full_folder, write_jpegs

    args.out.mkdir(parents=True, exist_ok=True)
    model = args.work / "model"
    if args.smoke:
        from trainer.models.tiny import make_tiny_models

        make_tiny_models(args.work / "tiny", ["flux"])
        model = args.work / "tiny" / "flux"
    elif not (model / "model_index.json").exists():
        t = time.time()
        nbytes = write_full_folder("flux", model, None)
        print(f"wrote {nbytes / 1e9:.1f} GB in {time.time() - t:.0f} s", flush=True)
    images = write_jpegs(args.work / "images", 3, 64 if args.smoke else 1024)
    gbps = h2d_gbps(torch.cuda.device_count()) if torch.cuda.is_available() else []
    print(f"h2d GB/s per GPU, all at once: {gbps}", flush=True)
    rows = []
    for name in args.runs:
        row = run_one(name, model, images, args.work, args.steps, args.smoke)
        shutil.copy(args.work / name / "fit.log", args.out / f"{name}.log")
        print(json.dumps({k: v for k, v in row.items() if k != "step_times"}), flush=True)
        rows.append(row)
        (args.out / "fsdp.json").write_text(json.dumps({"h2d_gbps": gbps, "rows": rows}, indent=1))
    lines = [f"h2d GB/s per GPU (all at once): {', '.join(f'{g:.1f}' for g in gbps)}", "",
             "| run | rc | step s (median 2..) | samples/s | peak reserved VRAM GB per rank | peak anon RSS GB: max rank / node |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        s = r.get("step_s")
        lines.append(f"| {r['run']} | {r['rc']} | {s:.3f} | {r['processes'] / s:.3f} | "
                     if s else f"| {r['run']} | {r['rc']} | - | - | ")
        lines[-1] += (f"{' / '.join(f'{v / 1e9:.1f}' for v in r['vram_per_rank'])} | "
                      f"{r['rank_anon_peak'] / 1e9:.1f} / {r['node_anon_peak'] / 1e9:.1f} |")
    (args.out / "fsdp.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
