"""`dittrain sample`: images from the family's diffusers pipeline, the transformer streamed by the conductor.

The run reads top to bottom as a few named steps:

1. `resolve` the request against the config: prompts, LoRA files, size, seeds, output names. Every problem a user
   can fix is reported here, before a weight is read.
2. Load the pipeline's parts from local files (`adapter.load`) onto the CPU, build the pipeline, and apply the
   LoRAs with diffusers' own `load_lora_weights` / `set_adapters`. A streamed transformer (fraction > 0) is built
   with placeholder weights instead (trainer/models/stream_load.py): its blocks are read from the files straight
   into the conductor's arena in step 4, so no copy of the model sits in ordinary RAM. The base weights load whole
   first where they are needed before that: a full fine-tune's `transformer/`, a DoRA LoRA, a single file in the
   original checkpoint layout (stream_load.supported).
3. Encode all prompts (text encoders on the GPU one run at a time, streamed if `offload.text_encoders` > 0), then
   release the encoders.
4. Place the transformer: resident at fraction 0, otherwise its blocks streamed by the offload conductor at
   `--offload` (or `offload.transformer`) on its sampling plan (plan.plan_for). `auto` picks the smallest fraction
   whose predicted denoising peak fits the GPU (planner/sampling.py `choose_sampling_fraction`; step 1 resolves
   it, reading the model folder's headers for the planner; 1.0 where that cannot be predicted), and is 0 on a
   CPU. On a CPU nothing is gained (there is
   no second memory): the fraction is accepted and the conductor replays the same plan through a ring in CPU
   RAM, which saves nothing and runs at resident speed; the tests use it to check the images do not change.
5. Denoise image by image (`sampling.engine.generate`), write PNGs with metadata and, for several images, a
   contact sheet. The VAE decodes as the pipeline does (untiled) where that fits next to the placed transformer,
   else in 512 px tiles with a note (`placement.decode_for_sample`).

The shared pieces live in `trainer/sampling/`; the training loop samples through `sampling.TrainingSampler`,
which calls the same `generate`.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .config import Config
from .data.video import write_video
from .dtypes import DTYPES
from .errors import UserError
from .lora_format import is_dora_file
from .models import stream_load
from .progress import bar as progress_bar
from .sampling.engine import encode_prompts, generate, release_text_encoders
from .sampling.lora import load_loras
from .sampling.output import contact_sheet, frame_sheet, image_metadata, save_png, video_fps
from .sampling.placement import decode_for_sample, place_text_encoders, place_transformer
from .sampling.request import (
    Job,
    LoraSpec,
    SampleRequest,
    SampleSettings,
    check_frames,
    check_guidance_2,
    check_image,
    check_loras,
    check_size,
    collect_prompts,
    image_setting,
    parse_lora,
    plan_jobs,
)
from .train.streaming import compile_options
from .words import count

__all__ = ["SampleRequest", "SamplePlan", "resolve", "run_sample"]

SHEET_NAME = "contact_sheet.png"


@dataclass
class SamplePlan:
    """A checked request: everything `run_sample` needs besides the weights."""

    prompts: list[str]
    loras: list[LoraSpec]
    settings: SampleSettings
    jobs: list[Job]
    num: int
    offload: float
    out: Path
    device: torch.device


def _device(cfg: Config) -> torch.device:
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device is cuda but no CUDA device is visible (use auto or cpu)")
    return torch.device("cuda" if want != "cpu" and torch.cuda.is_available() else "cpu")


def resolve(cfg: Config, req: SampleRequest, adapter) -> SamplePlan:
    """Merge the flags with the config's sample: and offload: sections; raise UserError on bad input."""
    s = cfg.sample
    prompts = collect_prompts(req, s.prompts)
    loras = [parse_lora(x) for x in req.loras]
    check_loras(loras)
    width = req.width if req.width is not None else s.width
    height = req.height if req.height is not None else s.height
    check_size(width, height, adapter.resolution_divisor, adapter.family)
    image = req.image if req.image is not None else s.image
    check_image(image, adapter)
    if isinstance(req.image, str | Path) and req.width is None and req.height is None:
        from .data.images import open_image

        picked = adapter.image_sample_size(*open_image(req.image).size)  # a pipeline that picks it from the image
        width, height = picked or (width, height)
    frames = req.frames if req.frames is not None else s.frames
    check_frames(frames, adapter)
    if req.num < 1:
        raise UserError(f"--num {req.num}: at least one image per prompt")
    offload = req.offload if req.offload is not None else cfg.offload.transformer
    if offload != "auto" and not 0.0 <= float(offload) <= 1.0:
        raise UserError(f"--offload {offload}: the fraction must be between 0 and 1")
    settings = SampleSettings(
        steps=req.steps if req.steps is not None else s.steps,
        guidance=req.guidance if req.guidance is not None else s.guidance,
        width=width,
        height=height,
        negative_prompt=s.negative_prompt,
        image=image_setting(image),
        frames=frames,
        guidance_2=s.guidance_2,
    )
    check_guidance_2(s.guidance_2, adapter)
    seed = req.seed if req.seed is not None else s.seed
    out = req.out if req.out is not None else default_out(cfg, bool(loras), req.base)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: --out must be a folder, and this is a file")
    from .train.run import check_writable

    check_writable(out, "--out" if req.out is not None else "the samples folder")  # before any weight loads
    device = _device(cfg)
    if offload == "auto":
        offload = _auto_fraction(cfg, adapter.family, settings, device)
    return SamplePlan(
        prompts,
        loras,
        settings,
        plan_jobs(prompts, req.num, seed),
        req.num,
        float(offload),
        out,
        device,
    )


