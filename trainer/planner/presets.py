"""Writes the sized presets `configs/<family>/<lora|full>-<N>gb.yaml` from the planner's predictions.

    python -m trainer.planner.presets [--out configs] [--families FAMILY ...]

For every family, method and card size the planner picks, in order of preference, the first setting that fits
the card minus `HEADROOM_GB` (CUDA context and other processes; `choose_fraction` keeps its own margin): 1024 px without activation offloading, 1024 px
with it, then 512 px without / with. Within a setting it takes the smallest offload fraction that fits
(`choose_fraction`). A LoRA whose setting recomputes every block without activation offloading then tries
`train.gradient_checkpointing: auto` at the same size (presets_auto.py): the fraction, that one or larger, whose
kept activations give the fastest predicted step, taken where every phase fits and the step is at least
`AUTO_MIN_GAIN` faster; its header says how many blocks it keeps, the predicted GB and step against recomputing
every block. A combination where nothing fits gets no file; `configs/README.md` lists them with
the reason. The header of each file carries the planner's predictions (VRAM, RAM, speed relative to the same
training without offloading); they are predictions until bench/speed/bench_plan.py measures them.

A video family's (`video`) ladder is the clip instead of the side (`VIDEO_CLIPS`): 720p x 81 frames, 480p x 81,
then fewer frames at 480p (49, 33), each without checkpointing, with it, then with activation offloading; then the
clip one rung longer than the longest that fits (the shortest where none does) with the blocks' token-wise sub-layers
in `NANO_BATCHES` token chunks too (offload.nano_batches), taken where it fits: a card pays the chunks' extra step
time only for a longer clip. One rung only, a choice: each rung has 1.4-2.3 x the tokens of the one below, while the
chunks took 32 % off the measured peak (Wan 2.1 14B at 480p x 81), and each clip tried costs the planner two compiles
of the block on meta (planner/compiled_saves.py `chunk_saving`). The preset names its size as
`data.resolutions: [480p]` (trainer/config.py `video_resolution`), samples that frame at the clip's length, and its
header says which rung it took (and, with chunks, that without them the clip is predicted not to fit). A family of
experts (Wan 2.2 A14B) trains the
`model.expert` its presets name (`EXPERT`: both experts in one run for a LoRA, trainer/train/experts.py; one for a
full fine-tune, the other the same size) with sampling during training off: a sample needs every expert, which the
planner does not count. Both experts' blocks are counted in RAM (offload.park: ram); where the whole run's predicted
RAM peak (its largest phase, activations included) with them exceeds the RAM assumed beside the card and with one
expert's does not (offload.park: auto's rule, prediction.py `auto_parks_on_disk`), the preset parks the idle expert
on disk (`offload.park: disk`:
its blocks read back from its files at each change of expert, the switch's seconds in the header). So does a family whose samples run further transformers (`sampling_components`:
Ideogram 4's unconditional one).
A family's other published sizes with presets of their own (`preset_variants`: Wan2.1-T2V-1.3B beside the 14 B) get
`configs/<family>-<size>/` (`wan-1.3b`), planned the same way at that size (models/base.py `ModelAdapter.sized`), for
the cards it declares; their model.path names the size, which is how `dittrain plan` of such a preset counts that size
without the folder (planner/meta.py `transformer_config`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..config import Config, video_frame, video_resolution
from ..errors import UserError
from ..models import ADAPTERS, preset_class, preset_folder
from ..optim.specs import OPTIMIZERS
from .phases import fit_text_fraction, predict_phases, run_ram_peaks
from .prediction import (
    DISK_READ,
    PREDICTION_MARGIN,
    Prediction,
    analyze,
    auto_parks_on_disk,
    choose_fraction,
    predict,
)
from .presets_auto import AUTO_MIN_GAIN, Kept, auto_budget_gb, fastest_kept, streamed_of
from .presets_auto import header_lines as auto_header_lines

HEADROOM_GB = 1.0


def device_budget_bytes(device) -> float:
    """The bytes an `auto` placement plans in on CUDA `device` (`dittrain sample`, `dittrain caption`): the card less
    `HEADROOM_GB` (the CUDA context and whatever else outside the caching allocator), or this process's cap where one
    is set below that (`set_per_process_memory_fraction`, as `DITTRAIN_VRAM_CAP_GB` sets): a cap already stands for the
    card less its context, as the benchmarks set it (card - 1 GB), and the allocator can use all of it. On a real 8 GB
    card and under a 7 GB cap on a larger one the budget is then the same 7 GB."""
    import torch

    from . import GB

    total = torch.cuda.get_device_properties(device).total_memory
    return min(total - HEADROOM_GB * GB, total * process_fraction(device))


def process_fraction(device) -> float:
    """This process's cap on CUDA `device` as a fraction of the card (`set_per_process_memory_fraction`, 1.0 where
    none is set); the getter wants an index, which a bare `torch.device("cuda")` lacks."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_per_process_memory_fraction(index)
