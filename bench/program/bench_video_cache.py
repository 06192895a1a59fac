"""`dittrain cache` over N video clips, for several N on one model folder: is caching flat in the clip count?

    python -m bench.program.bench_video_cache --families wan-1.3b --card 8 --clips 10,100 --work /tmp/vcache --keep
    MALLOC_MMAP_THRESHOLD_=1048576 python -m bench.program.bench_video_cache --families wan-1.3b --card 8 \
        --clips 10,100 --work /tmp/vcache --keep --out /tmp/vcache/out-mmap
    python -m bench.program.bench_video_cache --families wan-1.3b --card 8 --clips 10,100 --frames 81 --resolution 480p
    python -m bench.program.bench_video_cache --smoke --clips 10,100,200 --work /tmp/vcache-smoke   # CPU, tiny

Issue 39 asks that caching 100 clips take time proportional to the count (the same seconds per clip as 10) and
peak anonymous host RSS that does not grow with it. This writes the family's model folder once (full size with
random weights, or the tiny one with --smoke: bench_program.py `model_folder`), then max(N) clips
(program_video.py `write_clips`: moving H.264 content at the family's rate, `--frames` + 4 frames each at
`--resolution`, with a sound track for a family that trains sound), and for each N a data folder holding the first
N of them (hard links) and a fresh cache. It runs `dittrain cache` on each as bench_program.py does
(`run_commands`: a subprocess of the family's `lora-<card>gb` preset with DITTRAIN_VRAM_CAP_GB = card - 1, its
RssAnon polled every 0.1 s, the phases' records from DITTRAIN_PHASE_LOG) and reports per N:

    latent caching s     the phase's time (the VAE's load and every clip's encode)
    encode s / clip      the phase after its "VAE loaded" mark (trainer/data/cache.py), over N: what must be flat
    peak anon RSS GB     the phase's peak anonymous RSS (the VAE, a batch of decoded frames, the process)
    anon RSS after GB    anonymous RSS when the phase ended, the VAE freed and the heap trimmed: what caching kept
    VRAM GB              the phase's peak reserved VRAM (0 on the CPU)

and then, the largest N against the smallest: the ratio of encode seconds per clip, the ratio of peak anon RSS,
and the RSS growth per extra clip (MB; the tiny runs' RSS is mostly the interpreter, so the growth is what tells).
Table and JSON go to --out (default <work>/out): video_cache.md, video_cache.json. The environment passes to
`dittrain cache`: the MALLOC_MMAP_THRESHOLD_ line compares glibc with its mmap threshold fixed (docs/video.md: on the
CPU that made the peak flat in the clip count).

Cost (H200, estimated from bench_program's Wan runs: x264 writes a 480p clip of 85 frames in ~1.5 s, Wan 2.1's VAE
encodes one 480p x 81 clip in ~1.4 s). The defaults, wan-1.3b at 480p x 17 frames, --clips 10,100: the folder
(8.8 GB; 7.4 GB with --transformer-file fp8, which caching never reads) ~15 s, 100 clips ~40 s, then two `dittrain
cache` runs of which each loads UMT5-XXL and encodes the captions (~30 s) and encodes 10 and 100 clips (~0.4 s a
clip): ~3-4 minutes in all, ~9.6 GB of disk (the clips ~80 MB, the caches ~0.7 GB). Wan has no 8 GB preset: its
12 GB one is read (the line `config from ...` says so), under a 7 GB cap. --frames 81 makes the clips and their
encode ~4x longer (~8 minutes). --keep keeps the model folder and the clips for a second run (the caches are always
made anew).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

from bench.program import bench_program as bp

#: the phases' records this report reads (trainer/data/cache.py)
PHASE, LOADED = "latent caching", "latent caching (VAE loaded)"


def clip_counts(text: str) -> list[int]:
    """`--clips` ("10,100") as sorted distinct positive counts."""
    try:
        ns = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"--clips {text}: a comma-separated list of clip counts, e.g. 10,100") from None
    if not ns or ns[0] < 1:
        raise SystemExit(f"--clips {text}: counts of at least 1 clip")
    return ns


def data_folder(clips: Path, folder: Path, n: int) -> Path:
    """`folder` holding clips 0 .. n-1 of `clips` and their captions (hard links; copies across file systems)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for i in range(n):
        for name in (f"clip{i}.mp4", f"clip{i}.txt"):
            try:
                os.link(clips / name, folder / name)
            except OSError:
                shutil.copy2(clips / name, folder / name)
    return folder


