"""Checkpoints that survive a kill at any moment, and LoRA files diffusers loads.

How. A checkpoint is a folder `<output.dir>/checkpoints/step-000120/`. It is written under a temporary name
(`.tmp-step-000120-<pid>`), every file is flushed to disk, then a marker file `COMPLETE` is written last and the
folder is renamed into place (`os.replace`, atomic on one file system). Only folders holding the marker count:
a run killed mid-write leaves a `.tmp-*` folder that is ignored and deleted by the next run, and the previous
checkpoint is untouched. Old checkpoints are pruned only after the new one is in place.

What a checkpoint holds (no pickle anywhere):
- `adapter-state.safetensors` (LoRA; `ADAPTER_STATE`) or `transformer/` (full fine-tune, diffusers `save_pretrained`
  format);
- the optimizer state as safetensors + JSON (written by `trainer.optim`);
- `rng.safetensors`: generator states as uint8 tensors (the objective's noise generator, torch's global CPU
  generator that LoRA dropout draws from, and each CUDA device's);
- `state.json`: step, scheduler and data-sampler state, the config digest.

LoRA files. A checkpoint's `adapter-state.safetensors` has peft's keys (`get_peft_model_state_dict`) under the
`transformer.` prefix, the weights as trained, and in the header diffusers' `lora_adapter_metadata` (the peft
config: alpha, r, targets) and dittrain's own keys (rank, alpha, step, config digest): resuming reads it back
bitwise. The files a user gets (output.dir's `lora.safetensors`, `lora-ema`, the per-step files) are written from
it by `export_lora` in output.lora_format (trainer/lora_format/), where the alpha / rank scale is applied so that
diffusers and ComfyUI load the same update. The checkpoint's file is not one of them: ComfyUI reads alpha only from
`.alpha` tensors, which it has not (diffusers refuses them beside the header), so it would load at alpha = rank; it
is named so that nobody takes it for a LoRA to load (checkpoints written as `lora.safetensors` before still resume).

LoKr and LoHa (lora.type) use the same file layout with peft's own key names (`.lokr_w1`, `.hada_w1_a`, ...);
the header's peft config says which (`peft_type`). DoRA adds `.lora_magnitude_vector` keys, which diffusers reads.

Left out: sharded LoRA files (LoRAs are small) and checkpoints on several hosts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..atomic import _fsync_dir, _fsync_file, atomic_write, umask_mode
from ..errors import UserError
from ..lora_format import DIFFUSERS_PREFIX, LORA_METADATA_KEY

MARKER = "COMPLETE"
_STEP_RE = re.compile(r"^step-(\d+)$")


# ---------------------------------------------------------------------------------------------- disk helpers


def fsync_tree(root: Path) -> None:
    mode = umask_mode()
    for dirpath, _, files in os.walk(root):
        for f in files:
            os.chmod(Path(dirpath) / f, mode)
            _fsync_file(Path(dirpath) / f)
        _fsync_dir(Path(dirpath))


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True))


def atomic_dir(path: Path, write: Callable[[Path], None]) -> None:
    """Write a folder through `write(tmp_dir)`, then put it in place of `path` (replacing an old one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    old = path.with_name(f".old-{path.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
        fsync_tree(tmp)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- checkpoint folders


def checkpoint_root(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def is_complete(folder: Path) -> bool:
    return (Path(folder) / MARKER).is_file()


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def remove_partial(root: Path) -> list[Path]:
    """Delete folders an interrupted write left behind (never a complete checkpoint)."""
    gone = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".old-"):
                # Killed between moving an old folder aside and renaming its replacement in: put it back.
                target = root / p.name[len(".old-") :].rsplit("-", 1)[0]
                if not target.exists():
                    os.replace(p, target)
                    continue
            if p.name.startswith((".tmp-", ".old-")):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                gone.append(p)
    return gone


def write_checkpoint(root: Path, step: int, write: Callable[[Path], None], keep: int,
                     prune: Callable[[Path], object] | None = None) -> Path:
    """Write checkpoint `step` atomically through `write(tmp_dir)`, then prune: through `prune(root)` (the run's
    own checkpoints, trainer/train/run.py), else to the newest `keep` in `root`."""
    final = root / f"step-{step:06d}"

    def _write(tmp: Path) -> None:
        write(tmp)
        fsync_tree(tmp)
        # The marker goes last: a folder without it is never loaded.
        write_json(tmp / MARKER, {"step": step, "files": sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*"))})

    atomic_dir(final, _write)
    if prune is not None:
        prune(root)
        return final
    for _, old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def resolve_resume(output_dir: Path, resume: str) -> Path:
    """`latest` -> the newest complete checkpoint of this run; otherwise a checkpoint folder. Missing -> UserError."""
    root = checkpoint_root(output_dir)
    if resume == "latest":
        found = list_checkpoints(root)
        if not found:
            raise UserError(
                f"--resume latest: no complete checkpoint in {root} (train without --resume to start a new run)"
            )
        return found[-1][1]
    path = Path(resume)
    if not path.is_dir():
        raise UserError(f"--resume {resume}: no such checkpoint folder (expected e.g. {root}/step-000100)")
    if not is_complete(path):
        raise UserError(
            f"--resume {resume}: checkpoint is incomplete (no {MARKER} marker; it was interrupted while being "
            "written); use --resume latest for the newest complete one"
        )
    return path


# ---------------------------------------------------------------------------------------------- RNG state


def rng_state(objective_state: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {"objective": objective_state, "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda_{i}"] = s
    return out


def restore_rng(states: dict[str, torch.Tensor]) -> torch.Tensor:
    """Restore torch's global generators; returns the objective's state for `FlowMatching.load_state`."""
    torch.set_rng_state(states["torch_cpu"])
    cuda = [states[k] for k in sorted((k for k in states if k.startswith("cuda_")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    return states["objective"]


def first_nonfinite(named) -> str | None:
    """The name of the first tensor in `named` ((name, tensor) pairs) holding a NaN or inf, else None. One float32
    norm per tensor: no copy of the tensor, and a NaN or inf anywhere makes the norm non-finite. Host-device sync
    per tensor on the GPU (checkpoints only)."""
    for name, t in named:
        if t.numel() and not torch.isfinite(torch.linalg.vector_norm(t.detach(), dtype=torch.float32)):
            return name
    return None


# ---------------------------------------------------------------------------------------------- LoRA files


def lora_state_dict(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights in peft's naming, on the CPU, contiguous (safetensors needs that)."""
    from peft.utils import get_peft_model_state_dict

    sd = get_peft_model_state_dict(transformer)
    # Device-to-host copy of the (small) LoRA weights.
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()}


def lora_file(transformer: torch.nn.Module, meta: dict[str, str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(weights, header) of the live adapter in peft's layout (see the module essay)."""
    peft_cfg = transformer.peft_config["default"].to_dict()
    for k, v in list(peft_cfg.items()):
        if isinstance(v, set):
            peft_cfg[k] = sorted(v)
    packed = {f"{DIFFUSERS_PREFIX}{k}": v for k, v in peft_cfg.items()}
    header = {"format": "pt", LORA_METADATA_KEY: json.dumps(packed, indent=2, sort_keys=True, default=str)}
    header.update({f"dittrain.{k}": str(v) for k, v in meta.items()})
    return {f"{DIFFUSERS_PREFIX}{k}": v for k, v in lora_state_dict(transformer).items()}, header


#: the adapter inside a checkpoint folder (see the module essay: not a LoRA file for loaders)
ADAPTER_STATE = "adapter-state.safetensors"


def checkpoint_adapter(folder: Path) -> Path:
    """The adapter file of checkpoint `folder`: ADAPTER_STATE, or `lora.safetensors` in a checkpoint written before
    that name."""
    new, old = Path(folder) / ADAPTER_STATE, Path(folder) / "lora.safetensors"
    return old if not new.exists() and old.exists() else new


def save_lora(path: Path, transformer: torch.nn.Module, meta: dict[str, str]) -> None:
    """Write the LoRA in peft's layout with its config in the header (checkpoints), atomically."""
    weights, header = lora_file(transformer, meta)
    atomic_write(Path(path), lambda tmp: save_file(weights, str(tmp), metadata=header))


def export_lora(path: Path, lf, fmt: str, family: str, model_cfg=None) -> None:
    """Write a `trainer.lora_format.LoraFile` in the user's layout (output.lora_format), atomically. A DoRA in the
    comfy / kohya layout reads the base weights it needs from the files of `model_cfg` (trainer.config.ModelConfig)."""
    from ..lora_format import encode

    base = base_weights(model_cfg) if lf.dora and fmt != "diffusers" and model_cfg is not None else None
    tensors, header = encode(lf, fmt, family, path, base)
    atomic_write(Path(path), lambda tmp: save_file(tensors, str(tmp), metadata=header))


def base_weights(model_cfg):
    """The base weights of the ModelConfig `model_cfg`, read one by one from its transformer's files in their stored
    precision (what a user loads in ComfyUI; not the training copy: a bf16 cast, or streamed placeholders)."""
    from ..lora_format import file_weights
    from ..models import get_adapter
    from ..models.stream_load import open_files

    return file_weights(open_files(model_cfg, get_adapter(model_cfg).transformer_dir))


def lycoris_loading_hint(path: Path, kind: str, fmt: str, comfy_note: str) -> str:
    """Which loaders take a LoKr / LoHa file (docs/training.md: LoRA kinds): not diffusers' `load_lora_weights` (it refuses
    them for most pipelines); `dittrain sample`, peft, and ComfyUI's LoRA loader (`comfy_note`: the family's
    `comfy_diffusers_lora_note`, for the diffusers layout)."""
    if fmt != "diffusers":
        return (f"{path} is a {kind} adapter ({fmt} layout), which diffusers' load_lora_weights does not take: "
                f"ComfyUI's LoRA loader reads it, and `dittrain sample --lora {path}` loads it")
    return (f"{path} is a {kind} adapter in peft's format, which diffusers' load_lora_weights does not take: "
            f"`dittrain sample --lora {path}` loads it; in your own code, `from trainer.sampling.lora import "
            "load_peft_file; load_peft_file(pipe.transformer, path)` (peft's inject_adapter_in_model + "
            f"set_peft_model_state_dict with the config in the file's header); {comfy_note}")


def load_lora(path: Path, transformer: torch.nn.Module) -> None:
    """Put a file written by `save_lora` back into a transformer that has the same adapter (resume)."""
    from peft.utils import set_peft_model_state_dict

    sd = {k.removeprefix(DIFFUSERS_PREFIX): v for k, v in load_file(str(path)).items()}
    have = lora_state_dict(transformer)
    expected = set(have)
    if set(sd) != expected:
        missing, extra = sorted(expected - set(sd))[:3], sorted(set(sd) - expected)[:3]
        raise UserError(
            f"{path}: LoRA does not match this model and lora config (missing {missing}, unexpected {extra}); "
            "resume with the config the run was started with"
        )
    wrong = [f"{k} {tuple(sd[k].shape)} vs {tuple(have[k].shape)}" for k in sorted(sd) if sd[k].shape != have[k].shape]
    if wrong:  # a changed rank (or other shape key) that the config check did not see: still one line
        raise UserError(
            f"{path}: {len(wrong)} LoRA weights have other shapes than this lora config makes (e.g. {wrong[0]}); "
            "resume with the lora settings the run was started with"
        )
    result = set_peft_model_state_dict(transformer, sd)
    if getattr(result, "unexpected_keys", None):
        raise UserError(f"{path}: unexpected LoRA keys {result.unexpected_keys[:3]}")


# ---------------------------------------------------------------------------------------------- full weights


def save_transformer(folder: Path, transformer: torch.nn.Module) -> None:
    """Diffusers-format transformer folder (config.json + safetensors)."""
    transformer.save_pretrained(str(folder), safe_serialization=True)


def link_or_copy_tree(src: Path, dst: Path) -> None:
    """`src`'s files into the new folder `dst`: hard links (no second copy on disk; a checkpoint pruned later
    leaves them intact), or copies across file systems."""
    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dst, copy_function=link, dirs_exist_ok=True)


def load_transformer_weights(folder: Path, transformer: torch.nn.Module) -> None:
    """Load the weights of a `save_transformer` folder into an already built transformer, strictly."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder}: no .safetensors weights (expected a transformer saved by dittrain)")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    missing, unexpected = transformer.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise UserError(f"{folder}: weights do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
