#!/usr/bin/env python3
"""Why tests/test_planner_gpu.py measured 0.49 GB more than the planner predicts (H200, 2026-11-22 01:06 UTC),
stage by stage, in one GPU run.

The diagnosis it checks: the planner's arithmetic is right (bench/speed/bench_plan.py: full-size Flux within 0.08 GB;
a meta-device emulation of the same step, `--emulate`, puts the cut model's real dynamic peak at 0.45 GB
against the planner's 0.49 GB), and the 0.49 GB is memory the *process* held before the test started:
under `pytest -m gpu tests` the planner test runs after tests/test_offload_gpu.py, whose full fine-tune runs
never free their GPU weights and AdamW state (the post-accumulate-grad hooks of `fused_adamw` and of
trainer.optim's FusedBackPass close over the offload handle, which holds the parameters: a reference cycle
through C++ that `gc` cannot collect; a CPU dry run of that module leaves ~0.43 GB of such tensors that
would be on the GPU). `max_memory_allocated()` counts them.

Phases (each prints `torch.cuda.memory_allocated()` / `memory_reserved()` after every stage):

  A  clean process: the test's set-up (build, LoRA, cast, blocks to CPU, attach, inputs, optimizer, 3 steps
     at f = 0 and 0.5) beside the planner's matching terms. Expect peak - baseline within ~0.05 GB of the
     planner's peak_allocated.
  (B and C, which ran tests/test_offload_gpu.py's full fine-tunes in this process to show what they left allocated,
  went when bench became a package: they imported the tests' own modules. The leak they showed is fixed; the
  git history has them.)

    python -m bench.diag.diag_planner_gap             # A on a CUDA GPU
    python -m bench.diag.diag_planner_gap --emulate      # CPU only: the meta-device emulation of the step
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from bench.common.timing import build_bf16
from trainer import planner
from trainer.config import Config
from trainer.models.flux import FluxAdapter
from trainer.planner import trace as ptrace

ROOT = Path(__file__).resolve().parents[2]

GB = 1e9
CONFIG = dict(FluxAdapter.full_config, num_layers=2, num_single_layers=4)  # as tests/test_planner_gpu.py
RES = 512


def facts_for(config: dict):
    root = Path(tempfile.mkdtemp(prefix="diag_gap_"))
    (root / "transformer").mkdir()
    (root / "transformer" / "config.json").write_text(json.dumps(config))
    cfg = Config.model_validate({
        "model": {"family": "flux", "path": str(root)},
        "train": {"method": "lora"}, "lora": {"rank": 16, "alpha": 16},
        "data": {"sources": [{"path": "unused"}], "resolutions": [RES]}, "output": {"dir": "unused"},
    })  # fmt: skip
    return planner.analyze(cfg)


def planner_terms(facts, fraction: float) -> None:
    p = planner.predict(facts, fraction, RES)
    lora = facts.trainable_params * 4
    print(
        f"  planner f={fraction}: ring {p.ring / GB:.3f}  non-block {p.nonblock / GB:.3f}  LoRA weights "
        f"{lora / GB:.3f}  AdamW state {facts.state_gpu / GB:.3f}  grads at peak "
        f"{(p.trainable - lora - facts.state_gpu) / GB:.3f}  checkpoint inputs {p.act_checkpoint_gpu / GB:.3f}  "
        f"block working set {p.act_block / GB:.3f}  outside blocks {p.act_other / GB:.3f}"
    )
    print(
        f"  planner f={fraction}: static after attach = ring + non-block + LoRA = "
        f"{(p.ring + p.nonblock + lora) / GB:.3f} GB;  peak_allocated {p.peak_allocated / GB:.3f}  "
        f"(dynamic {p.dynamic / GB:.3f})  peak_reserved {p.peak_reserved / GB:.3f}"
    )


# ------------------------------------------------------------------------------------------------ GPU


def mem(stage: str, base: int) -> None:
    a, r = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    print(
        f"    {stage:<34} allocated {a / GB:7.3f} GB ({(a - base) / GB:+7.3f} over baseline)  "
        f"reserved {r / GB:7.3f}  peak {torch.cuda.max_memory_allocated() / GB:7.3f}"
    )


def staged_measure(fraction: float, facts) -> float:
    """tests/test_planner_gpu.py `_measure`, line for line, printing memory after each stage; returns the
    raw peak allocated (what the test compares)."""
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    from trainer.offload import attach_offload

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    gc.collect()
    print(
        f"  f={fraction}: allocated before the set-up {base / GB:.3f} GB "
        f"({torch.cuda.memory_allocated() / GB:.3f} after gc.collect)"
    )
    base = torch.cuda.memory_allocated()
    torch.backends.cuda.enable_cudnn_sdp(False)
    m = build_bf16(lambda: FluxTransformer2DModel(**CONFIG), "cuda")
    mem("build (bf16, on the GPU)", base)
    m.requires_grad_(False)
    m.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=list(ptrace.default_lora_targets("flux"))))
    params = [p for p in m.parameters() if p.requires_grad]
    mem(f"LoRA ({sum(p.numel() for p in params) / 1e6:.1f} M, {params[0].dtype})", base)
    for p in params:
        p.data = p.data.float()
    mem("LoRA cast to fp32", base)
    m.train()
    blocks = ptrace.blocks_of("flux", m)
    for b in blocks:
        b.to("cpu")
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    mem("blocks to CPU + empty_cache", base)
    torch.cuda.reset_peak_memory_stats()
    handle = attach_offload(blocks, "cuda", fraction)
    mem("attach_offload", base)
    for p in m.parameters():
        if id(p) not in in_blocks:
            p.data = p.data.to("cuda")
    mem("non-block modules placed", base)
    inputs = ptrace.forward_inputs("flux", m, 1, RES, RES, 512, torch.bfloat16, device="cuda")
    target = torch.randn(1, (RES // 16) ** 2, 64, device="cuda")
    mem("inputs + target", base)
    opt = torch.optim.AdamW(params, lr=1e-5)
    try:
        for s in range(3):
            out = m(**inputs, return_dict=False)[0]
            mem(f"step {s}: forward", base)
            F.mse_loss(out.float(), target).backward()
            del out
            mem(f"step {s}: backward", base)
            opt.step()
            mem(f"step {s}: optimizer step", base)
            opt.zero_grad(set_to_none=True)
            mem(f"step {s}: zero_grad", base)
        torch.cuda.synchronize()
        peak, rpeak = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    finally:
        handle.close()
        del opt, inputs, target, m, params, blocks, handle
        gc.collect()
        torch.cuda.empty_cache()
    pred = planner.predict(facts, fraction, RES)
    print(
        f"  f={fraction}: peak allocated {peak / GB:.3f} GB raw, {(peak - base) / GB:.3f} over the baseline; "
        f"planner {pred.peak_allocated / GB:.3f} -> raw gap {(peak - pred.peak_allocated) / GB:+.3f}, "
        f"gap over baseline {(peak - base - pred.peak_allocated) / GB:+.3f} GB; reserved peak "
        f"{rpeak / GB:.3f} (planner {pred.peak_reserved / GB:.3f})"
    )
    return peak


class _Live(TorchDispatchMode):
    """memory_allocated on the meta device: every storage an op creates counts (512 B rounded, as the CUDA
    caching allocator rounds) until its last reference dies."""

    def __init__(self, skip):
        super().__init__()
        self.skip, self.ids, self.live, self.peak, self.at = skip, set(), 0, 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                sid = st._cdata
                if sid in self.ids or sid in self.skip:
                    continue
                n = math.ceil(st.nbytes() / 512) * 512
                self.ids.add(sid)
                self.live += n
                weakref.finalize(st, self._free, sid, n)
                if self.live > self.peak:
                    self.peak, self.at = self.live, str(func)
        return out

    def _free(self, sid, n):
        self.ids.discard(sid)
        self.live -= n


def emulate(config: dict, steps: int = 2) -> int:
    """Peak bytes above the weights of the test's training step on the meta device (flash attention and the
    fused rms_norm stand in for the CUDA kernels; foreach AdamW as on CUDA)."""
    from trainer.offload import attach_offload

    m = ptrace.meta_transformer("flux", config, torch.bfloat16)
    m.requires_grad_(False)
    ptrace.add_meta_lora(m, ptrace.default_lora_targets("flux"), 16, 16)
    params = [p for p in m.parameters() if p.requires_grad]
    m.train()
    handle = attach_offload(ptrace.blocks_of("flux", m), "meta", 0.0)
    live = _Live({t.untyped_storage()._cdata for t in [*m.parameters(), *m.buffers()]})

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, 0.0, is_causal, False, scale=scale
        )[0]

    def rms(x, shape, weight=None, eps=None):
        return torch.ops.aten._fused_rms_norm(x, list(shape), weight, eps)[0]

    saved = F.scaled_dot_product_attention, F.rms_norm
    F.scaled_dot_product_attention, F.rms_norm = sdpa, rms
    try:
        with live:
            inputs = ptrace.forward_inputs("flux", m, 1, RES, RES, 512, torch.bfloat16, device="meta")
            target = torch.randn(1, (RES // 16) ** 2, 64, device="meta")
            opt = torch.optim.AdamW(params, lr=1e-5, foreach=True)
            for _ in range(steps):
                F.mse_loss(m(**inputs, return_dict=False)[0].float(), target).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        F.scaled_dot_product_attention, F.rms_norm = saved
        handle.close()
    return live.peak


def run_emulation() -> None:
    for name, config in (("cut 2+4", CONFIG), ("full 19+38", dict(FluxAdapter.full_config))):
        facts = facts_for(config)
        p = planner.predict(facts, 0.0, RES)
        lora = facts.trainable_params * 4
        planner_dyn = p.peak_allocated - p.ring - p.nonblock - lora  # state + grads + activations
        emu = emulate(config)
        print(
            f"{name}: emulated peak above the weights (inputs, AdamW state, grads, activations) "
            f"{emu / GB:.3f} GB; planner's {planner_dyn / GB:.3f} GB (inputs left out); "
            f"so peak_allocated {(p.peak_allocated - planner_dyn + emu) / GB:.3f} emulated vs "
            f"{p.peak_allocated / GB:.3f} predicted"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--emulate", action="store_true", help="CPU only: the meta-device emulation")
    args = ap.parse_args()
    if args.emulate:
        run_emulation()
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (or --emulate)", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    facts = facts_for(CONFIG)
    print("A: clean process")
    for f in (0.0, 0.5):
        planner_terms(facts, f)
        staged_measure(f, facts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