def vram_budget_gb(cfg: Config, device: torch.device) -> float:
    """The VRAM auto plans sampling for: offload.vram_budget_gb, else `presets.device_budget_bytes` (the card less
    the CUDA context's HEADROOM_GB, as the presets and `dittrain plan --vram` count it, or this process's cap where
    `DITTRAIN_VRAM_CAP_GB` set one below that)."""
    if cfg.offload.vram_budget_gb is not None:
        return cfg.offload.vram_budget_gb
    from .planner import GB
    from .planner.presets import device_budget_bytes

    return device_budget_bytes(device) / GB


def _auto_fraction(cfg: Config, family: str, settings: SampleSettings, device: torch.device) -> float:
    """offload.transformer (or --offload) auto: 0 on the CPU, else the planner's smallest fraction whose
    predicted denoising peak fits the budget at this size and guidance batch (planner/sampling.py)."""
    if device.type != "cuda":
        tqdm.write("offload: auto -> 0 on the CPU (there is no second memory to save: streaming within RAM only "
                   "costs time)", file=sys.stderr)
        return 0.0
    from .planner import analyze
    from .planner.sampling import cfg_batch, choose_sampling_fraction

    def say(line: str) -> None:
        tqdm.write(line, file=sys.stderr)

    try:
        facts = analyze(cfg)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - a prediction that cannot be made must not stop sampling
        say(f"offload: auto could not plan sampling ({type(e).__name__}: {e}); streaming every block (1.0)")
        return 1.0
    return choose_sampling_fraction(facts, vram_budget_gb(cfg, device), settings.width, settings.height,
                                    cfg_batch(family, settings.guidance), log=say, frames=settings.frames)


