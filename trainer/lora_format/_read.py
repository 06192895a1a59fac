"""Reading a LoRA file of any layout into a `LoraFile` (diffusers module names, each module at its scale)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import UserError
from ._core import (
    _FILE_NAMES,
    _REFUSED,
    _SUFFIXES,
    COMFY_PREFIX,
    DIFFUSERS_PREFIX,
    FORMATS,
    KOHYA_PREFIX,
    LORA_METADATA_KEY,
    META_BAKED,
    META_FORMAT,
    META_FUSED,
    LoraFile,
    Module,
    _in_features,
    _key_map,
)
from .kinds import LORA_KINDS, kind_of_factor, kind_of_peft_type

# ---------------------------------------------------------------------------------------------- reading


def _load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise UserError(f"{path}: LoRA file not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})  # noqa: SIM118
    except (SafetensorError, OSError) as e:
        raise UserError(f"{path}: not a readable safetensors LoRA file ({e})") from None


def detect_format(tensors: dict, meta: dict[str, str]) -> str:
    if meta.get(META_FORMAT) in FORMATS:
        return meta[META_FORMAT]
    if any(k.startswith(KOHYA_PREFIX) for k in tensors):
        return "kohya"
    if any(k.startswith(COMFY_PREFIX) for k in tensors):
        return "comfy"
    return "diffusers"


def file_format(path: Path) -> str:
    """diffusers, comfy or kohya, from a file's header and key names (diffusers when unreadable: its loader says
    what is wrong)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return detect_format(dict.fromkeys(f.keys()), dict(f.metadata() or {}))  # noqa: SIM118
    except Exception:  # noqa: BLE001 - any unreadable file
        return "diffusers"


def _split_key(path: Path, key: str) -> tuple[str, str]:
    for s in _SUFFIXES:
        if key.endswith("." + s):
            if s in _REFUSED:
                raise UserError(f"{path}: {key}: {_REFUSED[s]}")
            return key[: -len(s) - 1], s
    raise UserError(f"{path}: {key} is not a {_labels()} weight (unknown key suffix)")


def _labels() -> str:
    """LoRA, LoKr or LoHa: every kind's label."""
    labels = [k.label for k in LORA_KINDS.values()]
    return ", ".join(labels[:-1]) + " or " + labels[-1]


def _pattern(name: str, patterns: dict | None, default):
    import re

    for pat, val in (patterns or {}).items():  # peft's rule: the first pattern matching the name's end wins
        if re.match(rf"(.*\.)?({pat.lstrip('^')})$", name):
            return val
    return default


def _group(path: Path, tensors: dict, strip) -> dict[str, tuple[dict[str, torch.Tensor], float | None]]:
    """{module name as the file has it: ({canonical suffix: tensor}, alpha tensor value or None)}."""
    out: dict[str, tuple[dict, list]] = {}
    for key, v in tensors.items():
        name, suffix = _split_key(path, strip(key))
        t, alpha = out.setdefault(name, ({}, []))
        if suffix == "alpha":
            alpha.append(float(v.float().item()))
        else:
            t[_FILE_NAMES[suffix]] = v
    return {n: (t, a[0] if a else None) for n, (t, a) in out.items() if t}


def _kind(path: Path, name: str, t: dict) -> str:
    kinds = {kind_of_factor(k) for k in t}
    if len(kinds) != 1:
        raise UserError(f"{path}: {name} mixes adapter kinds ({', '.join(sorted(t))})")
    kind = kinds.pop()
    missing = [" / ".join(alts) for alts in LORA_KINDS[kind].required if not any(a in t for a in alts)]
    if missing:
        raise UserError(f"{path}: {name} has no {', '.join(missing)} weight")
    return kind


