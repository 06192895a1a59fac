"""LoRA files in the three layouts users load: diffusers, ComfyUI's own (`comfy`) and kohya's; reading any, writing any.

    lf = read_lora_file(path, family=None)          # any of the three -> LoraFile (diffusers module names)
    write_lora_file(path, lf, "comfy", family)      # LoraFile -> one layout, atomically
    convert_lora(src, dst, "kohya", family=None)    # `dittrain convert-lora`

The one thing every loader must agree on is the strength. peft and diffusers scale an update by alpha / r, with
alpha in the file's header (`lora_adapter_metadata`); ComfyUI and kohya-style loaders read alpha only from a
per-module `<module>.alpha` tensor and use scale 1 without it; and diffusers refuses `.alpha` tensors beside a
header (Flux: "both network_alphas and metadata"), SD3's loader refuses any key without "lora" in it, and Qwen-Image's
scales by them *and* by the header. So each layout carries the scale in the one way all its readers share:

- diffusers: the scale is multiplied into the weights (LoRA's `lora_B`, LoHa's `hada_w1_a`, LoKr's `lokr_w1`) and the
  header says alpha = r, so diffusers, peft and ComfyUI (which maps diffusers keys for Flux, SD3 and Qwen-Image) all
  apply the same delta. diffusers does the same to LoKr files it converts. The header keeps the training alpha
  (`dittrain.alpha`) and the factor (`dittrain.baked_scale`), so reading the file back (init_from, conversion) divides
  it out again and training goes on at the trained alpha.
- comfy (`diffusion_model.<original name>`) and kohya (`lora_unet_<original name with _>`): the weights as trained,
  `lora_down` / `lora_up` (LyCORIS names for LoKr / LoHa), and a `.alpha` tensor per module. ComfyUI applies no alpha
  to a LoKr whose factors are both full matrices, so such a module has the scale multiplied into `lokr_w1` and no
  `.alpha`.

Fused layers. Where the original layout fuses several diffusers layers (Flux's and SD3's q/k/v, Flux's single-block
`linear1`), a LoRA's parts are stacked so the fused delta is exactly the separate ones: the `lora_down`s concatenated,
the `lora_up`s block-diagonal (rank = the sum of the parts' ranks, alpha = scale x that rank); LoHa's two factor pairs
the same way. A part the LoRA does not adapt is a zero block. Reading splits them back: with our own
`dittrain.fused_ranks` header exactly, else (another tool's fused LoRA) each part keeps the whole `lora_down` and its
rows of `lora_up`, which is the same delta. A LoKr cannot be stacked (a stack of Kronecker products is not one):
refused for fused layers, and the diffusers layout, which ComfyUI reads for these families, is the answer.

DoRA. peft's DoRA rescales each output row (a magnitude vector of out_features); ComfyUI's `dora_scale` rescales
each input column (its `weight_decompose` takes the norm over the output axis). No renaming turns one into the
other, so DoRA stays in the diffusers layout (which diffusers loads exactly, and ComfyUI loads as a plain LoRA without
the magnitudes: the save log and the README say so), and comfy / kohya refuse it.

Left out: Tucker / conv factors (`lokr_t2`, `hada_t1`), LoRA biases, text-encoder LoRAs, modules a family's map does
not name (`norm_out.linear` and others stored differently in the original: the error names the module).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .errors import UserError

FORMATS = ("diffusers", "comfy", "kohya")
DIFFUSERS_PREFIX, COMFY_PREFIX, KOHYA_PREFIX = "transformer.", "diffusion_model.", "lora_unet_"
LORA_METADATA_KEY = "lora_adapter_metadata"  # diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY
META_FORMAT, META_BAKED, META_FUSED = "dittrain.lora_format", "dittrain.baked_scale", "dittrain.fused_ranks"

# file suffix -> canonical name (peft's for LoRA, LyCORIS' for LoKr / LoHa, which peft shares)
_LORA_SUFFIXES = {"lora_A.weight": "down", "lora_down.weight": "down", "lora_B.weight": "up", "lora_up.weight": "up",
                  "lora_magnitude_vector": "magnitude"}
_LYCORIS = ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b",
            "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
_REFUSED = {"dora_scale": "ComfyUI-style DoRA (dora_scale) has no peft equivalent",
            "lokr_t2": "Tucker (conv) LoKr factors are not supported", "hada_t1": "Tucker (conv) LoHa factors are not "
            "supported", "hada_t2": "Tucker (conv) LoHa factors are not supported",
            "lora_B.bias": "LoRA biases are not supported", "lora_mid.weight": "conv LoRA (lora_mid) is not supported"}
_SUFFIXES = sorted([*_LORA_SUFFIXES, *_LYCORIS, *_REFUSED, "alpha"], key=len, reverse=True)
# where a module's scale goes when it is multiplied into the weights
_BAKE_INTO = {"lora": ("up",), "loha": ("hada_w1_a",), "lokr": ("lokr_w1", "lokr_w1_a")}


@dataclass
class Module:
    """One adapted layer: its factors under canonical names and the scale its update is multiplied by."""

    kind: str  # lora | lokr | loha
    t: dict[str, torch.Tensor]
    scale: float = 1.0
    #: peft's r for a LoKr whose factors are full matrices (the tensors do not show it); None: from the tensors
    peft_r: int | None = None

    @property
    def rank(self) -> int | None:
        """The rank ComfyUI divides alpha by; None for a LoKr with two full factors (ComfyUI applies no alpha)."""
        if self.kind == "lora":
            return self.t["down"].shape[0]
        if self.kind == "loha":
            return self.t["hada_w1_b"].shape[0]
        for name in ("lokr_w2_b", "lokr_w1_b"):  # ComfyUI's order: w2's rank wins
            if name in self.t:
                return self.t[name].shape[0]
        return None

    def baked(self, factor: float | None = None) -> Module:
        """The same update with `factor` (default: the whole scale) multiplied into the weights."""
        f = self.scale if factor is None else factor
        if f == 1.0:
            return self
        t = dict(self.t)
        name = next(n for n in _BAKE_INTO[self.kind] if n in t)
        t[name] = t[name] * f
        return replace(self, t=t, scale=self.scale / f)

    def delta(self) -> torch.Tensor:
        """The weight update (out, in) in fp32 (without DoRA's rescaling, which needs the base weight)."""
        t = {k: v.float() for k, v in self.t.items()}
        if self.kind == "lora":
            d = t["up"] @ t["down"]
        elif self.kind == "loha":
            d = (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])
        else:
            w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
            w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]
            d = torch.kron(w1, w2)
        return d * self.scale


