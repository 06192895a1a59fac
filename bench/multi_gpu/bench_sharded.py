#!/usr/bin/env python3
"""The sharded stream (trainer/offload/gather.py) against whole copies per GPU, at 1, 2 and 4 GPUs of one host.

Full-size Flux.1-dev (11.9 B, random bf16 weights built on each GPU, seed 0) LoRA rank 16, 1024x1024, batch 1 per
GPU, every block streamed (--fraction 1.0) with activations offloaded, eager (or --compile), the streamed frozen blocks in one
/dev/shm arena shared by the host's processes (as the trainer does with several processes). For each world size a
fresh set of processes (spawn, NCCL):

- world 1: the reference a user would run instead, plain diffusers + peft (bf16 LoRA, diffusers' gradient
  checkpointing, torch AdamW, resident), eager and with `compile_repeated_blocks` (`--no-plain` leaves them out);
  then the same model under our conductor resident (fraction 0, every block recomputed) and then streamed;
- world N > 1: one conductor, two ways to fill its ring, switched between measurements at a step boundary on every
  process (the arena holds whole blocks either way): "whole copies" (each GPU copies every block over PCIe, what
  ddp did before) and "sharded stream" (each GPU copies 1/N of every block, NCCL all-gathers the rest);
- with --keep, one more row on the same handle: every streamed block keeps its activations on the GPU instead of
  being recomputed (the conductor resolves its saved weight views where the block is loaded for backward), sharded
  at N > 1;
- the host's links in the same processes: pinned host-to-device GB/s per GPU with all N copying at once, and the
  all-gather bus bandwidth of the gather group (256 MiB a rank).

Per row: median step, samples/s over the timed steps (world x steps / wall seconds), the first timed step's loss
(the same on every process and in both modes when the gathered rings hold the same bytes), peak reserved VRAM, and
per process its anonymous RSS with the node's shared memory (/dev/shm arena). Gradients are averaged with the
trainer's BucketedAllReduce. Writes sharded.json and sharded.md under --out.

With --full: a full fine-tune instead (every weight trains, the fused back pass, `--optimizer` with stochastic
rounding as `dittrain fit` builds it), each row on a fresh model: "whole copies" (each process streams the whole
model from its own arena with the optimizer state packed beside the weights, gradients all-reduced: the trainer's
ddp path) and "owned steps" (trainer/train/owners.py: the sharded stream from the host's one arena, each process
stepping 1/N of the weights and keeping their state in pinned RAM).

    python -m bench.multi_gpu.bench_sharded --gpus 4 --out $OUT/sharded
    python -m bench.multi_gpu.bench_sharded --gpus 4 --compile --ring 3 --keep --out $OUT/sharded-keep
    python -m bench.multi_gpu.bench_sharded --full --gpus 4 --worlds 1,4 --out $OUT/sharded-full
    python -m bench.multi_gpu.bench_sharded --gpus 2 --layers 1 --singles 2 --res 64 --text 16 --steps 2 --warmup 1   # smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.multi_gpu.bench_ddp import _join, _port, _sync
from bench.speed.bench_offload import LORA_TARGETS, add_flux_args, add_lora, block_list, build, inputs
from trainer.offload import attach_offload
from trainer.offload.allocators import SharedArena
from trainer.offload.gather import SliceGather
from trainer.train.distributed import BucketedAllReduce


def _barrier(world, dev) -> None:
    import torch.distributed as tdist

    if world > 1:
        tdist.barrier(device_ids=[dev.index]) if dev.type == "cuda" else tdist.barrier()


def _memory() -> dict:
    """This process's anonymous RSS and the node's shared memory (the /dev/shm arena), GB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            out["rss_anon_gb"] = int(line.split()[1]) * 1024 / 1e9
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            out["node_shmem_gb"] = int(line.split()[1]) * 1024 / 1e9
    return out


def _measure(step, dev, world, args) -> dict:
    for _ in range(args.warmup):
        step()
    _sync(dev)
    _barrier(world, dev)
    t0 = time.perf_counter()
    per, first = [], None
    for k in range(args.steps):
        s0 = time.perf_counter()
        loss = step()
        _sync(dev)
        per.append(time.perf_counter() - s0)
        if k == 0:
            first = float(loss)
    _barrier(world, dev)
    total = time.perf_counter() - t0
    return {"seconds": total, "step_s_median": statistics.median(per), "steps_s": per,
            "samples_per_s": world * args.steps / total, "first_loss": first}


