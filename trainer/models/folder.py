"""Is the folder at `model.path` a model of `model.family`? Answered from its small JSON files, before anything loads.

Why. A folder of another family loads: transformers fills a text encoder class from another model's weights as
best it can (a Z-Image config on a Chroma folder built a Qwen3 encoder from T5's files and was killed by the OOM
killer on a tiny model), a Flux config on an SD3 folder encoded every latent and caption with the wrong encoders
before the transformer refused, and `dittrain plan` planned a model that was never there. Every command that reads
`model.path` (fit, cache, plan, sample, merge) calls `check_folder_family` first, and the adapter's own load calls
it again, so a mismatch is one line naming the folder, the class found there, the family that class belongs to
and the fix (`model.family: X`).

What is compared, most telling first:
- `transformer/config.json`'s `_class_name` against the family's `transformer_cls` (the config folder of a
  single-file transformer, `model.transformer_file`, carries it too);
- `model_index.json`'s `_class_name` (the pipeline) against `pipeline_cls`: families that share a transformer
  class (Flux and Kontext, Flux.2-dev and -klein, Qwen-Image and its edit models) differ there;
- `model_index.json`'s component classes (text encoders, VAE) against `text_encoder_classes` and `vae_cls_name`,
  for a folder whose pipeline no family declares (or that names none).

A missing file is not this check's business (the adapter's load names it); a class no family declares is refused
only for the transformer (nothing here could train it). Which family a class belongs to is looked up in the
registry (`adapter_classes()`, imported only when something does not match, so the check costs a few small reads).
"""

from __future__ import annotations

import functools
import json
import re
import struct
from pathlib import Path

from ..errors import UserError


def _read(path: Path) -> dict:
    """A small JSON config, or {} when absent; an unreadable one is a one-line error."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{path}: not a readable JSON config ({e})") from None
    return data if isinstance(data, dict) else {}


def _families_with(attribute: str, name: str) -> list[str]:
    """Families whose adapter's `attribute` (a class, a class name, or a tuple of class names) is or holds `name`."""
    from . import adapter_classes

    out = []
    for cls in adapter_classes():
        value = getattr(cls, attribute, None)
        names = value if isinstance(value, tuple) else (value,)
        if name in {getattr(v, "__name__", v) for v in names}:
            out.append(cls.family)
    return out


def _refuse(root: Path, found: str, where: str, family: str, owners: list[str], want: str) -> UserError:
    """The one line: the folder, the class found (and in which file), whose it is, and the fix."""
    if not owners:
        return UserError(f"model.path {root}: {where} names {found}, which no dittrain family uses (model.family "
                         f"{family} needs {want}); point model.path at a {family} folder")
    fix = (f"set model.family: {owners[0]}" if len(owners) == 1
           else f"set model.family to the folder's family ({' or '.join(owners)})")
    return UserError(f"model.path {root} holds a model of family {' or '.join(owners)} ({where} names {found}; "
                     f"{family} needs {want}), but model.family is {family}: {fix}, or point model.path at a "
                     f"{family} folder")


def check_folder_family(path: str | Path, family: str, transformer_file: str | Path | None = None) -> None:
    """Raise a one-line `UserError` when the folder at `path` (`model.path`), or the single-file transformer
    `transformer_file` (`model.transformer_file`), holds another family's model than `family` (`model.family`; see
    the module essay); a folder or file that does not exist passes (its load says so)."""
    from . import adapter_class

    root = Path(path)
    if not root.is_dir():
        return
    _check_folder(root, adapter_class(family))
    if transformer_file is not None and Path(transformer_file).is_file():
        _check_single_file(root, family, Path(transformer_file))


def _check_folder(root: Path, own) -> None:
    family = own.family
    index = _read(root / "model_index.json")
    pipeline = index.get("_class_name") if isinstance(index.get("_class_name"), str) else None

    transformer = _read(root / "transformer" / "config.json").get("_class_name")
    want = own.transformer_cls.__name__
    if isinstance(transformer, str) and transformer != want:
        owners = _families_with("transformer_cls", transformer)
        narrowed = [f for f in owners if f in _families_with("pipeline_cls", pipeline)] if pipeline else []
        raise _refuse(root, transformer, "transformer/config.json", family, narrowed or owners, want)

    if pipeline == own.pipeline_cls.__name__:
        return  # saved by the family's own pipeline: its components are that pipeline's
    if pipeline:
        owners = _families_with("pipeline_cls", pipeline)
        if owners:  # a pipeline no family declares (a community folder): its components below decide
            raise _refuse(root, pipeline, "model_index.json", family, owners, own.pipeline_cls.__name__)

    expected = {d: ("text_encoder_classes", c) for d, c in zip(own.text_encoder_dirs, own.text_encoder_classes,
                                                                strict=False)}
    expected["vae"] = ("vae_cls_name", own.vae_cls_name)
    for part, (attribute, want) in expected.items():
        entry = index.get(part)
        found = entry[1] if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str) else None
        if want and found and found != want:
            owners = [f for f in _families_with(attribute, found) if f != family]
            raise _refuse(root, found, f"model_index.json's {part}", family, owners, want)


def _check_single_file(root: Path, family: str, file: Path) -> None:
    """A single file whose keys are neither this family's diffusers keys nor an original layout that maps onto
    them (trainer/models/stream_load.py `file_layout`) may be another family's transformer: its key names, block
    numbers aside, are compared with every family's transformer (built on the meta device from `full_config`).
    Only then: a file that maps costs one header read, which the load reads anyway."""
    from types import SimpleNamespace

    from .. import quant
    from . import adapter_classes, stream_load

    cfg = SimpleNamespace(path=root, family=family, transformer_file=file)
    try:
        if stream_load.file_layout(cfg) is not None:
            return
        keys = set(quant._header(file))
    except (OSError, ValueError, struct.error):
        return  # not a safetensors file (shorter than its 8-byte header length, say): the load says so

    found, by_class = _names(keys), {}
    for cls in adapter_classes():  # families sharing a transformer class share its keys
        by_class.setdefault(cls.transformer_cls, []).append(cls)
    owners = []
    for tcls, classes in by_class.items():
        want = _full_key_names(classes[0])
        k0 = next(iter(want))
        prefixes = {k[: len(k) - len(k0)] for k in found if k.endswith(k0)}
        if any((p == "" or p.endswith(".")) and all(p + k in found for k in want) for p in prefixes):
            owners.append((tcls.__name__, [c.family for c in classes]))
    if owners and not any(family in fams for _, fams in owners):
        tname, fams = owners[0]
        fix = f"set model.family: {fams[0]}" if len(fams) == 1 else f"set model.family to {' or '.join(fams)}"
        raise UserError(f"model.transformer_file {file} holds a {' or '.join(fams)} transformer (its keys are "
                        f"{tname}'s), but model.family is {family}: {fix} with model.path at that family's config "
                        f"folder, or use a {family} transformer file")


def _names(keys) -> frozenset[str]:
    """State-dict key names with block numbers left out (`blocks.3.attn` -> `blocks.#.attn`)."""
    return frozenset(re.sub(r"\.\d+\.", ".#.", k) for k in keys)


@functools.cache
def _full_key_names(adapter_cls) -> frozenset[str]:
    """The key names of the family's full-size transformer, built on the meta device (once per process)."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        return _names(adapter_cls.transformer_cls.from_config(adapter_cls.full_config).state_dict())
