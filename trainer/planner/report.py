"""The text of `dittrain plan`: components, activations per bucket, a table per offload fraction and the
assumptions. Numbers come from trainer/planner/prediction.py; nothing is computed here that the planner does not
also use to choose a fraction."""

from __future__ import annotations

from dataclasses import replace

import torch

from .. import quant
from ..dtypes import DTYPES
from ..errors import UserError
from ..offload.plan import kept_blocks
from . import timing as ptime
from .phases import arena_shared, fit_text_fraction, predict_phases, run_ram_peaks, text_sizes
from .phases import table as phase_table
from .prediction import (
    ALLOCATOR_OVERHEAD,
    DISK_READ,
    GB,
    TABLE_FRACTIONS,
    WORKSPACE,
    Facts,
    _fraction_of,
    analyze,
    choose_fraction,
    node_arena_words,
    node_ram_of_processes,
    physical_ram,
    predict,
    shared_arena_bytes,
    streaming,
    with_owned_steps,
)
from .sampling import cfg_batch, predict_sampling
from .text import table as _table
from .text import terminal_width, wrap

_DTYPE_NAMES = {**{v: k for k, v in DTYPES.items()}, torch.float8_e4m3fn: "fp8", torch.int8: "int8"}


def _gb(n: float) -> str:
    return f"{n / GB:.2f}"


def report(
    cfg,
    vram_gb: float | None = None,
    ram_gb: float | None = None,
    rates: ptime.Rates | None = None,
    facts: Facts | None = None,
    width: int | None = None,
    gpus: int = 1,
) -> tuple[list[str], float | None]:
    """The lines `dittrain plan` prints, and the chosen fraction (None when no budget was given); with `width`,
    fitted to that many columns (trainer/planner/text.py); `gpus` > 1: also the step of each of that many
    processes of one host (`_several`; a full fine-tune: the node's RAM and owned steps' VRAM, `_several_full`), and
    the phases as one of them holds them (`_phases`).

    The sections, in order: what is trained; with --vram or offload.transformer: auto and a budget, `auto`'s choice
    of fraction; with train.gradient_checkpointing: auto, the blocks that keep their activations (counted in the
    training step's phase below); the components at the fraction shown (the chosen one, else the config's, else 0);
    activations per bucket; the table per fraction; with `gpus`, the processes of one host; sampling; the phases
    of `fit`; with `ram_gb`, the RAM verdict; the assumptions."""
    facts = facts or analyze(cfg)
    if ram_gb is not None and facts.host_ram is None:  # offload.park: auto plans for the RAM `--ram` names
        facts = replace(facts, host_ram=ram_gb * GB)
    rates = rates or ptime.reference_rates()
    act = cfg.offload.activations
    big = max(facts.resolutions)
    budget = vram_gb if vram_gb is not None else cfg.offload.vram_budget_gb
    lines = _title(cfg, facts)
    # a fraction is chosen for --vram or offload.transformer: auto; a config that names its own (a preset whose
    # train.gradient_checkpointing: auto plans in offload.vram_budget_gb) is shown at it
    asks = vram_gb is not None or cfg.offload.transformer == "auto"
    choice, chosen = _choice(cfg, facts, budget if asks else None)
    lines += choice
    shown = chosen if chosen is not None else (_fraction_of(cfg) or 0.0)
    kept: frozenset[int] = frozenset()
    if cfg.train.gradient_checkpointing == "auto":
        more, kept = _checkpointing(cfg, facts, shown, budget)
        lines += more
    lines += _components(cfg, facts, shown, width)
    lines += _activations(facts, width)
    fractions = _table_fractions(cfg, facts, chosen)
    lines += _per_fraction(cfg, facts, fractions, chosen, rates, width)
    if gpus > 1:
        several = _several if facts.method == "lora" else _several_full
        lines += several(facts, [f for f in fractions if f > 0], big, act, rates, gpus, width)
    s = cfg.sample  # a video family samples the config's clip (`dittrain sample`'s default); images the bucket
    clip = (s.width, s.height, s.frames) if facts.adapter.video else None
    lines += _sampling(facts, fractions, big, rates, cfg_batch(facts.family, s.guidance), width, clip)
    lines += _phases(cfg, facts, shown, budget, width, kept, gpus)
    lines += _experts(cfg, facts, shown, act, rates)
    if ram_gb is not None:
        lines.append(_ram_line(facts, shown, ram_gb, act, rates)[0])
    lines += _assumptions(facts, rates)
    return wrap(lines, width), chosen