def run_sample(cfg: Config, req: SampleRequest) -> list[Path]:
    """Generate the requested images; returns the written PNG paths (the contact sheet last, if any)."""
    from .models import get_adapter

    adapter = get_adapter(cfg.model)
    plan = resolve(cfg, req, adapter)
    image = plan.settings.image  # bound to the reference count: a family may stream more blocks with references
    adapter = get_adapter(cfg.model, references=0 if image is None else 1 if isinstance(image, str) else len(image))
    if plan.device.type == "cpu" and plan.offload > 0:
        tqdm.write(f"note: --offload {plan.offload:g} on the CPU streams the blocks within RAM, which saves no memory "
                   "(it pays only with a GPU)", file=sys.stderr)
    trained = trained_transformer(cfg, req.base)
    pipe, adapters, loaders = _build_pipeline(cfg, adapter, plan, trained)
    tqdm.write(f"sampling with {'the fine-tuned transformer ' + str(trained) if trained else 'the base transformer'}"
               f" ({cfg.model.path}{' + ' + count(len(adapters), 'LoRA') if adapters else ''})", file=sys.stderr)
    embeds = _encode_and_release(pipe, adapter, plan, cfg.offload.text_encoders)

    pipe.vae.to(plan.device)  # small (Flux: 168 MB); decodes on the device
    written, images = [], []
    fix = "raise --offload (1.0 streams every block)" if plan.offload < 1 else "lower --width/--height"
    oom = f"out of GPU memory sampling {plan.settings.width}x{plan.settings.height} at --offload {plan.offload}: {fix}"
    with _oom_as_user_error(oom), ExitStack() as placed:
        for tr in adapter.pipeline_transformers(pipe):  # a family of experts places each (streamed: while it runs)
            loader = loaders.get(id(tr))  # a transformer whose blocks are placeholders, read from its files
            placed.enter_context(place_transformer(
                adapter, tr, plan.device, plan.offload, compile_options(cfg, plan.device) or False,
                fill=loader and loader.fill, keep_weights=False))  # the pipeline is dropped after the images
        tiled = decode_for_sample(pipe.vae, plan.device, plan.settings.height, plan.settings.width,
                                  plan.settings.frames, adapter.family)
        if tiled:
            tqdm.write(tiled, file=sys.stderr)
        for job in progress_bar(plan.jobs, desc="images", unit="img", enabled=len(plan.jobs) > 1):
            (image,) = generate(
                pipe, adapter, [embeds[job.prompt]], settings=plan.settings, seeds=[job.seed], progress=True
            )
            if isinstance(image, list):  # a video family's frames: the mp4, and the PNG of its frames beside it
                written.append(write_video(image, (plan.out / job.filename).with_suffix(".mp4"), video_fps(cfg)))
                image = frame_sheet(image)
            written.append(
                save_png(image, plan.out / job.filename, _metadata(cfg, adapter.family, plan, job))
            )
            images.append(image)
    if len(images) > 1:
        sheet = contact_sheet(images, columns=plan.num)
        meta = image_metadata(
            prompts=" | ".join(plan.prompts),
            files=",".join(p.name for p in written),
            model=cfg.model.path,
            loras=",".join(str(x) for x in plan.loras) or None,
        )
        written.append(save_png(sheet, plan.out / SHEET_NAME, meta))
    note = f" (LoRA adapters: {', '.join(adapters)})" if adapters else ""
    videos = sum(p.suffix == ".mp4" for p in written)
    what = f"{count(videos, 'video')} (mp4, each with a PNG of its frames)" if videos else count(len(images), "image")
    tqdm.write(f"wrote {what} to {plan.out}{note}", file=sys.stderr)
    return written


def default_out(cfg: Config, loras: bool, base: bool = False) -> Path:
    """Where images go without --out: <output.dir>/samples, beside the run's own samples, when they show what the
    run trained (a LoRA given, or a full fine-tune's transformer); the base model's go to samples/base/, so they
    are never taken for the run's."""
    out = Path(cfg.output.dir) / "samples"
    return out if loras or trained_transformer(cfg, base) is not None else out / "base"


def trained_transformer(cfg: Config, base: bool = False) -> Path | None:
    """A full fine-tune config samples what it trained: output.dir/transformer when it exists (unless --base)."""
    folder = Path(cfg.output.dir) / "transformer"
    if base or cfg.train.method != "full" or not folder.is_dir():
        return None
    return folder