# (resolution, activation offloading, gradient checkpointing), most preferred first. Without checkpointing a
# step is ~1.4x faster (DESIGN.md: 0.545 s vs 0.775 s) but every block's activations stay: big cards only.
SETTINGS = (
    (1024, False, False),
    (1024, False, True),
    (1024, True, True),
    (512, False, True),
    (512, True, True),
)
#: token chunks a video preset may turn on (trainer/offload/nano.py): the measured setting, Wan 2.1 14B at
#: 480p x 81 on an H200, 12.92 GB reserved against 19.10 without, +6.4 % step (bench/history/2026-11-27.md 12:05)
NANO_BATCHES = 16
# A video family's clips (video height as `<N>p`, frames), most preferred first, each tried with the three
# (activation offloading, gradient checkpointing) settings of 1024 px above: Wan's 720p and 480p at its 81 frames
# (5 s at 16 fps), then shorter 480p clips where nothing longer fits.
VIDEO_CLIPS = (("720p", 81), ("480p", 81), ("480p", 49), ("480p", 33))
# (activation offloading, gradient checkpointing) at each clip, most preferred first; then `NANO_BATCHES` (_first_fit)
VIDEO_SETTINGS = ((False, False), (False, True), (True, True))
# the expert(s) a family of experts' presets train, per method: LoRA both in one run (model.expert: both); a full
# fine-tune one per run (the other is the same size)
EXPERT = {"lora": "both", "full": "high_noise"}
# Host RAM a preset may assume: workstations with <= 24 GB cards, servers with 48 / 80 GB cards.
RAM_GB = {8: 128, 12: 128, 16: 128, 24: 128, 48: 256, 80: 256}
# LoRA presets for these cards switch to an fp8 base (model.quantize: fp8) where the bf16 one would not fit the
# card, or would need more host RAM than SMALL_RAM_GB: the 32 GB machine most users of 8-16 GB cards have.
FP8_CARDS = (8, 12, 16)
SMALL_RAM_GB = 32
# LoRA presets for these cards may take train.gradient_checkpointing: auto (presets_auto.py). 24 GB cards since a
# GPU run of Flux.1-dev's 48 GB preset through `fit` (57 blocks kept, 30 of them streamed) reserved 44.1 GB where the
# planner predicted 45.1 GB: the kept-block count errs on the safe side by more than the 0.7 GB margin of a 24 GB
# card, about one kept block at 1024 px (0.6 GB for Flux.1). Not yet 12-16 GB cards, though the generator predicts
# 2-30 % faster steps there (Flux.1 2 and 5 %, Flux.2 klein 0.43 -> 0.30 s): their margin (3 % of 11-15 GB, 0.3-0.45
# GB) is less than one kept block, the one run measured 57 kept blocks and not the 3-26 those presets would keep, and
# Qwen-Image's (12 and 16 GB) and Qwen-Image-Edit-Plus's (16 GB) would keep streamed blocks on an fp8 base, which no
# test runs.
AUTO_CARDS = (24, 48, 80)


def _settings(family: str) -> list[tuple[int | str, int, bool, bool]]:
    """(resolution, frames, activation offloading, gradient checkpointing) in order of preference:
    SETTINGS for an image family (frames 1), its clips (`preset_clips`, else VIDEO_CLIPS) x VIDEO_SETTINGS for a
    video family, without chunks (`_first_fit` tries them)."""
    cls = preset_class(family)
    if not cls.video:
        return [(res, 1, act, ckpt) for res, act, ckpt in SETTINGS]
    clips = cls.preset_clips or VIDEO_CLIPS  # the family's own ladder (LTX-2's 121 frames), else Wan's
    return [(name, frames, act, ckpt) for name, frames in clips for act, ckpt in VIDEO_SETTINGS]