def _title(cfg, facts: Facts) -> list[str]:
    """What is trained (family, method, batch, buckets, clip length), the weights' storage and the model's
    source, then a blank line."""
    if facts.method == "lora":
        method = f" rank {cfg.lora.rank}"
    elif facts.fused:
        method = f" ({facts.optimizer}, fused back pass)"
    else:
        method = f" ({facts.optimizer})"
    m = cfg.model
    return [
        f"dittrain plan: {facts.family} {facts.method}{method}, batch {facts.batch}, "
        f"buckets {', '.join(map(str, facts.resolutions))} px"
        + (f", clips of {facts.frames} frames" if facts.adapter.video else ""),
        quant.describe(m.quantize, m.quantize_modulation, m.dtype, m.fp8_matmul)
        + ("; LoRA fp32" if facts.method == "lora" else ""),
        f"model: {facts.source}",
        "",
    ]


def _choice(cfg, facts: Facts, budget: float | None) -> tuple[list[str], float | None]:
    """With a VRAM budget (GB): the fraction `auto` picks for it and the planner's reasoning lines, then a
    blank line; without one, no lines and None."""
    if budget is None:
        return [], None
    lines: list[str] = []
    chosen = choose_fraction(cfg, budget, facts=facts, log=lines.append)
    return [*lines, ""], chosen


def _checkpointing(cfg, facts: Facts, fraction: float, budget: float | None) -> tuple[list[str], frozenset[int]]:
    """train.gradient_checkpointing: auto: which blocks keep their activations at `fraction`, and the cost
    (trainer/planner/checkpointing.py), then a blank line; and those blocks."""
    from .checkpointing import choose_checkpointing

    lines: list[str] = []
    budget_bytes = budget * GB if budget is not None else None
    choice = choose_checkpointing(cfg, fraction, budget_bytes, facts=facts, log=lines.append)
    return [*lines, ""], kept_blocks(choice.checkpointed)


def _components(cfg, facts: Facts, fraction: float, width: int | None) -> list[str]:
    """The table of what takes memory at `fraction` (blocks, the rest of the transformer, the trainable part,
    the text encoders; total, on the GPU, in pinned host RAM) and whether the text encoders run during
    training."""
    rows = [("component", "params (B)", "dtype", "GB", "on GPU GB", "pinned host GB", "note")]
    rows += _block_rows(cfg, facts, fraction)
    rows += _text_encoder_rows(cfg, facts)
    cached = cfg.data is None or cfg.data.cache
    return [
        *_table(rows, note=True, width=width),
        "text encoders run "
        + (
            "in `dittrain cache` only (data.cache: true): not in the training peak"
            if cached
            else "during training (data.cache: false): add their resident GB"
        ),
    ]