@contextmanager
def _oom_as_user_error(message: str):
    """A CUDA out-of-memory error is the user's to fix (a fraction or a size): one line instead of a traceback."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise UserError(message) from None


def _build_pipeline(cfg: Config, adapter, plan: SamplePlan, trained: Path | None = None):
    """Every part on the CPU (the transformer's blocks as placeholders, read from the files straight into the
    arena, or at --offload 0 onto the device, once the text encoders are gone: never a whole copy in RAM), the
    fine-tuned weights (`trained`) loaded into the transformer, the LoRAs applied by diffusers, the transformer
    frozen. The family's other sampling transformers (`sampling_components`: Ideogram 4's unconditional one) are
    read the same way, from their own folders (`load_component`). Returns (pipe, adapter names, {id(transformer):
    the loader that fills its placeholders})."""
    dtype = DTYPES[cfg.model.dtype]
    stream = (trained is None and stream_load.supported(cfg.model)
              and not any(is_dora_file(s.path) for s in plan.loras))
    experts = {"experts"} if adapter.experts else set()  # a family of experts' others, whole in RAM
    comps = adapter.load(cfg.model, parts={"vae", "text", "scheduler"} | experts | (set() if stream else {"transformer"}),
                         dtype=dtype, device="cpu")
    loaders = {}
    if stream:
        comps.transformer, loader = stream_load.load(adapter, cfg.model, dtype, torch.device("cpu"), True)
        loaders[id(comps.transformer)] = loader
    pipe = adapter.pipeline(comps)
    del comps  # the pipeline holds the only references from here, so releasing the encoders frees them
    for name in adapter.sampling_components:  # never adapted by a LoRA: loaded block by block like the main one
        module, loader = adapter.load_component(cfg.model, name, dtype, "cpu")
        loaders[id(module)] = loader
        setattr(pipe, name, module)
    if trained is not None:
        from .train.checkpoint import load_transformer_weights

        load_transformer_weights(trained, getattr(pipe, adapter.transformer_dir))  # model.expert's, if experts
    names = load_loras(pipe, plan.loras, adapter.family)
    # Inference only. It also tells the conductor that every block weight (LoRA layers included) is frozen, so
    # all of it is packed and streamed; a parameter that requires grad would be kept resident on the device.
    for tr in adapter.pipeline_transformers(pipe):
        tr.requires_grad_(False)
    return pipe, names, loaders



def _encode_and_release(pipe, adapter, plan: SamplePlan, text_fraction: float) -> dict[str, dict]:
    """Each distinct prompt's pipeline kwargs; the text encoders are gone when this returns."""
    unique = list(dict.fromkeys(plan.prompts))
    fix = "stream them with --set offload.text_encoders=1.0" if text_fraction < 1 else "use a larger GPU"
    with _oom_as_user_error(
        f"the text encoders do not fit in GPU memory at offload.text_encoders={text_fraction}: {fix}"
    ):
        with place_text_encoders(pipe, plan.device, text_fraction):
            embeds = encode_prompts(
                pipe,
                adapter.family,
                unique,
                guidance=plan.settings.guidance,
                negative_prompt=plan.settings.negative_prompt,
                device=plan.device,
                image=plan.settings.reference(),
            )
    release_text_encoders(pipe)
    return dict(zip(unique, embeds, strict=True))


def _metadata(cfg: Config, family: str, plan: SamplePlan, job: Job) -> dict[str, str]:
    s = plan.settings
    return image_metadata(
        prompt=job.prompt,
        seed=job.seed,
        steps=s.steps,
        guidance=s.guidance,
        guidance_2=s.guidance_2,
        width=s.width,
        height=s.height,
        frames=s.frames if s.frames > 1 else None,
        model=cfg.model.path,
        transformer_file=cfg.model.transformer_file,
        dtype=cfg.model.dtype,
        family=family,
        loras=",".join(str(x) for x in plan.loras) or None,
        offload=plan.offload,
        negative_prompt=s.negative_prompt or None,
        image=s.image if not isinstance(s.image, tuple) else ",".join(s.image),
    )
