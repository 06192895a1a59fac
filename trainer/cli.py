"""The `dittrain` command. Wiring and error presentation only: every command calls one function elsewhere.

A `UserError` (bad config, missing path, corrupt data, out of memory) prints one line and exits with its code;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import gc
import logging
import shlex
import sys
import textwrap
from pathlib import Path

import typer

from .errors import UserError
from .models import ADAPTERS  # the family registry: a dict, cheap to import (no torch)

# transformers warns on every run that torchvision is missing; the pipelines' image processors it falls back for
# are never used by dittrain, so the line is noise to a user.
logging.getLogger("transformers.utils.import_utils").setLevel(logging.ERROR)


def _no_empty_fp32_notice(record: logging.LogRecord) -> bool:
    """diffusers warns on every `.to(dtype)` of a model that 'should be kept in float32: []', an empty list: no
    module is affected, so the line says nothing. A non-empty list still shows."""
    return "should be kept in float32: []" not in record.getMessage()


logging.getLogger("diffusers.models.modeling_utils").addFilter(_no_empty_fp32_notice)



def _families(width: int = 72) -> str:
    """The registry's family keys as a help paragraph, wrapped here between keys: click would break
    `qwen-image-edit` at its hyphens. Its leading \\b line keeps click from wrapping it again."""
    text = f"Model families (model.family): {', '.join(ADAPTERS)}."
    return "\b\n" + "\n".join(textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False))


app = typer.Typer(
    name="dittrain",
    help=f"Fine-tune diffusion transformers ({len(ADAPTERS)} families of image and video models, listed below) "
    "with LoRA or full fine-tuning on GPUs far smaller than the model, by streaming blocks between pinned CPU RAM "
    f"and the GPU.\n\n{_families()}\n\n"
    "Start from a preset (`dittrain presets`), copy it, edit the paths, then `dittrain fit my.yaml`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

CONFIG_ARG = typer.Argument(..., help="YAML config (start from one in configs/, see `dittrain presets`).", show_default=False)
SET_OPT = typer.Option(
    [], "--set", metavar="KEY=VALUE", help="Override a config value, e.g. --set train.steps=500 (repeatable).", show_default=False
)


def _version(value: bool) -> None:
    if value:
        from . import __version__

        typer.echo(f"dittrain {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Fine-tune diffusion transformers on GPUs far smaller than the model."""
    if __import__("os").environ.get("DITTRAIN_VRAM_CAP_GB"):  # benchmarks: act as if the card were that small
        from .phase_log import apply_vram_cap

        apply_vram_cap()


