"""Optimizer state <-> safetensors + JSON, no pickle.

A torch state dict is a tree of dicts, lists, tuples, numbers, strings and tensors. We walk it once: every
tensor goes into a flat `{name: tensor}` dict for safetensors (its name is its path in the tree, e.g.
`state/3/exp_avg`), and the tree itself, with each tensor replaced by `{"__tensor__": name}`, becomes JSON.
Two shapes JSON cannot say directly are tagged: dicts with int keys (`state` is keyed by parameter index)
as `{"__intdict__": [[k, v], ...]}` and tuples (Adam's `betas`) as `{"__tuple__": [...]}`. Tensors that
share storage (bitsandbytes shares one quantisation map between parameters) are stored once and referenced
by name, since safetensors refuses aliased tensors. Floats go through JSON's repr, which round-trips exactly.

No copy of the state. safetensors refuses tensors whose bytes overlap, not tensors that share a storage: a
streamed full fine-tune's state is thousands of disjoint views of one host arena (trainer/offload/fused_state.py:
between steps the state points at the arena's copies), and each is written from its place. Only a view that
overlaps bytes already stored (another view of a bitsandbytes map) is cloned. Cloning every view of a shared
storage instead held a second copy of the streamed state in RAM for the whole write (Wan 2.1 1.3B's full
fine-tune: 9-10 GB over the planner's checkpoint-save prediction, bench/logs/2026-11-28i).

`save_optimizer_state(optimizer, folder)` writes `folder/optimizer.safetensors` with the JSON tree in the
header metadata (key `dittrain.optimizer`), one file per checkpoint; the tensors are the optimizer's live
state (copied to the CPU by safetensors as it writes), so write them before the next step.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import UserError

FORMAT = "dittrain.optimizer/1"
FILE_NAME = "optimizer.safetensors"
_META_KEY = "dittrain.optimizer"


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor], seen: dict[tuple, str],
            spans: dict[tuple, list[tuple[int, int]]]) -> Any:
    """`obj` as JSON with its tensors put in `tensors`; `seen`: the views stored so far (view -> name), `spans`:
    per storage, the byte ranges stored from it (`_claim`)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.numel():
            view = (t.untyped_storage().data_ptr(), str(t.device), t.storage_offset(), tuple(t.shape),
                    tuple(t.stride()), t.dtype)
            if view in seen:
                return {"__tensor__": seen[view]}
            seen[view] = path
        t = t.contiguous()  # a strided view becomes its own tensor; a contiguous one stays where it is
        if t.numel() and not _claim(t, spans.setdefault((t.untyped_storage().data_ptr(), str(t.device)), [])):
            t = t.clone()  # overlaps bytes already stored: safetensors refuses overlapping tensors
        tensors[path] = t
        return {"__tensor__": path}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _encode(v, _join(path, k), tensors, seen, spans) for k, v in obj.items()}
        if all(isinstance(k, int) for k in obj):
            return {"__intdict__": [[k, _encode(v, _join(path, k), tensors, seen, spans)] for k, v in obj.items()]}
        raise TypeError(f"optimizer state at {path!r}: dict keys must be all str or all int")
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, _join(path, i), tensors, seen, spans) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, _join(path, i), tensors, seen, spans) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"optimizer state at {path!r}: cannot store a {type(obj).__name__} without pickle")