def _size(d: dict) -> tuple[int, int]:
    """(resolution in px, frames) a preset dict trains: its preference among the fits (larger first)."""
    res = d["data"]["resolutions"][0]
    return (video_resolution(res) if isinstance(res, str) else res), d["data"].get("clip_frames", 1)


def _frame(family: str, res: int | str) -> tuple[int, int]:
    """The sample's width and height: res x res, or a video family's `<N>p` frame (its height rounded down to the
    family's divisor: Wan 2.2 TI2V-5B's 720p is 1280x704, as Wan 2.2 samples it)."""
    if not isinstance(res, str):
        return res, res
    cls = preset_class(family)
    div = cls.latent_scale * cls.token_patch
    w, h = video_frame(int(res[:-1]))
    return w // div * div, h // div * div


def _config(
    family: str,
    method: str,
    res: int | str,
    act: bool,
    fraction: float = 0.0,
    ckpt: bool = True,
    opt: str = "adamw",
    te: float = 0.0,
    quantize: str = "none",
    frames: int = 1,
    nano: int = 1,
) -> dict:
    full = method == "full"
    cls = preset_class(family)
    width, height = cls.sample_frame(*_frame(family, res))
    expert = {"expert": EXPERT[method]} if cls.experts else {}
    # qwen-image-edit: its captions are encoded with their reference images (~1400 vision tokens at 1024 px), so
    # one at a time; its samples need a reference image
    ref_text = cls.text_uses_reference
    ref_sample = ref_text or cls.sample_needs_reference
    # an fp8 base is chosen for RAM: the modulation Linears in the blocks (a quarter to a third of the block bytes,
    # where a family has them) go to fp8 too (bench/history/2026-11-23.md: loss curve unchanged on the bundled data)
    mod = {"quantize_modulation": True} if cls.modulation_linears else {}
    return {
        "model": {"family": cls.family, "path": cls.example_path, "dtype": "bf16", **expert,
                  **({"quantize": quantize, **mod} if quantize != "none" else {})},
        "train": {
            "method": method,
            "steps": 2000 if full else 1500,
            "batch_size": 1,
            "seed": 42,
            "gradient_checkpointing": ckpt,
            "checkpoint_every": 250,
        },
        **({} if full else {"lora": {"rank": 16, "alpha": 16}}),
        "optimizer": {
            "name": opt,
            "lr": 1.0e-5 if full else 1.0e-4,
            "warmup_steps": 50,
            **({"fused_back_pass": True, "max_grad_norm": None, "stochastic_rounding": True} if full else {}),
        },
        "data": {
            "sources": [{"path": "/path/to/videos" if cls.video else "/path/to/images"}],
            "resolutions": [res],
            **({"clip_frames": frames} if cls.video else {}),
            "cache_dir": f"cache/{family}-{res}" + (f"-{frames}f" if cls.video else ""),
            **({"encode_batch_size": 1} if ref_text else {}),
        },
        "offload": {"transformer": fraction, "text_encoders": te, "activations": act,
                    **({"nano_batches": nano} if nano > 1 else {})},
        "sample": {
            "prompts": ["a cat walks along a wooden fence in the afternoon sun" if cls.video
                        else "a photo of a cat sitting on a wooden table"],
            "every": 250,
            "steps": 28,
            "width": width,
            "height": height,
            **({"frames": frames} if cls.video else {}),
            **cls.sample_defaults,  # a distilled model's steps and guidance
            **({"image": "/path/to/reference.png"} if ref_sample else {}),
            **({"image": "/path/to/first-frame.png"} if cls.first_frame_conditions else {}),  # image-to-video
            # the family's own sampling settings (e.g. Qwen-Image 2.1: 40 steps without guidance)
            **cls.sample_defaults,
        },
        "output": {"dir": f"out/{family}-{method}" + (f"-{EXPERT[method]}" if expert else "")},
    }


def _yaml(d: dict, indent: int = 0) -> list[str]:
    import json

    out = []
    pad = "  " * indent
    for k, v in d.items():
        if isinstance(v, dict):
            out.append(f"{pad}{k}:")
            out += _yaml(v, indent + 1)
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            out.append(f"{pad}{k}:")
            for item in v:
                first, *rest = _yaml(item, indent + 2)
                out.append(f"{pad}  - {first.strip()}")
                out += rest
        elif isinstance(v, bool):
            out.append(f"{pad}{k}: {'true' if v else 'false'}")
        elif v is None:
            out.append(f"{pad}{k}: null")
        elif isinstance(v, str):
            out.append(f"{pad}{k}: {json.dumps(v) if any(c in v for c in ':#') else v}")
        else:
            out.append(f"{pad}{k}: {json.dumps(v)}")
    return out


