"""Where a LoRA preset takes `train.gradient_checkpointing: auto` instead of recomputing every block.

Why. A recomputed block runs its forward twice a step; `auto` (planner/checkpointing.py) keeps the activations of
as many blocks as the VRAM budget allows, streamed blocks of a LoRA included (conductor `saved_weights`), and skips
their recompute. Measured on an H200 (Flux.1-dev LoRA, 1024 px, every block streamed): 0.849 s a step keeping every
block's activations against 1.007 s recomputing every block, at 43.6 GB instead of 5.9 GB. A streamed preset whose
compute hides its copies (Flux.2-dev on a 48 GB card) can then stream more of the transformer to make room for
activations and still step faster.

How. The presets generator (presets.py) first finds a card's setting as before: the largest size, then the
smallest fraction that fits with every block recomputed. For a LoRA whose setting recomputes every block without
activation offloading it then tries `auto` at the same size: at each fraction on the planner's grid from that one
up, the blocks `choose_checkpointing` keeps within the preset's `offload.vram_budget_gb` (the budget the trainer's
`auto` plans in: the card less `HEADROOM_GB`, less `PREDICTION_MARGIN` for prediction error, so that the trainer
keeps the blocks the header names), and the predicted step there. The fastest fraction within the host RAM allowed
wins; the generator writes it where every phase fits the card and the step is at least `AUTO_MIN_GAIN` faster than
recomputing every block. Size is never traded for it: `auto` is only tried at the size already chosen.

Left out: full fine-tunes (a streamed trainable block is stepped in its backward: it must be recomputed), `auto`
with activation offloading (the trainer allows it, but no test runs kept blocks beside offloaded ones), and token
chunks (offload.nano_batches, which recompute the sub-layers they split). These are predictions; measured as shipped:
Flux.1-dev's 48 GB LoRA (57 of 57 blocks kept, 30 streamed) on an H200 under a 47 GB cap, 44.1 GB reserved against
45.1 GB predicted, 0.45 s a step against 0.73 s recomputing every block at fraction 0 (models/flux.py
`measured_presets`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..offload.plan import kept_blocks as kept_of  # this module's kept_blocks plans them
from .checkpointing import choose_checkpointing
from .prediction import GB, GRID, PREDICTION_MARGIN, Facts, Prediction, _train_plan, predict

#: `auto` is written only where its predicted step is at least this much faster than recomputing every block: its
#: kept activations fill the card up to the prediction margin, a risk taken for a real gain only
AUTO_MIN_GAIN = 0.02


@dataclass(frozen=True)
class Kept:
    """What a preset's `auto` keeps, and the setting recomputing every block that it replaced."""

    blocks: int  #: the transformer's blocks
    kept: int  #: blocks that keep their activations
    streamed: int  #: of those, blocks that stream (reloaded for their backward, not recomputed)
    budget_gb: float  #: offload.vram_budget_gb, the budget `auto` keeps them in
    fraction: float  #: the recomputed setting's transformer fraction
    step_s: float  #: its predicted step
    vram: float  #: its largest phase's predicted VRAM (bytes)


def auto_budget_gb(budget_gb: float) -> float:
    """offload.vram_budget_gb for a preset planned in `budget_gb` (the card less HEADROOM_GB): less the prediction
    margin, as `choose_fraction` keeps it, rounded down to 0.1 GB."""
    return math.floor(budget_gb * (1 - PREDICTION_MARGIN) * 10) / 10


def kept_blocks(cfg, facts: Facts, fraction: float, res: int, budget_gb: float) -> frozenset[int]:
    """The blocks `auto` keeps at `fraction` within `budget_gb`, as the trainer will choose them
    (streaming.py `checkpoint_policy` with offload.vram_budget_gb)."""
    choice = choose_checkpointing(cfg, fraction, budget_gb * GB, facts=facts, activation_offload=False,
                                  log=lambda s: None)
    return kept_of(choice.checkpointed)


def fastest_kept(cfg, facts: Facts, first: float, res: int, budget_gb: float,
                 ram_bytes: float) -> tuple[float, frozenset[int], Prediction] | None:
    """(fraction, kept blocks, prediction) of `auto`'s fastest predicted step at `first` or a larger fraction of
    the grid where it keeps some block, within `ram_bytes` of host RAM; None where there is none. `facts` as the
    trainer's `auto` counts them (checkpointing on, kept blocks counted as compiled)."""
    best = None
    for f in (g for g in GRID if g >= first):
        kept = kept_blocks(cfg, facts, f, res, budget_gb)
        p = predict(facts, f, res, False, kept=kept)
        if p.ram_peak > ram_bytes:
            break  # the pinned arena only grows with the fraction
        if kept and (best is None or p.step_s < best[2].step_s):
            best = f, kept, p
    return best


def streamed_of(facts: Facts, fraction: float, kept: frozenset[int]) -> int:
    """How many of `kept` stream at `fraction` (the training plan's streamed blocks)."""
    return len(kept & set(_train_plan(tuple(facts.packed), fraction).streamed)) if fraction > 0 else 0


def header_lines(k: Kept, p: Prediction, vram: float, measured: str = "not yet measured") -> list[str]:
    """The preset header's account of `auto`: what it keeps, within which budget, and the predicted step and VRAM
    against the setting recomputing every block (`vram`: the largest phase's bytes with `auto`; `measured`: the
    family's note for this preset as shipped, models/base.py `MeasuredPreset`)."""
    known = ", not yet measured" if measured == "not yet measured" else f" ({measured})"
    streamed = (f" ({k.streamed} of them streamed: reloaded for their backward, not recomputed)" if k.streamed
                else "")
    return [
        f"# Gradient checkpointing auto (train.gradient_checkpointing: auto) keeps the activations of {k.kept} of "
        f"{k.blocks} blocks{streamed} and recomputes {k.blocks - k.kept}, within offload.vram_budget_gb: "
        f"{k.budget_gb:g} (the card less 1 GB, less {PREDICTION_MARGIN:.0%} for prediction error): predicted step "
        f"{p.step_s:.2f} s at {vram / GB:.1f} GB, against {k.step_s:.2f} s at {k.vram / GB:.1f} GB recomputing every "
        f"block (at fraction {k.fraction:.2f}). Planner predictions{known}: if a step runs out of memory, "
        f"set train.gradient_checkpointing to true and offload.transformer to {k.fraction:g}.",
    ]