def _claim(t: torch.Tensor, spans: list[tuple[int, int]]) -> bool:
    """Add contiguous `t`'s bytes to `spans` (sorted, disjoint (start, stop) byte ranges already stored from its
    storage) and return True, or return False where they overlap one of them."""
    start = t.data_ptr()
    stop = start + t.numel() * t.element_size()
    i = bisect.bisect(spans, (start, stop))
    if (i and spans[i - 1][1] > start) or (i < len(spans) and spans[i][0] < stop):
        return False
    spans.insert(i, (start, stop))
    return True


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__intdict__" in obj:
            return {int(k): _decode(v, tensors) for k, v in obj["__intdict__"]}
        if "__tuple__" in obj:
            return tuple(_decode(v, tensors) for v in obj["__tuple__"])
        return {k: _decode(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    return obj


def optimizer_state_to_safetensors(optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, meta): the optimizer's `state_dict()` as safetensors-ready tensors and a JSON-able tree.

    Works for torch optimizers, `Fp32StepOptimizer` and `FusedBackPass`. The tensors alias the live state.
    """
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(optimizer.state_dict(), "", tensors, {}, {})
    return tensors, {"format": FORMAT, "state_dict": tree}


def optimizer_state_from_safetensors(
    optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> None:
    """Load (tensors, meta) from `optimizer_state_to_safetensors` into an optimizer built the same way."""
    if meta.get("format") != FORMAT:
        raise ValueError(f"optimizer state format {meta.get('format')!r}, expected {FORMAT!r}")
    state_dict = _decode(meta["state_dict"], tensors)
    # torch loads another optimizer's state silently and fails at the next step; compare the groups' keys.
    ignore = {"params", "initial_lr"}
    saved = [set(g) - ignore for g in state_dict.get("param_groups", [])]
    have = [set(g) - ignore for g in optimizer.param_groups]
    # A subset, not equality: some optimizers add group keys at their first step (Prodigy's d_denom, d_hat).
    if len(saved) != len(have) or any(not h <= s for h, s in zip(have, saved, strict=True)):
        raise ValueError("it was saved by a different optimizer (its param groups have other settings)")
    optimizer.load_state_dict(state_dict)


def save_optimizer_state(optimizer, folder: str | Path, name: str = FILE_NAME) -> Path:
    """Write `folder/optimizer.safetensors` (tensors, with the JSON tree in the header). Returns the path."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # host-device sync: state copied off the GPU asynchronously must be complete
    tensors, meta = optimizer_state_to_safetensors(optimizer)
    path = Path(folder) / name
    save_file(tensors, str(path), metadata={_META_KEY: json.dumps(meta)})
    return path


def load_optimizer_shards(optimizer, files: list[Path], keep) -> None:
    """Load the state entries whose parameter index `keep(i)` accepts from several files, each written by
    `save_optimizer_state` on one process that stepped some of the parameters (trainer/train/owners.py): their
    `state` entries are disjoint; param groups come from the first file, per-weight rounding counts are the
    owners' (the largest). Only the kept entries' tensors are read."""
    state, tensors, tree = [], {}, None
    for j, path in enumerate(files):
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {})[_META_KEY])
                sd = meta["state_dict"]
                entries = sd["state"].get("__intdict__", []) if isinstance(sd["state"], dict) else []
                # a process's state dict also lists the others' parameters, with empty entries: skip those
                kept = _renamed([[k, v] for k, v in entries if v and keep(int(k))], f"{j}:")
                for name in _tensor_names(kept):
                    tensors[name] = f.get_tensor(name.split(":", 1)[1])
        except Exception as e:  # noqa: BLE001 - a truncated file, a foreign one: one line for the user
            raise UserError(f"{path}: cannot read the optimizer state ({type(e).__name__}: {e}); resume from "
                            "another checkpoint") from None
        state += kept
        if tree is None:
            tree = {k: v for k, v in sd.items() if k != "state"}
            if _tensor_names(tree):
                raise UserError(f"{path}: optimizer settings hold tensors, which a sharded state cannot merge")
        elif "rounding_counts" in sd:
            tree["rounding_counts"] = [max(a, b) for a, b in zip(tree["rounding_counts"], sd["rounding_counts"],
                                                                  strict=True)]
    tree["state"] = {"__intdict__": state}
    try:
        optimizer_state_from_safetensors(optimizer, tensors, {"format": meta.get("format"), "state_dict": tree})
    except (ValueError, KeyError) as e:
        raise UserError(f"{files[0].parent}: optimizer state does not fit this run's parameters or optimizer ({e}); "
                        "resume with the config it was saved with") from None


def _tensor_names(tree: Any) -> list[str]:
    if isinstance(tree, dict):
        if "__tensor__" in tree:
            return [tree["__tensor__"]]
        return [n for v in tree.values() for n in _tensor_names(v)]
    if isinstance(tree, list):
        return [n for v in tree for n in _tensor_names(v)]
    return []


def _renamed(tree: Any, prefix: str) -> Any:
    """The tree with every tensor reference prefixed (files' tensor names may repeat)."""
    if isinstance(tree, dict):
        if "__tensor__" in tree:
            return {"__tensor__": prefix + tree["__tensor__"]}
        return {k: _renamed(v, prefix) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_renamed(v, prefix) for v in tree]
    return tree


def load_optimizer_state(optimizer, folder: str | Path) -> None:
    """Load `folder/optimizer.safetensors` into `optimizer` (built with the same parameters and config)."""
    path = Path(folder) / FILE_NAME
    if not path.is_file():
        raise UserError(
            f"{path}: optimizer state missing; the checkpoint is incomplete, resume from another one"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise UserError(
            f"{path}: cannot read the optimizer state ({e}); resume from another checkpoint"
        ) from None
    if _META_KEY not in header:
        raise UserError(f"{path}: not a dittrain optimizer state (no {_META_KEY!r} header)")
    try:
        optimizer_state_from_safetensors(optimizer, tensors, json.loads(header[_META_KEY]))
    except (ValueError, KeyError) as e:
        raise UserError(
            f"{path}: optimizer state does not fit this run's parameters or optimizer ({e}); "
            "resume with the config it was saved with"
        ) from None
    from .build import torch_optimizer

    inner = torch_optimizer(optimizer)
    if hasattr(inner, "train") and not all(g.get("train_mode", True) for g in inner.param_groups):
        inner.train()  # schedule-free: saved with the averaged weights in place (build.eval_weights); train again