def _links(dev, world, group, args) -> dict:
    """Pinned host-to-device GB/s of this GPU while every GPU copies; all-gather bus GB/s of the group."""
    import torch.distributed as tdist

    out = {}
    if dev.type != "cuda":
        return out
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(n, dtype=torch.uint8, device=dev)
    ts = []
    for _ in range(4):
        _barrier(world, dev)
        t0 = time.perf_counter()
        gpu.copy_(host, non_blocking=True)
        _sync(dev)
        ts.append(time.perf_counter() - t0)
    out["h2d_gbps_each"] = n / statistics.median(ts[1:]) / 1e9
    del host, gpu
    if world > 1:
        k = 256 << 20
        buf = torch.empty(k * world, dtype=torch.uint8, device=dev)
        ts = []
        for _ in range(5):
            _barrier(world, dev)
            t0 = time.perf_counter()
            tdist.all_gather_into_tensor(buf, buf[dev.index * k:(dev.index + 1) * k], group=group)
            _sync(dev)
            ts.append(time.perf_counter() - t0)
        out["allgather_bus_gbps"] = k * (world - 1) / statistics.median(ts[1:]) / 1e9
        del buf
    return out


def _full_rows(rank, world, args, dev, gather, arena, row) -> list[dict]:
    """--full: the rows of one world size, each on a fresh model (module docstring)."""
    import gc

    from trainer.config import OptimizerConfig
    from trainer.offload import bind_fused
    from trainer.offload.allocators import pinned_exact
    from trainer.optim import FusedBackPass, StateOffload, build_optimizer
    from trainer.train.distributed import FusedAllReduce
    from trainer.train.owners import OwnedSteps

    opt_cfg = OptimizerConfig(name=args.optimizer, lr=1e-5, fused_back_pass=True, max_grad_norm=None,
                              stochastic_rounding=True)
    kw, target = inputs(dev, args.res, text=args.text)
    rows = []
    for mode in (args.full_modes.split(",") if world > 1 else ["whole"]):
        model = build(args, dev)
        model.requires_grad_(True)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        fused = FusedBackPass(build_optimizer(params, opt_cfg, seed=0))
        blocks = block_list(model)
        common = dict(mode="train", activations=args.activations and dev.type == "cuda", trainable=True,
                      compile=args.compile, min_ring_blocks=args.ring)
        if mode == "whole":
            if world > 1:
                fused.add_step_hooks(pre=FusedAllReduce(world).pre)
            h = attach_offload(blocks, dev, args.fraction, optimizer_state=fused.state_layout, **common)
            bind_fused(h, fused)
        else:
            owners = OwnedSteps(params, rank, world)
            owners.attach(fused)
            h = attach_offload(blocks, dev, args.fraction, share=arena(mode), gather=gather, **common)
            off = StateOffload(owners.owned([p for i in h.plan.streamed for p in blocks[i].parameters()]),
                               alloc=pinned_exact if args.exact_pins else None)
            fused.add_step_hooks(pre=off.pre, post=off.post, synchronize=off.synchronize)

        def step(model=model, fused=fused):
            loss = F.mse_loss(model(**kw)[0].float(), target)
            loss.backward()
            fused.finish_step()
            return loss.detach()

        name = {"whole": "whole copies", "owned": "owned steps + sharded stream"}[mode]
        rows.append(row(f"{world} GPU{'s' if world > 1 else ''}, full {args.optimizer}, {name}", h, step))
        h.close(keep_weights=False)
        fused.remove()
        del model, params, fused, h
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _plain_row(args, dev, compile_blocks: bool, row) -> dict:
    """One reference row: plain diffusers + peft, bf16 LoRA (peft's own dtype), diffusers' gradient checkpointing,
    torch AdamW, resident; `compile_blocks`: diffusers' `compile_repeated_blocks()`. The model goes with this frame."""
    from peft import LoraConfig

    model = build(args, dev)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=LORA_TARGETS,
                                 init_lora_weights="gaussian"))
    params = [p for p in model.parameters() if p.requires_grad]
    model.enable_gradient_checkpointing()
    if compile_blocks:
        model.compile_repeated_blocks(fullgraph=False)
    model.train()
    kw, target = inputs(dev, args.res, text=args.text)
    opt = torch.optim.AdamW(params, lr=1e-5)

    def step():
        loss = F.mse_loss(model(**kw)[0].float(), target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    name = "plain diffusers + peft, resident" + (", compile_repeated_blocks" if compile_blocks else ", eager")
    return row(name, None, step)


def _worker(rank: int, world: int, args, port: int, out: str) -> None:
    import torch.distributed as tdist

    dev = _join(rank, world, port)
    cuda = dev.type == "cuda"
    group = gather = share = None
    if world > 1:
        group = tdist.new_group(list(range(world)))
        gather = SliceGather(group, rank, world)
        share = SharedArena(Path("/dev/shm") / f"dittrain-bench-{port}", owner=rank == 0,
                            barrier=lambda: _barrier(world, dev))

    def arena(tag: str):
        if world == 1:
            return None
        return SharedArena(Path("/dev/shm") / f"dittrain-bench-{port}-{tag}", owner=rank == 0,
                           barrier=lambda: _barrier(world, dev))

    def reset_peak():
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)

    def row(name, handle, step) -> dict:
        reset_peak()
        r = {"name": name, "world": world, "rank": rank, **_measure(step, dev, world, args)}
        st = handle.stats() if handle is not None else {"h2d_bytes_per_step": 0, "offloaded_bytes": 0}
        r.update(peak_reserved_gb=torch.cuda.max_memory_reserved(dev) / 1e9 if cuda else None,
                 h2d_gbps_loads=st.get("h2d_gbps"), h2d_bytes_per_step=st["h2d_bytes_per_step"],
                 offloaded_gb=st["offloaded_bytes"] / 1e9, **_memory())
        return r

    plain = []
    if world == 1 and args.plain and not args.full:
        import gc

        for compile_blocks in (False, True):
            plain.append(_plain_row(args, dev, compile_blocks, row))
            gc.collect()
            torch._dynamo.reset()  # the compiled block graphs hold the model
            gc.collect()
            reset_peak()

    if args.full:
        rows = _full_rows(rank, world, args, dev, gather, arena, row)
        rows = [{**r, **_links(dev, world, group, args)} for r in rows] if rows else rows
        Path(out, f"world{world}-rank{rank}.json").write_text(json.dumps(rows))
        print(json.dumps([{k: v for k, v in r.items() if k != "steps_s"} for r in rows]), flush=True)
        if world > 1:
            tdist.destroy_process_group()
        return
    model = build(args, dev)
    torch.manual_seed(1)
    params = add_lora(model, args.rank)
    model.train()
    kw, target = inputs(dev, args.res, text=args.text)
    opt = torch.optim.AdamW(params, lr=1e-5)
    reducer = BucketedAllReduce(params, world, 1) if world > 1 else None

    def step():
        loss = F.mse_loss(model(**kw)[0].float(), target)
        loss.backward()
        if reducer is not None:
            reducer.finish()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    rows = plain
    if world == 1 and args.resident:
        h = attach_offload(block_list(model), dev, 0.0, mode="train", checkpointing=True, compile=args.compile)
        rows.append(row("1 GPU resident (every block recomputed)", h, step))
        h.close()
        h = attach_offload(block_list(model), dev, 0.0, mode="train", checkpointing=False, compile=args.compile)
        try:  # the bound of a step that recomputes nothing (activations kept on the GPU)
            rows.append(row("1 GPU resident (nothing recomputed)", h, step))
        except torch.cuda.OutOfMemoryError:
            print("1 GPU resident (nothing recomputed): out of memory, row left out", flush=True)
            opt.zero_grad(set_to_none=True)
        h.close()
    h = attach_offload(block_list(model), dev, args.fraction, mode="train", activations=args.activations and cuda,
                       share=share, gather=gather, compile=args.compile, min_ring_blocks=args.ring)
    c = h._c
    if world == 1:
        rows.append(row("1 GPU streamed", h, step))
    else:
        for name, g in (("whole copies", None), ("sharded stream", gather)):
            _sync(dev)
            _barrier(world, dev)
            c.gather = g  # every process switches at the same step boundary
            rows.append(row(f"{world} GPUs, {name}", h, step))
    if args.keep:  # the same ring and stream, every block keeping its activations (conductor `saved_weights`)
        _sync(dev)
        _barrier(world, dev)
        c.checkpointed = [False] * len(c.checkpointed)
        name = "1 GPU streamed" if world == 1 else f"{world} GPUs, sharded stream"
        try:
            rows.append(row(f"{name}, nothing recomputed", h, step))
        except torch.cuda.OutOfMemoryError:
            print(f"{name}, nothing recomputed: out of memory, row left out", flush=True)
            opt.zero_grad(set_to_none=True)
    links = _links(dev, world, group, args)
    for r in rows:
        r.update(links)
    Path(out, f"world{world}-rank{rank}.json").write_text(json.dumps(rows))
    print(json.dumps([{k: v for k, v in r.items() if k != "steps_s"} for r in rows]), flush=True)
    h.close(keep_weights=False)
    if world > 1:
        tdist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_flux_args(ap)
    ap.add_argument("--fraction", type=float, default=1.0)
    ap.add_argument("--no-activations", dest="activations", action="store_false")
    ap.add_argument("--no-resident", dest="resident", action="store_false")
    ap.add_argument("--no-plain", dest="plain", action="store_false",
                    help="world 1 without the plain diffusers + peft rows (eager and compile_repeated_blocks)")
    ap.add_argument("--compile", action="store_true", help="each block class compiled (the trainer's train.compile)")
    ap.add_argument("--ring", type=int, default=2, help="min_ring_blocks of the streamed runs")
    ap.add_argument("--keep", action="store_true",
                    help="also a row where the streamed blocks keep their activations (nothing recomputed)")
    ap.add_argument("--full", action="store_true", help="a full fine-tune: whole copies against owned steps")
    ap.add_argument("--optimizer", default="adafactor", help="--full: adamw, adamw8bit or adafactor")
    ap.add_argument("--full-modes", default="whole,owned", help="--full with several GPUs: rows to run")
    ap.add_argument("--rounded-pins", dest="exact_pins", action="store_false",
                    help="--full owned rows: the owned state in torch's pinned allocator (rounded up), not pinned_exact")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--worlds", default=None, help="comma-separated world sizes (default: 1, 2, ..., --gpus)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=Path("bench_out/sharded"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if torch.cuda.is_available() and torch.cuda.device_count() < args.gpus:
        sys.exit(f"needs {args.gpus} GPUs, found {torch.cuda.device_count()}")
    worlds = [int(w) for w in args.worlds.split(",")] if args.worlds else sorted({1, 2, args.gpus})

    import torch.multiprocessing as mp

    for world in worlds:
        t0 = time.perf_counter()
        mp.start_processes(_worker, args=(world, args, _port(), str(args.out)), nprocs=world, start_method="spawn")
        print(f"world {world}: {time.perf_counter() - t0:.0f} s", flush=True)

    def ranks(world):
        return [json.loads((args.out / f"world{world}-rank{r}.json").read_text()) for r in range(world)]

    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (gloo smoke)",
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
        "worlds": {w: ranks(w) for w in worlds},
    }
    (args.out / "sharded.json").write_text(json.dumps(result, indent=1))
    one = next((r for r in result["worlds"].get(1, [[]])[0] if r["name"].startswith("1 GPU") and "resident"
                not in r["name"]), None)
    lines = [
        f"Flux.1-dev {'full fine-tune' if args.full else f'LoRA r{args.rank}'}, {args.res} px, batch 1 a GPU, fraction {args.fraction}, activations "
        f"{'offloaded' if args.activations else 'kept'}, {'compiled' if args.compile else 'eager'}, ring "
        f"{args.ring} blocks, {args.layers}+{args.singles} blocks, {result['device']}, "
        f"torch {result['torch']}, {result['date']}",
        "",
        "| run | median step s | samples/s | x 1 streaming GPU | first loss (ranks) | peak reserved GB | PCIe GB/s in "
        "loads | RSS anon GB / proc | node shmem GB | H2D GB/s each (all copying) | all-gather bus GB/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for w in worlds:
        per_rank = result["worlds"][w]
        for i, r in enumerate(per_rank[0]):
            losses = sorted({f"{pr[i]['first_loss']:.6f}" for pr in per_rank})
            gb = lambda x: "" if x is None else f"{x:.2f}"  # noqa: E731
            lines.append(
                f"| {r['name']} | {r['step_s_median']:.3f} | {r['samples_per_s']:.3f} | "
                f"{r['samples_per_s'] / one['samples_per_s'] if one else float('nan'):.2f} | {' / '.join(losses)} | "
                f"{gb(max(pr[i]['peak_reserved_gb'] or 0 for pr in per_rank))} | {gb(r.get('h2d_gbps_loads'))} | "
                f"{gb(max(pr[i].get('rss_anon_gb', 0) for pr in per_rank))} | {gb(r.get('node_shmem_gb'))} | "
                f"{gb(r.get('h2d_gbps_each'))} | {gb(r.get('allgather_bus_gbps'))} |")
    (args.out / "sharded.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