def _block_rows(cfg, facts: Facts, fraction: float) -> list[tuple]:
    """The components table's rows of the transformer: its blocks (ring, host copies and copies per step at
    `fraction`), the rest of it, and the trainable part (a LoRA with its optimizer, or a full fine-tune's
    optimizer state and gradients)."""
    total_blocks = sum(facts.packed)
    ring, pinned, h2d = streaming(facts.packed, fraction)
    # Parameters counted, not bytes divided by the model dtype's size (an 8-bit base has half the bytes, not half
    # the parameters); the LoRA's own parameters sit inside the blocks and are counted on their row
    frozen = [p for b in facts.blocks for p in b.parameters() if not (facts.method == "lora" and p.requires_grad)]
    nparams = sum(p.numel() for p in frozen)
    # the quantized dtype first, then by name (a set's order changes with each process's string hashes)
    stored = sorted({_DTYPE_NAMES.get(p.dtype, str(p.dtype)) for p in frozen},
                    key=lambda n: (n != cfg.model.quantize, n))
    if fraction > 0:
        copies = "every block" if pinned >= total_blocks else f"{_gb(pinned)} GB of blocks"
        note = f"f={fraction:.2f}: ring {_gb(ring)} GB; host copies of {copies}; {_gb(h2d)} GB H2D per step"
    else:
        note = "f=0: resident"
    rows = [
        (f"transformer blocks ({len(facts.blocks)})", f"{nparams / 1e9:.2f}", "+".join(stored),
         _gb(total_blocks), _gb(ring), _gb(pinned), note),
        ("transformer non-block", f"{facts.nonblock_params / 1e9:.2f}", cfg.model.dtype,
         _gb(facts.nonblock_bytes), _gb(facts.nonblock_bytes), "0.00", "embedders, final norm and projection"),
    ]
    big, act = max(facts.resolutions), cfg.offload.activations
    if facts.method == "lora":
        rows.append((f"LoRA (fp32 + {facts.optimizer})", f"{facts.trainable_params / 1e9:.3f}", "fp32",
                     _gb(facts.trainable_params * 4), _gb(predict(facts, 0.0, big, act).trainable), "0.00",
                     "weights, gradients and optimizer state"))
    else:
        p = predict(facts, fraction, big, act)
        state_host = p.pinned - pinned
        masters = " + master weights" if cfg.optimizer.master_weights else ""  # 4 bytes per parameter more
        rows.append((f"optimizer state ({facts.optimizer}{masters}, fp32) + gradients", "-", "fp32",
                     _gb(sum(facts.block_states) + facts.state_gpu), _gb(p.trainable), _gb(state_host),
                     "streamed blocks' state in pinned RAM, on the GPU while its parameter steps"
                     if state_host else "all on the GPU"))
    return rows


def _text_encoder_rows(cfg, facts: Facts) -> list[tuple]:
    """The components table's rows of the text encoders, as the loader builds and slims them, at
    offload.text_encoders (the ring holds whole blocks)."""
    f_te = cfg.offload.text_encoders
    dtype = cfg.model.dtype if cfg.model.quantize_text_encoders == "none" else cfg.model.quantize_text_encoders
    rows = []
    for size in text_sizes(facts):
        gpu = size.on_gpu(f_te)
        rows.append((f"text encoder {size.name}", "-", dtype, _gb(size.gpu), _gb(gpu), _gb(size.gpu - gpu),
                     f"f={f_te:.2f} (offload.text_encoders)"))
    return rows


def _activations(facts: Facts, width: int | None) -> list[str]:
    """Activations per bucket, resident: the checkpointed block inputs, one block's backward working set and the
    rest; and with activation offloading, what stays on the GPU and what goes to the host."""
    video = facts.adapter.video
    title = (
        "Activations per bucket (GB; checkpoint inputs of all blocks, one block's backward working set"
        + (f", its token-wise sub-layers in {facts.nano_batches} token chunks: offload.nano_batches"
           if facts.nano_batches > 1 else "") + "):"
    )
    rows = [("bucket", "clip+text tokens" if video else "image+text tokens", "ckpt inputs", "block working set",
             "other", "with act. offload: GPU", "host")]
    for res in facts.resolutions:
        p0, p1 = predict(facts, 0.0, res, False), predict(facts, 0.0, res, True)
        n_img = facts.tokens(res) * (1 + facts.references)  # + references
        w, h, frames = facts.size(res)
        rows.append(
            (
                f"{res} px" + (f" ({w}x{h}x{frames})" if video else ""),
                f"{n_img}+{facts.text_tokens}",
                _gb(p0.act_checkpoint_gpu),
                _gb(p0.act_block),
                _gb(p0.act_other),
                _gb(p1.act_checkpoint_gpu + p1.act_block + p1.act_other),
                _gb(p1.act_checkpoint_host),
            )
        )
    return ["", title, *_table(rows, width=width)]


def _table_fractions(cfg, facts: Facts, chosen: float | None) -> list[float]:
    """The fractions the per-fraction and sampling tables show: the usual ones (`TABLE_FRACTIONS`), the chosen
    one and the config's; only 0 where blocks cannot stream (no gradient checkpointing, or a full fine-tune
    without the fused back pass)."""
    if not facts.checkpointing or (facts.method == "full" and not facts.fused):
        return [0.0]
    frac = _fraction_of(cfg)
    return sorted(
        set(TABLE_FRACTIONS)
        | ({chosen} if chosen is not None else set())
        | ({frac} if frac is not None else set())
    )


