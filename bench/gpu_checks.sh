#!/usr/bin/env bash
# On a CUDA machine, from the project root: every GPU test, then `dittrain fit` / `dittrain sample` end to end on
# the tiny models through the conductor, with the trained LoRA compared across offload fractions.
# Usage: OUT=results bash bench/gpu_checks.sh     (results land in $OUT)
set -uo pipefail
OUT=${OUT:-gpu_checks_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
DT="python3 -m trainer"

python3 -m pytest -q -m gpu tests 2>&1 | tee "$OUT/gpu_tests.log"

{
  $DT make-tiny --out models/tiny
  for f in 0 0.5 1.0; do
    echo "=== fit tiny Flux LoRA, cuda, fp32, math attention, offload.transformer=$f"
    $DT fit configs/tiny/flux-lora.yaml --set train.device=cuda --set train.attention=math \
      --set offload.transformer=$f --set output.dir=/tmp/e2e-lora-$f --set train.steps=12 \
      --set sample.every=6 --set train.checkpoint_every=6
  done
  python3 - <<'PY'
from safetensors.torch import load_file
import torch
ref = load_file("/tmp/e2e-lora-0/lora.safetensors")
for f in ("0.5", "1.0"):
    other = load_file(f"/tmp/e2e-lora-{f}/lora.safetensors")
    same = ref.keys() == other.keys() and all(torch.equal(ref[k], other[k]) for k in ref)
    diff = max((ref[k] - other[k]).abs().max().item() for k in ref)
    print(f"LoRA after 12 steps, offload {f} vs 0: bitwise equal={same}, max abs diff={diff:.3g}")
PY
  echo "=== fit tiny Flux full fine-tune (fused back pass), offload 1.0 + activation offloading"
  $DT fit configs/tiny/flux-full.yaml --set train.device=cuda --set offload.transformer=1.0 \
    --set offload.activations=true --set output.dir=/tmp/e2e-full --set train.steps=10 --set sample.every=0
  echo "=== sample, offload 1.0, with the LoRA"
  $DT sample configs/tiny/flux-lora.yaml --set train.device=cuda --offload 1.0 --lora /tmp/e2e-lora-0.5/lora.safetensors \
    --prompt "a red square on a blue background" --prompt "a green circle" --num 2 --out "$OUT/samples"
  ls -la "$OUT/samples"
} 2>&1 | tee "$OUT/e2e.log"
