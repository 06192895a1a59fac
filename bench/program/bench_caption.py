#!/usr/bin/env python3
"""`dittrain caption` against what users run instead (issue 43): transformers' `device_map="auto"` under the same
VRAM cap, and the model resident on the card.

The models (`--model-family`), full-size random-weight folders (bf16 on disk) with the project's tiny Qwen
tokenizer (its special tokens carry Qwen-VL's chat and image markers; nothing is downloaded):
- `qwen2.5-vl`: Qwen2.5-VL-7B's released config (28 decoder layers 3584 wide, the 32-block vision tower, the
  152,064-row embedding and head; 8.29 B parameters) and Qwen2.5-VL's image processor (patch 14, merge 2: a 1024 px
  image is 1,369 image tokens);
- `qwen3-vl`: Qwen3-VL-8B-Instruct's released config (36 decoder layers 4096 wide, 32 heads / 8 KV heads of 128,
  MLP 12,288; the 27-block vision tower 1152 wide with deepstack at 8, 16, 24; the 151,936-row embedding and an
  untied head; 8.77 B parameters): trainer/models/qwen_image_21.py `qwen3_vl_8b_config`, the same dict Qwen-Image
  2.1's full-size folders use, checked field by field against the released config.json (as quoted in
  TensorRT-LLM's Qwen3-VL modeling test), and its image processor (patch 16, merge 2, mean / std 0.5: a 1024 px
  image is 1,024 image tokens).
Random weights generate random text: every row is made to generate exactly `--tokens` new tokens
(`min_new_tokens`), so the rows do the same work (the captions themselves are noise, most of it ids the tiny
tokenizer does not have: `ours` then writes few or none).

Rows, each in its own process (one GPU, `torch.cuda.set_per_process_memory_fraction` = the cap), for each batch
size of `--batches`:
- `ours`: trainer/captioning `run_caption` (what `dittrain caption DIR --model F --offload auto --batch B
  --quantize Q` runs), once per `--quantize` mode: the decoder layers (every Linear 8-bit with fp8 / int8, the
  vision tower's and the head's too) streamed through the conductor at the fraction `auto` picks for the cap, with
  auto's estimate there (`estimate_gb`, beside the peak reserved);
- `auto`: `AutoModelForImageTextToText.from_pretrained(F, device_map="auto", max_memory={0: cap - 2 GB, "cpu": ...})`
  (accelerate keeps what fits on the GPU and moves the rest in per layer, per call), bf16, the same inputs, greedy;
- `resident`: the whole model on the GPU in bf16, no cap.
Per row: images/s over the generate calls (load time apart), the load time, peak reserved VRAM, peak RSS (VmHWM) and
anonymous RSS at the end. Writes caption.json and caption.md under --out. A batch larger than `--images` runs as
one batch of `--images` (as `dittrain caption` does): give at least as many images as the largest batch.

`--estimate`: no folder, no GPU: the full-size model built on the meta device, and the fraction `--offload auto`
would pick for each `ours` row (quantize, batch, cap), with its estimate and the decoder bytes its plan streams per
new token (`vlm.streamed_bytes`), printed, and the same for its decode steps (`vlm.decode_fraction`).
`--decode-placement on`: the ours rows decode at their own fraction (`CaptionRequest.decode_placement`, off as
shipped: measured slower, vlm.py's essay); off (the default) at the prefill's.
`--small`: a model of the same kind at a CPU's size, every row in seconds (the CPU smoke; tests/test_caption_bench.py runs it).

    python -m bench.program.bench_caption --model-family qwen3-vl --quantize none,fp8 --batches 4,16 --images 16 --out $OUT/caption
    python -m bench.program.bench_caption --estimate --model-family qwen2.5-vl --quantize none,fp8 --batches 4,16 --caps 7,15
    python -m bench.program.bench_caption --small --images 2 --px 64 --tokens 4 --caps 0 --rows ours,resident --out /tmp/bc   # CPU smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: `python -m bench...` runs from it

#: Qwen2.5-VL-7B's released sizes (its config.json); `small` keeps the shapes' kinds at a CPU's size
QWEN25 = {
    "full": {"text": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                      "num_key_value_heads": 4, "mrope_section": [16, 24, 24]},
             "vision": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16}},
    "small": {"text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "mrope_section": [2, 3, 3]},
              "vision": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}},
}
#: Qwen3-VL at a CPU's size (the full size: `qwen3_vl_8b_config`)
QWEN3_SMALL = {"text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "head_dim": 16},
               "vision": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                          "deepstack_visual_indexes": [0, 1]}}
FAMILIES = ("qwen2.5-vl", "qwen3-vl")
#: per family: the image processor's patch and merge sizes, the processor class a real folder names
PATCH = {"qwen2.5-vl": (14, 2), "qwen3-vl": (16, 2)}
PROCESSOR = {"qwen2.5-vl": "Qwen2_5_VLProcessor", "qwen3-vl": "Qwen3VLProcessor"}


def _ids() -> dict[str, int]:
    from trainer.models.tiny import QWEN_SPECIAL, qwen_tokenizer

    tok = qwen_tokenizer()
    return {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}


def model_config(family: str, small: bool):
    """The family's config (module docstring), its special token ids the tiny tokenizer's."""
    ids = _ids()
    special = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
               "pad_token_id": ids["<|endoftext|>"]}
    markers = {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
               "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"]}
    if family == "qwen2.5-vl":
        from transformers import Qwen2_5_VLConfig

        size = QWEN25["small" if small else "full"]
        t = size["text"]
        return Qwen2_5_VLConfig(
            text_config={**{k: v for k, v in t.items() if k != "mrope_section"}, "vocab_size": 152064,
                         "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
                         "rope_parameters": {"rope_type": "default", "mrope_section": t["mrope_section"],
                                             "rope_theta": 1000000.0}, **special},
            vision_config={**size["vision"], "out_hidden_size": t["hidden_size"]},
            vocab_size=152064, hidden_size=t["hidden_size"], **markers)
    from transformers import Qwen3VLConfig

    from trainer.models.qwen_image_21 import qwen3_vl_8b_config

    cfg = qwen3_vl_8b_config()
    if small:
        cfg["text_config"].update(QWEN3_SMALL["text"])
        cfg["text_config"]["rope_parameters"]["mrope_section"] = [2, 3, 3]  # head_dim / 2, as [24, 20, 20] of 128
        cfg["vision_config"].update({**QWEN3_SMALL["vision"], "out_hidden_size": QWEN3_SMALL["text"]["hidden_size"]})
    cfg["text_config"].update(special)
    cfg.update(markers)
    return Qwen3VLConfig(**cfg)


def model_class(family: str):
    import transformers

    return getattr(transformers, {"qwen2.5-vl": "Qwen2_5_VLForConditionalGeneration",
                                  "qwen3-vl": "Qwen3VLForConditionalGeneration"}[family])


def write_model(folder: Path, small: bool, family: str = "qwen2.5-vl") -> int:
    """The model folder (module docstring); returns the bytes of weights written."""
    import torch
    import transformers
    from transformers import Qwen2VLImageProcessorPil
    from transformers.video_processing_utils import BaseVideoProcessor

    from bench.program.bench_program import write_random
    from trainer.captioning import vlm
    from trainer.models.tiny import QWEN_VL_CHAT_TEMPLATE, qwen_tokenizer

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    with torch.device("meta"):
        model = model_class(family)(model_config(family, small))
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    nbytes = write_random(model, folder, "model", torch.bfloat16, seed=0)
    patch, merge = PATCH[family]
    norm = {} if family == "qwen2.5-vl" else {"image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    proc = vlm.torchvision_free(getattr(transformers, PROCESSOR[family]))(
        image_processor=Qwen2VLImageProcessorPil(patch_size=patch, merge_size=merge, **norm), tokenizer=qwen_tokenizer(),
        video_processor=BaseVideoProcessor(), chat_template=QWEN_VL_CHAT_TEMPLATE)
    proc.save_pretrained(folder)
    for name in ("processor_config.json", "tokenizer_config.json"):  # the class a real folder names
        d = json.loads((folder / name).read_text())
        d["processor_class"] = PROCESSOR[family]
        (folder / name).write_text(json.dumps(d))
    return nbytes


def write_images(folder: Path, n: int, px: int) -> None:
    import numpy as np
    from PIL import Image

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (px, px, 3), dtype=np.uint8)).save(folder / f"img{i:03d}.png")


# ---------------------------------------------------------------------------------------------- one row


def _cap(cap_gb: float) -> None:
    import torch

    if cap_gb and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gb * 1e9 / total), 0)


def _memory() -> dict:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        for key in ("VmHWM", "RssAnon"):
            if line.startswith(key + ":"):
                out[key] = int(line.split()[1]) * 1024 / 1e9
    return out


def row(kind: str, cap_gb: float, folder: Path, images: Path, batch: int, tokens: int, quantize: str = "none",
        decode: bool = True) -> dict:
    """One row in this process (see the module docstring); `quantize` is the `ours` row's `--quantize`, `decode`
    its decode placement (False: the prefill's fraction for the decode steps too, as before it)."""
    import torch

    from trainer.captioning import captioner as crun
    from trainer.captioning import vlm

    _cap(cap_gb)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    timed = {"seconds": 0.0, "images": 0}
    inner_generate, inner_greedy, inner_auto = vlm.generate, vlm.greedy_config, vlm.auto_fraction

    def generate(model, processor, gc, inputs):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = inner_generate(model, processor, gc, inputs)
        if cuda:
            torch.cuda.synchronize()
        timed["seconds"] += time.perf_counter() - t0
        timed["images"] += len(out)
        return out

    def greedy(model, processor, max_new_tokens):
        gc = inner_greedy(model, processor, max_new_tokens)
        gc.min_new_tokens = max_new_tokens  # random weights: every row generates the same number of tokens
        return gc

    def auto(model, blocks, budget, batch, tokens, say):  # the estimate at auto's pick, beside the reserved peak
        f = inner_auto(model, blocks, budget, batch, tokens, say)
        timed["estimate_gb"] = vlm.estimate(model, blocks, batch, tokens)(f) / 1e9
        return f

    vlm.generate, vlm.greedy_config, vlm.auto_fraction = generate, greedy, auto
    t0 = time.perf_counter()
    out = {"kind": kind, "cap_gb": cap_gb, "batch": batch, "quantize": quantize if kind == "ours" else "none"}
    if kind == "ours":
        data = Path(str(images) + f"-{kind}-{cap_gb:g}-{batch}-{quantize}")
        shutil.rmtree(data, ignore_errors=True)
        shutil.copytree(images, data)
        summary = crun.run_caption(crun.CaptionRequest(data_dir=data, model=folder, offload="auto", batch=batch,
                                                       max_new_tokens=tokens, overwrite=True, quantize=quantize,
                                                       decode_placement=decode))
        out["fraction"] = summary.fraction
        out["decode_fraction"] = summary.decode_fraction
        out["estimate_gb"] = timed.get("estimate_gb")
        out["written"] = len(summary.written)
    else:
        from transformers import AutoModelForImageTextToText

        dtype = torch.bfloat16 if cuda else torch.float32
        processor = vlm.load_processor(folder)
        if kind == "auto":
            gpu = max(1.0, cap_gb - 2.0) if cap_gb else None
            model = AutoModelForImageTextToText.from_pretrained(
                folder, dtype=dtype, device_map="auto" if cuda else "cpu",
                max_memory={0: f"{gpu:g}GB", "cpu": "400GB"} if cuda and gpu else None)
            out["gpu_max_memory_gb"] = gpu
        else:
            model = AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype).to(dev)
        model.eval().requires_grad_(False)
        gc = greedy(model, processor, tokens)
        paths = sorted(images.glob("*.png"))
        from trainer.captioning import files

        for i in range(0, len(paths), batch):
            pics = [files.load_pictures(p, 4) for p in paths[i:i + batch]]
            inputs = vlm.prepare(processor, dev, model.dtype, pics, [crun.STYLES["detailed"]] * len(pics))
            generate(model, processor, gc, inputs)
    out.update(wall_s=time.perf_counter() - t0, generate_s=timed["seconds"], images=timed["images"],
               images_per_s=timed["images"] / timed["seconds"] if timed["seconds"] else None,
               peak_reserved_gb=torch.cuda.max_memory_reserved() / 1e9 if cuda else None, **_memory())
    out["load_and_rest_s"] = out["wall_s"] - out["generate_s"]
    return out


