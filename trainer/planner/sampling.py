"""Sampling (`dittrain sample --offload F`): the denoising loop's VRAM and time per step for an offload fraction.

Same sources as training (trainer/planner/prediction.py): the ring and the bytes each step moves come from the
plan the conductor runs (`plan.plan_for(..., "sample")`: the seed's cycle, or a spread resident part plus a
streaming window when that moves fewer bytes);
activations of a no-grad forward are small: the block's inputs and outputs plus its largest intermediate twice
(produced and consumed), from the same meta-device trace; the inputs every block takes (`Trace.block_shared_inputs`:
the timestep's modulations, per token in LTX-2 I2V's and Wan 2.2 TI2V's pipelines, and the text) once, held through
the call, not as a block's input and output. Time per step = max(forward compute, f W / B_h2d).

Classifier-free guidance (SD3 / Qwen-Image pipelines with guidance > 1) runs the prompt and the negative prompt as
one batch of two: `batch` (`cfg_batch`) doubles the activations and the compute.

A pipeline with a KV cache (the family's `sampling_kv_cache`: Qwen-Image 2.1) keeps every block's keys and values
of the prompt from the first step to its return, decode included (`kv_cache_bytes`): the prompt's share of each
block's keys and values (`Trace.block_kv`, at the planner's text length). Compiled blocks would hand the cache views
of their *whole* first-step keys and values (inductor drops the `.clone()` of a slice of a tensor that lives only
inside the compiled block; shown on the CPU with inductor: a 5-token prefix kept the storage of all 261 tokens):
2.15 GB at 1024 px, which is what Qwen-Image 2.1's 16 GB preset measured above its sampling prediction (predicted
12.39 GB, measured 14.11 GB while denoising: bench/history/2026-11-25.md, 2026-11-25 21:40). The family's `sampling_hooks`
copy each view down to the prompt's rows as its block returns (trainer/models/qwen_image_21.py), so compiled and
eager sampling keep the same share.

The VAE decode at the end has its own peak (`decode_reserved`: the placed transformer, the VAE and an untiled
decode's activations), which can exceed the denoising loop's at large sizes; `dittrain sample` decodes in 512 px
tiles where that does not fit (trainer/sampling/placement.py). A video family's sample is its clip (`size`: width x
height x sample.frames, the tokens of every latent frame), and its decode is the video VAE's own, counted on the meta
device (trainer/planner/vae.py). A family whose pipeline keeps large prompt inputs on the device declares them
(`sampling_prompt`: Ideogram 4's fp32 text features, 53248 wide over its 2048-token window, held through the call,
and their projection's bf16 and fp32 copies made once before the loop): held in both peaks, the preparation in
place of the forward's activations where larger; what the call holds for its prompts where the family counts it
(`sampling_prompt_bytes`: LTX-2's sound decoders and its text connectors' outputs, computed with the text
encoder). Left out: the text encoders (they run first and are released, trainer/sample.py).

A family whose samples also run other transformers (`sampling_components`: Ideogram 4's unconditional one, the
trained one's size) has each placed at the same fraction by `dittrain sample`: their rings and non-block weights
sit beside the trained one's and each step runs and streams them too (`others`; counted at the trained one's size
and tokens). The training sampler streams them at 1.0, each read for the call into a pinned arena of all its
blocks (trainer/planner/phases.py counts that RAM in the fit's sampling phase).

`choose_sampling_fraction` is `offload.transformer: auto` (or `--offload auto`) for `dittrain sample`: the smallest
fraction on choose_fraction's grid (the same search, prediction.first_fit) whose denoising peak (`peak_reserved`)
fits the budget less PREDICTION_MARGIN, at the sample's larger side squared and its guidance batch. The decode's
peak is left out of the choice: `dittrain sample` decodes tiled where the untiled decode does not fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..models import adapter_class
from ..offload.plan import PlanError, capacity_for, plan_for
from . import timing as ptime
from .prediction import ALLOCATOR_OVERHEAD, GB, GRID, PREDICTION_MARGIN, WORKSPACE, _round2m, first_fit
from .vae import RESERVED_PER_COUNTED, clip_peak

#: activation bytes per image pixel at the peak of a bf16 VAE decode (128 channels at full resolution, several live
#: tensors in the up blocks): coarse, from diffusers' figures for 1024 px; phases.py's sampling phase uses it too
VAE_ACT_DECODE = 12 * 128 * 2
#: frames above this many pixels decode tiled where the untiled decode does not fit, and always while sampling during
#: training (trainer/sampling/placement.py, which reads it)
SAMPLE_TILE_PIXELS = 512 * 512


@dataclass
class SamplePrediction:
    fraction: float
    resolution: int
    ring: int
    peak_reserved: float
    step_s: float
    compute_s: float
    transfer_s: float
    #: peak reserved while the VAE decodes one image untiled next to the placed transformer (`dittrain sample`
    #: decodes tiled where this does not fit: trainer/sampling/placement.py `decode_for_sample`)
    decode_reserved: float = 0.0
    #: bytes the pipeline's KV cache holds from the first step to the end of the call (in both peaks above)
    kv_cache: float = 0.0
    #: bytes of the family's other sampling transformers (`sampling_components`) placed at this fraction (in both
    #: peaks above)
    others: float = 0.0
    #: bytes of the pipeline's prompt inputs held on the device through the call (the family's `sampling_prompt`
    #: and `sampling_prompt_bytes`; in both peaks above)
    prompt: float = 0.0
    #: peak reserved while the VAE decodes tiled instead (trainer/sampling/placement.py `tile_decode`: 512 px tiles
    #: for an image, a video VAE's own tiles, HunyuanVideo 1.5's in its time chunks) above 512x512 pixels; the
    #: untiled figure at or below
    decode_tiled: float = 0.0


def kv_cache_bytes(facts, tr, res: int, batch: int = 1) -> float:
    """What the family's pipeline keeps in its KV cache while it samples at `res` (0 without one): the prompt's
    share of every block's keys and values, compiled or not (see the module essay)."""
    cls = facts.adapter
    if not cls.sampling_kv_cache:
        return 0.0
    kv = batch * sum(tr.block_kv)
    text = facts.text_tokens
    return kv * text / (text + cls.full_image_tokens(res, res))