def read_lora_file(path: Path, family: str | None = None) -> LoraFile:
    """Any of the three layouts -> LoraFile in diffusers' module names, each module at its own scale. `family` is
    needed for comfy / kohya files that do not name it in their header (`dittrain.family`)."""
    path = Path(path)
    tensors, meta = _load(path)
    if not tensors:
        raise UserError(f"{path}: the file holds no weights")
    fmt = detect_format(tensors, meta)
    own = {k: v for k, v in meta.items() if k.startswith("dittrain.")}
    if fmt == "diffusers":
        modules = _read_diffusers(path, tensors, meta)
    else:
        modules = _read_original(path, tensors, meta, fmt, _key_map(family or meta.get("dittrain.family"), path))
    if not modules:
        raise UserError(f"{path}: no {_labels()} weights in this file")
    baked = float(meta.get(META_BAKED, 1.0))
    if baked != 1.0:  # ours: divide the trained scale back out of the weights it was multiplied into
        modules = {n: m.baked(1.0 / baked) if fmt == "diffusers" or m.rank is None else m for n, m in modules.items()}
    own.pop(META_BAKED, None)
    own.pop(META_FUSED, None)
    return LoraFile(modules, own)


def _read_diffusers(path: Path, tensors: dict, meta: dict) -> dict[str, Module]:
    cfg = peft_config(meta)

    def strip(k: str) -> str:
        for p in (DIFFUSERS_PREFIX, "base_model.model.", "unet."):
            k = k.removeprefix(p)
        return k

    out = {}
    for name, (t, alpha) in _group(path, tensors, strip).items():
        kind = _kind(path, name, t)
        m = Module(kind, t)
        r = _pattern(name, cfg.get("rank_pattern"), cfg.get("r"))
        if m.rank is None:  # a LoKr with two full factors: peft's r is not in the tensors
            m.peft_r = int(r) if r else m.spec.r_of(t)
        if alpha is not None and m.rank:  # kohya-style alpha tensors under diffusers names
            m.scale = alpha / m.rank
        elif cfg:
            a = _pattern(name, cfg.get("alpha_pattern"), cfg.get("lora_alpha", cfg.get("alpha", r)))
            r_eff = int(r) if m.spec.scales_by_config_r else m.rank  # how peft scales this kind
            m.scale = float(a) / float(r_eff)
        out[name] = m
    return out


def _read_original(path: Path, tensors: dict, meta: dict, fmt: str, kmap) -> dict[str, Module]:
    fused_ranks = json.loads(meta.get(META_FUSED, "{}"))
    prefix = COMFY_PREFIX if fmt == "comfy" else KOHYA_PREFIX
    other = next((k for k in tensors if not k.startswith(prefix)), None)
    if other is not None:  # text-encoder LoRAs (lora_te1_*, ...) and the like: dittrain reads the transformer's only
        raise UserError(f"{path}: {other} is not a {prefix}* key; only transformer LoRA files are read (this one "
                        "also adapts something else, e.g. a text encoder)")
    if fmt == "comfy":
        grouped = _group(path, tensors, lambda k: k.removeprefix(COMFY_PREFIX))
    else:
        raw = _group(path, tensors, lambda k: k.removeprefix(KOHYA_PREFIX))
        grouped = {}
        for flat, v in raw.items():
            orig = kmap.from_kohya(flat)
            if orig is None:
                raise UserError(f"{path}: {KOHYA_PREFIX}{flat} is not a layer of this family's original layout")
            grouped[orig] = v
    out: dict[str, Module] = {}
    for orig, (t, alpha) in grouped.items():
        found = kmap.parts(orig)
        if found is None:
            raise UserError(f"{path}: {orig} is not a layer of this family's original layout")
        rule, names = found
        kind = _kind(path, orig, t)
        m = Module(kind, t)
        if alpha is not None and m.rank:
            m.scale = alpha / m.rank
        if m.rank is None:
            m.peft_r = int(meta.get("dittrain.rank") or m.spec.r_of(t))
        if not rule.fused:
            out[names[0]] = m
            continue
        out.update(_split_fused(path, orig, rule, names, m, fused_ranks.get(orig)))
    return out


