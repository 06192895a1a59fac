#!/usr/bin/env python3
"""Chroma's attention with its mask, alone (trainer/models/chroma.py, "Attention with the mask"): forward +
backward of one block's attention at Chroma1-HD's width (24 heads of 128) over 512 text + the image tokens, bf16,
batch 1, in four forms:

- `sdpa, (B,1,S,S) mask`: what the Chroma pipeline and dittrain run in every block (torch picks the kernel);
- `sdpa, no mask`: what Flux runs, and what diffusers' checkpointed Chroma runs in its single blocks (a different
  function where the mask has zeros: its difference is the mask's effect, not an error);
- `flash mask`: `attend_outer_mask`, the mask as one more head dimension (136), no mask tensor;
- `flex, score_mod`: `attend_flex` (train.attention: flex), torch.compile'd flex attention adding m_i m_j in the
  kernel (CUDA only: flex has no CPU backward).

Each row: milliseconds per forward + backward (CUDA events, median of --steps after --warmup), whether flash
attention accepts its SDPA call (run once under `sdpa_kernel(FLASH_ATTENTION)` only), and the largest
difference of its output and input gradients from the masked SDPA row.

    python -m bench.speed.attn_mask_speed --out $OUT/attn            # ~1 min on an H100
    python -m bench.speed.attn_mask_speed --smoke                    # CPU: checks the script

The step-level numbers come from bench_speed.py's Chroma rows (--rows issue29 --family chroma).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common.timing import step_seconds
from trainer.models.chroma import attend_flex, attend_outer_mask


def sdpa(q, k, v, mask=None):
    """diffusers' native backend: (B, S, H, D) in and out."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--res", type=int, default=1024)
    ap.add_argument("--text", type=int, default=512)
    ap.add_argument("--valid", type=int, default=80, help="caption tokens the mask keeps (the rest is padding)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny width: checks the script")
    args = ap.parse_args(argv)
    dev = torch.device("cpu" if args.smoke else "cuda")
    heads, dim = (2, 16) if args.smoke else (24, 128)
    if args.smoke:
        args.res, args.text, args.valid, args.warmup, args.steps = 64, 8, 3, 1, 1
    if dev.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # as the trainer and bench_speed
    s = args.text + (args.res // 16) ** 2
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, s, heads, dim, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
    m = torch.ones(1, s, device=dev, dtype=torch.bfloat16)
    m[:, args.valid + 1:args.text] = 0  # the pipeline's mask: valid tokens and one more
    mask4 = m[:, None, None, :] * m[:, None, :, None]
    grad = torch.randn(1, s, heads, dim, device=dev, dtype=torch.bfloat16, generator=g)
    forms = {"sdpa, (B,1,S,S) mask": lambda a, b, c: sdpa(a, b, c, mask4),  # first: the others' reference
             "sdpa, no mask": lambda a, b, c: sdpa(a, b, c),
             f"flash mask (head dim {dim + 8 - dim % 8})": lambda a, b, c: attend_outer_mask(a, b, c, m)}
    if dev.type == "cuda":
        forms["flex, score_mod m_i m_j"] = lambda a, b, c: attend_flex(a, b, c, m)  # a failure is a row's error
    ref, rows = None, []
    for name, fn in forms.items():
        xs = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]

        def step(fn=fn, xs=xs):
            out = fn(*xs)
            out.backward(grad)
            return out

        try:
            out = step()
            got = (out.detach().float(), *[x.grad.float() for x in xs])
            for x in xs:
                x.grad = None
            for _ in range(args.warmup):
                step()
            ts = step_seconds(step, args.steps, dev.type == "cuda")
        except Exception as e:  # noqa: BLE001
            rows.append({"name": name, "error": str(e).splitlines()[0][:100]})
            print(f"{name}: {rows[-1]['error']}", flush=True)
            continue
        flash = None
        if dev.type == "cuda" and not name.startswith("flex"):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            try:
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    fn(*xs).backward(grad)
                flash = True
            except RuntimeError:
                flash = False
        if name.startswith("sdpa, (B"):
            ref = got
        diff = None if ref is None else max((a - b).abs().max().item() for a, b in zip(got, ref, strict=True))
        rows.append({"name": name, "ms": 1000 * statistics.median(ts), "flash": flash, "max_diff_vs_masked": diff})
        print(f"{name}: {rows[-1]['ms']:.2f} ms fwd+bwd, flash-eligible {flash}, max diff vs masked sdpa {diff}",
              flush=True)
    head = f"attention fwd+bwd, {s} tokens ({args.text} text, {args.valid} valid), {heads} x {dim}, bf16, " + (
        "cpu (smoke)" if args.smoke else torch.cuda.get_device_name())
    lines = [head, "", "| form | ms fwd+bwd | flash accepts it | max diff vs masked sdpa |", "|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['error']} | | |")
        else:
            d = "" if r["max_diff_vs_masked"] is None else f"{r['max_diff_vs_masked']:.3g}"
            lines.append(f"| {r['name']} | {r['ms']:.2f} | {r['flash']} | {d} |")
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "attn_mask_speed.json").write_text(json.dumps(rows, indent=1))
        (args.out / "attn_mask_speed.md").write_text("\n".join(lines) + "\n")
    return rows


if __name__ == "__main__":
    main()