def cfg_batch(family: str, guidance: float) -> int:
    """The batch the family's pipeline denoises per image: its `guided_batch` where it runs classifier-free guidance."""
    cls = adapter_class(family)
    return cls.guided_batch if cls.runs_cfg(guidance) else 1


def _block_in_out(tr) -> int:
    """A block's inputs and outputs at the largest, with the inputs every block takes held once for the call."""
    shared = tr.block_shared_inputs or [0] * len(tr.block_inputs)
    return 2 * max(i - s for i, s in zip(tr.block_inputs, shared, strict=True)) + sum(shared)


def predict_sampling(facts, fraction: float, res: int, rates: ptime.Rates | None = None,
                     batch: int = 1, size: tuple[int, int, int] | None = None) -> SamplePrediction:
    """The denoising loop and the decode at bucket `res` (`Facts.size`: an image family's res x res), or at `size`
    (width, height, frames): a video family's sample of `sample.frames` frames."""
    rates = rates or ptime.reference_rates()
    w, h, frames = size or facts.size(res)
    tr = facts.trace_at(w, h, frames)
    packed = facts.packed if facts.method == "lora" else facts.block_param_bytes
    if fraction <= 0.0:
        ring, moved = sum(packed), 0
    else:
        ring = capacity_for(packed, fraction)
        moved = plan_for(packed, ring, "sample").bytes_per_step()
    act = batch * (_block_in_out(tr) + 2 * max(tr.block_largest) + tr.outside_saved)
    kv = kv_cache_bytes(facts, tr, res, batch)
    # a family whose samples also run other transformers of the same size (`sampling_components`: Ideogram 4's
    # unconditional one) places each at this fraction too: their rings and non-block weights sit beside this one's,
    # and each step runs and streams each of them (counted at the trained one's size and tokens: an upper bound)
    placed = 1 + len(facts.adapter.sampling_components)
    others = (placed - 1) * (_round2m(ring) + _round2m(facts.nonblock_bytes))
    weights = _round2m(ring) + _round2m(facts.nonblock_bytes) + others
    # the pipeline's prompt inputs: held through the call, and their preparation's transients before the loop,
    # when no block runs (`sampling_prompt`: Ideogram 4's fp32 features over its 2048-token window and their
    # projection, 0.44 + 1.31 GB at full size)
    held, prep = facts.adapter.sampling_prompt
    held += _prompt_bytes(facts, batch)  # LTX-2's packed connector outputs and sound decoders
    reserved = weights + kv + held + ALLOCATOR_OVERHEAD * max(act, prep) + WORKSPACE
    compute = placed * batch * (tr.linear_flops + tr.attn_flops) / ptime.forward_rate(rates, res)
    transfer = placed * moved / rates.h2d
    tiles = w * h > SAMPLE_TILE_PIXELS
    if facts.vae_config is None:  # an image: bytes per pixel
        dec_act = ALLOCATOR_OVERHEAD * w * h * VAE_ACT_DECODE
        tiled_act = ALLOCATOR_OVERHEAD * min(w * h, SAMPLE_TILE_PIXELS) * VAE_ACT_DECODE
    else:  # a clip: the video VAE's own decode, counted on the meta device (planner/vae.py), untiled and tiled
        dec_act, tiled_act = (RESERVED_PER_COUNTED * clip_peak(facts.family, facts.vae_config, facts.dtype, "decode",
                                                               w, h, frames, tiled=t) for t in (False, tiles))
    beside = weights + facts.adapter.vae_params * 2 + kv + held + WORKSPACE
    return SamplePrediction(fraction, res, ring, reserved, max(compute, transfer), compute, transfer, beside + dec_act,
                            kv, others, held, beside + tiled_act)