@dataclass
class LoraFile:
    """A LoRA in diffusers' module names, whatever layout it came from."""

    modules: dict[str, Module]
    meta: dict[str, str] = field(default_factory=dict)  # the source's dittrain.* header keys

    @property
    def kind(self) -> str:
        return next(iter(self.modules.values())).kind

    @property
    def dora(self) -> bool:
        return any("magnitude" in m.t for m in self.modules.values())


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
    raise UserError(f"{path}: {key} is not a LoRA, LoKr or LoHa weight (unknown key suffix)")


def _peft_config(meta: dict[str, str]) -> dict:
    if LORA_METADATA_KEY not in meta:
        return {}
    raw = json.loads(meta[LORA_METADATA_KEY])
    return {k.removeprefix(DIFFUSERS_PREFIX): v for k, v in raw.items()}


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
            t[_LORA_SUFFIXES.get(suffix, suffix)] = v
    return {n: (t, a[0] if a else None) for n, (t, a) in out.items() if t}


def _kind(path: Path, name: str, t: dict) -> str:
    kinds = {"lora" if k in ("down", "up", "magnitude") else k[:4].replace("hada", "loha") for k in t}
    need = {"lora": ("down", "up"), "loha": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")}
    if len(kinds) != 1:
        raise UserError(f"{path}: {name} mixes adapter kinds ({', '.join(sorted(t))})")
    kind = kinds.pop()
    missing = [n for n in need.get(kind, ()) if n not in t]
    if kind == "lokr" and not (("lokr_w1" in t or "lokr_w1_a" in t) and ("lokr_w2" in t or "lokr_w2_a" in t)):
        missing = ["lokr_w1 / lokr_w2"]
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
    baked = float(meta.get(META_BAKED, 1.0))
    if baked != 1.0:  # ours: divide the trained scale back out of the weights it was multiplied into
        modules = {n: m.baked(1.0 / baked) if fmt == "diffusers" or m.rank is None else m for n, m in modules.items()}
    own.pop(META_BAKED, None)
    own.pop(META_FUSED, None)
    return LoraFile(modules, own)


def _read_diffusers(path: Path, tensors: dict, meta: dict) -> dict[str, Module]:
    cfg = _peft_config(meta)

    def strip(k: str) -> str:
        for p in (DIFFUSERS_PREFIX, "base_model.model.", "unet."):
            k = k.removeprefix(p)
        return k

    out = {}
    for name, (t, alpha) in _group(path, tensors, strip).items():
        kind = _kind(path, name, t)
        m = Module(kind, t)
        r = _pattern(name, cfg.get("rank_pattern"), cfg.get("r"))
        if kind == "lokr" and m.rank is None:
            m.peft_r = int(r) if r else max(t["lokr_w2"].shape)
        if alpha is not None and m.rank:  # kohya-style alpha tensors under diffusers names
            m.scale = alpha / m.rank
        elif cfg:
            a = _pattern(name, cfg.get("alpha_pattern"), cfg.get("lora_alpha", cfg.get("alpha", r)))
            r_eff = m.rank if kind != "lokr" else int(r)  # peft divides by the config's r
            m.scale = float(a) / float(r_eff)
        out[name] = m
    return out


def _key_map(family: str | None, path: Path):
    from .models import ADAPTERS, adapter_class

    if family is None:
        raise UserError(f"{path}: the file does not say which model family it is for; pass --family "
                        f"({', '.join(ADAPTERS)})")
    kmap = adapter_class(family).lora_key_map
    if kmap is None:
        raise UserError(f"{family}: no ComfyUI / kohya key map for this family yet (lora_key_map on its adapter "
                        "class); use the diffusers layout")
    return kmap


def _read_original(path: Path, tensors: dict, meta: dict, fmt: str, kmap) -> dict[str, Module]:
    fused_ranks = json.loads(meta.get(META_FUSED, "{}"))
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
        if kind == "lokr" and m.rank is None:
            m.peft_r = int(meta.get("dittrain.rank") or max(t["lokr_w2"].shape))
        if not rule.fused:
            out[names[0]] = m
            continue
        out.update(_split_fused(path, orig, rule, names, m, fused_ranks.get(orig)))
    return out


def _in_features(m: Module) -> int:
    return m.t["down"].shape[1] if m.kind == "lora" else m.t["hada_w1_b"].shape[1]


def _split_fused(path, orig, rule, names, m: Module, ranks) -> dict[str, Module]:
    if m.kind == "lokr":
        raise UserError(f"{path}: {orig} is a LoKr on a fused layer, which cannot be split into diffusers' "
                        f"separate {', '.join(n.rsplit('.', 1)[-1] for n in names)}")
    sizes = [w * _in_features(m) for w in rule.widths]
    up_name = "up" if m.kind == "lora" else "hada_w1_a"
    if m.t[up_name].shape[0] != sum(sizes):
        raise UserError(f"{path}: {orig} has {m.t[up_name].shape[0]} outputs, this family's fused layer "
                        f"{sum(sizes)} ({'+'.join(map(str, sizes))})")
    pairs = [("down", "up")] if m.kind == "lora" else [("hada_w1_b", "hada_w1_a"), ("hada_w2_b", "hada_w2_a")]
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


# ---------------------------------------------------------------------------------------------- writing


def _peft_metadata(modules: dict[str, Module]) -> dict:
    """The peft config (as diffusers stores it) for weights with their scale baked in: alpha = r everywhere."""
    kinds = {m.kind for m in modules.values()}
    if len(kinds) != 1:
        raise UserError(f"a LoRA file holds one adapter kind, not {sorted(kinds)}")
    kind = kinds.pop()

    def r_of(m: Module) -> int:
        return m.rank if m.kind != "lokr" else (m.t["lokr_w2_b"].shape[0] if "lokr_w2_b" in m.t else m.peft_r
                                                 or max(m.t["lokr_w2"].shape))

    ranks = {n: r_of(m) for n, m in modules.items()}
    r0 = max(set(ranks.values()), key=list(ranks.values()).count)
    pattern = {n: r for n, r in ranks.items() if r != r0}
    cfg: dict = {"r": r0, "target_modules": sorted(modules), "rank_pattern": pattern, "alpha_pattern": dict(pattern)}
    if kind == "lora":
        cfg.update(peft_type="LORA", lora_alpha=r0, use_dora=any("magnitude" in m.t for m in modules.values()),
                   lora_dropout=0.0, bias="none", init_lora_weights=True)
    else:
        cfg.update(peft_type=kind.upper(), alpha=r0, rank_dropout=0.0, module_dropout=0.0, init_weights=True)
        if kind == "lokr":
            cfg["decompose_both"] = any("lokr_w1_a" in m.t for m in modules.values())
    return {f"{DIFFUSERS_PREFIX}{k}": v for k, v in cfg.items()}


def _diffusers_tensors(modules: dict[str, Module]) -> dict[str, torch.Tensor]:
    names = {"down": "lora_A.weight", "up": "lora_B.weight", "magnitude": "lora_magnitude_vector"}
    return {f"{DIFFUSERS_PREFIX}{n}.{names.get(k, k)}": v.contiguous()
            for n, m in modules.items() for k, v in m.baked().t.items()}


def _alpha(value: float) -> torch.Tensor:
    return torch.tensor(float(value), dtype=torch.float32)


def _original_tensors(modules: dict[str, Module], kmap, fmt: str, family: str) -> tuple[dict, dict, set]:
    """(tensors, fused ranks, the scales multiplied into full-factor LoKr weights) in the comfy or kohya layout."""
    names = {"down": "lora_down.weight", "up": "lora_up.weight"}
    groups: dict[str, tuple] = {}
    for n, m in modules.items():
        place = _place(kmap, n, m.kind, "magnitude" in m.t, family)
        groups.setdefault(place.original, (place.rule, {}))[1][place.index] = m
    prefix = COMFY_PREFIX if fmt == "comfy" else ""
    out, fused, baked = {}, {}, set()
    for orig, (rule, parts) in groups.items():
        key = prefix + (orig if fmt == "comfy" else kmap.kohya(orig))
        if rule.fused:
            m, ranks = _stack(orig, rule, parts)
            fused[orig] = ranks
        else:
            m = parts[0]
        if m.rank is None:  # both LoKr factors full: ComfyUI applies no alpha, so the scale goes into the weights
            baked.add(m.scale)
            m = m.baked()
        else:
            out[f"{key}.alpha"] = _alpha(m.scale * m.rank)
        out.update({f"{key}.{names.get(k, k)}": v.contiguous() for k, v in m.t.items()})
    return out, fused, baked


def _place(kmap, name: str, kind: str, dora: bool, family: str):
    """Where module `name` goes in the original layout, or the one-line reason it cannot."""
    if dora:
        raise UserError("DoRA cannot be written in the comfy / kohya layout (ComfyUI's dora_scale is another "
                        "decomposition); keep output.lora_format: diffusers for DoRA")
    place = kmap.place(name)
    if place is None:
        raise UserError(f"{name}: no name for this module in the {family} original layout (lora_key_map in "
                        f"trainer/models/); use the diffusers layout")
    if kind == "lokr" and place.rule.fused:
        raise UserError(f"{place.original}: a LoKr on {', '.join(p.rsplit('.', 1)[-1] for p in place.rule.parts)} "
                        "cannot be written as one fused LoKr; use the diffusers layout (ComfyUI reads it for this "
                        "family)")
    return place


def check_layout(modules: list[str], kind: str, dora: bool, fmt: str, family: str) -> None:
    """Refuse, before training, an adapter that layout `fmt` cannot hold (by module names only)."""
    if fmt == "diffusers":
        return
    kmap = _key_map(family, Path(f"output.lora_format: {fmt}"))
    for name in modules:
        _place(kmap, name, kind, dora, family)


def _stack(orig: str, rule, parts: dict[int, Module]) -> tuple[Module, list[int]]:
    """One module for a fused layer from its parts (see the module essay)."""
    first = next(iter(parts.values()))
    same = len({m.scale for m in parts.values()}) == 1
    parts = {j: m if same else m.baked() for j, m in parts.items()}
    fin = _in_features(first)
    sizes = [w * fin for w in rule.widths]
    ranks = [parts[j].rank if j in parts else 0 for j in range(len(sizes))]
    pairs = [("down", "up")] if first.kind == "lora" else [("hada_w1_b", "hada_w1_a"), ("hada_w2_b", "hada_w2_a")]
    t = {}
    for d, u in pairs:
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
    return Module(first.kind, t, first.scale if same else 1.0), ranks


def encode(lf: LoraFile, fmt: str, family: str | None = None, where: Path | str = "") -> tuple[dict, dict]:
    """(tensors, header) of `lf` in layout `fmt` (FORMATS); the header keeps the source's dittrain.* keys and names
    the layout. `where` names the file in errors."""
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
        tensors, fused, baked = _original_tensors(lf.modules, _key_map(family, Path(where)), fmt, family)
        if fused:
            header[META_FUSED] = json.dumps(fused, sort_keys=True)
        if len(baked) == 1 and baked != {1.0}:
            header[META_BAKED] = repr(baked.pop())
    if family:
        header["dittrain.family"] = family
    return tensors, header


def write_lora_file(path: Path, lf: LoraFile, fmt: str, family: str | None = None) -> None:
    """Write `lf` in layout `fmt` to `path`, under a temporary name renamed into place."""
    from safetensors.torch import save_file

    tensors, header = encode(lf, fmt, family, path)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=header)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def lora_file_from(tensors: dict[str, torch.Tensor], meta: dict[str, str], where: Path | str = "") -> LoraFile:
    """A LoraFile from peft-named tensors and a header as `trainer.train.checkpoint.save_lora` writes them (the
    live adapter, without a file)."""
    return LoraFile(_read_diffusers(Path(where), tensors, meta),
                    {k: v for k, v in meta.items() if k.startswith("dittrain.")})


def peft_state_dict(lf: LoraFile) -> dict[str, torch.Tensor]:
    """peft's state dict of `lf` (each module at its own scale: load it into an adapter with alpha = scale x r)."""
    names = {"down": "lora_A.weight", "up": "lora_B.weight", "magnitude": "lora_magnitude_vector"}
    return {f"{n}.{names.get(k, k)}": v for n, m in lf.modules.items() for k, v in m.t.items()}


def convert_lora(src: Path, dst: Path, to: str, family: str | None = None) -> LoraFile:
    """`dittrain convert-lora`: read any layout, write `to`."""
    if to not in FORMATS:
        raise UserError(f"--to {to}: choose one of {', '.join(FORMATS)}")
    lf = read_lora_file(src, family)
    write_lora_file(dst, lf, to, family)
    return lf


DORA_COMFY_NOTE = ("DoRA: ComfyUI does not read peft's DoRA magnitudes (it loads this file as a plain LoRA without "
                   "them); use it with diffusers' load_lora_weights or `dittrain sample`")