def _user_errors(fn):
    """Turn a UserError into one line on stderr and its exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            typer.echo(f"{e.label}{e}", err=True)
            raise typer.Exit(e.exit_code) from None

    return wrapper


def _load(config: Path, overrides: list[str]):
    """The validated config, its model folder checked against model.family before any command loads from it."""
    from .config import load_config
    from .models.folder import check_folder_family

    cfg = load_config(config, overrides)
    check_folder_family(cfg.model.path, cfg.model.family, cfg.model.transformer_file)
    return cfg


@app.command()
@_user_errors
def fit(
    config: Path = CONFIG_ARG,
    overrides: list[str] = SET_OPT,
    resume: str | None = typer.Option(
        None,
        "--resume",
        metavar="latest|PATH",
        help="Continue a run: 'latest' (the newest complete checkpoint in output.dir) or a checkpoint folder. "
        "A missing checkpoint is an error, never a silent fresh start.",
        show_default=False,
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Start a new run in an output.dir that holds another one: deletes its "
        "checkpoints, weights, metrics, TensorBoard logs and the fit's sample images first, and lists them (other files, "
        "and images made by `dittrain sample`, stay)."),
    resume_other_run: bool = typer.Option(
        False, "--resume-other-run", help="Allow --resume from a checkpoint of a run other than the one output.dir "
        "holds (that run's files are kept)."),
) -> None:
    """Train a LoRA or fine-tune the transformer as the config says.

    Saves a resumable checkpoint every train.checkpoint_every steps and at the end; Ctrl-C finishes the current
    step and saves one (press it twice to quit at once)."""
    from .progress import line

    # The config's checks and the trainer import torch and diffusers: seconds, tens on a busy machine (issue 46)
    line(f"fit {config}: loading torch, diffusers and the trainer")
    cfg = _load(config, overrides)
    from .train.trainer import Trainer

    # What continues this run after a Ctrl-C: the same config and --set overrides (output.dir among them), resumed
    again = " ".join(["dittrain fit", shlex.quote(str(config)), *(f"--set {shlex.quote(o)}" for o in overrides),
                      "--resume latest"])
    Trainer(cfg, resume=resume, overwrite=overwrite, resume_other_run=resume_other_run, keep_model=False,
            relaunch=again).fit()


@app.command()
@_user_errors
def sample(
    config: Path = CONFIG_ARG,
    overrides: list[str] = SET_OPT,
    prompt: list[str] = typer.Option([], "--prompt", "-p", metavar="TEXT", help="Prompt (repeatable).", show_default=False),
    prompts_file: Path | None = typer.Option(None, "--prompts", help="Text file with one prompt per line.", show_default=False),
    lora: list[str] = typer.Option(
        [], "--lora", metavar="PATH[:WEIGHT]", help="LoRA .safetensors to apply, optionally weighted as PATH:WEIGHT (repeatable).", show_default=False
    ),
    offload: str | None = typer.Option(
        None, "--offload", metavar="F|auto", help="Share of transformer block bytes kept in CPU RAM, 0 to 1 "
        "(overrides offload.transformer); auto: the smallest share whose predicted peak fits the GPU "
        "(offload.vram_budget_gb, else the card minus 1 GB), 0 on a CPU.", show_default=False
    ),
    steps: int | None = typer.Option(None, "--steps", min=1, help="Denoising steps (default: sample.steps)."),
    guidance: float | None = typer.Option(None, "--guidance", help="Guidance scale (default: sample.guidance)."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of the first image (default: sample.seed)."),
    width: int | None = typer.Option(None, "--width", min=16, help="Width in pixels (default: sample.width)."),
    height: int | None = typer.Option(None, "--height", min=16, help="Height in pixels (default: sample.height)."),
    frames: int | None = typer.Option(None, "--frames", min=1, help="Video families: frames per video, 4k+1 for Wan "
                                      "(default: sample.frames).", show_default=False),
    num: int = typer.Option(1, "--num", min=1, help="Images per prompt."),
    out: Path | None = typer.Option(None, "--out", help="Output folder (default: <output.dir>/samples with --lora or a "
                                    "full fine-tune's transformer; the base model's images, without them, go to "
                                    "<output.dir>/samples/base).", show_default=False),
    base: bool = typer.Option(
        False, "--base", help="Full fine-tune configs: sample the base model instead of <output.dir>/transformer."),
    image: list[Path] = typer.Option(
        [], "--image", metavar="PATH", help="Edit families (trained on image pairs): the reference image to edit, resized to the sample "
        "size (default: sample.image); repeat it for several references (Flux.2). Image-to-video families: the first "
        "frame.",
        show_default=False),
) -> None:
    """Generate images with the family's diffusers pipeline, the transformer streamed by the offload conductor.

    PNGs carry the prompt, seed, steps and model in their metadata; several images also get a contact sheet."""
    cfg = _load(config, overrides)
    from .phase_log import measured
    from .sample import SampleRequest, run_sample

    run_sample = measured("sampling", run_sample)  # per-phase peaks (bench/program/bench_program.py); errors unchanged
    run_sample(
        cfg,
        SampleRequest(
            prompts=list(prompt),
            prompts_file=prompts_file,
            loras=list(lora),
            offload=_offload_option(offload),
            steps=steps,
            guidance=guidance,
            seed=seed,
            width=width,
            height=height,
            frames=frames,
            num=num,
            out=out,
            base=base,
            image=(image[0] if len(image) == 1 else list(image)) if image else None,
        ),
    )


def _offload_option(value: str | None) -> float | str | None:
    """`--offload`: a fraction from 0 to 1, or auto."""
    if value is None or value.strip().lower() == "auto":
        return None if value is None else "auto"
    try:
        f = float(value)
    except ValueError:
        f = None
    if f is None or not 0.0 <= f <= 1.0:
        raise UserError(f"--offload {value}: give a fraction from 0 to 1 (e.g. 0.5) or auto")
    return f


@app.command()
@_user_errors
def plan(
    config: Path = CONFIG_ARG,
    overrides: list[str] = SET_OPT,
    vram: float | None = typer.Option(None, "--vram", help="The GPU's memory in GB (the card size, e.g. 12): the "
                                      "fraction is picked for it minus 1 GB for the CUDA context, as the presets are."),
    ram: float | None = typer.Option(None, "--ram", help="CPU RAM in GB to check the pinned arena against."),
    gpus: int = typer.Option(1, "--gpus", min=1, help="Processes of one host training at once (torchrun "
                             "--nproc_per_node): also each one's step with whole copies and with the sharded stream."),
) -> None:
    """Predict VRAM, RAM and step time per offload fraction without training, and pick the fraction that fits."""
    cfg = _load(config, overrides)
    from .planner import run_plan
    from .planner.presets import HEADROOM_GB

    if vram is not None:
        if vram <= HEADROOM_GB:
            raise UserError(f"--vram {vram:g}: give the card's memory in GB (more than {HEADROOM_GB:g})")
        typer.echo(f"budget {vram - HEADROOM_GB:g} GB: the {vram:g} GB card minus {HEADROOM_GB:g} GB for the CUDA "
                   "context (as the presets)")
    run_plan(cfg, vram_gb=None if vram is None else vram - HEADROOM_GB, ram_gb=ram, gpus=gpus)


@app.command()
@_user_errors
def cache(config: Path = CONFIG_ARG, overrides: list[str] = SET_OPT) -> None:
    """Encode the data set's latents and captions once into data.cache_dir (fit reuses them).

    Entries are keyed by file content, model, resolution and crop: a changed image or model re-encodes only
    its own entries."""
    cfg = _load(config, overrides)
    from .data.cache import run_cache
    from .sampling.placement import encode_tiles
    from .train.faults import StopFlag

    stop = StopFlag()
    stop.install(at_once=True)  # Ctrl-C / SIGTERM: one line on what is kept, exit 130 / 143
    try:
        if cfg.data is not None:
            from .captioning import caption_sources

            caption_sources(cfg.data)  # data.sources[].caption_with: the missing captions first
        run_cache(cfg, tile_vae=encode_tiles(cfg.model.family, cfg.train.device))  # the device StagedLoader takes
    finally:
        stop.restore()


@app.command()
@_user_errors
def merge(
    config: Path = CONFIG_ARG,
    overrides: list[str] = SET_OPT,
    lora: list[str] = typer.Option(
        [], "--lora", metavar="PATH[:WEIGHT]", help="LoRA .safetensors to merge, optionally weighted (repeatable).", show_default=False
    ),
    out: Path | None = typer.Option(None, "--out", help="Transformer folder to write (default: <output.dir>/merged).", show_default=False),
    single: Path | None = typer.Option(None, "--single", help="Also write every weight to this one .safetensors file.", show_default=False),
) -> None:
    """Merge LoRAs into the config's transformer (model.path) and write a diffusers transformer folder.

    Streams tensor by tensor, so it needs little more RAM than the largest weight."""
    cfg = _load(config, overrides)
    from .merge import merge_loras
    from .sampling.request import parse_lora

    path = merge_loras(cfg.model.path, [parse_lora(x) for x in lora], out or Path(cfg.output.dir) / "merged",
                       single=single, transformer_file=cfg.model.transformer_file)
    typer.echo(f"wrote {path}" + (f" and {single}" if single else ""))


@app.command("convert-lora")
@_user_errors
def convert_lora(
    src: Path = typer.Argument(..., help="LoRA .safetensors to read (diffusers, comfy or kohya layout).", show_default=False),
    dst: Path = typer.Argument(..., help="File to write.", show_default=False),
    to: str = typer.Option(..., "--to", help="Layout to write: diffusers, comfy (ComfyUI's own keys) or kohya (lora_unet_*).", show_default=False),
    family: str | None = typer.Option(None, "--family", help="Model family, for comfy / kohya files whose header does not name it.", show_default=False),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace DST if it exists (never SRC itself)."),
    model: Path | None = typer.Option(None, "--model", help="The diffusers model folder the LoRA was trained on: a DoRA in the comfy / kohya layout needs its base weights.", show_default=False),
) -> None:
    """Convert a LoRA between the diffusers, ComfyUI and kohya layouts (same update, alpha kept)."""
    from .lora_format import DORA_COMFY_NOTE
    from .lora_format import convert_lora as run

    lf = run(src, dst, to, family, overwrite=overwrite, base=_base_weights(model, src, family) if model else None)
    typer.echo(f"wrote {dst} ({to}, {len(lf.modules)} modules, {lf.kind}{' + DoRA' if lf.dora else ''})")
    if lf.dora and to == "diffusers":
        typer.echo(DORA_COMFY_NOTE)


def _base_weights(model: Path, src: Path, family: str | None):
    """convert-lora --model: the base weights of that diffusers folder, for the family the LoRA is for."""
    from .config import ModelConfig
    from .errors import UserError
    from .lora_format import read_lora_file
    from .train.checkpoint import base_weights

    family = family or read_lora_file(src).meta.get("dittrain.family")
    if family is None:
        raise UserError(f"{src}: the file does not say which model family it is for; pass --family")
    return base_weights(ModelConfig.model_validate({"family": family, "path": str(model)}))


@app.command()
@_user_errors
def presets(
    family: str | None = typer.Argument(None, metavar="[FAMILY]", help="Only this family's presets (a model.family "
                                        "value; with its other sizes', e.g. wan-1.3b, which names one alone); all "
                                        "when left out.", show_default=False),
    vram: float | None = typer.Option(None, "--vram", help="Only the presets for a card of this many GB (per family "
                                      "and method, the largest card size at or below it).", show_default=False),
    configs_dir: Path = typer.Option(Path("configs"), "--dir", help="Folder of presets."),
) -> None:
    """List the shipped presets per model family and GPU size (all of them unless FAMILY or --vram narrow it)."""
    from .preset_files import print_presets

    print_presets(configs_dir, family=family, vram_gb=vram)


@app.command()
@_user_errors
def caption(
    data_dir: Path = typer.Argument(..., help="Folder of images and videos (sub-folders included).", show_default=False),
    model: Path = typer.Option(..., "--model", help="Local transformers image-text-to-text model folder with a chat "
                               "template (e.g. Qwen2.5-VL-7B-Instruct, Qwen3-VL-8B-Instruct).", show_default=False),
    style: str = typer.Option("detailed", "--style", help="tags, short or detailed."),
    trigger: str = typer.Option("", "--trigger", metavar="WORD", help="Put first in every caption.", show_default=False),
    prompt: str | None = typer.Option(None, "--prompt", metavar="TEXT", help="The instruction instead of the "
                                      "--style's.", show_default=False),
    overwrite: bool = typer.Option(False, "--overwrite", help="Caption files that have a caption too (replaces it)."),
    offload: str = typer.Option("auto", "--offload", metavar="F|auto", help="Share of the decoder layers' bytes "
                                "kept in CPU RAM and streamed, 0 to 1; auto: the smallest that fits the GPU, 0 on a "
                                "CPU."),
    batch: int | None = typer.Option(None, "--batch", min=1, help="Files per generate call (one pass of the weights "
                                     "per token serves them all); default 8, halved while --offload auto's estimate "
                                     "does not fit it.", show_default=False),
    quantize: str = typer.Option("none", "--quantize", metavar="none|fp8|int8", help="Hold every Linear weight "
                                 "(decoder layers, vision tower, head) as 8 bits (float8 e4m3 or int8, per-channel "
                                 "scales) in RAM, over PCIe and on the GPU, as model.quantize_text_encoders does a "
                                 "text encoder's: half the bytes streamed per token, dequantized per layer to "
                                 "compute."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1, help="Longest caption, in tokens."),
    frames: int = typer.Option(4, "--frames", min=1, help="Frames per video, spread from first to last."),
) -> None:
    """Write a .txt caption beside every image and video of DATA_DIR that has none, with a vision-language model
    whose decoder layers stream like the transformer's. Ctrl-C keeps every caption written; run it again to go on."""
    from .captioning import CaptionRequest, run_caption
    from .train.faults import StopFlag

    stop = StopFlag()
    stop.install(at_once=True)  # Ctrl-C / SIGTERM: stop now, the captions written stay
    try:
        run_caption(CaptionRequest(data_dir=data_dir, model=model, style=style, trigger=trigger, prompt=prompt,
                                   overwrite=overwrite, offload=_offload_option(offload), batch=batch,
                                   quantize=quantize, max_new_tokens=max_new_tokens, frames=frames))
    finally:
        stop.restore()


@app.command("make-tiny")
@_user_errors
def make_tiny(
    out: Path = typer.Option(Path("models/tiny"), "--out", help="Folder to write <family>/ model folders into."),
    family: list[str] = typer.Option([], "--family", metavar="NAME", help=f"Only these families ({', '.join(ADAPTERS)}; repeat the option for several).",
                                  show_default=False),
) -> None:
    """Write tiny random-weight models of every family in diffusers format (for the demo and the tests)."""
    from .models.tiny import make_tiny_models

    for path in make_tiny_models(out, families=family or None):
        typer.echo(f"wrote {path}")


def main() -> None:  # pragma: no cover - `python -m trainer`
    try:
        app(prog_name="dittrain")
    finally:
        # The process ends: clearing the modules, the interpreter collects, each pass walking every object not
        # frozen (seconds on a busy 2-core CPU after a fit, whose trainer unfreezes on close: issue 46). Frozen,
        # they are freed by their counts alone; cycles among them stay for the OS to reclaim, and nothing waits on
        # them (the trainer and the sampler close their files, writers and process groups before this).
        gc.freeze()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