def _first_fit(family, method, card, opt, cache, quantize="none", ram_gb=None):
    """The first setting of `_settings` that fits (see `_fit`), for a LoRA that recomputes every block without
    activation offloading then `auto` at the same size where it is faster (`_with_auto`); for a video family, then
    its clip one rung longer with `NANO_BATCHES` token chunks where they make it fit (the rung above the longest clip
    that fits without them, or the shortest where none does: only there can the chunks lift the card, whose step
    they make slower). (config dict, prediction, step seconds without offloading, phases, `Kept` or None), or why
    nothing fits."""
    last = ""
    fit = None
    for name, frames, act, ckpt in _settings(family):
        r = _fit(family, method, card, opt, cache, quantize, ram_gb, name, frames, act, ckpt, 1)
        if not isinstance(r, str):
            if method == "lora" and ckpt is True and not act and card in AUTO_CARDS:
                r = _with_auto(family, card, opt, cache, quantize, ram_gb, name, frames, r)
            fit = r, (name, frames)
            break
        last = r
    cls = preset_class(family)
    if cls.video:
        clips = list(cls.preset_clips or VIDEO_CLIPS)
        k = clips.index(fit[1]) if fit is not None else len(clips)
        if k > 0:
            r = _fit(family, method, card, opt, cache, quantize, ram_gb, *clips[k - 1], True, True, NANO_BATCHES)
            if not isinstance(r, str):
                return r
    return fit[0] if fit is not None else last or "does not fit"


def _with_auto(family, card, opt, cache, quantize, ram_gb, name, frames, rec):
    """`rec` (a LoRA fit recomputing every block, without activation offloading) or, where every phase fits and the
    predicted step is at least AUTO_MIN_GAIN faster, the same size with train.gradient_checkpointing: auto
    (presets_auto.py), within the RAM assumed beside the card."""
    r = _fit(family, "lora", card, opt, cache, quantize, ram_gb, name, frames, False, "auto", 1, rec=rec)
    if isinstance(r, str) or r[1].step_s > (1 - AUTO_MIN_GAIN) * rec[1].step_s:
        return rec
    return r