def _per_fraction(cfg, facts: Facts, fractions: list[float], chosen: float | None, rates,
                  width: int | None) -> list[str]:
    """The table per offload fraction at the largest bucket: memory (ring, trainable, activations, peaks, RAM)
    and the step's time (GPU, host, PCIe alone, and the replayed step against the resident one); the chosen
    fraction, else the config's, marked."""
    act, big, frac = cfg.offload.activations, max(facts.resolutions), _fraction_of(cfg)
    base = predict(facts, 0.0, big, False, rates)
    rows = [("fraction", "ring", "trainable", "activations", "peak alloc", "peak reserved", "pinned RAM", "peak RAM",
             "GPU", "host", "PCIe", "step", "vs resident")]
    for f in fractions:
        p = predict(facts, f, big, act, rates)
        mark = (
            " <- chosen"
            if chosen is not None and f == chosen
            else (" <- config" if frac == f and chosen is None else "")
        )
        rows.append(
            (
                f"{f:.2f}{mark}",
                _gb(p.ring),
                _gb(p.trainable),
                _gb(p.act_checkpoint_gpu + p.act_block + p.act_other),
                _gb(p.peak_allocated),
                _gb(p.peak_reserved),
                _gb(p.pinned + p.act_checkpoint_host),
                _gb(p.ram_peak),
                f"{p.compute_s:.2f}",
                f"{p.host_s:.2f}",
                f"{p.transfer_s:.2f}",
                f"{p.step_s:.2f}",
                f"{p.step_s / base.step_s:.2f}x",
            )
        )
    return [
        "",
        f"Per fraction at the largest bucket ({big} px), activation offloading {'on' if act else 'off'} (GB, s):",
        *_table(rows, width=width),
    ]


def _assumptions(facts: Facts, rates) -> list[str]:
    """The closing list of what the predictions assume: the rates, the reserved-memory and working-set models,
    the tokens and clips, the step's replay."""
    video = facts.adapter.video
    return [
        "",
        "Assumptions (predictions, not measurements):",
        f"- rates: {rates.source}",
        f"- peak reserved = static allocations (2 MiB rounded) + {ALLOCATOR_OVERHEAD:.2f} x the varying part (activations, gradients) + "
        f"{WORKSPACE / GB:.2f} GB workspaces; the CUDA context (0.5-1 GB) comes on top",
        "- block working set = saved tensors of one block's recompute (flash attention, fused RMS norm) "
        "+ 2 x its inputs + 2 x its largest saved tensor or, where more, its attention's backward (q, k, v "
        "gradients and flash attention's fp32 dq) (backward transients, estimated)",
        f"- text tokens per caption: {facts.text_tokens}; "
        + (f"clips of {facts.frames} frames ({facts.adapter.latent_frames(facts.frames)} latent "
           "frames) in the bucket of res nearest the square (data.bucket_step); the VAE's clip encode and decode "
           "counted on the meta device" if video else "square buckets of res x res pixels"),
        "- step: the host's launches, the GPU's kernels and the conductor's copies replayed block by block "
        "over the offload plan (GPU = kernels alone, host = launches alone, PCIe = copies alone); without a GPU "
        "measurement, GPU time scales the reference by FLOPs and host time by traced operations",
    ]


def _experts(cfg, facts: Facts, fraction: float, act: bool, rates) -> list[str]:
    """model.expert: both: where the idle expert waits (offload.park, resolved: auto by the whole run's RAM peak
    with either park against offload.host_ram_gb or this machine's RAM) and, for ram and disk, that peak (the
    largest phase of `fit`) and one switch's seconds (the disk read at DISK_READ, assumed)."""
    if facts.experts <= 1:
        return []
    res = max(facts.resolutions)
    both = {m: predict(replace(facts, park=m), fraction, res, act, rates) for m in ("ram", "disk")}
    peaks = run_ram_peaks(cfg, fraction, facts)
    chosen = "disk" if facts.parks_on_disk_at(fraction) else "ram"
    why = ""
    if facts.park == "auto":
        budget = facts.host_ram if facts.host_ram is not None else physical_ram()
        where = "offload.host_ram_gb" if facts.host_ram is not None else "this machine's RAM"
        why = f" -> {chosen} (the {budget / GB:.1f} GB of {where})"
    return ["", f"Experts ({facts.experts} in one run, model.expert: both): offload.park: {facts.park}{why}; "
            + "; ".join(f"{m}: RAM peak {peaks[m] / GB:.1f} GB (largest phase), a switch {p.switch_s:.1f} s"
                        for m, p in both.items())
            + f" (disk: the incoming expert's blocks read at {DISK_READ / GB:.0f} GB/s, assumed; half a switch a step)"]


