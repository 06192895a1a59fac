"""What to sample, checked before any weights are read.

`dittrain sample` arrives here with the command-line flags (`SampleRequest`); `resolve` merges them with the
config's `sample:` section and turns every problem a user can fix (no prompts, an empty or missing prompt file, a
missing LoRA file, a size the model cannot make) into one `UserError` line. Checking all of this first matters:
loading a 12 B model only to fail on a typo in a LoRA path costs minutes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError


@dataclass
class SampleRequest:
    """The `dittrain sample` flags; None means "take it from the config's sample: section"."""

    prompts: list[str] = field(default_factory=list)
    prompts_file: Path | None = None
    loras: list[str] = field(default_factory=list)
    offload: float | str | None = None  #: a fraction, or "auto" (trainer/sample.py resolves it)
    steps: int | None = None
    guidance: float | None = None
    seed: int | None = None
    width: int | None = None
    height: int | None = None
    num: int = 1
    out: Path | None = None
    base: bool = False  # full fine-tune configs: sample the base model, not output.dir/transformer
    image: Path | list[Path] | None = None  # edit families: the reference image (several: Flux.2, `max_references`)
    frames: int | None = None  # video families: frames per sample


@dataclass(frozen=True)
class LoraSpec:
    """One `--lora PATH[:WEIGHT]`."""

    path: Path
    weight: float = 1.0

    def __str__(self) -> str:
        return f"{self.path}:{self.weight:g}"


@dataclass(frozen=True)
class SampleSettings:
    """How each image is denoised (shared by `dittrain sample` and sampling during training)."""

    steps: int
    guidance: float
    width: int
    height: int
    negative_prompt: str = ""
    #: edit families: the reference image file (resized and centre-cropped to width x height, as in training);
    #: a tuple of files for several references (families with `max_references` > 1)
    image: str | tuple[str, ...] | None = None
    #: video families: frames per sample (1: a still image)
    frames: int = 1
    #: families of two experts: the low-noise expert's guidance (None: `guidance`)
    guidance_2: float | None = None

    def reference(self):
        """The reference image as the pipeline gets it (PIL, width x height), a list of them for several, or None."""
        if self.image is None:
            return None
        from ..data.images import cover_and_crop, crop_box, open_image

        size = (self.width, self.height)
        cut = [cover_and_crop(im, size, crop_box(im.width, im.height, size, "center"))
               for im in map(open_image, [self.image] if isinstance(self.image, str) else self.image)]
        return cut[0] if isinstance(self.image, str) else cut

    @classmethod
    def from_config(cls, sample_cfg) -> SampleSettings:
        """The config's `sample:` section as settings (what sampling during training uses)."""
        s = sample_cfg
        return cls(s.steps, s.guidance, s.width, s.height, s.negative_prompt, image_setting(getattr(s, "image", None)),
                   getattr(s, "frames", 1), getattr(s, "guidance_2", None))


def image_setting(image) -> str | tuple[str, ...] | None:
    """`--image` / `sample.image` (a path or a list of paths) as `SampleSettings.image`: one path a str, several a
    tuple, none None."""
    if isinstance(image, list | tuple):
        if not image:
            return None
        return str(image[0]) if len(image) == 1 else tuple(str(p) for p in image)
    return str(image) if image is not None else None


@dataclass(frozen=True)
class Job:
    """One image to make: which prompt (index into the prompt list), its seed, and its file name."""

    prompt_index: int
    prompt: str
    seed: int
    filename: str


def parse_lora(text: str) -> LoraSpec:
    """`PATH` or `PATH:WEIGHT`. A colon followed by something that is not a number stays part of the path, unless
    what comes before it is a .safetensors file (or exists): then the weight is what is wrong, and said so."""
    path, sep, weight = text.rpartition(":")
    if sep and path:
        try:
            return LoraSpec(Path(path), float(weight))
        except ValueError:
            if (path.endswith(".safetensors") or Path(path).is_file()) and not Path(text).exists():
                raise UserError(f"--lora {text}: the weight {weight!r} is not a number; write PATH:WEIGHT, e.g. "
                                f"{path}:0.8") from None
    return LoraSpec(Path(text), 1.0)


def read_prompts_file(path: Path) -> list[str]:
    """One prompt per line; blank lines and lines starting with '#' are skipped."""
    if not path.is_file():
        raise UserError(
            f"{path}: prompt file not found (--prompts expects a text file with one prompt per line)"
        )
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # -sig: a BOM is not part of the first prompt
    except UnicodeDecodeError:
        raise UserError(f"{path}: prompt file is not UTF-8 text (one prompt per line expected)") from None
    prompts = [s.strip() for s in lines if s.strip() and not s.lstrip().startswith("#")]
    if not prompts:
        raise UserError(f"{path}: prompt file has no prompts (one prompt per line; '#' starts a comment)")
    return prompts


def check_size(width: int, height: int, divisor: int, family: str) -> None:
    """Sides must be positive multiples of the model's divisor; the error names the nearest valid sides."""
    for name, side in (("width", width), ("height", height)):
        if side < divisor:
            raise UserError(
                f"--{name} {side} is too small for {family}: the smallest side is {divisor} pixels "
                f"(sides must be multiples of {divisor})"
            )
        if side % divisor:
            lo = side - side % divisor
            raise UserError(
                f"--{name} {side} is not a multiple of {divisor} (needed by {family}): use {lo} or {lo + divisor}"
            )