def _fit(family, method, card, opt, cache, quantize, ram_gb, name, frames, act, ckpt, nano, rec=None):
    """(config dict, prediction, step seconds without offloading, phases, `Kept` or None) of one setting at the
    smallest fraction that fits the card, or why it does not. `ckpt` "auto" (a LoRA, `_with_auto`; `rec` the fit it
    competes with): at the fraction, from that one up, of the fastest predicted step (presets_auto.py)."""
    budget = card - HEADROOM_GB
    # a family of experts, or one whose samples run other transformers too: sampling off (module essay)
    cls = preset_class(family)
    sample_off = bool(cls.experts or cls.sampling_components)
    d0 = _config(family, method, name, act, 0.0, ckpt, opt, quantize=quantize, frames=frames, nano=nano)
    d0["sample"]["every"] = 0  # the fraction for training; sampling is checked below (off if it does not fit)
    cfg = Config.model_validate(d0)
    res = cfg.data.resolutions[0]  # a video height (480p) as the side it names (632)
    key = (family, method, opt, quantize)
    if key not in cache:
        cache[key] = analyze(cfg)
    facts = cache[key]
    # as analyze(cfg) sets them for this setting (compile auto: kept activations counted as compiled blocks')
    facts.resolutions, facts.checkpointing, facts.compiled = [res], ckpt is not False, ckpt is not True
    facts.frames = cfg.data.clip_frames if cls.video else 1
    facts.nano_batches = nano
    facts.park = "ram"  # the generating machine's RAM never decides: ram, or disk below where it must (`park`)
    try:
        f = choose_fraction(cfg, budget, facts=facts, activation_offload=act, log=lambda s: None)
    except UserError as e:
        return str(e).split(";")[0]
    ram = ram_gb or RAM_GB[card]
    kept, auto = frozenset(), None
    if ckpt == "auto":
        best = fastest_kept(cfg, facts, f, res, auto_budget_gb(budget), ram * 1e9)
        if best is None:
            return f"auto keeps no block within {ram:g} GB of CPU RAM ({_where(name, frames)})"
        f, kept, _ = best
    p = predict(facts, f, res, act, kept=kept)
    park = None
    # the idle expert on disk where offload.park: auto would take it on a machine of the RAM assumed: the whole
    # run's peak (its largest phase) with both experts' blocks in RAM over it, with one expert's within it
    if facts.experts > 1 and not facts.loads_whole and auto_parks_on_disk(run_ram_peaks(cfg, f, facts), ram * 1e9):
        facts.park = park = "disk"
        p = predict(facts, f, res, act, kept=kept)
    if p.ram_peak / 1e9 > ram:
        return (
            f"needs {p.ram_peak / 1e9:.0f} GB of CPU RAM at fraction {f:.2f} ({_where(name, frames)}), more than the "
            f"{ram} GB assumed beside a {card} GB card"
        )
    facts.checkpointing, facts.compiled, facts.nano_batches, park_now = True, bool(kept), 1, facts.park
    facts.park = "ram"  # the same training without offloading (the same blocks kept, no chunks, experts in RAM)
    base = predict(facts, 0.0, res, False, kept=kept)
    facts.checkpointing, facts.compiled = ckpt is not False, ckpt is not True
    facts.nano_batches, facts.park = nano, park_now
    te = fit_text_fraction(facts, budget)
    d = _config(family, method, name, act, f, ckpt, opt, te, quantize, frames, nano)
    if park is not None:  # the RAM assumed beside this card holds one expert's blocks, not both
        d["offload"]["park"] = park
    if ckpt == "auto":  # the budget the trainer's auto keeps the same blocks in (presets_auto.py)
        d["offload"]["vram_budget_gb"] = auto_budget_gb(budget)
    dcfg = Config.model_validate(d)
    phases = predict_phases(dcfg, f, facts, te, budget * 1e9, kept)  # clips tiled where the card needs it
    if sample_off or any(ph.name == "sampling" and ph.vram > budget * 1e9 for ph in phases):
        # off where it would not fit beside the ring, and for a family of experts (module essay)
        d["sample"]["every"] = 0
        phases = predict_phases(Config.model_validate(d), f, facts, te, budget * 1e9, kept)
    if max(ph.vram for ph in phases) > budget * 1e9:
        return f"a phase does not fit at {_where(name, frames)}: " + ", ".join(
            f"{ph.name} {ph.vram / 1e9:.1f} GB" for ph in phases if ph.vram > budget * 1e9)
    if ckpt == "auto":  # what it keeps, and the recomputed setting `rec` it is compared with
        auto = Kept(len(facts.blocks), len(kept), streamed_of(facts, f, kept), auto_budget_gb(budget),
                    rec[0]["offload"]["transformer"], rec[1].step_s, max(ph.vram for ph in rec[3]))
    return d, p, min(base.step_s, p.step_s), phases, auto


def _where(res: int | str, frames: int) -> str:
    """A setting's size in words: 512 px, or 480p x 49 frames."""
    return f"{res} x {frames} frames" if isinstance(res, str) else f"{res} px"