# ---------------------------------------------------------------------------------------------- estimate


def estimate(family: str, quantize: list[str], batches: list[int], caps: list[float], tokens: int) -> list[dict]:
    """`--estimate` (module docstring): per (quantize, batch, cap), the fraction `--offload auto` picks for the
    full-size model, and the estimate it prints. On the meta device: nothing is allocated or written."""
    import types

    import torch

    from trainer.captioning import captioner as crun
    from trainer.captioning import vlm
    from trainer.planner import GB
    patch, merge = PATCH[family]
    processor = types.SimpleNamespace(image_processor=types.SimpleNamespace(patch_size=patch, merge_size=merge))
    out = []
    for q in quantize:
        with torch.device("meta"):
            model = model_class(family)(model_config(family, small=False)).to(torch.bfloat16)
        blocks = vlm.decoder_blocks(model)
        vlm.quantize_decoder(blocks, q)
        vlm.quantize_outside(model, q)  # as run_caption: the vision tower's and the head's Linears too
        layers = sum(t.numel() * t.element_size() for b in blocks for t in (*b.parameters(), *b.buffers()))
        per_row = crun._tokens_per_row(processor, crun.CaptionRequest(data_dir=Path("."), model=Path("."),
                                                                      max_new_tokens=tokens))
        for batch in batches:
            for cap in caps:
                said: list[str] = []
                # the budget under a cap is the cap (presets.device_budget_bytes: the cap is the card less its context)
                f = vlm.auto_fraction(model, blocks, cap * GB, batch, per_row, said.append)
                line = said[-1]
                d = vlm.decode_fraction(model, blocks, cap * GB, batch, per_row, f, said.append)
                streamed = vlm.streamed_bytes(blocks, f) / GB
                decode = vlm.streamed_bytes(blocks, f, d) / GB
                out.append({"quantize": q, "batch": batch, "cap_gb": cap, "fraction": f, "layers_gb": layers / GB,
                            "streamed_gb_per_token": streamed, "decode_fraction": d,
                            "decode_streamed_gb_per_token": decode, "tokens_per_row": per_row, "line": line,
                            "decode_line": said[-1]})
                print(f"{family} quantize {q} batch {batch} cap {cap:g} GB: decoder layers {layers / GB:.2f} GB, "
                      f"{line}; {streamed:.2f} GB streamed per token; decode steps: {said[-1]}", flush=True)
    return out