def _split_fused(path, orig, rule, names, m: Module, ranks) -> dict[str, Module]:
    pairs = m.spec.pairs
    if pairs is None:
        raise UserError(f"{path}: {orig} is a {m.spec.label} on a fused layer, which cannot be split into diffusers' "
                        f"separate {', '.join(n.rsplit('.', 1)[-1] for n in names)}")
    sizes = [round(w * _in_features(m)) for w in rule.widths]  # a fraction for grouped-query k / v
    up_name = pairs[0][1]
    if m.t[up_name].shape[0] != sum(sizes):
        raise UserError(f"{path}: {orig} has {m.t[up_name].shape[0]} outputs, this family's fused layer "
                        f"{sum(sizes)} ({'+'.join(map(str, sizes))})")
    out, row = {}, 0
    for j, (name, size) in enumerate(zip(names, sizes, strict=True)):
        rows = slice(row, row + size)
        row += size
        if ranks is not None:  # ours: block-diagonal, part j owns ranks[j] columns
            if not ranks[j]:
                continue
            cols = slice(sum(ranks[:j]), sum(ranks[: j + 1]))
            t = {}
            for d, u in pairs:
                t[d], t[u] = m.t[d][cols], m.t[u][rows, cols]
        else:  # another tool's fused LoRA: the whole down factor, this part's rows of the up factor
            t = {}
            for d, u in pairs:
                t[d], t[u] = m.t[d], m.t[u][rows]
        out[name] = Module(m.kind, {k: v.contiguous() for k, v in t.items()}, m.scale)
    return out


def lora_file_from(tensors: dict[str, torch.Tensor], meta: dict[str, str], where: Path | str = "") -> LoraFile:
    """A LoraFile from peft-named tensors and a header as `trainer.train.checkpoint.save_lora` writes them (the
    live adapter, without a file)."""
    return LoraFile(_read_diffusers(Path(where), tensors, meta),
                    {k: v for k, v in meta.items() if k.startswith("dittrain.")})


def peft_state_dict(lf: LoraFile) -> dict[str, torch.Tensor]:
    """peft's state dict of `lf` (each module at its own scale: load it into an adapter with alpha = scale x r)."""
    return {f"{n}.{m.spec.peft_names.get(k, k)}": v for n, m in lf.modules.items() for k, v in m.t.items()}


# ---------------------------------------------------------------------------------------------- headers


def lora_metadata(path: Path) -> dict[str, str]:
    """The header (`__metadata__`) of a safetensors LoRA file."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def peft_config(meta: dict[str, str]) -> dict:
    """The peft config in a header (diffusers' `lora_adapter_metadata`, keys without the `transformer.` prefix);
    empty when the header has none."""
    if LORA_METADATA_KEY not in meta:
        return {}
    raw = json.loads(meta[LORA_METADATA_KEY])
    return {k.removeprefix(DIFFUSERS_PREFIX): v for k, v in raw.items()}


def lora_kind(meta: dict[str, str]) -> str:
    """A key of LORA_KINDS (lora, lokr, loha), from a LoRA file's header (peft_type in the adapter metadata; lora
    when absent)."""
    if LORA_METADATA_KEY in meta:
        cfg = json.loads(meta[LORA_METADATA_KEY])
        return kind_of_peft_type(cfg.get(f"{DIFFUSERS_PREFIX}peft_type", "LORA"))
    return meta.get("dittrain.type", "lora")


def is_dora_file(path: Path) -> bool:
    """Whether a LoRA file is DoRA: ours (`dittrain.dora` in the header, as the trainer writes it) or another
    tool's (a `dora` header, or magnitude / dora_scale tensors). False for a file that cannot be read: the LoRA
    loader reports that with the file's name."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            return "True" in (meta.get("dittrain.dora"), meta.get("dora")) or any(
                "magnitude" in k or "dora_scale" in k for k in f.keys())
    except Exception:  # noqa: BLE001 - any unreadable file
        return False
