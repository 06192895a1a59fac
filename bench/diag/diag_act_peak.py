#!/usr/bin/env python3
# ruff: noqa: B023 - each closure runs inside the loop iteration that defines it
"""Where the peak of a streamed LoRA step sits, with and without activation offloading (issue 7's remaining gap:
the planner is ~1 GB low at f=1.0 + activation offloading). Full-size Flux LoRA r16, 1024 px, random bf16
weights. At every block entry of one step (forward and backward) it records the allocator's allocated bytes and
the peak since the previous entry, then prints the planner's per-block model beside it.

    python -m bench.diag.diag_act_peak --out /tmp/diag_act
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.speed.bench_offload import inputs
from bench.speed.bench_plan import attach, blocks_of, build, detach, lora_cfg
from trainer import planner

GB = 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("diag_act"))
    ap.add_argument("--res", type=int, default=1024)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.enable_cudnn_sdp(False)
    facts = planner.analyze(lora_cfg([args.res]))
    tr = facts.trace(args.res)
    model, params = build("cuda")
    for b in blocks_of(model):
        b.to("cpu")
    torch.cuda.empty_cache()
    report = {"trace": dict(block_inputs=tr.block_inputs, block_saved=tr.block_saved,
                            block_largest=tr.block_largest, outside_saved=tr.outside_saved,
                            checkpoint_inputs=tr.checkpoint_inputs)}
    for f, act in ((1.0, False), (1.0, True)):
        h = attach(blocks_of(model), "cuda", f, act)
        kw, target = inputs("cuda", args.res)
        opt = torch.optim.AdamW(params, lr=1e-5)
        c = h._c
        log = []
        real_enter = c.enter

        def enter(phase, i):
            log.append((phase, i, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()))
            torch.cuda.reset_peak_memory_stats()
            return real_enter(phase, i)

        def step(record):
            c.enter = enter if record else real_enter
            o = model(**kw)[0]
            loss = F.mse_loss(o.float(), target)
            if record:
                log.append(("loss", -1, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()))
                torch.cuda.reset_peak_memory_stats()
            loss.backward()
            if record:
                log.append(("end", -1, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()))
            opt.step()
            opt.zero_grad(set_to_none=True)
            c.enter = real_enter

        step(False)
        step(False)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(True)
        torch.cuda.synchronize()
        # log[k] holds (pass, block, allocated at entry, peak since the previous entry): the peak belongs to the
        # interval that ended at this entry, i.e. to the previous entry's block.
        rows = []
        for k in range(len(log) - 1):
            pas, i, alloc, _ = log[k]
            peak = log[k + 1][3]
            rows.append(dict(pas=pas, block=i, alloc_gb=alloc / GB, peak_gb=peak / GB))
        top = max(rows, key=lambda r: r["peak_gb"])
        p = planner.predict(facts, f, args.res, act)
        out = dict(fraction=f, act=act, base_gb=base / GB, rows=rows, top=top,
                   offloaded_gb=(c.activations.offloaded_bytes / GB if c.activations else 0.0),
                   pred=dict(peak_allocated=p.peak_allocated / GB, dynamic=p.dynamic / GB, static=p.static / GB,
                             ck_gpu=p.act_checkpoint_gpu / GB, act_block=p.act_block / GB,
                             other=p.act_other / GB, trainable=p.trainable / GB, ring=p.ring / GB))
        report[f"f{f}-act{act}"] = out
        print(json.dumps({k: v for k, v in out.items() if k != "rows"}), flush=True)
        for r in rows[::6] + [top]:
            print(f"  {r['pas']} {r['block']:3d}  alloc {r['alloc_gb']:.2f}  peak {r['peak_gb']:.2f}")
        opt = kw = target = None
        detach(h, model, params)
    (args.out / "act_peak.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
