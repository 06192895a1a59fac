"""Recompute only what must be: which blocks `train.gradient_checkpointing: auto` keeps the activations of.

Why. Checkpointing a block frees everything its forward saves for backward except its inputs, and pays for it with
a second forward of the block inside backward: about a third of a LoRA step's FLOPs (bench/RESULTS.md: Flux at
1024 px, 0.775 s with every block checkpointed, 0.545 s without, 26.7 vs 52.7 GB). Where VRAM allows, the step is
faster without. It is all or nothing only on a card that holds every block's activations; between the two, each
block kept saves its recompute and costs its saved tensors.

Which blocks may keep. Any block of a LoRA (frozen blocks): a streamed one is reloaded for its backward into a
region whose bytes were refilled since its forward, and the conductor saves its weights as places in its region,
resolved where the block is when backward reads them (conductor `saved_weights`; without that, autograd's saved
views would read another block's weights: the version-counter pitfall in DESIGN.md). A kept streamed block still
streams twice a step; it saves its recompute, not its copies. In a full fine-tune only the blocks that never leave
the ring: a streamed trainable block is stepped and written back inside its backward (the conductor refuses it).

How. The planner's own prediction (prediction.py `predict(..., kept=...)`) gives the peak reserved VRAM and the
step time with a set of blocks kept. Candidates are taken from the last block backwards (the tail is
differentiated first, so its saved tensors are freed soonest; at offload > 0 the resident blocks are the ones the
plan never loads). The number kept is the largest whose predicted peak fits the budget at every bucket (the peak
grows with every block kept, so a bisection finds it). The budget is offload.vram_budget_gb, or on a GPU without
one the card's memory less a margin for the CUDA context and fragmentation the prediction does not see.
What a kept block holds is counted as it runs: under train.compile (auto: on for CUDA) the partition AOTAutograd
makes of the compiled block (trainer/planner/compiled_saves.py), else the eager block's saved tensors. Issue 29 measured
what happens otherwise: the planner counted eager blocks with peft's fp32 LoRA input copies (0.89 GB per Qwen-Image
block at 1024 px; the compiled block with bf16 LoRA math keeps 0.46 GB), predicted 117 GB without checkpointing
against 66.9 GiB measured, and auto kept 26 of 60 blocks where all 60 fit.

Left out: choosing by saved bytes per recompute second (blocks of one class cost the same; Flux's double and
single blocks differ by about 2x in both), and partial checkpointing inside a block (e.g. keeping attention
outputs only).
"""

from __future__ import annotations

from dataclasses import dataclass

from .prediction import GB, Facts, _train_plan, analyze, predict

#: share of a GPU's memory the auto policy plans to fill when no offload.vram_budget_gb is given: the CUDA
#: context (0.5-1 GB) and the allocator's fragmentation beyond the prediction's overhead take the rest
CARD_SHARE = 0.90


@dataclass
class Choice:
    checkpointed: list[bool]  #: per block: recomputed in backward
    kept: int  #: blocks that keep their activations
    extra_bytes: float  #: predicted peak reserved VRAM added by keeping them (largest bucket)
    saved_s: float  #: predicted step time saved (largest bucket)
    peak_bytes: float  #: predicted peak reserved VRAM with the choice
    line: str  #: what the log and `dittrain plan` say


def candidates(facts: Facts, fraction: float) -> list[int]:
    """Blocks that may keep their activations at `fraction` (every block of a LoRA; in a full fine-tune those
    never streamed), last first."""
    plan = _train_plan(tuple(facts.packed), fraction) if facts.method == "full" else None
    streamed = set(plan.streamed) if plan is not None else set()
    return [b for b in reversed(range(len(facts.blocks))) if b not in streamed]


def choose_checkpointing(cfg, fraction: float, budget_bytes: float | None, *, facts: Facts | None = None,
                         activation_offload: bool | None = None, log=print) -> Choice:
    """The auto policy (see the module essay); `budget_bytes` None keeps every block checkpointed."""
    facts = facts or analyze(cfg)
    act = cfg.offload.activations if activation_offload is None else activation_offload
    n = len(facts.blocks)
    order = candidates(facts, fraction) if budget_bytes is not None else []

    def peak(k: int) -> float:
        kept = frozenset(order[:k])
        return max(predict(facts, fraction, r, act, kept=kept).peak_reserved for r in facts.resolutions)

    lo, hi = 0, len(order)  # largest k with peak(k) <= budget: peak grows with k
    if order and peak(0) <= budget_bytes:
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if peak(mid) <= budget_bytes:
                lo = mid
            else:
                hi = mid - 1
    k = lo
    big = max(facts.resolutions)
    base = predict(facts, fraction, big, act)
    got = predict(facts, fraction, big, act, kept=frozenset(order[:k])) if k else base
    kept = set(order[:k])
    checkpointed = [b not in kept for b in range(n)]
    streamed = n - len(order) if budget_bytes is not None else 0
    if budget_bytes is None:
        line = ("checkpointing: auto has no VRAM budget to plan for (no GPU, no offload.vram_budget_gb): every "
                f"block recomputed ({n})")
    else:
        line = (f"checkpointing: auto keeps the activations of {k} of {n} blocks and recomputes {n - k}"
                + (f" ({streamed} stream, which must)" if streamed else "")
                + f": +{(got.peak_reserved - base.peak_reserved) / GB:.2f} GB at the peak "
                f"(predicted {got.peak_reserved / GB:.1f} GB of {budget_bytes / GB:.1f} GB), step predicted "
                f"{got.step_s:.2f} s instead of {base.step_s:.2f} s at {big} px; saved tensors counted as "
                f"{facts.trace(big).saved_by} keep them")
    log(line)
    return Choice(checkpointed, k, got.peak_reserved - base.peak_reserved, base.step_s - got.step_s,
                  got.peak_reserved, line)