def _prompt_bytes(facts, batch: int) -> float:
    """What the pipeline's call holds for its prompts from start to end where the family counts it
    (`sampling_prompt_bytes`: LTX-2's packed connector outputs and its sound decoders); 0 elsewhere: the prompts'
    embeddings are small beside the denoising activations."""
    return float(facts.adapter.sampling_prompt_bytes(batch, facts.dtype.itemsize))


def choose_sampling_fraction(facts, budget_gb: float, width: int, height: int, batch: int = 1, log=print,
                             frames: int = 1) -> float:
    """`dittrain sample`'s auto: the smallest grid fraction whose predicted denoising peak at max(width, height)
    px (a video family: width x height x `frames`) fits `budget_gb` less PREDICTION_MARGIN; 1.0 with a warning line
    when none does (the prediction may be pessimistic, and 1.0 is the least the transformer can hold)."""
    res = max(width, height)
    size = (width, height, frames) if facts.adapter.video else None
    limit = budget_gb * GB * (1 - PREDICTION_MARGIN)
    peaks: dict[float, float] = {}

    def peak(f: float) -> float:
        if f not in peaks:
            try:
                peaks[f] = predict_sampling(facts, f, res, batch=batch, size=size).peak_reserved
            except PlanError:  # a block larger than the ring this fraction leaves
                peaks[f] = math.inf
        return peaks[f]

    fit = first_fit(lambda f: peak(f) <= limit, GRID)
    shown = f"{width}x{height}" + (f"x{frames}" if size and frames > 1 else "")
    if fit is None:
        log(f"offload: auto -> 1.0 for sampling {shown}, but the prediction ({peak(1.0) / GB:.1f} GB) exceeds the "
            f"{budget_gb:.1f} GB budget: it may run out of memory (lower --width/--height)")
        return 1.0
    log(f"offload: auto -> {fit:g} for sampling {shown} (predicted {peak(fit) / GB:.1f} GB of the "
        f"{budget_gb:.1f} GB budget)")
    return fit
