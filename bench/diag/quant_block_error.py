#!/usr/bin/env python3
"""How much an 8-bit base moves one full-width transformer block's output, with and without the modulation Linears
quantized (`model.quantize_modulation`), on the CPU. Prints one table; writes quant_block_error.json under --out.

    python -m bench.diag.quant_block_error --out /tmp/qbe                 # Flux double + single, Qwen-Image block
    python -m bench.diag.quant_block_error --out /tmp/qbe --families flux  # Flux only
    python -m bench.diag.quant_block_error --smoke --out /tmp/qbe          # tiny widths, seconds (tests)

What. The family's transformer at its real widths with one block of each kind (Flux: 1 double + 1 single; Qwen-Image:
1 block), every weight N(0, 0.02) and every bias N(0, 0.02) (norm weights 1), in bf16; one forward on a 256-token
image (16 x 16 latent patches) and 64 text tokens, timestep 0.5 (Flux: guidance 3.5, a random pooled embedding),
so each block sees the inputs and the `temb` the model's own embedders make. Each block's inputs are recorded, then
each variant of the block (a copy, quantized as the loader does) runs on exactly those inputs.

Reported per block and variant (relative L2 errors, image and text stream together): the block's output y against
the bf16 block's, ||y - y_bf16|| / ||y_bf16|| (diluted by the residual stream x the block adds to); the block's
update y - x against the bf16 block's, ||y - y_bf16|| / ||y_bf16 - x||, and against the fp32 block's (the bf16
row of that column is the floor every bf16 run already lives with); and the modulation Linear's output alone (the
scale / shift / gate vectors of the block's first modulation Linear) against fp32. Caveat: random Gaussian weights have no outlier channels, which
per-channel absmax scaling handles worst; real checkpoints can be harsher, so this bounds the harm from below.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from trainer import quant
from trainer.models import adapter_class

VARIANTS = (("bf16", "none", False), ("fp8", "fp8", False), ("fp8+mod", "fp8", True), ("int8", "int8", False),
            ("int8+mod", "int8", True))


def _init(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 or name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def _flux(smoke: bool):
    from diffusers import FluxTransformer2DModel

    kw = dict(num_layers=1, num_single_layers=1, guidance_embeds=True)
    if smoke:
        kw.update(attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
                  axes_dims_rope=(4, 6, 6))
    m = FluxTransformer2DModel(**kw)
    c = m.config
    g = torch.Generator().manual_seed(1)
    side, text = (16, 64) if not smoke else (4, 8)
    ids = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij"), -1).reshape(-1, 2)
    inputs = dict(
        hidden_states=torch.randn(1, side * side, c.in_channels, generator=g),
        encoder_hidden_states=torch.randn(1, text, c.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(1, c.pooled_projection_dim, generator=g),
        timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]),
        img_ids=torch.cat([torch.zeros(side * side, 1), ids.float()], 1), txt_ids=torch.zeros(text, 3),
    )
    blocks = {"flux double": m.transformer_blocks[0], "flux single": m.single_transformer_blocks[0]}
    return m, inputs, blocks


def _qwen(smoke: bool):
    from diffusers import QwenImageTransformer2DModel

    kw = dict(num_layers=1)
    if smoke:
        kw.update(attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
    m = QwenImageTransformer2DModel(**kw)
    c = m.config
    g = torch.Generator().manual_seed(1)
    side, text = (16, 64) if not smoke else (4, 8)
    inputs = dict(
        hidden_states=torch.randn(1, side * side, c.in_channels, generator=g),
        encoder_hidden_states=torch.randn(1, text, c.joint_attention_dim, generator=g),
        encoder_hidden_states_mask=torch.ones(1, text, dtype=torch.long),
        timestep=torch.tensor([0.5]), img_shapes=[[(1, side, side)]],
    )
    return m, inputs, {"qwen-image": m.transformer_blocks[0]}


def _cast(x, dtype):
    if torch.is_tensor(x):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(_cast(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: _cast(v, dtype) for k, v in x.items()}
    return x


def _flat(out) -> torch.Tensor:
    ts = out if isinstance(out, (tuple, list)) else (out,)
    return torch.cat([t.float().reshape(-1) for t in ts if torch.is_tensor(t)])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def measure(family: str, smoke: bool) -> list[dict]:
    torch.manual_seed(0)
    m, inputs, blocks = (_flux if family == "flux" else _qwen)(smoke)
    pattern = adapter_class(family).modulation_linears
    _init(m, 0)
    m32 = m.float().eval()
    m = copy.deepcopy(m32).to(torch.bfloat16)
    seen: dict[str, tuple] = {}
    mods = dict(m.named_modules())
    hooks = []
    for name, b32 in blocks.items():  # record the bf16 model's block inputs (args, kwargs)
        def hook(mod, a, k, name=name):
            seen[name] = (a, k)
        hooks.append(mods[_path(m32, b32)].register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        m(**_cast(inputs, torch.bfloat16), return_dict=False)
    for h in hooks:
        h.remove()
    rows = []
    with torch.no_grad():
        for name, b32 in blocks.items():
            args, kwargs = seen[name]
            y32 = _flat(b32(*_cast(args, torch.float32), **_cast(kwargs, torch.float32)))
            # the residual stream the block adds to (every family returns (text, image), as it takes them)
            x = _flat((kwargs["encoder_hidden_states"], kwargs["hidden_states"]))
            ref = None
            mod_name, mod32 = next((n, x) for n, x in b32.named_modules()
                                   if isinstance(x, torch.nn.Linear) and quant.is_modulation(n, pattern))
            temb = kwargs.get("temb", args[2] if len(args) > 2 else None)
            e32 = mod32(torch.nn.functional.silu(temb.float()))
            for label, mode, modulation in VARIANTS:
                b = copy.deepcopy(b32).to(torch.bfloat16)
                t0 = time.perf_counter()
                n = quant.quantize_blocks([b], mode, modulation, pattern)
                y = _flat(b(*args, **kwargs))
                ref = y if ref is None else ref
                e = dict(b.named_modules())[mod_name](torch.nn.functional.silu(temb)).float()
                rows.append(dict(block=name, variant=label, linears=n, out_vs_bf16=_rel(y, ref),
                                 update_vs_bf16=_rel(y - x, ref - x), update_vs_fp32=_rel(y - x, y32 - x.float()),
                                 modulation_vs_fp32=_rel(e, e32), temb_rms=temb.float().square().mean().sqrt().item(),
                                 seconds=round(time.perf_counter() - t0, 1)))
                r = rows[-1]
                print(f"{name:12s} {label:9s} {n:3d} Linears  out vs bf16 {r['out_vs_bf16']:.2e}  update vs bf16 "
                      f"{r['update_vs_bf16']:.2e}  vs fp32 {r['update_vs_fp32']:.2e}  modulation vs fp32 "
                      f"{r['modulation_vs_fp32']:.2e}  (temb rms {r['temb_rms']:.3f})", flush=True)
    return rows


def _path(model: torch.nn.Module, block: torch.nn.Module) -> str:
    return next(n for n, x in model.named_modules() if x is block)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("quant_block_error"))
    ap.add_argument("--families", nargs="+", default=["flux", "qwen_image"], choices=["flux", "qwen_image"])
    ap.add_argument("--smoke", action="store_true", help="tiny widths on the CPU (seconds)")
    args = ap.parse_args(argv)
    with torch.no_grad():
        rows = [r for f in args.families for r in measure(f, args.smoke)]
    print("\n| block | variant | 8-bit Linears | output vs bf16 | update vs bf16 | update vs fp32 | modulation vs fp32 |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['block']} | {r['variant']} | {r['linears']} | {r['out_vs_bf16']:.2e} | {r['update_vs_bf16']:.2e} | "
              f"{r['update_vs_fp32']:.2e} | {r['modulation_vs_fp32']:.2e} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quant_block_error.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