def _ram_line(facts: Facts, fraction: float, ram_gb: float, act: bool, rates) -> tuple[str, bool]:
    """`--ram`'s verdict line, and whether the peak fits."""
    p = predict(facts, fraction, max(facts.resolutions), act, rates)
    host = (p.pinned + p.act_checkpoint_host) / GB
    fits = p.ram_peak / GB <= ram_gb
    return (f"RAM {ram_gb:g} GB: pinned {host:.1f} GB, peak while loading {p.ram_peak / GB:.1f} GB: "
            f"{'fits' if fits else 'does NOT fit'}"), fits


class DoesNotFit(UserError):
    """`dittrain plan --ram` found the run's host memory over the budget: exit 1 after the table (scripts test it)."""

    label = ""


def _phases(cfg, facts: Facts, fraction: float, budget: float | None, width: int | None = None,
            kept: frozenset[int] = frozenset(), gpus: int = 1) -> list[str]:
    """Every phase of `fit` (trainer/planner/phases.py), the training step with the blocks `kept` keeping their
    activations; with a budget, the text-encoder share that fits it. `gpus` > 1: one of that many processes of one
    host, as the trainer's phase lines give it under torchrun (its RAM without a shared arena, which is said once
    for the node; a full fine-tune's owned steps: its VRAM and 1/N of the state)."""
    te = float(cfg.offload.text_encoders)
    out = []
    if budget is not None:
        need = fit_text_fraction(facts, budget, cfg.data.encode_batch_size if cfg.data else 4)
        if need > te:
            out.append(f"text caching needs offload.text_encoders >= {need:.2f} for {budget:g} GB (config: {te:g}); "
                       "the table uses it")
            te = need
    shared = arena_shared(cfg, fraction, gpus)
    table = phase_table(predict_phases(cfg, fraction, facts, te, None if budget is None else budget * GB, kept,
                                       processes=gpus, shared=shared), budget, width)
    if gpus > 1:
        out.append(f"one of {gpus} processes of one host" + (
            f"; {node_arena_words(shared_arena_bytes(facts, fraction, gpus, shared), gpus)} (not in the RAM column)"
            if shared else
            "; each process has its own arena, in the RAM column"))
    return table[:2] + out + table[2:]


def _several(facts: Facts, fractions, res: int, act: bool, rates, gpus: int, width: int | None) -> list[str]:
    """`--gpus N`: each process's step when N processes of one host stream at once, copying whole blocks (the host's
    copy bandwidth shared) or through the sharded stream (offload.sharded_stream; timing.for_processes)."""
    if not fractions:
        return []
    one = {f: predict(facts, f, res, act, rates).step_s for f in fractions}
    rows = [("fraction", "1 GPU step", "whole copies step", "sharded step", "x 1 GPU (whole)", "x 1 GPU (sharded)")]
    for f in fractions:
        whole = predict(facts, f, res, act, ptime.for_processes(rates, gpus, False)).step_s
        shard = predict(facts, f, res, act, ptime.for_processes(rates, gpus, True)).step_s
        rows.append((f"{f:.2f}", f"{one[f]:.2f}", f"{whole:.2f}", f"{shard:.2f}", f"{gpus * one[f] / whole:.2f}x",
                     f"{gpus * one[f] / shard:.2f}x"))
    return [
        "",
        f"{gpus} GPUs of one host, each streaming at the largest bucket (s; samples/s against one streaming GPU). "
        f"Assumed: the host's copies {ptime.HOST_H2D_TOTAL / 1e9:.0f} GB/s in all, all-gathers at "
        f"{(ptime.GATHER_BUS_2 if gpus == 2 else ptime.GATHER_BUS_MORE) / 1e9:.0f} GB/s bus bandwidth (4 x H200 "
        "with NVLink; without peer access the sharded stream is off):",
        *_table(rows, width=width),
    ]


