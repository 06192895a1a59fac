"""Writing a `LoraFile` in one layout: the scale where that layout's loaders read it, fused layers stacked."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..atomic import atomic_write
from ..errors import UserError
from ._core import (
    COMFY_PREFIX,
    DIFFUSERS_PREFIX,
    FORMATS,
    LORA_METADATA_KEY,
    META_BAKED,
    META_FORMAT,
    META_FUSED,
    LoraFile,
    Module,
    _in_features,
    _key_map,
)
from ._dora import BaseWeights, comfy_dora_scale, missing_base_message, unchanged_scale
from .kinds import LORA_KINDS

# ---------------------------------------------------------------------------------------------- writing


def _peft_metadata(modules: dict[str, Module]) -> dict:
    """The peft config (as diffusers stores it) for weights with their scale baked in: alpha = r everywhere."""
    kinds = {m.kind for m in modules.values()}
    if len(kinds) != 1:
        raise UserError(f"a LoRA file holds one adapter kind, not {sorted(kinds)}")
    spec = LORA_KINDS[kinds.pop()]
    ranks = {n: spec.r_of(m.t, m.peft_r) for n, m in modules.items()}
    r0 = max(set(ranks.values()), key=list(ranks.values()).count)
    pattern = {n: r for n, r in ranks.items() if r != r0}
    cfg: dict = {"r": r0, "target_modules": sorted(modules), "rank_pattern": pattern, "alpha_pattern": dict(pattern)}
    cfg.update(spec.header(modules, r0))
    return {f"{DIFFUSERS_PREFIX}{k}": v for k, v in cfg.items()}


def _diffusers_tensors(modules: dict[str, Module]) -> dict[str, torch.Tensor]:
    return {f"{DIFFUSERS_PREFIX}{n}.{m.spec.peft_names.get(k, k)}": v.contiguous()
            for n, m in modules.items() for k, v in m.baked().t.items()}


def _alpha(value: float) -> torch.Tensor:
    return torch.tensor(float(value), dtype=torch.float32)


def _original_tensors(modules: dict[str, Module], kmap, fmt: str, family: str,
                      base: BaseWeights | None = None) -> tuple[dict, dict, set]:
    """(tensors, fused ranks, the scales multiplied into full-factor LoKr weights) in the comfy or kohya layout; a
    DoRA's magnitudes become ComfyUI's `dora_scale` from the `base` weights (trainer/lora_format/_dora.py)."""
    groups: dict[str, tuple] = {}
    for n, m in modules.items():
        place = _place(kmap, n, m.kind, family)
        if "magnitude" in m.t:
            m = _with_dora_scale(n, m, base)
        groups.setdefault(place.original, (place.rule, {}))[1][place.index] = m
    prefix = COMFY_PREFIX if fmt == "comfy" else ""
    out, fused, baked = {}, {}, set()
    for orig, (rule, parts) in groups.items():
        key = prefix + (orig if fmt == "comfy" else kmap.kohya(orig))
        if rule.fused:
            m, ranks = _stack(orig, rule, parts, kmap.parts(orig)[1], base)
            fused[orig] = ranks
        else:
            m = parts[0]
        if m.rank is None:  # both LoKr factors full: ComfyUI applies no alpha, so the scale goes into the weights
            baked.add(m.scale)
            m = m.baked()
        else:
            out[f"{key}.alpha"] = _alpha(m.scale * m.rank)
        out.update({f"{key}.{m.spec.original_names.get(k, k)}": v.contiguous() for k, v in m.t.items()})
    return out, fused, baked


def _with_dora_scale(name: str, m: Module, base: BaseWeights | None) -> Module:
    """`m` with peft's magnitude replaced by ComfyUI's dora_scale (needs the base weight)."""
    if base is None:
        raise UserError(missing_base_message(name))
    t = {k: v for k, v in m.t.items() if k != "magnitude"}
    t["dora_scale"] = comfy_dora_scale(m.t["magnitude"], base(name), m.delta())
    return Module(m.kind, t, m.scale, m.peft_r)


def _place(kmap, name: str, kind: str, family: str):
    """Where module `name` goes in the original layout, or the one-line reason it cannot."""
    place = kmap.place(name)
    if place is None:
        raise UserError(f"{name}: no name for this module in the {family} original layout (lora_key_map in "
                        f"trainer/models/); use the diffusers layout")
    if LORA_KINDS[kind].pairs is None and place.rule.fused:
        raise UserError(_unfusable_message(place.original, place.rule, family, kind))
    return place


def _unfusable_message(original: str, rule, family: str, kind: str) -> str:
    """Why a kind that cannot be stacked (`pairs` None: LoKr) on a part of a fused original layer has no comfy /
    kohya file, and what to do instead."""
    from ..models import adapter_class

    cls = adapter_class(family)
    label = LORA_KINDS[kind].label
    others = " or ".join(k.name for k in LORA_KINDS.values() if k.pairs is not None)
    comfy = (cls.comfy_diffusers_lora_note() if cls.comfy_reads_diffusers_lora
             else f"which ComfyUI does not map for {family}: for ComfyUI train lora.type: {others}")
    return (f"{original}: a {label} on {', '.join(p.rsplit('.', 1)[-1] for p in rule.parts)} cannot be written as "
            f"one fused {label} in the comfy / kohya layout; use output.lora_format: diffusers ({comfy}), train "
            f"lora.type: {others}, or leave {', '.join(p.rsplit('.', 1)[-1] for p in rule.parts)} out of lora.targets")


def check_layout(modules: list[str], kind: str, fmt: str, family: str) -> None:
    """Refuse, before training, an adapter that layout `fmt` cannot hold (by module names only)."""
    if fmt == "diffusers":
        return
    kmap = _key_map(family, Path(f"output.lora_format: {fmt}"))
    for name in modules:
        _place(kmap, name, kind, family)


def _matches(template: str, target: str) -> bool:
    """Whether a module named by key-map template `template` ({i}: a block index) is one that peft's list target
    `target` adapts (peft: the name equals the target or ends with "." + target)."""
    import re

    t, want = template.split("."), target.split(".")
    if len(want) > len(t):
        return False
    return all(re.fullmatch(re.escape(a).replace(r"\{i\}", r"\d+"), b) for a, b in zip(t[-len(want):], want,
                                                                                     strict=True))


def check_targets(targets: list[str], kind: str, fmt: str, family: str) -> str | None:
    """Before anything loads (config validation): the one-line reason layout `fmt` cannot hold a `kind` adapter on
    peft targets `targets`, or None. Only a kind that cannot be stacked (LoKr) on a part of a fused original layer is
    known from names alone."""
    if fmt == "diffusers" or LORA_KINDS[kind].pairs is not None:
        return None
    from ..models import adapter_class

    kmap = adapter_class(family).lora_key_map
    if kmap is None:
        return None  # _key_map says so when the file is written
    for rule in kmap.rules:
        if rule.fused and any(_matches(p, t) for p in rule.parts for t in targets):
            return _unfusable_message(rule.original, rule, family, kind)
    return None


def _stack(orig: str, rule, parts: dict[int, Module], names: list[str],
           base: BaseWeights | None = None) -> tuple[Module, list[int]]:
    """One module for a fused layer from its parts (see the module essay); DoRA's dora_scale rows stacked too, a
    part without an update at the scale that leaves its rows unchanged."""
    first = next(iter(parts.values()))
    same = len({m.scale for m in parts.values()}) == 1
    parts = {j: m if same else m.baked() for j, m in parts.items()}
    fin = _in_features(first)
    sizes = [round(w * fin) for w in rule.widths]  # a fraction for grouped-query k / v
    ranks = [parts[j].rank if j in parts else 0 for j in range(len(sizes))]
    t = {}
    for d, u in first.spec.pairs:
        ref = parts[next(iter(parts))].t[u]
        t[d] = torch.cat([parts[j].t[d] for j in sorted(parts)])
        t[u] = torch.zeros(sum(sizes), sum(ranks), dtype=ref.dtype)
        row = col = 0
        for j, size in enumerate(sizes):
            if j in parts:
                if parts[j].t[u].shape[0] != size:
                    raise UserError(f"{rule.parts[j]}: {parts[j].t[u].shape[0]} outputs, the fused {orig} expects "
                                    f"{size}")
                t[u][row:row + size, col:col + ranks[j]] = parts[j].t[u]
            row, col = row + size, col + ranks[j]
    if any("dora_scale" in m.t for m in parts.values()):
        t["dora_scale"] = torch.cat([parts[j].t["dora_scale"] if j in parts else unchanged_scale(base(names[j]))
                                     for j in range(len(sizes))])
    return Module(first.kind, t, first.scale if same else 1.0), ranks


def encode(lf: LoraFile, fmt: str, family: str | None = None, where: Path | str = "",
           base: BaseWeights | None = None) -> tuple[dict, dict]:
    """(tensors, header) of `lf` in layout `fmt` (FORMATS); the header keeps the source's dittrain.* keys and names
    the layout. `where` names the file in errors; `base` gives the base weights a DoRA needs in comfy / kohya."""
    if fmt not in FORMATS:
        raise UserError(f"--to {fmt}: choose one of {', '.join(FORMATS)}")
    family = family or lf.meta.get("dittrain.family")
    header = {"format": "pt", **lf.meta, META_FORMAT: fmt}
    if fmt == "diffusers":
        tensors = _diffusers_tensors(lf.modules)
        header[LORA_METADATA_KEY] = json.dumps(_peft_metadata(lf.modules), indent=2, sort_keys=True)
        scales = {m.scale for m in lf.modules.values()}
        if len(scales) == 1 and scales != {1.0}:
            header[META_BAKED] = repr(scales.pop())
    else:
        if lf.dora and base is None:
            raise UserError(missing_base_message(str(where)))
        tensors, fused, baked = _original_tensors(lf.modules, _key_map(family, Path(where)), fmt, family, base)
        if fused:
            header[META_FUSED] = json.dumps(fused, sort_keys=True)
        if len(baked) == 1 and baked != {1.0}:
            header[META_BAKED] = repr(baked.pop())
    if family:
        header["dittrain.family"] = family
    return tensors, header


def write_lora_file(path: Path, lf: LoraFile, fmt: str, family: str | None = None,
                    base: BaseWeights | None = None) -> None:
    """Write `lf` in layout `fmt` to `path`, under a temporary name renamed into place, with the mode the umask
    gives a new file (as fit's files: trainer/atomic.py)."""
    from safetensors.torch import save_file

    tensors, header = encode(lf, fmt, family, path, base)
    atomic_write(Path(path), lambda tmp: save_file(tensors, str(tmp), metadata=header))


