"""A run owns its output folder: run ids, claiming a folder, this run's checkpoints, pruning, resume checks.

Why. Two `dittrain fit` commands sharing one `output.dir` silently would break each other: the second run's pruning
(which keeps the highest step numbers) would delete its own checkpoints, its final save would crash, `metrics.jsonl`
and the final LoRA would mix both runs, and `--resume latest` would pick up the other run. Here a folder belongs to
one run at a time.

How.
- A fresh run gets an id (`20250101-120000-3fa9c2`: start time and 6 random hex digits) and writes it to
  `<output.dir>/run.json` before anything heavy loads. Every checkpoint's `state.json`, every `metrics.jsonl` line
  and TensorBoard's hparams carry it.
- `claim` decides who may write into the folder:
    fresh run, folder holds no run (or a run that saved nothing)  -> new id;
    fresh run, folder holds a run with saved weights              -> one-line error offering `--resume latest`,
                                                                     `--overwrite` or another output.dir;
    `--overwrite`                                                 -> dittrain's own outputs are deleted first,
                                                                     listed in one line (other files in the folder,
                                                                     and images `dittrain sample` wrote into
                                                                     samples/, are left alone);
    `--resume CKPT`                                               -> the checkpoint's run id continues; a
                                                                     checkpoint of a run other than the folder's
                                                                     is refused unless `allow_other_run`.
- `prune` deletes only checkpoints of this run at or below the current step: another run's checkpoints, or this
  run's at higher steps (left by a resume from an earlier checkpoint), are never touched.
- `check_checkpoint` reads every file of a checkpoint's header (state.json parses, every safetensors header and
  size is sound, every file the marker lists exists) before a weight is loaded, so a broken checkpoint is one line
  naming it and the last intact one, not a traceback mid-load.
- `check_writable` tries a folder before the model loads, and `disk_errors` turns a full disk during a save into
  one line with the size needed.

Two live processes: `claim` refuses a second run only once the first has saved something; the lock of lock.py,
taken before `claim`, refuses it from the start.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from ..errors import UserError
from ..lora_format import lora_metadata
from ..models.base import BOTH_EXPERTS
from . import checkpoint as ck

RUN_FILE = "run.json"
# What dittrain writes into output.dir: what `--overwrite` deletes, and what marks a folder as used.
OUTPUTS = ("checkpoints", "lora.safetensors", "lora-ema.safetensors", "transformer", "transformer-ema",
           "metrics.jsonl", "tensorboard", "wandb", "samples", RUN_FILE)
_WEIGHTS_GLOBS = ("lora*.safetensors", "transformer", "transformer-ema")


class DiskFullError(UserError, OSError):
    """No space left while saving; still an OSError for callers that catch those."""

    def __str__(self) -> str:
        return str(self.strerror)


def is_main_process() -> bool:
    """Rank 0 of a torchrun / accelerate launch (or a single process): the one that writes output.dir."""
    return os.environ.get("RANK", "0") == "0"


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


@dataclass
class Run:
    id: str
    out: Path

    def state(self) -> dict:
        """What every checkpoint's state.json carries about the run."""
        return {"run_id": self.id}


# ---------------------------------------------------------------------------------------------- reading a folder