def plan_preset(
    family: str, method: str, card: int, cache: dict
) -> tuple[dict, Prediction, float, list, Kept | None, str] | str:
    """(config dict, prediction, step seconds without offloading, phase predictions, what `auto` keeps or None) for
    the first setting whose every phase fits (text caching at the offload.text_encoders chosen for the budget; sampling during training
    is turned off where it would not fit), or why none does. Full fine-tunes try AdamW (moments stream with the weights: 10 bytes a parameter) and Adafactor
    (factored state stays on the GPU: 2 bytes a parameter stream) and keep the higher resolution, then the
    faster step. LoRA presets for FP8_CARDS use an fp8 base where bf16 does not fit the card or SMALL_RAM_GB of
    RAM, and fp8 does (or, for a model too big for SMALL_RAM_GB even in fp8, where fp8 needs less RAM than bf16
    within the card's RAM_GB); the last element says why (empty for bf16)."""
    opts = ("adamw", "adafactor") if method == "full" else ("adamw",)
    found = [_first_fit(family, method, card, o, cache) for o in opts]
    fits = [r for r in found if not isinstance(r, str)]
    why = ""
    if method == "lora" and card in FP8_CARDS:
        if not fits:
            why = f"in bf16 it would not fit ({found[-1]})"
        elif fits[0][1].ram_peak / 1e9 > SMALL_RAM_GB:
            why = (f"in bf16 it would need {fits[0][1].ram_peak / 1e9:.0f} GB of host RAM, more than the "
                   f"{SMALL_RAM_GB} GB of most machines with {card} GB cards")
        if why:
            q = _first_fit(family, method, card, "adamw", cache, "fp8", ram_gb=SMALL_RAM_GB)
            if isinstance(q, str) and fits:
                # a model whose fp8 blocks alone outgrow SMALL_RAM_GB (Flux.2-dev: 32 GB): fp8 still halves the
                # host RAM the bf16 preset needs, within the RAM assumed beside the card
                q = _first_fit(family, method, card, "adamw", cache, "fp8")
                if not isinstance(q, str) and q[1].ram_peak >= fits[0][1].ram_peak:
                    q = "no gain"
            # bf16 within the same RAM, where it trains as large a clip or image as fp8 does (a video family's
            # longest clip may outgrow the RAM in bf16 where a shorter one fits: HunyuanVideo 1.5's 16 GB LoRA
            # at 480p x 121 in bf16, 29 GB, rather than fp8 at the same size)
            b = "not tried" if isinstance(q, str) else _first_fit(family, method, card, "adamw", cache, "none",
                                                                    ram_gb=SMALL_RAM_GB)
            if not isinstance(b, str) and _size(b[0]) >= _size(q[0]):
                return (*b, "")
            if not isinstance(q, str):  # else bf16 stays
                over = q[1].ram_peak / 1e9 > SMALL_RAM_GB
                return (*q, why + f"; with fp8 Linear weights it pins {q[1].pinned / 1e9:.0f} GB"
                        + (f" ({q[1].ram_peak / 1e9:.0f} GB peak: over {SMALL_RAM_GB} GB too, but less than half the "
                           "bf16 need)" if over else ""))
            why = ""
    if not fits:
        return found[-1]
    return (*min(fits, key=lambda r: (*(-n for n in _size(r[0])), r[1].step_s)), why)


