#!/usr/bin/env python3
"""Data-parallel throughput: 2 GPUs vs 1 GPU, full-size Flux (11.9 B params, random bf16 weights built on each GPU)
LoRA rank 16 at 1024x1024, batch 1 per GPU, half of the block bytes streamed from CPU RAM (offload fraction 0.5).
Issue 8's target: 2-GPU samples/s >= 1.8 x 1-GPU samples/s. Writes ddp.json and ddp.md under --out.

    python -m bench.multi_gpu.bench_ddp --out /tmp/bench-ddp                       # needs 2 GPUs and ~2 x 12 GB pinned RAM
    python -m bench.multi_gpu.bench_ddp --layers 2 --singles 4 --out /tmp/smoke    # a quick smoke run
    python -m bench.multi_gpu.bench_ddp --layers 1 --singles 1 --res 64 --text 16 --steps 2 --warmup 1   # CPU/gloo smoke

What runs. For each world size (1, then 2) a fresh set of processes (torch.multiprocessing spawn; NCCL, one GPU
each) builds the model on its GPU, adds the LoRA, attaches the offload conductor (checkpointed blocks, fraction
--fraction) and trains with the trainer's own gradient averaging (trainer/train/distributed.py
BucketedAllReduce): forward, loss, backward (buckets all-reduced as their gradients complete), `finish()`,
global-norm clipping, AdamW step. With 2 processes it runs twice: buckets launched from the gradient hooks
(overlapped with backward, what the trainer does) and all buckets launched after backward (no overlap), to show
what the overlap buys. Timing: wall clock over --steps steps after --warmup, between a device synchronise and a
barrier on both ends; samples/s = world x batch x steps / seconds. Also the time of one all-reduce of all LoRA
gradients alone, and each process's peak reserved VRAM and pinned bytes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.speed.bench_offload import add_flux_args, add_lora, block_list, build, inputs
from trainer.offload import attach_offload
from trainer.train.distributed import BucketedAllReduce


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _measure(step, dev, world, args) -> dict:
    import torch.distributed as tdist

    for _ in range(args.warmup):
        step()
    _sync(dev)
    if world > 1:
        tdist.barrier()
    t0 = time.perf_counter()
    per = []
    for _ in range(args.steps):
        s0 = time.perf_counter()
        step()
        _sync(dev)  # per-step times only; the total is what counts
        per.append(time.perf_counter() - s0)
    if world > 1:
        tdist.barrier()
    total = time.perf_counter() - t0
    return {
        "seconds": total,
        "step_s_median": statistics.median(per),
        "steps_s": per,
        "samples_per_s": world * args.batch * args.steps / total,
    }


def _join(rank: int, world: int, port: int) -> torch.device:
    """This process's device (GPU `rank`, or the CPU), and with several processes the job's group (NCCL / gloo)."""
    import torch.distributed as tdist

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
        torch.backends.cuda.enable_cudnn_sdp(False)  # fails in backward for some shapes (GPU.md)
    if world > 1:
        tdist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                 world_size=world, timeout=datetime.timedelta(minutes=10),
                                 device_id=dev if cuda else None)
    return dev


def _worker(rank: int, world: int, args, port: int, out: str) -> None:
    import torch.distributed as tdist

    dev = _join(rank, world, port)
    cuda = dev.type == "cuda"
    model = build(args, dev)
    params = add_lora(model, args.rank)
    model.train()
    handle = attach_offload(block_list(model), dev, args.fraction, mode="train")
    kw, target = inputs(dev, args.res, text=args.text)
    if args.batch > 1:
        batched = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance")
        kw = {
            k: (v.expand(args.batch, *v.shape[1:]).contiguous() if k in batched else v) for k, v in kw.items()
        }
        target = target.expand(args.batch, *target.shape[1:]).contiguous()
    opt = torch.optim.AdamW(params, lr=1e-5)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)

    def run(reducer):
        def step():
            out = model(**kw)[0]
            F.mse_loss(out.float(), target).backward()
            if reducer is not None:
                reducer.finish()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return _measure(step, dev, world, args)

    rows = []
    lora = sum(p.numel() for p in params)
    if world == 1:
        rows.append({"name": "1 process", **run(None)})
    else:
        red = BucketedAllReduce(params, world, 1)
        rows.append(
            {
                "name": f"{world} processes, buckets overlapped with backward",
                "buckets": len(red.buckets),
                **run(red),
            }
        )
        red.remove()
        red = BucketedAllReduce(params, world, 1)
        red.remove()  # no hooks: finish() launches every bucket after backward
        rows.append({"name": f"{world} processes, all-reduce after backward", **run(red)})
        flat = torch.zeros(lora, dtype=torch.float32, device=dev)
        ts = []
        for _ in range(5):
            _sync(dev)
            t0 = time.perf_counter()
            tdist.all_reduce(flat)
            _sync(dev)
            ts.append(time.perf_counter() - t0)
        rows[0]["allreduce_lora_s"] = statistics.median(ts[1:])
    st = handle.stats()
    for r in rows:
        r.update(
            world=world,
            rank=rank,
            lora_params=lora,
            pinned_bytes=st["pinned_bytes"],
            offloaded_bytes=st["offloaded_bytes"],
            peak_reserved_gb=torch.cuda.max_memory_reserved(dev) / 1e9 if cuda else None,
        )
    Path(out, f"world{world}-rank{rank}.json").write_text(json.dumps(rows))
    print(json.dumps([{k: v for k, v in r.items() if k != "steps_s"} for r in rows]), flush=True)
    handle.close()
    if world > 1:
        tdist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_flux_args(ap)
    ap.add_argument("--batch", type=int, default=1, help="per process")
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=Path("bench_out/ddp"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if torch.cuda.is_available() and torch.cuda.device_count() < args.gpus:
        sys.exit(f"needs {args.gpus} GPUs, found {torch.cuda.device_count()}")

    import torch.multiprocessing as mp

    for world in (1, args.gpus):
        mp.start_processes(
            _worker, args=(world, args, _port(), str(args.out)), nprocs=world, start_method="spawn"
        )

    def rows(world):
        return json.loads((args.out / f"world{world}-rank0.json").read_text())

    one, many = rows(1)[0], rows(args.gpus)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (gloo smoke)",
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": [one, *many],
        "scaling": {r["name"]: r["samples_per_s"] / one["samples_per_s"] for r in many},
        "target": 0.9 * args.gpus,
    }
    (args.out / "ddp.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"Flux LoRA rank {args.rank}, {args.res}x{args.res}, batch {args.batch} per process, offload fraction "
        f"{args.fraction}, {args.layers}+{args.singles} blocks, {result['device']}, torch {result['torch']}, "
        f"{result['date']}",
        "",
        "| configuration | samples/s | x 1 GPU | median step s | peak reserved GB | all-reduce of LoRA grads s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        gb = "" if r["peak_reserved_gb"] is None else f"{r['peak_reserved_gb']:.1f}"
        ar = f"{r['allreduce_lora_s']:.4f}" if "allreduce_lora_s" in r else ""
        lines.append(
            f"| {r['name']} | {r['samples_per_s']:.3f} | {r['samples_per_s'] / one['samples_per_s']:.2f} | "
            f"{r['step_s_median']:.3f} | {gb} | {ar} |"
        )
    lines.append("")
    lines.append(f"target: >= {result['target']:.1f} x 1 GPU (issue 8)")
    (args.out / "ddp.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