def _several_full(facts: Facts, fractions, res: int, act: bool, rates, gpus: int, width: int | None) -> list[str]:
    """`--gpus N`, a full fine-tune: the node's RAM with whole copies against owned steps (trainer/train/owners.py,
    the sharded stream: one arena, 1/N of the optimizer state each); their step times are not modelled."""
    if not fractions:
        return []
    rows = [("fraction", "whole copies: node RAM", "owned steps: node RAM", "owned steps: VRAM a GPU")]
    owners = with_owned_steps(facts, gpus)
    for f in fractions:
        whole, owned = node_ram_of_processes(facts, predict(facts, f, res, act, rates), f, gpus)
        rows.append((f"{f:.2f}", _gb(whole), _gb(owned), _gb(predict(owners, f, res, act, rates).peak_reserved)))
    return ["", f"{gpus} GPUs of one host, a full fine-tune: host RAM of the node with whole copies per process (each "
                "GPU's VRAM as one GPU's), and with the sharded stream's owned steps (offload.sharded_stream; each "
                "process steps 1/N of the weights; the ring holds the weights alone). Step times of owned steps are "
                "not modelled (measured: docs/multi-gpu.md):",
            *_table(rows, width=width)]


def _sampling(facts: Facts, fractions, res: int, rates, batch: int = 1, width: int | None = None,
              clip: tuple[int, int, int] | None = None) -> list[str]:
    """`dittrain sample --offload F`: the denoising loop alone (trainer/planner/sampling.py), at `res` px or, for a
    video family, at `clip` (width, height, frames)."""
    base = predict_sampling(facts, 0.0, res, rates, batch, size=clip)
    rows = [("fraction", "ring", "peak reserved", "untiled decode", "tiled decode", "compute", "transfer", "s / step",
             "vs resident")]
    for f in sorted(set(fractions) | {1.0}):
        p = predict_sampling(facts, f, res, rates, batch, size=clip)
        rows.append(
            (
                f"{f:.2f}",
                _gb(p.ring),
                _gb(p.peak_reserved),
                _gb(p.decode_reserved),
                _gb(p.decode_tiled),
                f"{p.compute_s:.2f}",
                f"{p.transfer_s:.2f}",
                f"{p.step_s:.2f}",
                f"{p.step_s / base.step_s:.2f}x",
            )
        )
    where = f"{clip[0]}x{clip[1]}x{clip[2]} (sample.width x height x frames)" if clip else f"{res} px"
    return [
        "",
        f"Sampling at {where}, batch {batch}{' (classifier-free guidance)' if batch > 1 else ''}, denoising steps (GB, s; "
        "streamed blocks are reloaded every step, part of the model stays resident; text encoders not included). The VAE decode after them reserves "
        "'untiled decode' where it decodes as the pipeline does; `dittrain sample` decodes tiled where that does not "
        "fit the card ('tiled decode': 512 px tiles, or a video VAE's own):",
        *_table(rows, width=width),
    ]


def run_plan(cfg, vram_gb: float | None = None, ram_gb: float | None = None, gpus: int = 1) -> None:
    """`dittrain plan`: print the table; with a GPU present, measure its copy rates and one block first."""
    facts = analyze(cfg)
    rates = None
    if torch.cuda.is_available():
        try:
            from .measure import measure

            rates = measure(facts)
        except Exception as e:  # noqa: BLE001 - a failed measurement must not stop the plan
            print(f"(GPU measurement failed: {type(e).__name__}: {e}; using the reference figures)")
    lines, chosen = report(cfg, vram_gb=vram_gb, ram_gb=ram_gb, rates=rates, facts=facts, width=terminal_width(),
                           gpus=gpus)
    print("\n".join(lines))
    if ram_gb is not None:
        fraction = chosen if chosen is not None else (_fraction_of(cfg) or 0.0)
        line, fits = _ram_line(facts, fraction, ram_gb, cfg.offload.activations, rates or ptime.reference_rates())
        if not fits:  # a VRAM budget that cannot be met already fails in choose_fraction
            m = cfg.model
            fixes = ["a lower offload.transformer pins less RAM (and needs more VRAM)"]
            if m.quantize == "none":
                fixes.append("model.quantize: fp8 halves the blocks' bytes")
            elif not m.quantize_modulation:
                fixes.append("model.quantize_modulation: true makes the modulation Linears 8-bit too")
            raise DoesNotFit(f"{line}: {'; '.join(fixes)}; or a machine with more RAM")