def measure(run: dict, n: int, records: list[dict]) -> dict:
    """One N's figures from a `run_commands` row and the run's phase records."""
    phases = run["phases"]
    lat, loaded = phases.get(PHASE), phases.get(LOADED)
    phase_s = max(sum(ts) for ts in lat["times"].values()) if lat else 0.0
    load_s = max(sum(ts) for ts in loaded["times"].values()) if loaded else 0.0
    after = max((r["anon_rss"] for r in records if r["phase"] == PHASE), default=0)
    return {"clips": n, "rc": run["rc"], "command_s": run["wall_s"], "latent_caching_s": phase_s,
            "vae_load_s": load_s, "encode_s": phase_s - load_s, "encode_s_per_clip": (phase_s - load_s) / n,
            "anon_peak": lat["anon"] if lat else 0, "anon_after": after, "vram": lat["vram"] if lat else 0,
            "command_anon_peak": run["anon_peak"], "last_line": run["last_line"]}


def ratios(rows: list[dict]) -> dict:
    """The largest N against the smallest: encode time per clip and peak anon RSS as ratios, RSS growth per clip."""
    a, b = rows[0], rows[-1]
    extra = b["clips"] - a["clips"]
    return {"from": a["clips"], "to": b["clips"],
            "encode_s_per_clip": b["encode_s_per_clip"] / a["encode_s_per_clip"] if a["encode_s_per_clip"] else None,
            "anon_peak": b["anon_peak"] / a["anon_peak"] if a["anon_peak"] else None,
            "anon_peak_mb_per_clip": (b["anon_peak"] - a["anon_peak"]) / extra / 1e6 if extra else None,
            "anon_after_mb_per_clip": (b["anon_after"] - a["anon_after"]) / extra / 1e6 if extra else None}


