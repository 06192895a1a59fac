"""`dittrain caption`: the run, top to bottom. Find what has no caption, load the model and place it, then per batch:
read the files (a bad one is named in one line and counted), generate, write each caption at once.

Ctrl-C (or SIGTERM) stops at once: every caption written is a whole file already (files.py), the batch being
generated is lost, and the same command later captions exactly what is left. Stopped or finished, the run ends
with one summary line (written, skipped because a caption existed, failed).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..data.captions import with_trigger
from ..data.images import BadImage
from ..errors import Interrupted, UserError
from ..progress import bar, shown
from ..words import count
from . import files, vlm

#: the instruction per --style; a video's prompt says first that the pictures are its frames, in order
STYLES = {
    "tags": "List what this image shows as comma-separated tags (subjects, attributes, clothing, setting, style, "
            "composition), most important first. Output only the tags.",
    "short": "Describe this image in one sentence. Output only the sentence.",
    "detailed": "Describe this image in detail in one paragraph: the subjects, their appearance and actions, the "
                "setting, composition, lighting, colours and style. Output only the description.",
}
VIDEO_PREFIX = "These {n} images are frames of one video, in order; caption the video. "
#: files per generate without --batch: 8 rows share each pass of the streamed layers (vlm.py's essay, Default batch)
DEFAULT_BATCH = 8
#: without a terminal, one progress line at most this often (seconds)
LOG_EVERY = 30.0


@dataclass
class CaptionRequest:
    data_dir: Path
    model: Path
    style: str = "detailed"
    trigger: str = ""
    prompt: str | None = None
    overwrite: bool = False
    offload: float | str = "auto"  # a fraction, or "auto"
    batch: int | None = None  # None: DEFAULT_BATCH, halved while auto's estimate does not fit it (`_default_batch`)
    quantize: str = "none"  # every Linear (decoder layers, vision tower, head): none, fp8 or int8 (vlm.py)
    max_new_tokens: int = 256
    frames: int = 4  # per video
    device: str | None = None  # None: cuda if there is one, else cpu
    recursive: bool = True  # sub-folders too
    # decode steps at their own, smaller fraction under --offload auto (vlm.py's essay, Decode placement): off, as
    # measured slower on an H200 (Qwen3-VL-8B fp8, 7 GB cap, batch 8: 0.915 images/s on, 1.087 off)
    decode_placement: bool = False


@dataclass
class CaptionSummary:
    written: list[Path] = field(default_factory=list)
    skipped: int = 0  # a caption existed (no --overwrite)
    failed: list[tuple[Path, str]] = field(default_factory=list)
    fraction: float = 0.0
    decode_fraction: float = 0.0  # the decode steps' (below `fraction` under --offload auto: vlm.py's essay)

    def line(self) -> str:
        return (f"captions: {len(self.written)} written, {self.skipped} skipped (caption exists), "
                f"{len(self.failed)} failed")


def _say(line: str) -> None:
    tqdm.write(line, file=sys.stderr)


def _prompt(req: CaptionRequest, path: Path, pictures: int) -> str:
    text = req.prompt or STYLES[req.style]
    return VIDEO_PREFIX.format(n=pictures) + text if pictures > 1 or files.is_video(path) else text


def _budget(device: torch.device) -> float | None:
    """The bytes `--offload auto` plans in (`presets.device_budget_bytes`, as `dittrain sample`'s); None on the CPU."""
    if device.type != "cuda":
        return None
    from ..planner.presets import device_budget_bytes

    return device_budget_bytes(device)


def _fraction(req: CaptionRequest, model, blocks, device: torch.device, tokens: int, batch: int) -> float:
    """`--offload` as a fraction; auto's for `batch` rows per `generate` (the KV cache and activations grow with it)."""
    if req.offload != "auto":
        return float(req.offload)
    budget = _budget(device)
    if budget is None:
        _say("offload: auto -> 0 on the CPU (there is no second memory to save)")
        return 0.0
    return vlm.auto_fraction(model, blocks, budget, batch, tokens, _say)


def _decode_fraction(req: CaptionRequest, model, blocks, device: torch.device, tokens: int, batch: int,
                     fraction: float) -> float:
    """Under `--offload auto` on a GPU with `req.decode_placement`, the fraction of the decode steps (vlm.py's
    essay, Decode placement): at most the prefill's; otherwise the prefill's one placement."""
    budget = _budget(device)
    if req.offload != "auto" or budget is None or not req.decode_placement:
        return fraction
    return vlm.decode_fraction(model, blocks, budget, batch, tokens, fraction, _say)


def _hint_quantize(req: CaptionRequest, fraction: float) -> None:
    """Streaming most of a bf16 decoder under `--offload auto`: each new token copies those layers again, so say
    once that 8-bit Linears halve those bytes (measured on an H200 under a 7 GB cap: 0.54-0.55 x the resident
    model with fp8 at batch 8, against 0.27 x in bf16 at batch 4; docs/data.md)."""
    if req.offload == "auto" and req.quantize == "none" and fraction >= 0.5:
        _say(f"offload: {fraction:g} of the decoder layers stream for every new token; --quantize fp8 halves their "
             "bytes (about twice the images/s on small cards, docs/data.md)")


def _default_batch(req: CaptionRequest, model, blocks, device: torch.device, tokens: int, batch: int) -> int:
    """Without --batch, under --offload auto on a GPU: `batch` halved while auto's estimate does not fit the
    budget even with every layer streamed (a larger batch that does not fit would run out of memory)."""
    if req.batch is not None or req.offload != "auto" or (budget := _budget(device)) is None:
        return batch
    from ..planner.prediction import PREDICTION_MARGIN

    start = batch
    while batch > 1 and vlm.estimate(model, blocks, batch, tokens)(1.0) > budget * (1 - PREDICTION_MARGIN):
        batch //= 2
    if batch < start:
        _say(f"batch: {start} -> {batch} files per generate (a batch of {start} does not fit the GPU even with every "
             "layer streamed; --batch chooses)")
    return batch


def _tokens_per_row(processor, req: CaptionRequest) -> int:
    """A prompt's length for the auto estimate: an image at files.IMAGE_PIXELS (or a video's frames), the
    instruction and the new tokens."""
    ip = getattr(processor, "image_processor", None)
    px = (getattr(ip, "patch_size", 14) * getattr(ip, "merge_size", 2)) ** 2
    return max(files.IMAGE_PIXELS, req.frames * files.FRAME_PIXELS) // px + 128 + req.max_new_tokens


class _Progress:
    """The tqdm bar (images/s, time left) on a terminal; else a line at most every LOG_EVERY seconds."""

    def __init__(self, total: int):
        self.total, self.done, self.t0, self.last = total, 0, time.monotonic(), time.monotonic()
        self.bar = bar(total=total, desc="captioning", unit="img")

    def update(self, n: int) -> None:
        self.done += n
        self.bar.update(n)
        now = time.monotonic()
        if not shown() and (now - self.last >= LOG_EVERY or self.done == self.total):
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            left = (self.total - self.done) / rate if rate else 0.0
            _say(f"captioning: {self.done}/{self.total} files ({rate:.2f} files/s, {left / 60:.1f} min left)")

    def close(self) -> None:
        self.bar.close()


def _batches(todo: list[Path], size: int):
    for i in range(0, len(todo), size):
        yield todo[i:i + size]


def _read(paths: list[Path], frames: int, summary: CaptionSummary) -> list[tuple[Path, list]]:
    out = []
    for p in paths:
        try:
            out.append((p, files.load_pictures(p, frames)))
        except BadImage as e:
            _say(f"skipped {p}: {e}")
            summary.failed.append((p, str(e)))
    return out


def _caption_batch(model, processor, gc, device, dtype, req: CaptionRequest, rows, summary: CaptionSummary) -> None:
    """Generate and write one batch; where the processor refuses the batch, each row alone (naming the bad one)."""
    prompts = [_prompt(req, p, len(pics)) for p, pics in rows]
    try:
        inputs = vlm.prepare(processor, device, dtype, [pics for _, pics in rows], prompts)
    except (ValueError, TypeError) as e:  # the processor refused some image (too small, extreme aspect ratio)
        if len(rows) == 1:
            _say(f"skipped {rows[0][0]}: the model's processor refused it ({e})")
            summary.failed.append((rows[0][0], str(e)))
            return
        for row in rows:
            _caption_batch(model, processor, gc, device, dtype, req, [row], summary)
        return
    texts = vlm.generate(model, processor, gc, inputs)
    for (path, _), text in zip(rows, texts, strict=True):
        text = files.clean(text)
        if not text:
            _say(f"skipped {path}: the model generated an empty caption")
            summary.failed.append((path, "empty caption"))
            continue
        files.write_caption(path, with_trigger(req.trigger, text))
        summary.written.append(path)


def _caption_in_memory(model, processor, gc, device, dtype, req: CaptionRequest, rows, summary: CaptionSummary,
                       handle) -> None:
    """`_caption_batch`; out of memory with the decode placement on, the decode steps keep the prefill's layers
    from then on (said once) and the rows not yet written run again (greedy: the same captions); out of memory
    otherwise, one line that names the fix."""
    for attempt in range(2):
        try:
            _caption_batch(model, processor, gc, device, dtype, req, rows, summary)
            return
        except torch.OutOfMemoryError:
            pass  # handled below, outside the except clause: its traceback holds the batch's tensors
        if attempt or handle is None or not handle.decode_off():
            raise UserError(f"out of memory captioning a batch of {len(rows)} at --offload {summary.fraction:g}: "
                            "lower --batch or raise --offload")
        _say(f"offload: out of memory with the decode steps at {summary.decode_fraction:g}: they run at "
             f"{summary.fraction:g} from now on (the prefill's layers)")
        summary.decode_fraction = summary.fraction
        done = set(summary.written) | {p for p, _ in summary.failed}
        rows = [r for r in rows if r[0] not in done]


def _device(req: CaptionRequest) -> torch.device:
    if req.device is not None:
        return torch.device(req.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run_caption(req: CaptionRequest) -> CaptionSummary:
    """Caption every image and video under `req.data_dir` that has no caption (all with `overwrite`)."""
    if not req.data_dir.is_dir():
        raise UserError(f"{req.data_dir}: no such folder")
    if req.style not in STYLES:
        raise UserError(f"--style {req.style}: one of {', '.join(STYLES)}")
    if req.quantize not in vlm.QUANTIZE:
        raise UserError(f"--quantize {req.quantize}: one of {', '.join(vlm.QUANTIZE)}")
    if req.batch is not None and req.batch < 1:
        raise UserError(f"--batch {req.batch}: at least 1")
    vlm.check_model_folder(req.model)
    todo, skipped = files.find_items(req.data_dir, req.overwrite, req.recursive)
    summary = CaptionSummary(skipped=skipped)
    if not todo:
        _say(f"nothing to caption in {req.data_dir}: {count(skipped, 'file')} already captioned")
        return summary
    device = _device(req)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    processor = vlm.load_processor(req.model)
    model = vlm.load_model(req.model, dtype, req.quantize)
    blocks = vlm.decoder_blocks(model)
    if req.quantize != "none":
        n, rest = vlm.quantized_linears(model, blocks)
        fmt = "fp8 e4m3" if req.quantize == "fp8" else "int8"
        _say(f"--quantize {req.quantize}: the {count(n, 'Linear')} of the {len(blocks)} decoder layers and the "
             f"{count(rest, 'Linear')} outside them (vision tower, head) held as {fmt} with per-channel fp32 scales, "
             f"computed in {str(dtype).removeprefix('torch.')}")
    batch = min(req.batch or DEFAULT_BATCH, len(todo))  # a batch is never larger than what is left to caption
    tokens = _tokens_per_row(processor, req)
    batch = _default_batch(req, model, blocks, device, tokens, batch)
    summary.fraction = _fraction(req, model, blocks, device, tokens, batch)
    _hint_quantize(req, summary.fraction)
    summary.decode_fraction = _decode_fraction(req, model, blocks, device, tokens, batch, summary.fraction)
    handle = vlm.place(model, blocks, device, summary.fraction)
    if handle is not None and summary.decode_fraction < summary.fraction:
        handle.decode_at(model, summary.decode_fraction, _say)
    gc = vlm.greedy_config(model, processor, req.max_new_tokens)
    progress = _Progress(len(todo))
    try:
        for paths in _batches(todo, batch):
            rows = _read(paths, req.frames, summary)
            if rows:
                _caption_in_memory(model, processor, gc, device, dtype, req, rows, summary, handle)
            progress.update(len(paths))
    except KeyboardInterrupt as e:
        progress.close()
        _say(summary.line())
        raise Interrupted(f"captioning stopped by {Interrupted.signal_of(e)}: the {count(len(summary.written), 'caption')} "
                          "written are kept; the same command captions the rest",
                          Interrupted.signal_of(e)) from None
    finally:
        if handle is not None:
            handle.close(keep_weights=False)
    progress.close()
    _say(summary.line())
    return summary


def caption_sources(data, device: torch.device | str | None = None) -> None:
    """`data.sources[].caption_with` (and the validation sources'): caption each such source's uncaptioned files
    before `fit` or `cache` scans them. Runs before any model of the run loads; the captioner is freed after."""
    sources = list(data.sources) + (list(data.validation.sources or []) if data.validation is not None else [])
    for src in sources:
        if src.caption_with is not None:
            _say(f"captioning {src.path} with {src.caption_with} (data.sources[].caption_with)")
            run_caption(CaptionRequest(data_dir=Path(src.path), model=Path(src.caption_with), recursive=src.recursive,
                                       device=None if device is None else str(device)))
