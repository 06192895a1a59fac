"""Single-file checkpoints in the original layout (BFL's `flux1-dev.safetensors`, Stability's SD3.5 files,
ComfyUI's `model.diffusion_model.*` fp8 files), read block by block instead of converted whole.

Why. diffusers' `from_single_file` loads the whole state dict, then its family converter renames the keys, splits
fused projections (Flux's `img_attn.qkv` into to_q / to_k / to_v, the single blocks' `linear1` into q, k, v and
the MLP input) and reorders halves (the final layer's shift / scale). That needs the whole model in RAM at once:
for Flux.1-dev 23.8 GB before a single block streams. The conversion is, however, pure bookkeeping along the first
axis of each tensor: every diffusers tensor is some rows of one or more original tensors, in some order.

How. `row_map` runs diffusers' own converter (the one `from_single_file` runs,
`SINGLE_FILE_LOADABLE_CLASSES[cls]["checkpoint_mapping_fn"]`) once, on *provenance* tensors instead of weights:
each original tensor of shape (n, ...) becomes a float64 column (n, 1, ...) holding the global ids of its rows.
Whatever the converter does along the first axis (pop, rename, chunk, split, cat, swap) it does to the ids, so each
converted tensor tells, row by row, which original tensor and row it came from; runs of consecutive rows are
stored as `(original key, start, stop)`. Reading a diffusers tensor is then reading those row ranges with
safetensors' `get_slice` (only those bytes) and concatenating: one block at a time, exactly the values the converter
would have produced. The map costs a few floats per row (about 2 M for Flux.1-dev), never a weight.

Refused (the file keeps the whole path, `from_single_file`, with the trainer's one-line note): a converter that
fails on the file (e.g. Flux.1's, whose single-block split is hard-coded to 3072 wide, on a smaller model), one
that does anything but move rows (a transpose, reshape or arithmetic shows as a wrong shape or non-integer ids), a
diffusers tensor left uncovered or of the wrong row count, a tensor gathered from original tensors of different
dtypes, and, in a scaled fp8 file, a weight gathered from several scaled tensors (one per-tensor scale each).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: a diffusers key -> the (original key, first row, row after the last) ranges it is made of, in order
Runs = dict[str, list[tuple[str, int, int]]]


@dataclass(frozen=True)
class OriginalLayout:
    prefix: str  #: stripped from every original key before conversion ("" or e.g. "model.diffusion_model.")
    runs: Runs


def common_prefix(keys: list[str]) -> str:
    """The longest prefix ending in "." that every key shares ("" for none)."""
    if not keys:
        return ""
    lo, hi = min(keys), max(keys)
    n = 0
    while n < min(len(lo), len(hi)) and lo[n] == hi[n]:
        n += 1
    return lo[: lo.rfind(".", 0, n) + 1] if "." in lo[:n] else ""


def row_map(transformer_cls: type, config: dict, header: dict[str, dict], want: dict[str, torch.Size],
            is_extra) -> OriginalLayout | None:
    """The row map from the original-layout file with safetensors `header` to the diffusers keys `want` (their
    shapes), or None when it cannot be made exactly (see the module essay). `is_extra(key)` marks keys that are
    no tensor of the model (fp8 scales, markers); they are left out of the conversion."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    entry = SINGLE_FILE_LOADABLE_CLASSES.get(transformer_cls.__name__)
    if entry is None:
        return None
    keys = [k for k in header if not is_extra(k)]
    prefix = common_prefix(keys)
    ids, owners, starts, offset = {}, [], [], 0
    for k in keys:
        shape = header[k]["shape"]
        n = shape[0] if shape else 1
        col = torch.arange(offset, offset + n, dtype=torch.float64)
        ids[k[len(prefix):]] = col.reshape(n, *([1] * (len(shape) - 1))) if shape else col.reshape(())
        owners.append(k[len(prefix):])
        starts.append(offset)
        offset += n
    try:
        out = entry["checkpoint_mapping_fn"](checkpoint=ids, config=config)
    except Exception:  # noqa: BLE001 - any failure of the converter on this file: the whole path decides
        return None
    cols = []
    for key, shape in want.items():
        t = out.get(key)
        if t is None or t.dtype != torch.float64 or t.dim() != len(shape) or t.numel() != (shape[0] if shape else 1):
            return None
        cols.append(t.reshape(-1))
    # every wanted tensor's rows at once: which original tensor (`which`) and which of its rows (`local`)
    rows = torch.cat(cols)
    if not torch.equal(rows, rows.round()) or rows.min() < 0 or rows.max() >= offset:
        return None
    start_of = torch.tensor(starts, dtype=torch.float64)
    which = torch.searchsorted(start_of, rows, right=True) - 1
    local = (rows - start_of[which]).long()
    # a run ends where a wanted tensor ends, the source tensor changes or the rows stop being consecutive
    cut = torch.ones_like(which, dtype=torch.bool)
    cut[1:] = (which[1:] != which[:-1]) | (local[1:] != local[:-1] + 1)
    ends = torch.tensor([len(c) for c in cols]).cumsum(0)
    cut[ends[:-1]] = True
    first = cut.nonzero().reshape(-1).tolist()
    which, local = which.tolist(), local.tolist()
    runs: Runs = {}
    i = 0
    for key, end in zip(want, ends.tolist(), strict=True):
        r = []
        while i < len(first) and first[i] < end:
            a, b = first[i], first[i + 1] if i + 1 < len(first) else len(local)
            r.append((owners[which[a]], local[a], local[b - 1] + 1))
            i += 1
        if len({header[prefix + o]["dtype"] for o, _, _ in r}) != 1:
            return None
        runs[key] = r
    return OriginalLayout(prefix, runs)