def header(family: str, method: str, card: int, d: dict, p: Prediction, base_s: float, phases: list,
           why_fp8: str = "", kept: Kept | None = None) -> list[str]:
    cls = preset_class(family)
    name = cls.full_name
    res, act, f = d["data"]["resolutions"][0], d["offload"]["activations"], d["offload"]["transformer"]
    opt = OPTIMIZERS[d["optimizer"]["name"]].label
    what = (
        "LoRA rank 16"
        if method == "lora"
        else f"full fine-tune ({opt}, fused back pass, bf16 + stochastic rounding)"
    )
    ckpt = d["train"]["gradient_checkpointing"]
    nano = d["offload"].get("nano_batches", 1)
    how = f"transformer fraction {f:.2f}" + (" + activation offloading" if act else "")
    how += f" + {nano} token chunks" if nano > 1 else ""
    how += "" if ckpt else ", no gradient checkpointing"
    how += ", gradient checkpointing auto" if ckpt == "auto" else ""
    speed = p.step_s / base_s
    big = max(phases, key=lambda ph: ph.vram)
    measured = cls.measured(method, card, f, ckpt)  # its note only for the settings measured
    s = d["sample"]
    te = d["offload"]["text_encoders"]
    frames = d["data"].get("clip_frames", 1)
    clip = f"x{s['frames']}" if cls.video else ""
    sampling = (
        [f"# Sampling during training: every {s['every']} steps (sample.every: {s['every']}), {s['width']}x"
         f"{s['height']}{clip}, through the training ring with",
         "# the prompt embeddings computed up front and a tiled VAE decode (set sample.every to 0 to turn it off)."]
        if s["every"] else
        ["# Sampling during training is off (sample.every: 0): a sample needs every expert (the other one loaded and",
         "# streamed beside the training ring, not in these figures); use `dittrain sample` with both LoRAs afterwards."]
        if cls.experts and d["model"].get("expert") != "both" else
        ["# Sampling during training is off (sample.every: 0): the planner does not count a sample through both",
         "# experts in turn yet; use `dittrain sample` with both LoRAs afterwards."]
        if cls.experts else
        [f"# Sampling during training is off (sample.every: 0): a sample also runs {', '.join(cls.sampling_components)}",
         "# (loaded and streamed beside the training ring, not in these figures); use `dittrain sample` afterwards."]
        if cls.sampling_components else
        ["# Sampling during training is off (sample.every: 0): it would not fit beside training on this card;",
         "# use `dittrain sample` afterwards."]
    )
    if cls.video:  # the clip: the rung of the family's ladder (`preset_clips`, else VIDEO_CLIPS) it took
        size = f"{res} x {frames} frames"
        cw, ch = _frame(family, res)  # the clip's frame (an I2V sample may come out at its pipeline's own size)
        buckets = (f"{res} clips of {frames} frames (data.clip_frames: {frames}; {cw}x{ch} and the "
                   f"other aspect buckets of its area, {_size(d)[0]}^2 pixels a frame)")
        ladder = ", ".join(f"{n} x {k}" for n, k in cls.preset_clips or VIDEO_CLIPS)
        rung = [f"# Clip: {size}, the largest of the presets' ladder ({ladder} frames) predicted to fit this card."]
        if nano > 1:
            tw = cls.token_wise or ("feed-forwards",)  # one sub-layer (LTX-2's ff) named alone
            subs = ", ".join(tw[:-1]) + " and " + tw[-1] if len(tw) > 1 else tw[0]
            rung.append(f"# Token chunks: offload.nano_batches: {nano} runs each block's {subs} in {nano} token chunks, "
                        "each recomputed in backward; without them this clip is predicted not to fit this card (measured "
                        "for Wan 2.1 14B at 480p x 81 on an H200: 12.9 GB reserved against 19.1 GB, +6 % step time).")
    else:
        size, buckets, rung = f"{res} px", f"{res}x{res} buckets", []
    expert = d["model"].get("expert")
    disk = d["offload"].get("park") == "disk"
    where = ("the running one's in pinned RAM, the other's read back from its files at each change of expert "
             f"(offload.park: disk, {p.switch_s:.0f} s a switch predicted: both in RAM would exceed the RAM "
             "assumed beside this card; with more RAM, offload.park set to ram keeps both pinned and reads nothing at a "
             "switch)" if disk else "every expert's in pinned RAM")
    experts = [f"# {cls.full_name}: this file trains model.expert: {expert} (its experts {', '.join(cls.experts)} in one "
               f"run: each step the one that owns its timestep, only its blocks on the GPU, {where}), writing "
               f"lora-{'.safetensors, lora-'.join(cls.experts)}.safetensors."] if expert == "both" else [
               f"# {cls.full_name} trains one expert per run: this file trains model.expert: {expert} "
               f"({cls.experts[expert]}/); for the other expert, copy it with {next(e for e in cls.experts if e != expert)} "
               "as model.expert and its own output.dir (the same size: the same figures)."] if expert else []
    return [
        f"# {name} {'LoRA' if method == 'lora' else 'full fine-tune'} for {card} GB cards ({how}, {size})",
        f"# trains: {what} on the transformer, {buckets}, batch 1, bf16"
        + (", gradient checkpointing" if ckpt is True else ", gradient checkpointing auto" if ckpt else "")
        + (", frozen base in fp8 (model.quantize: fp8)" if why_fp8 else ""),
        *rung,
        *(auto_header_lines(kept, p, big.vram, measured) if kept is not None else []),
        *experts,
        *([f"# fp8 base: {why_fp8} ("
           + ("modulation Linears too: model.quantize_modulation; " if cls.modulation_linears
              else "the modulation Linears sit outside the blocks and stay bf16; ")
           + "norms and biases stay bf16; the LoRA trains in fp32)."]
          if why_fp8 else []),
        f"# expects: {big.vram / 1e9:.1f} GB VRAM (largest phase: {big.name}), {(p.pinned + p.act_checkpoint_host) / 1e9:.0f} GB pinned RAM "
        f"({p.ram_peak / 1e9:.0f} GB peak), {speed:.2f}x the step time without offloading (planner prediction; "
        + measured
        + ")",
        f"# Predicted step {p.step_s:.2f} s on an H200-class GPU (GPU {p.compute_s:.2f} s, host {p.host_s:.2f} s, "
        f"PCIe {p.transfer_s:.2f} s" + ("; with half a change of expert's read of its blocks from the files, at "
                                        f"{DISK_READ / 1e9:.0f} GB/s assumed)." if p.park == "disk" else ")."),
        "# VRAM is what torch reserves; the CUDA context (0.5-1 GB) comes on top, and "
        f"{HEADROOM_GB:g} GB of the card is left for it, and {PREDICTION_MARGIN:.0%} of the rest for prediction error.",
        "# phases (predicted peak VRAM): " + ", ".join(f"{ph.name} {ph.vram / 1e9:.1f} GB" for ph in phases) + ".",
        f"# Text caching streams the text encoders at offload.text_encoders: {te:g} (one model group on the GPU at"
        " a time).",
        *sampling,
        "# `dittrain plan <this file>` prints the whole prediction and its assumptions. Written by",
        "# `python -m trainer.planner.presets`.",
        "# Copy this file, set model.path, data.sources and output.dir, then: dittrain fit my.yaml",
    ]