def folder_run_id(out: Path) -> str | None:
    try:
        return json.loads((Path(out) / RUN_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def checkpoint_run_id(folder: Path) -> str | None:
    try:
        return json.loads((Path(folder) / "state.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def saved_weights(out: Path) -> list[Path]:
    """Checkpoints and final weights in `out` (what a fresh run there would lose)."""
    out = Path(out)
    found = [p for _, p in ck.list_checkpoints(ck.checkpoint_root(out))]
    for pattern in _WEIGHTS_GLOBS:
        found += sorted(out.glob(pattern))
    return found


def run_checkpoints(out: Path, run_id: str | None) -> list[tuple[int, Path]]:
    """Complete checkpoints of run `run_id` (all of them when the folder predates run ids), oldest first."""
    found = ck.list_checkpoints(ck.checkpoint_root(out))
    if run_id is None:
        return found
    return [(s, p) for s, p in found if checkpoint_run_id(p) in (run_id, None)]


def describe(out: Path) -> str:
    rid = folder_run_id(out)
    ckpts = run_checkpoints(out, rid)
    what = f"run {rid}" if rid else "an earlier run"
    last = f", last checkpoint at step {ckpts[-1][0]}" if ckpts else ""
    return f"{what}{last}"


# ---------------------------------------------------------------------------------------------- claiming a folder


def claim(out: Path, resume_dir: Path | None, overwrite: bool = False, allow_other_run: bool = False,
          write: bool = True) -> Run:
    """Decide the run id for a `fit` into `out` and record it in run.json (with `write`; rank 0 only). Raises
    UserError before anything is loaded when the folder belongs to another run. Every process of a launch calls
    it before the process group forms, so all of them stop on the same error; only rank 0 writes or deletes (the
    others' run id is unused: they write nothing)."""
    out = Path(out)
    owner = folder_run_id(out)
    if resume_dir is not None:
        if overwrite:
            raise UserError("--overwrite and --resume contradict each other: --overwrite deletes the checkpoints "
                            "--resume continues from")
        theirs = checkpoint_run_id(resume_dir)
        if owner and theirs and owner != theirs and not allow_other_run:
            raise UserError(
                f"--resume {resume_dir}: that checkpoint is of run {theirs}, but {out} holds run {owner}; resume "
                f"into another output.dir (--set output.dir=...), or add --resume-other-run to continue run "
                f"{theirs} here (run {owner}'s files are kept)"
            )
        rid = theirs or owner or new_run_id()
    else:
        used = saved_weights(out)
        if used and not overwrite:
            raise UserError(
                f"{out} already holds {describe(out)}: continue it with --resume latest, start over with "
                f"--overwrite (deletes its checkpoints and weights), or choose another output.dir "
                f"(--set output.dir=...)"
            )
        if overwrite and write:
            found = len(ck.list_checkpoints(ck.checkpoint_root(out)))
            gone = clear(out)
            if gone:
                from .monitor import say

                say(describe_cleared(out, gone, found))
        elif owner and write:
            clear(out)  # a run that saved nothing: nothing trained is lost
        rid = new_run_id()
    run = Run(rid, out)
    if write:
        out.mkdir(parents=True, exist_ok=True)
        ck.atomic_write(out / RUN_FILE, lambda tmp: ck.write_json(tmp, {"run_id": rid, "started": time.time()}))
    return run


def release(out: Path, run_id: str, keep_folder: bool) -> None:
    """A fresh run that failed before it trained a step or saved anything gives the folder back: its run.json
    (and the empty logs it opened) go, so the folder does not claim a run that never ran; the folder itself too
    when the run created it and nothing else is in it."""
    out = Path(out)
    if folder_run_id(out) != run_id or saved_weights(out):
        return
    clear(out)
    if not keep_folder:
        try:
            out.rmdir()  # only when empty
        except OSError:
            pass


def _training_sample(path: Path) -> bool:
    """An image a fit saved (`samples/step-000060-0.png`, its PNG text carrying the training step), not one made by
    `dittrain sample` into the same folder."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return "training_step" in (getattr(im, "text", None) or {})
    except OSError:
        return False


def clear(out: Path) -> list[Path]:
    """Delete dittrain's training outputs from `out` (never other files, nor images `dittrain sample` wrote into
    samples/: only the fit's own step-*.png go, with a video's mp4 beside it, and the folder if that empties it)."""
    out, gone = Path(out), []
    for name in OUTPUTS:
        for p in out.glob(name):
            if name == "samples" and p.is_dir():
                for f in sorted(p.glob("step-[0-9]*.png")):
                    if _training_sample(f):
                        f.unlink()
                        gone.append(f)
                        if (video := f.with_suffix(".mp4")).is_file():  # a video family's sample beside its frames
                            video.unlink()
                if not any(p.iterdir()):
                    p.rmdir()
                continue
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            gone.append(p)
    for p in out.glob("*-step-[0-9]*.safetensors"):
        p.unlink()
        gone.append(p)
    return gone


def describe_cleared(out: Path, gone: list[Path], checkpoints: int) -> str:
    """`--overwrite`'s line: what was deleted, by name (checkpoints and sample images counted)."""
    out, names, images = Path(out), [], 0
    for p in gone:
        if p.suffix == ".png":
            images += 1
        elif p.name == "checkpoints":
            names.append(f"checkpoints/ ({checkpoints} checkpoint{'s' if checkpoints != 1 else ''})")
        else:
            names.append(p.name + ("/" if not p.suffix else ""))
    if images:
        names.append(f"{images} sample image{'s' if images != 1 else ''} in samples/")
    left = sorted(f.name for f in (out / "samples").glob("*.png")) if (out / "samples").is_dir() else []
    kept = f"; kept {len(left)} image{'s' if len(left) != 1 else ''} made by `dittrain sample` in samples/" if left else ""
    return f"--overwrite: deleted {', '.join(names) or 'nothing'} from {out}{kept}"


def prune(root: Path, run_id: str, step: int, keep: int) -> list[Path]:
    """Keep the newest `keep` checkpoints of run `run_id` at or below `step`; nothing else is touched."""
    mine = [(s, p) for s, p in ck.list_checkpoints(root) if s <= step and checkpoint_run_id(p) == run_id]
    gone = [p for _, p in mine[:-keep]]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


# ---------------------------------------------------------------------------------------------- resume checks


def check_checkpoint(folder: Path) -> str | None:
    """What is wrong with a complete-looking checkpoint, or None when every file reads."""
    folder = Path(folder)
    try:
        listed = json.loads((folder / ck.MARKER).read_text()).get("files", [])
    except (OSError, ValueError, AttributeError):
        listed = []
    for rel in listed:
        if not (folder / rel).exists():
            return f"{rel} is missing"
    for name in ("state.json", "rng.safetensors"):
        if not (folder / name).is_file():
            return f"{name} is missing"
    try:
        state = json.loads((folder / "state.json").read_text())
        if not isinstance(state, dict) or "step" not in state:
            return "state.json holds no step"
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"state.json is not valid JSON ({e})"
    for f in sorted(folder.rglob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as h:
                h.keys()
        except (SafetensorError, OSError, ValueError) as e:
            return f"{f.relative_to(folder)} is not a readable safetensors file ({str(e).splitlines()[0][:120]})"
    return None


def last_intact(root: Path, before: int | None = None) -> Path | None:
    for s, p in reversed(ck.list_checkpoints(root)):
        if (before is None or s < before) and check_checkpoint(p) is None:
            return p
    return None


def resolve_resume(out: Path, resume: str, allow_other_run: bool = False) -> Path:
    """`--resume latest|PATH` -> a checkpoint folder whose files all read; a broken one is a one-line error naming
    the last intact checkpoint. `latest` is the newest checkpoint of the run that owns `out`."""
    if resume == "latest" and not allow_other_run:
        owner = folder_run_id(out)
        mine = run_checkpoints(out, owner)
        folder = mine[-1][1] if mine else ck.resolve_resume(out, resume)
    else:
        folder = ck.resolve_resume(out, resume)
    problem = check_checkpoint(folder)
    if problem is not None:
        step = int(ck._STEP_RE.match(folder.name).group(1)) if ck._STEP_RE.match(folder.name) else None
        good = last_intact(folder.parent, step)
        fix = f"the last intact one is {good}: --resume {good}" if good else "no intact checkpoint is left before it"
        raise UserError(f"checkpoint {folder} is broken: {problem}; {fix}")
    return folder


def check_target(state: dict, steps: int, folder: Path, out: Path | None = None) -> None:
    """A checkpoint at or past train.steps has nothing left to train; resuming it would only rewrite the final
    weights. And a resume that would end below weights the folder already holds (a 100-step run's final LoRA,
    resumed from step 20 with train.steps 40) would replace them: refused, pointing at another output.dir."""
    if int(state["step"]) >= steps:
        raise UserError(
            f"--resume {folder}: the checkpoint is at step {state['step']} and train.steps is {steps}, so there is "
            f"nothing to train; raise train.steps (--set train.steps=N) to continue it"
        )
    if out is None:
        return
    reached = [s for s, _ in run_checkpoints(out, folder_run_id(out))]
    lora = Path(out) / "lora.safetensors"
    if lora.is_file():
        try:
            reached.append(int(lora_metadata(lora).get("dittrain.step", 0)))
        except (OSError, ValueError, SafetensorError):
            pass
    if reached and max(reached) > steps:
        raise UserError(
            f"--resume {folder}: {out} already holds this run's weights at step {max(reached)}, beyond train.steps "
            f"{steps}, and the resumed run's final save would replace them; resume into another output.dir "
            f"(--set output.dir=...) or raise train.steps to at least {max(reached)}"
        )


# Config keys that change the shapes (or the set) of the trained weights: a checkpoint saved under other values
# cannot be loaded into this run's model, whatever else is the same.
SHAPE_KEYS = ("train.method", "lora.type", "lora.rank", "lora.dora", "lora.targets", "model.family")


def _dotted(d: dict | None, key: str):
    for part in key.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)
    return d


def check_shapes(state: dict, current: dict, folder: Path) -> None:
    """Refuse, in one line before the model loads, a resume whose config changes the trained weights' shapes
    (lora.rank 16 -> 8): the checkpoint's weights would not fit the model this config builds."""
    saved = state.get("config")
    if not isinstance(saved, dict):
        return
    changed = [(k, _dotted(saved, k), _dotted(current, k)) for k in SHAPE_KEYS
               if _dotted(saved, k) != _dotted(current, k)]
    if changed:
        what = ", ".join(f"{k} {a} -> {b}" for k, a, b in changed)
        back = " ".join(f"--set {k}={_yaml_value(a)}" for k, a, _ in changed)
        raise UserError(
            f"--resume {folder}: {what} changes the shapes of the trained weights, so the checkpoint cannot be "
            f"loaded; resume with the run's values ({back}) or start a new run in another output.dir "
            f"(--set output.dir=...)"
        )


def _yaml_value(v) -> str:
    if isinstance(v, bool) or v is None:
        return {True: "true", False: "false", None: "null"}[v]
    if isinstance(v, list):
        return "[" + ",".join(map(str, v)) + "]"
    return str(v)


def config_changes(saved: dict | None, current: dict, limit: int = 4) -> list[str]:
    """Dotted keys whose values differ between two config dumps, as `key: old -> new`."""
    if not saved:
        return []
    out: list[str] = []

    def walk(a, b, path):
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k), b.get(k), f"{path}.{k}" if path else k)
        elif a != b:
            out.append(f"{path}: {a} -> {b}")

    walk(saved, current, "")
    return out[:limit] + ([f"(and {len(out) - limit} more)"] if len(out) > limit else [])


# ---------------------------------------------------------------------------------------------- disk


def check_writable(folder: Path, what: str) -> None:
    """Create `folder` if needed and write a file into it, so an unwritable folder fails before the model loads."""
    folder = Path(folder)
    probe = folder / f".dittrain-write-test-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"{what} {folder} is not writable ({e.strerror or e}); choose a folder you can write to") from None


def _is_disk_full(e: BaseException) -> bool:
    return getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


@contextmanager
def disk_errors(where: Path, needed_bytes: int):
    """A full disk inside the block becomes one line: what was being written, about how much it needs, how much is
    free."""
    try:
        yield
    except (OSError, SafetensorError) as e:
        if not _is_disk_full(e):
            raise
        try:
            free = _gb(shutil.disk_usage(Path(where).parent if not Path(where).exists() else where).free)
        except OSError:
            free = "unknown"
        raise DiskFullError(
            errno.ENOSPC,
            f"No space left on device while saving to {where}: a checkpoint needs about {_gb(needed_bytes)}, "
            f"{free} is free there; free some space (or lower train.keep_checkpoints), then --resume latest",
        ) from None


def estimate_checkpoint_bytes(out: Path, params) -> int:
    """About what the next checkpoint takes: the newest one's size, else the trainable weights with two fp32
    moments (AdamW's), which bounds the other optimizers' state."""
    found = ck.list_checkpoints(ck.checkpoint_root(out))
    if found:
        try:
            return folder_bytes(found[-1][1])
        except OSError:
            pass
    return sum(p.numel() * (p.element_size() + 8) for p in params)


# ---------------------------------------------------------------------------------------------- per-step LoRAs


def save_due(cfg, step: int) -> bool:
    """A checkpoint before the end: every train.checkpoint_every steps, and every output.save_every steps (whose
    LoRA is kept as its own file)."""
    if step >= cfg.train.steps:
        return False  # the final save follows
    return any(n and step % n == 0 for n in (cfg.train.checkpoint_every, cfg.output.save_every))


def step_lora_name(cfg, step: int) -> str:
    expert = getattr(cfg.model, "expert", None)  # a family of experts: the name says which (sample routes by it)
    return f"{cfg.output.name or 'lora'}{'-' + expert if expert else ''}-step-{step:06d}.safetensors"


def keep_step_lora(cfg, run: Run, checkpoint: Path, step: int) -> Path | None:
    """With output.save_every, a checkpoint's LoRA (in output.lora_format) that pruning never deletes, beside the
    checkpoints: `<output.dir>/<run name>-step-000500.safetensors`."""
    every = getattr(cfg.output, "save_every", 0)
    if getattr(cfg.model, "expert", None) == BOTH_EXPERTS:  # each expert's, from its subfolder (train/experts.py)
        from ..models import adapter_class

        for name in adapter_class(cfg.model.family).experts:
            one = cfg.model_copy(update={"model": cfg.model.model_copy(update={"expert": name})})
            keep_step_lora(one, run, checkpoint / name, step)
        return None
    src = ck.checkpoint_adapter(checkpoint)
    if not every or step % every or not src.is_file():
        return None
    from ..lora_format import read_lora_file

    path = run.out / step_lora_name(cfg, step)
    ck.export_lora(path, read_lora_file(src), cfg.output.lora_format, cfg.model.family, cfg.model)  # the user's layout
    from .monitor import say

    say(f"saved {path} (step {step})")
    return path