def slug(text: str, limit: int = 40) -> str:
    """A file-name-safe, deterministic short form of a prompt."""
    out, dash = [], False
    for ch in text.lower():
        if ch.isascii() and ch.isalnum():
            out.append(ch)
            dash = False
        elif not dash and out:
            out.append("-")
            dash = True
    return "".join(out)[:limit].strip("-") or "prompt"


def plan_jobs(prompts: list[str], num: int, seed: int) -> list[Job]:
    """Image k (prompt-major, `num` per prompt) uses seed + k; its name encodes k, the seed and the prompt.

    Names depend only on the inputs, so the same command writes the same files (and overwrites them)."""
    jobs = []
    for i, prompt in enumerate(prompts):
        for j in range(num):
            k = i * num + j
            jobs.append(Job(i, prompt, seed + k, f"{k:04d}-seed{seed + k}-{slug(prompt)}.png"))
    return jobs


def collect_prompts(req: SampleRequest, config_prompts: list[str]) -> list[str]:
    """--prompt and --prompts together; the config's sample.prompts only when neither is given."""
    prompts = [p for p in req.prompts if p.strip()]
    if req.prompts and not prompts:
        raise UserError('--prompt is empty: give the text to generate, e.g. --prompt "a red square"')
    if req.prompts_file is not None:
        prompts += read_prompts_file(req.prompts_file)
    if not prompts:
        prompts = [p for p in config_prompts if p.strip()]
    if not prompts:
        raise UserError("no prompts: pass --prompt TEXT, --prompts FILE, or set sample.prompts in the config")
    return prompts


def check_guidance_2(guidance_2: float | None, adapter) -> None:
    """`sample.guidance_2`: only for a family of two experts (its pipeline refuses it otherwise)."""
    if guidance_2 is not None and not adapter.experts:
        raise UserError(f"sample.guidance_2: {adapter.family} has one transformer; the low-noise guidance is for a "
                        f"family of two experts (leave it null)")


def check_frames(frames: int, adapter) -> None:
    """`sample.frames` / `--frames`: more than one only for a video family, and then a clip its VAE decodes
    (frame_step * k + 1)."""
    if frames == 1:
        return
    if not adapter.video:
        raise UserError(f"sample.frames {frames}: {adapter.family} makes images; frames are for video families "
                        f"(set sample.frames: 1)")
    if not adapter.valid_frames(frames):
        k = (frames - 1) // adapter.frame_step
        raise UserError(f"sample.frames {frames}: {adapter.family} makes {adapter.frame_step}k+1 frames: use "
                        f"{k * adapter.frame_step + 1} or {(k + 1) * adapter.frame_step + 1}")


def check_image(path: Path | list[Path] | None, adapter) -> None:
    """`--image`: only for edit families, and it must be a readable image (several: no more than the family's
    `max_references`); families whose text encoder sees the reference (`text_uses_reference`) cannot sample
    without one."""
    paths = list(path) if isinstance(path, list | tuple) else [] if path is None else [path]
    if adapter.takes_reference and len(paths) > adapter.max_references:
        raise UserError(f"--image given {len(paths)} times: {adapter.family} takes at most "
                        f"{adapter.max_references} reference image{'s' if adapter.max_references > 1 else ''}")
    if len(paths) > 1:
        for p in paths:
            check_image(p, adapter)
        return
    path = paths[0] if paths else None
    if path is None:
        if adapter.first_frame_conditions:
            raise UserError(f"{adapter.family} is image-to-video: pass --image (or set sample.image), the first frame")
        if adapter.text_uses_reference or adapter.sample_needs_reference:
            raise UserError(f"{adapter.family} samples need a reference image: pass --image (or set sample.image)")
        return
    if not adapter.takes_reference and not adapter.first_frame_conditions:
        from ..models import adapter_classes

        edit = ", ".join(c.family for c in adapter_classes() if c.takes_reference)
        raise UserError(f"--image is for edit models ({edit}); model.family {adapter.family} takes no reference image")
    from ..data.images import BadImage, open_image

    try:
        open_image(path)
    except BadImage as e:
        raise UserError(f"{path}: --image is not a usable image ({e})") from None


def check_loras(specs: list[LoraSpec]) -> None:
    for spec in specs:
        if not spec.path.is_file():
            raise UserError(
                f"{spec.path}: LoRA file not found (--lora expects a .safetensors file, PATH[:WEIGHT])"
            )
        if spec.path.suffix != ".safetensors":
            raise UserError(
                f"{spec.path}: a LoRA must be a .safetensors file (pickled .bin/.pt files are not read)"
            )
        _check_safetensors(spec.path)


def _check_safetensors(path: Path) -> None:
    """Read the file's header (not its weights): a file that is not safetensors, or is cut short, is one line
    here instead of a traceback after the model has loaded."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError, ValueError) as e:
        first = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise UserError(f"{path}: not a readable safetensors LoRA file ({first})") from None
