"""`dittrain merge`: bake LoRAs into the transformer's weights, streaming one tensor at a time.

    dittrain merge my.yaml --lora out/a/lora.safetensors:0.8 --lora b.safetensors --out merged/ [--single m.safetensors]

What it writes. A diffusers transformer folder (`config.json` and the base's safetensors shards with the same file
names and the same `diffusion_pytorch_model.safetensors.index.json`), loadable with `<Family>Transformer2DModel.
from_pretrained(out)`, and optionally one `.safetensors` with every weight (for `model.transformer_file`). Weights
keep the base's dtype. The merged model gives the images of the base with the LoRAs applied through diffusers'
`load_lora_weights` / `set_adapters(weights)`, up to the rounding of the weights to the base dtype (bf16).

How. For a LoRA module `transformer.<name>.lora_A.weight` (r x in) and `.lora_B.weight` (out x r) the base weight
`<name>.weight` becomes W + w * (alpha / r) * B @ A, computed in fp32 and rounded once. `alpha` and `r` come from the
peft config diffusers keeps in the file's header (`lora_adapter_metadata`, with its per-module `alpha_pattern` /
`rank_pattern`), which is what `load_lora_weights` uses; a file without it is taken at alpha = r (scale 1), as
diffusers does. A LoRA module that matches no base weight, or a shape that does not fit, stops with the file named.

Memory. The base is read with `safetensors.safe_open` one tensor at a time and the output is written by a small
streaming writer of the safetensors format (the header is known from the base's shapes and dtypes, so the tensors
can follow one by one). RAM holds the LoRAs (small), one base tensor and its fp32 merge: never a shard or a block.

comfy / kohya files (output.lora_format) are read through trainer/lora_format/, which knows the family from the
file's header.

Left out: LoRAs on the text encoders (dittrain trains the transformer only), LoKr / LoHa files, DoRA magnitudes,
biases in the LoRA.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import UserError
from .progress import bar as progress_bar
from .quant import SAFETENSORS_DTYPES

INDEX = "diffusion_pytorch_model.safetensors.index.json"
SINGLE = "diffusion_pytorch_model.safetensors"
_PREFIX = "transformer."


# ---------------------------------------------------------------------------------------------- LoRA deltas


def _pattern_value(name: str, patterns: dict, default: float) -> float:
    """peft's rule: the first pattern that matches the module name's end wins."""
    for pat, val in patterns.items():
        if re.match(rf"(.*\.)?({pat})$", name):
            return float(val)
    return float(default)


def read_lora(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """{base weight name: (A, B, alpha / r)} of one diffusers-format LoRA file, fp32."""
    from .lora_format import LORA_KINDS, file_format, read_lora_file

    path = Path(path)
    if not path.is_file():
        raise UserError(f"--lora {path}: file not found")
    if file_format(path) != "diffusers":  # comfy / kohya layout (output.lora_format): through the converter
        lf = read_lora_file(path)
        if not LORA_KINDS[lf.kind].mergeable or lf.dora:
            raise UserError(f"--lora {path}: only plain LoRA files merge here, not {lf.kind}"
                            f"{' + DoRA' if lf.dora else ''}")
        return {f"{n}.weight": (m.t["down"].float(), m.t["up"].float(), m.scale) for n, m in lf.modules.items()}
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
    cfg = {}
    if "lora_adapter_metadata" in meta:
        cfg = {k.removeprefix(_PREFIX): v for k, v in json.loads(meta["lora_adapter_metadata"]).items()}
    if any(k.endswith(".lora_magnitude_vector") for k in tensors):  # B @ A alone would merge the wrong weights
        raise UserError(f"--lora {path}: a DoRA file (lora.dora: true) cannot be merged here; load it with "
                        "load_lora_weights or `dittrain sample --lora`")
    out = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        module = key.split(".lora_A.")[0]
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        if b is None:
            raise UserError(f"--lora {path}: {key} has no matching lora_B weight")
        name = module.removeprefix(_PREFIX)
        r = a.shape[0]
        alpha = _pattern_value(name, cfg.get("alpha_pattern") or {}, cfg.get("lora_alpha", r))
        out[f"{name}.weight"] = (a.float(), b.float(), alpha / r)
    if not out:
        raise UserError(f"--lora {path}: no lora_A / lora_B weights in this file (a diffusers-format LoRA is expected)")
    return out


# ---------------------------------------------------------------------------------------------- streaming writer


class _Writer:
    """Writes a safetensors file tensor by tensor: the header first (from names, dtypes and shapes), then the data."""

    def __init__(self, path: Path, specs: list[tuple[str, str, list[int]]], metadata: dict[str, str] | None = None):
        header: dict = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        for name, dtype, shape in specs:
            n = SAFETENSORS_DTYPES[dtype].itemsize
            for s in shape:
                n *= s
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
        self._order = [s[0] for s in specs]
        self._next = 0
        self._f = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._f.write(struct.pack("<Q", len(blob)) + blob)

    def write(self, name: str, t: torch.Tensor) -> None:
        if name != self._order[self._next]:
            raise RuntimeError(f"tensor {name} written out of order (expected {self._order[self._next]})")
        self._next += 1
        self._f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    def close(self) -> None:
        self._f.close()
        if self._next != len(self._order):
            raise RuntimeError(f"{len(self._order) - self._next} tensors were not written")


# ---------------------------------------------------------------------------------------------- merge


def _base_files(model_path: Path, transformer_file: Path | None) -> tuple[Path, list[Path], dict | None]:
    """(transformer folder, shard files in order, index.json or None)."""
    folder = Path(model_path) / "transformer"
    if not (folder / "config.json").is_file():
        raise UserError(f"model.path: {folder / 'config.json'} not found (a diffusers transformer folder is expected)")
    if transformer_file is not None:
        if not Path(transformer_file).is_file():
            raise UserError(f"model.transformer_file: {transformer_file} not found")
        return folder, [Path(transformer_file)], None
    if (folder / INDEX).is_file():
        index = json.loads((folder / INDEX).read_text())
        shards = list(dict.fromkeys(index["weight_map"].values()))
        return folder, [folder / s for s in shards], index
    if (folder / SINGLE).is_file():
        return folder, [folder / SINGLE], None
    raise UserError(f"model.path: no {SINGLE} or {INDEX} in {folder}")


def _merged_tensors(shard: Path, deltas: list[tuple[dict, float, Path]]) -> Iterator[tuple[str, torch.Tensor]]:
    with safe_open(str(shard), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            w = f.get_tensor(name)
            hits = [(d[name], weight, path) for d, weight, path in deltas if name in d]
            if hits:
                acc = w.float()
                for (a, b, scale), weight, path in hits:
                    if (b.shape[0], a.shape[1]) != tuple(acc.shape):
                        raise UserError(f"--lora {path}: {name} is {tuple(acc.shape)} in the model, the LoRA makes "
                                        f"{(b.shape[0], a.shape[1])}; was it trained for another model?")
                    acc.addmm_(b, a, alpha=weight * scale)  # fp32 delta, one rounding at the end
                w = acc.to(w.dtype)
                del acc
            yield name, w


def _specs(shard: Path) -> list[tuple[str, str, list[int]]]:
    with safe_open(str(shard), framework="pt") as f:
        out = []
        for name in f.keys():  # noqa: SIM118
            sl = f.get_slice(name)
            out.append((name, sl.get_dtype(), list(sl.get_shape())))
        return out


def merge_loras(
    model_path: Path,
    loras: list,
    out: Path,
    single: Path | None = None,
    transformer_file: Path | None = None,
    progress: bool = True,
) -> Path:
    """Write `out` (a transformer folder) with every `LoraSpec` (path, weight) merged in; and `single` if given.

    Returns `out`. Raises UserError for a LoRA that does not fit the model."""
    if not loras:
        raise UserError("merge: give at least one --lora PATH[:WEIGHT]")
    folder, shards, index = _base_files(Path(model_path), transformer_file)
    deltas = [(read_lora(s.path), float(s.weight), Path(s.path)) for s in loras]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() == folder.resolve():
        raise UserError(f"merge --out {out}: that is the base model's own transformer folder")
    shutil.copy2(folder / "config.json", out / "config.json")
    names = [shard.name for shard in shards] if index is not None else [SINGLE]
    if index is not None:
        (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    specs = [_specs(s) for s in shards]
    base = {x[0] for s in specs for x in s}
    for d, _, path in deltas:  # before anything is written
        unused = sorted(k for k in d if k not in base)
        if unused:
            raise UserError(f"--lora {path}: {len(unused)} LoRA modules match no weight of this model "
                            f"(first: {unused[0].removesuffix('.weight')}); was it trained for another model?")
    bar = progress_bar(total=len(base), desc="merging", unit="tensor", enabled=progress)
    one = _Writer(single, [x for s in specs for x in s]) if single is not None else None
    try:
        for shard, name, spec in zip(shards, names, specs, strict=True):
            w = _Writer(out / name, spec)
            for key, t in _merged_tensors(shard, deltas):
                w.write(key, t)
                if one is not None:
                    one.write(key, t)
                bar.update(1)
            w.close()
        if one is not None:
            one.close()
    finally:
        bar.close()
    return out
