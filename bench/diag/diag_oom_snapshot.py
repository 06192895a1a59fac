#!/usr/bin/env python3
"""What fills the GPU when a `dittrain` command runs out of memory: the live allocations at that moment, grouped
by where they were made.

Runs the command in this process with torch's CUDA memory history on (Python stacks). At the first
out-of-memory, and once more when the command ends, it writes a table of the live (allocated) blocks grouped by
the innermost frames of the project, diffusers, peft and torch.nn that made them, largest group first, with the
allocator's totals. The planner's trace (trainer/planner/trace.py) can then be compared term by term.

    DITTRAIN_VRAM_CAP_GB=15 python -m bench.diag.diag_oom_snapshot --out /tmp/oom -- fit config.yaml
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch

KEEP = ("/trainer/", "/diffusers/", "/peft/", "/torch/nn/", "/torch/utils/checkpoint")


def _site(frames: list[dict], depth: int) -> str:
    """The innermost `depth` frames from the files worth naming (the allocation site a reader recognizes)."""
    named = [f for f in frames if any(k in f.get("filename", "") for k in KEEP)]
    return " <- ".join(f"{f['filename'].rsplit('/', 2)[-2]}/{f['filename'].rsplit('/', 1)[-1]}:{f['line']}"
                       f" {f['name']}" for f in named[:depth]) or "(no named frame)"


def summarize(path: Path, title: str, depth: int = 4, top: int = 40) -> None:
    snap = torch.cuda.memory._snapshot()
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    sizes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    live = reserved = 0
    for seg in snap["segments"]:
        reserved += seg["total_size"]
        for b in seg["blocks"]:
            if b["state"] != "active_allocated":
                continue
            live += b["size"]
            key = _site(b.get("frames", []), depth)
            groups[key][0] += b["size"]
            groups[key][1] += 1
            sizes[key][b["size"]] += 1
    lines = [f"# {title}", f"live {live / 1e9:.3f} GB in {sum(c for _, c in groups.values())} blocks, "
             f"reserved {reserved / 1e9:.3f} GB, max allocated {torch.cuda.max_memory_allocated() / 1e9:.3f} GB", ""]
    for key, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        common = ", ".join(f"{c} x {s / 1e6:.1f} MB" for s, c in sizes[key].most_common(3))
        lines.append(f"{size / 1e9:8.3f} GB {count:6d}  ({common})  {key}")
    with path.open("a") as f:
        f.write("\n".join(lines) + "\n\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("oom"))
    ap.add_argument("--depth", type=int, default=4, help="frames named per allocation site")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the dittrain command and its arguments")
    args = ap.parse_args()
    argv = args.command[1:] if args.command[:1] == ["--"] else args.command
    args.out.mkdir(parents=True, exist_ok=True)
    report = args.out / "live.txt"
    report.unlink(missing_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    seen = []

    def on_oom(device, alloc, device_alloc, device_free):
        if not seen:
            seen.append(alloc)
            summarize(report, f"out of memory asking {alloc / 1e9:.3f} GB (device allocated {device_alloc / 1e9:.3f} "
                      f"GB, free {device_free / 1e9:.3f} GB)", args.depth)

    torch._C._cuda_attach_out_of_memory_observer(on_oom)
    from trainer.cli import app

    try:
        app(argv, standalone_mode=False)
    except (SystemExit, Exception) as e:  # the command's own error message was printed; the table is the point
        print(f"the command ended with {type(e).__name__}: {e}")
    finally:
        summarize(report, "at the end of the command", args.depth)
    print(report.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
