#!/usr/bin/env python3
"""fp8 base vs bf16 base: the LoRA training loss curve of the tiny Flux on the bundled data/shapes, same seed, on
the CPU. Prints one table (step, loss bf16, loss fp8, loss fp8 with the modulation Linears quantized too, the
differences to bf16) and the mean over the last quarter of steps.

    python -m bench.diag.quant_loss_curve --steps 40 --out /tmp/qlc

Each run is the real trainer (`Trainer.fit`) on a config that differs only in `model.quantize` /
`model.quantize_modulation`; the first step's loss differs by the fp8 rounding of the untrained base, later steps
show whether the LoRA trains the same way.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: curve name -> (model.quantize, model.quantize_modulation)
CURVES = {"bf16": ("none", False), "fp8": ("fp8", False), "fp8+mod": ("fp8", True)}


def run(models: Path, out: Path, name: str, steps: int) -> list[float]:
    from trainer.config import Config
    from trainer.train.trainer import Trainer

    root = Path(__file__).resolve().parents[2]
    quantize, modulation = CURVES[name]
    cfg = Config.model_validate({
        "model": {"family": "flux", "path": str(models / "flux"), "dtype": "bf16", "quantize": quantize,
                  **({"quantize_modulation": True} if modulation else {})},
        "train": {"method": "lora", "steps": steps, "batch_size": 2, "seed": 0, "checkpoint_every": 0,
                  "gradient_checkpointing": True, "device": "cpu"},
        "lora": {"rank": 8, "alpha": 8},
        "optimizer": {"lr": 3e-3},
        "data": {"sources": [{"path": str(root / "data" / "shapes")}], "resolutions": [64],
                 "cache_dir": str(out / "cache")},
        "output": {"dir": str(out / name.replace("+", "-")), "tensorboard": False},
    })
    Trainer(cfg).fit()
    lines = (out / name.replace("+", "-") / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["loss"] for x in lines]


def main(argv=None) -> dict[str, list[float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path, default=Path("quant_loss_curve"))
    args = ap.parse_args(argv)
    from trainer.models.tiny import make_tiny_models

    args.out.mkdir(parents=True, exist_ok=True)
    make_tiny_models(args.out / "models", ["flux"])
    curves = {name: run(args.out / "models", args.out, name, args.steps) for name in CURVES}
    print(f"{'step':>4s} {'bf16':>9s} {'fp8':>9s} {'fp8+mod':>9s} {'fp8-bf16':>9s} {'+mod-bf16':>9s}")
    for i, (a, b, c) in enumerate(zip(curves["bf16"], curves["fp8"], curves["fp8+mod"], strict=True)):
        print(f"{i + 1:4d} {a:9.4f} {b:9.4f} {c:9.4f} {b - a:+9.4f} {c - a:+9.4f}")
    tail = max(1, args.steps // 4)
    ma, mb, mc = (sum(c[-tail:]) / tail for c in curves.values())
    print(f"mean of the last {tail} steps: bf16 {ma:.4f}  fp8 {mb:.4f} ({(mb - ma) / ma:+.2%})  "
          f"fp8+mod {mc:.4f} ({(mc - ma) / ma:+.2%})")
    gaps = {k: max(abs(x - y) for x, y in zip(curves["bf16"], c, strict=True)) for k, c in curves.items() if k != "bf16"}
    print("largest per-step gap to bf16: " + "  ".join(f"{k} {v:.4f}" for k, v in gaps.items()))
    (args.out / "curves.json").write_text(json.dumps(curves))
    return curves


if __name__ == "__main__":
    main()
