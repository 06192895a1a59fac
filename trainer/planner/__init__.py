"""The memory planner: predicted VRAM, RAM and step time per offload fraction, `offload.transformer: auto`'s
choice, `dittrain plan`'s report and the sized presets.

It reads the offload conductor's own arithmetic (`trainer.offload.plan` for the ring and the schedule,
`trainer.offload.allocators` for block packing) and every fact about a model family from its adapter in
trainer/models/ (full-size config, text tokens, encoder sizes, dummy inputs for a bucket); the conductor never
imports it. Modules:

- prediction.py: `analyze` (sizes and the meta model of a config), `predict`, `choose_fraction` and the
  trainer's entry points `resolve_fraction`, `expected`, `check_line`;
- meta.py: the transformer on the meta device, text-encoder and optimizer-state bytes;
- trace.py: activation bytes and FLOPs from one forward on meta tensors;
- compiled_saves.py: what a compiled block keeps for backward (AOTAutograd's partition of it, on meta tensors);
- timing.py, replay.py: step-time costs, and the step replayed block by block over the conductor's plan;
- measure.py: a short measurement on the user's GPU (`dittrain plan` with a GPU);
- sampling.py: the same for the denoising loop of `dittrain sample`;
- vae.py: what a video family's VAE holds while it encodes a clip or decodes one, counted on the meta device;
- checkpointing.py: which blocks `train.gradient_checkpointing: auto` keeps the activations of;
- report.py: the text `dittrain plan` prints (`report`, `run_plan`);
- presets.py: `python -m trainer.planner.presets` writes configs/<family>/<method>-<N>gb.yaml (and a family's other
  sizes', configs/<family>-<size>/: wan-1.3b).
"""

from __future__ import annotations

from .meta import optimizer_state_bytes
from .prediction import (
    ALLOCATOR_OVERHEAD,
    GB,
    GRID,
    WORKSPACE,
    Facts,
    Prediction,
    analyze,
    check_line,
    choose_fraction,
    expected,
    predict,
    resolve_fraction,
    streaming,
)
from .report import report, run_plan
from .sampling import SamplePrediction, predict_sampling

__all__ = [
    "ALLOCATOR_OVERHEAD",
    "GB",
    "GRID",
    "WORKSPACE",
    "Facts",
    "Prediction",
    "SamplePrediction",
    "analyze",
    "check_line",
    "choose_fraction",
    "expected",
    "optimizer_state_bytes",
    "predict",
    "predict_sampling",
    "report",
    "resolve_fraction",
    "run_plan",
    "streaming",
]