#: the line that starts every preset's commented block of optional features (tests/test_presets.py reads it)
OPTIONAL_MARK = "# Optional features: uncomment what you want and merge it into the sections above"


def optional_features(method: str, family: str = "") -> list[str]:
    """Commented YAML showing the keys of the features most users of other trainers look for (docs/training.md).
    Validation is left out for families whose captions are encoded with their reference and for video families
    (not supported there)."""
    lora = method == "lora"
    cls = preset_class(family) if family else None
    val = not (cls.text_uses_reference or cls.video) if cls else True
    ema = not (lora and cls is not None and cls.experts)  # both experts in one run have no EMA yet (train/experts.py)
    train = [
        *(["  ema: {decay: 0.999, every: 1, device: cpu}  # EMA of the trained weights: "
           + ("lora-ema.safetensors" if lora else "transformer-ema/")] if ema else []),
        *(["  validate_every: 250                       # score data.validation every 250 steps (val_loss)"]
          if val else []),
    ]
    body = [
        *(["train:", *train] if train else []),
        *(["lora:", "  type: lokr                                # lora | lokr | loha (or dora: true with type lora)"]
          if lora else []),
        "data:",
        *(["  validation: {fraction: 0.05}              # hold out 5 % of the images for the validation loss"]
          if val else []),
        "  masked_loss: true                         # <source>/masks/<same name>: white trains, black is ignored",
        "  sources:",
        "    - path: /path/to/images",
        "      trigger_word: ohwx                    # put first in every caption",
        "      shuffle_tags: true                    # shuffle the comma-separated tags after keep_tokens",
        "      keep_tokens: 1",
        "      tag_dropout: 0.1",
        "      several_captions: true                # each line of a .txt is a caption; one drawn each time",
        *(["output:", "  save_every: 500                           # also keep the LoRA of every 500th step"]
          if lora else []),
    ]
    return ["", OPTIONAL_MARK, "# (docs/training.md says what each does):", *("# " + line for line in body)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("configs"))
    ap.add_argument("--families", nargs="*", default=list(ADAPTERS),
                    help="families (each with its sizes' folders, e.g. wan and wan-1.3b), or one size alone (wan-1.3b)")
    args = ap.parse_args(argv)
    cache: dict = {}
    absent = []
    folders = []  # each family's, then its sizes' (configs/wan-1.3b/); a size named alone, only its own
    for name in args.families:
        family, size = preset_folder(name, "--families")
        preset_class(name)  # a size it does not have: the UserError
        folders += [f"{family}-{size}"] if size else [family, *(f"{family}-{k}" for k in preset_class(family).sizes())]
    for family in folders:
        for method in ("lora", "full"):
            for card in preset_class(family).preset_cards:
                r = plan_preset(family, method, card, cache)
                path = args.out / family / f"{method}-{card}gb.yaml"
                if isinstance(r, str):
                    absent.append(f"| {family} | {method} | {card} GB | {r} |")
                    path.unlink(missing_ok=True)
                    print(f"absent  {path}: {r}")
                    continue
                d, p, base, phases, kept, why_fp8 = r
                path.parent.mkdir(parents=True, exist_ok=True)
                head = header(family, method, card, d, p, base, phases, why_fp8, kept)
                path.write_text("\n".join(head + _yaml(d) + optional_features(method, family)) + "\n")
                print(f"wrote   {path}: {next(h for h in head if h.startswith('# expects'))[2:]}")
    print("\nabsent combinations (for configs/README.md):")
    print("\n".join(absent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
