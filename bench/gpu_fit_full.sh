#!/usr/bin/env bash
# On a CUDA machine, from the project root: `dittrain fit` full fine-tune of the tiny Flux (fp32, math attention)
# resident and streamed at offload 0.5 / 1.0 (+ activation offloading), optimizer state packed beside the streamed
# weights as fit wires it; prints the largest weight difference against the resident run.
# Usage: OUT=results bash bench/gpu_fit_full.sh
set -uo pipefail
OUT=${OUT:-gpu_fit_full_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
DT="python3 -m trainer"
{
  $DT make-tiny --out models/tiny
  for opt in adamw adafactor; do
    for f in 0 0.5 1.0; do
      act=false; [ "$f" = "1.0" ] && act=true
      echo "=== fit tiny Flux full fine-tune, $opt, cuda fp32 math attention, offload.transformer=$f activations=$act"
      $DT fit configs/tiny/flux-full.yaml --set train.device=cuda --set train.attention=math \
        --set optimizer.name=$opt --set offload.transformer=$f --set offload.activations=$act \
        --set output.dir=/tmp/e2e-full-$opt-$f --set train.steps=8 --set sample.every=0 --set train.checkpoint_every=0
    done
  done
  python3 - <<'PY'
import glob, torch
from safetensors.torch import load_file
def w(d):
    sd = {}
    for f in sorted(glob.glob(f"{d}/transformer/*.safetensors")):
        sd.update(load_file(f))
    return sd
for opt in ("adamw", "adafactor"):
    ref = w(f"/tmp/e2e-full-{opt}-0")
    for f in ("0.5", "1.0"):
        o = w(f"/tmp/e2e-full-{opt}-{f}")
        diff = max((ref[k] - o[k]).abs().max().item() for k in ref)
        print(f"{opt}: full fine-tune after 8 steps, offload {f} vs 0: {len(ref)} tensors, "
              f"bitwise equal={all(torch.equal(ref[k], o[k]) for k in ref)}, max abs diff={diff:.3g}")
PY
} 2>&1 | tee "$OUT/fit_full.log"