def _num(x, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def report(label: str, rows: list[dict], r: dict | None) -> list[str]:
    lines = [f"### {label}", "",
             "| clips | rc | `dittrain cache` s | latent caching s | VAE load s | encode s | encode s / clip | "
             "peak anon RSS GB | anon RSS after GB | peak reserved VRAM GB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for x in rows:
        lines.append(f"| {x['clips']} | {x['rc']} | {x['command_s']:.1f} | {x['latent_caching_s']:.2f} | "
                     f"{x['vae_load_s']:.2f} | {x['encode_s']:.2f} | {x['encode_s_per_clip']:.4f} | "
                     f"{x['anon_peak'] / 1e9:.3f} | {x['anon_after'] / 1e9:.3f} | {x['vram'] / 1e9:.2f} |")
        if x["rc"]:
            lines.append(f"| | last line: {x['last_line'][:200]} | | | | | | | | |")
    if r is not None:
        lines += ["", f"{r['to']} clips against {r['from']}: encode s / clip x{_num(r['encode_s_per_clip'], '.3f')}, "
                  f"peak anon RSS x{_num(r['anon_peak'], '.3f')} ({_num(r['anon_peak_mb_per_clip'], '+.2f')} MB a "
                  f"clip), anon RSS after caching {_num(r['anon_after_mb_per_clip'], '+.2f')} MB a clip"]
    return lines + [""]


def bench_family(name: str, args) -> dict:
    """Every N of `args.clips` for the `--families` entry `name`: {"label", "rows", "ratios"}."""
    from trainer.models import adapter_class

    family, _ = bp.split_variant(name)
    ad = adapter_class(family)
    if not getattr(ad, "video", False):
        raise SystemExit(f"--families {name}: not a video family")
    fam_dir = args.work / name
    model = bp.model_folder(name, fam_dir, args)
    clips = bp.video_clips(ad, args)
    ns = args.clips
    written = fam_dir / f"clips-{clips.width}x{clips.height}x{clips.frames}"  # --keep reuses clips of this size only
    if not (args.keep and all((written / f"clip{i}.{e}").exists() for i in range(ns[-1]) for e in ("mp4", "txt"))):
        bp.write_clip_folder(name, written, ns[-1], clips)
    image = None
    if getattr(ad, "first_frame_conditions", False):  # an image-to-video config names its sample image
        from bench.program.program_video import first_frame

        image = first_frame(fam_dir / "first-frame.png", clips)
    runner = SimpleNamespace(smoke=args.smoke, gpus=1, commands="cache", tag="", method="lora")
    rows = []
    for n in ns:
        data = data_folder(written, fam_dir / f"data-{n}", n)
        run_dir = fam_dir / f"{args.card}gb-{n}clips"
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh cache: entries of an earlier run would be reused
        cfg = bp.write_config(family, model, data, run_dir, None, 1, args.smoke, args.card, args.transformer_file,
                              args.set, clips=clips, image=image, preset=name)
        runner.tag = f"{n} clips"
        (run,) = bp.run_commands(name, args.card, cfg, run_dir, runner)
        rows.append(measure(run, n, bp._records(run_dir / "phases.jsonl")))
    if not args.keep:
        shutil.rmtree(model, ignore_errors=True)
        shutil.rmtree(written, ignore_errors=True)
    label = (f"{name}, {args.card} GB preset, {clips.width}x{clips.height} x {clips.frames} frames at {clips.fps:g} fps"
             f"{' with sound' if clips.sound else ''}{' (smoke: tiny, CPU)' if args.smoke else ''}")
    return {"label": label, "rows": rows, "ratios": ratios(rows) if len(rows) > 1 else None}


def video_families() -> list[str]:
    """The `--families` entries bench_program writes whose adapter is a video family."""
    from trainer.models import adapter_class

    return [n for n in bp.writable() if getattr(adapter_class(bp.split_variant(n)[0]), "video", False)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=["wan-1.3b"], choices=video_families())
    ap.add_argument("--clips", type=clip_counts, default=[10, 100], help="clip counts, comma-separated (10,100)")
    ap.add_argument("--card", type=int, default=8, help="the preset's card size in GB; the VRAM cap is card - 1")
    ap.add_argument("--resolution", default=None, help="480p (832x480, the default), 720p or WxH (smoke: 96x64)")
    ap.add_argument("--frames", type=int, default=None, help="frames per clip at the family's rate (default 17; "
                    "smoke: the shortest the family takes)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/dittrain-bench-video-cache"))
    ap.add_argument("--out", type=Path, default=None, help="where video_cache.md and .json go (default <work>/out)")
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU (tests)")
    ap.add_argument("--keep", action="store_true", help="keep the model folder and the clips, and reuse them")
    ap.add_argument("--transformer-file", choices=sorted(bp.FILES), default=None,
                    help="write the transformer as one fp8 file (a smaller folder; caching does not read it)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a preset setting (dotted key, YAML value), e.g. --set data.encode_batch_size=1")
    args = ap.parse_args(argv)
    if args.frames is None and not args.smoke:
        args.frames = 17
    args.sample_frames = None
    out = args.out or args.work / "out"
    results, lines = [], []
    for name in args.families:
        res = bench_family(name, args)
        results.append(res)
        part = report(res["label"], res["rows"], res["ratios"])
        print("\n".join(part), flush=True)
        lines += part
    out.mkdir(parents=True, exist_ok=True)
    (out / "video_cache.md").write_text("\n".join(lines))
    (out / "video_cache.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'video_cache.md'} and {out / 'video_cache.json'}")
    return 0 if all(x["rc"] == 0 for r in results for x in r["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
