"""The planner's count of a video VAE's clip encode and decode (trainer/planner/vae.py, on the meta device) against
the GPU's own allocator, for the full-size VAE with random weights.

    python -m bench.diag.diag_vae_peak [--family wan] [--sizes 832x480x81 1280x720x81]

For each clip: the activation peak counted on meta (`clip_peak`), and on the GPU `max_memory_allocated` minus what
was allocated before the call (the weights and the input), and `max_memory_reserved` over the same baseline; for the
encode, the decode of its latents and the tiled decode that sampling during training uses. bf16, batch 1.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn


def _gpu_peak(fn) -> tuple[float, float]:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base_a, base_r = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        out = fn()
    torch.cuda.synchronize()
    del out
    return torch.cuda.max_memory_allocated() - base_a, torch.cuda.max_memory_reserved() - base_r


def main() -> None:
    import diffusers

    from trainer.models import adapter_class
    from trainer.planner.vae import clip_peak

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="wan")
    ap.add_argument("--sizes", nargs="+", default=["832x480x81", "1280x720x81"])
    args = ap.parse_args()
    cls = adapter_class(args.family)
    config = dict(cls.full_vae_config or {})
    dt = torch.bfloat16
    torch.manual_seed(0)
    with torch.device("cuda"):
        vae = getattr(diffusers, cls.vae_cls_name).from_config(config)
    nn.Module.to(vae, dt)
    vae.eval().requires_grad_(False)
    c = vae.config
    torch.backends.cudnn.benchmark = False
    rows = []
    for size in args.sizes:
        w, h, f = (int(v) for v in size.split("x"))
        x = torch.rand(1, 3, f, h, w, device="cuda", dtype=dt) * 2 - 1
        vae.disable_tiling()
        enc = _gpu_peak(lambda x=x: vae.encode(x).latent_dist.mode())
        z = torch.randn(1, c.z_dim, (f - 1) // c.scale_factor_temporal + 1, h // c.scale_factor_spatial,
                        w // c.scale_factor_spatial, device="cuda", dtype=dt)
        dec = _gpu_peak(lambda z=z: vae.decode(z).sample)
        vae.enable_tiling()
        tiled = _gpu_peak(lambda z=z: vae.decode(z).sample)
        vae.disable_tiling()
        del x, z
        for kind, got, tile in (("encode", enc, False), ("decode", dec, False), ("decode tiled", tiled, True)):
            meta = clip_peak(args.family, config, dt, kind.split()[0], w, h, f, tiled=tile)
            rows.append({"clip": size, "kind": kind, "meta_GB": round(meta / 1e9, 3),
                         "gpu_allocated_GB": round(got[0] / 1e9, 3), "gpu_reserved_GB": round(got[1] / 1e9, 3),
                         "reserved/meta": round(got[1] / meta, 3)})
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, diffusers {diffusers.__version__}, "
          f"{args.family} VAE {json.dumps(config)}")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