# ---------------------------------------------------------------------------------------------- main


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _plan(rows: list[str], quantize: list[str], batches: list[int], caps: list[float]) -> list[tuple]:
    """(kind, cap, batch, quantize) of every row, batch by batch."""
    plan = []
    for batch in batches:
        for kind in rows:
            if kind == "resident":
                plan.append((kind, 0.0, batch, "none"))
            for cap in caps if kind != "resident" else ():
                plan += [(kind, cap, batch, q) for q in (quantize if kind == "ours" else ["none"])]
    return plan


def _label(kind: str, cap: float, batch: int, q: str) -> str:
    return f"{kind}-cap{cap:g}-b{batch}" + (f"-{q}" if kind == "ours" else "")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-caption"))
    ap.add_argument("--out", type=Path, default=Path("bench_out/caption"))
    ap.add_argument("--model-family", choices=FAMILIES, default="qwen2.5-vl")
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--px", type=int, default=1024)
    ap.add_argument("--batches", default="4", help="batch sizes, comma-separated: every row at each")
    ap.add_argument("--batch", default=None, help=argparse.SUPPRESS)  # the one batch of earlier command lines
    ap.add_argument("--quantize", default="none", help="the ours rows' --quantize modes, comma-separated "
                    "(none, fp8, int8); auto and resident rows run bf16")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per image")
    ap.add_argument("--caps", default="7,15", help="VRAM caps in GB for the ours / auto rows (0: none)")
    ap.add_argument("--rows", default="ours,auto,resident")
    ap.add_argument("--small", action="store_true", help="a small model of the same kind (CPU smoke)")
    ap.add_argument("--estimate", action="store_true", help="print auto's fraction per ours row; no GPU, no folder")
    ap.add_argument("--keep-model", action="store_true", help="reuse the model folder an earlier run wrote")
    ap.add_argument("--row-timeout", type=float, default=None, help="seconds a row may take (then it is failed)")
    ap.add_argument("--decode-placement", choices=("on", "off"), default="off",
                    help="ours rows: the decode steps' own fraction under auto (on), or the prefill's (off, as "
                         "`dittrain caption` ships)")
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)  # internal: run one row here
    ap.add_argument("--cap", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    batches = [int(b) for b in (args.batch or args.batches).split(",")]
    quantize = args.quantize.split(",")
    from trainer.captioning import vlm

    if bad := [q for q in quantize if q not in vlm.QUANTIZE] + [r for r in args.rows.split(",")
                                                                 if r not in ("ours", "auto", "resident")]:
        ap.error(f"unknown --quantize / --rows value(s): {', '.join(bad)}")
    caps = [float(c) for c in args.caps.split(",")]
    if args.estimate:
        rows = estimate(args.model_family, quantize, batches, [c for c in caps if c], args.tokens)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "estimate.json").write_text(json.dumps({"family": args.model_family, "rows": rows}, indent=1))
        return
    folder = args.work / (args.model_family + ("-small" if args.small else ""))
    images = args.work / "images"
    if args.row:
        print("ROW " + json.dumps(row(args.row, args.cap, folder, images, batches[0], args.tokens, quantize[0],
                                      args.decode_placement == "on")), flush=True)
        return
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.keep_model and (folder / "config.json").is_file():  # written by an earlier run of the same kind
        nbytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    else:
        nbytes = write_model(folder, args.small, args.model_family)
    write_images(images, args.images, args.px)
    print(f"{args.model_family} model folder {nbytes / 1e9:.2f} GB written in {time.perf_counter() - t0:.0f} s",
          flush=True)
    rows = []
    for kind, cap, batch, q in _plan(args.rows.split(","), quantize, batches, caps):
        cmd = [sys.executable, "-m", "bench.program.bench_caption", "--row", kind, "--cap", str(cap), "--work",
               str(args.work), "--batches", str(batch), "--tokens", str(args.tokens), "--quantize", q,
               "--model-family", args.model_family, "--decode-placement", args.decode_placement] + \
            (["--small"] if args.small else [])
        t = time.perf_counter()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.row_timeout,
                               env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}, cwd=ROOT)
        except subprocess.TimeoutExpired as e:
            r = subprocess.CompletedProcess(cmd, -9, _text(e.stdout), _text(e.stderr) + f"\ntimed out after "
                                            f"{args.row_timeout:g} s")
        (args.out / f"{_label(kind, cap, batch, q)}.log").write_text(r.stdout + r.stderr)
        got = [json.loads(line[4:]) for line in r.stdout.splitlines() if line.startswith("ROW ")]
        rows.append(got[0] if got else {"kind": kind, "cap_gb": cap, "batch": batch, "quantize": q,
                                        "error": (r.stderr or r.stdout)[-400:]})
        print(f"{_label(kind, cap, batch, q)}: rc {r.returncode}, {time.perf_counter() - t:.0f} s: "
              f"{json.dumps(rows[-1])}", flush=True)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()},
              "model_family": args.model_family, "model_gb": nbytes / 1e9, "rows": rows}
    (args.out / "caption.json").write_text(json.dumps(result, indent=1))
    name = {"qwen2.5-vl": "Qwen2.5-VL-7B", "qwen3-vl": "Qwen3-VL-8B"}[args.model_family]
    lines = [f"{name}{' (small)' if args.small else ''} random weights ({nbytes / 1e9:.1f} GB bf16), "
             f"{args.images} images of {args.px} px, {args.tokens} new tokens each, "
             f"{result['device']}, torch {result['torch']}, {result['date']}", "",
             "| row | quantize | batch | cap GB | images/s | generate s | load + rest s | streamed fraction (decode) | "
             "peak reserved GB | auto's estimate GB | peak RSS GB | anon RSS at end GB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        head = f"| {r['kind']} | {r['quantize']} | {r['batch']} | {r['cap_gb']:g} |"
        if r.get("error"):
            lines.append(f"{head} failed: {r['error'][-160:]!r} | | | | | | | |")
            continue
        f = lambda x: "" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)  # noqa: E731
        lines.append(f"{head} {f(r['images_per_s'])} | {f(r['generate_s'])} | {f(r['load_and_rest_s'])} | "
                     f"{f(r.get('fraction'))} ({f(r.get('decode_fraction'))}) | {f(r['peak_reserved_gb'])} | {f(r.get('estimate_gb'))} | "
                     f"{f(r.get('VmHWM'))} | "
                     f"{f(r.get('RssAnon'))} |")
    (args.out / "caption.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
