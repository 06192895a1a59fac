"""Loading the transformer without ever holding a copy of it in ordinary RAM.

Why. diffusers' `from_pretrained` materialises the whole model in CPU RAM; the offload conductor then copies the
streamed blocks into its pinned arena, so a streamed run used to peak at about twice the model (issue #14: 48.8 GB
host RSS for a 23.7 GB arena). Here every weight is read once, from the safetensors files, straight to where it
will live: the conductor's arena region (streamed blocks), the GPU ring (blocks resident from the start), or the
device (non-block weights, and every weight at fraction 0).

How, in the order the trainer calls it:

    tr = empty_transformer(adapter, cfg, dtype)  # the real class, built with no weight memory (placeholders)
    loader = TransformerLoader(tr, cfg, dtype)   # maps tensors to safetensors keys (sharded index.json or not)
    loader.place(tr, device, skip=blocks)        # non-block weights to the device as they are read
    ... LoRA injection, the optimizer ...        # they see the real class, shapes and dtypes
    attach_offload(blocks, ..., fill=loader.fill)  # the conductor lays out arena and ring, `fill` writes each block

The empty model is built under accelerate's `init_empty_weights` (parameters on `meta`, buffers real), the
blocks are quantized there when `model.quantize` is set (their modulation Linears too with
`model.quantize_modulation`; shapes and dtypes only), and then every meta parameter
becomes a *placeholder*: one NaN scalar of its dtype expanded to its shape. A placeholder is an ordinary CPU
tensor (so `param.data = view` works, which it does not from `meta`, and peft creates LoRA weights on the CPU in
the base dtype exactly as on a loaded model) that costs no memory; anything that reads one before its load gets
NaN, never plausible numbers. `is_placeholder` tells them apart.

Each tensor is read with `safetensors.safe_open` (mmap; one file open at a time, so the file-backed pages the
process maps stay within one shard), cast to the model's dtype and, for a quantized Linear, quantized on the way
(trainer/quant.py `quantize`, the same function the old path ran after `from_pretrained`): the values are
bitwise those of `from_pretrained` + `prepare_transformer` (tests/test_stream_load.py checks it).

Left out: single-file transformers (`model.transformer_file`, whose keys diffusers converts from the original
checkpoint layout, and fp8 files whose scales are adopted) keep the old `from_pretrained` path; so does resuming a
full fine-tune (its weights come from the checkpoint, not the model folder).
"""

from __future__ import annotations

import ctypes
import gc
import json
from pathlib import Path

import torch
from torch import nn

from .. import quant
from ..errors import UserError

_INDEX = "diffusion_pytorch_model.safetensors.index.json"
_NAN: dict[torch.dtype, torch.Tensor] = {}


def _nan(dtype: torch.dtype) -> torch.Tensor:
    t = _NAN.get(dtype)
    if t is None:  # integer and fp8 dtypes have no NaN to spare: their placeholder holds the closest thing
        t = _NAN[dtype] = torch.full((), float("nan")).to(dtype) if dtype.is_floating_point else torch.zeros((), dtype=dtype)
    return t


def placeholder(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of `shape` and `dtype` that costs no memory (see the module essay). Made with `set_`, not
    `expand`: an expanded view would share its autograd version counter with every other placeholder, and keep
    sharing it after `param.data` is replaced, so one weight's in-place optimizer step would invalidate them all."""
    ref = _nan(dtype)
    return torch.empty(0, dtype=dtype).set_(ref.untyped_storage(), 0, shape, (0,) * len(shape))


def is_placeholder(t: torch.Tensor) -> bool:
    ref = _NAN.get(t.dtype)
    return ref is not None and t.device.type == "cpu" and t.untyped_storage().data_ptr() == ref.untyped_storage().data_ptr()


def supported(cfg) -> bool:
    """Whether `cfg.model` loads through this module (a diffusers folder; single files keep from_pretrained)."""
    return cfg.transformer_file is None


def loads_whole(cfg, resuming: bool = False, streamed: bool = True) -> bool:
    """Whether `fit` with the full Config `cfg` reads the whole transformer into RAM before its blocks stream,
    instead of block by block from the files into the arena (the trainer loads by it, the planner counts RAM by
    it): a single file (not a diffusers folder); a resumed full fine-tune (its checkpoint replaces every weight);
    and, where blocks stream (they keep placeholders until the conductor fills them), DoRA (peft starts its
    magnitudes from the base weights) and an EMA of a full fine-tune (its shadow starts from them)."""
    full = cfg.train.method == "full"
    needs_base = resuming and full
    if streamed:
        needs_base = needs_base or (not full and cfg.lora.dora) or (full and cfg.train.ema is not None)
    return not supported(cfg.model) or needs_base


def empty_transformer(adapter, cfg, dtype: torch.dtype) -> nn.Module:
    """The family's transformer with placeholders for weights, its blocks quantized per `cfg.quantize`."""
    from accelerate import init_empty_weights

    adapter._check(cfg, {"transformer"})
    config = adapter.transformer_cls.load_config(str(cfg.path), subfolder="transformer", local_files_only=True)
    with init_empty_weights():  # parameters on meta, buffers real (rotary tables and the like)
        tr = adapter.transformer_cls.from_config(config)
    nn.Module.to(tr, dtype)  # torch's, not ModelMixin's (whose warning is about fp32 modules no family has)
    quant.quantize_blocks(adapter.blocks(tr), cfg.quantize, cfg.quantize_modulation)  # on meta: shapes, dtypes
    for mod in tr.modules():
        for name, p in mod._parameters.items():
            if p is not None and p.is_meta:
                mod._parameters[name] = nn.Parameter(placeholder(p.shape, p.dtype), requires_grad=p.requires_grad)
        for name, b in mod._buffers.items():
            if b is not None and b.is_meta:  # quantize's weight_scale
                mod._buffers[name] = placeholder(b.shape, b.dtype)
    return tr


class _Files:
    """The transformer's safetensors files: key -> file, and one open handle at a time."""

    def __init__(self, folder: Path):
        index = folder / _INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.where = {k: folder / f for k, f in weight_map.items()}
        else:
            from safetensors import safe_open

            self.where = {}
            for f in sorted(folder.glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as h:
                    self.where.update(dict.fromkeys(h.keys(), f))
        self._path: Path | None = None
        self._handle = None

    def read(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        f = self.where.get(key)
        if f is None:
            raise KeyError(key)
        if f != self._path:
            self.close()  # unmaps the previous shard: its file-backed pages leave this process
            self._handle, self._path = safe_open(str(f), framework="pt"), f
        return self._handle.get_tensor(key)  # allocation: this one tensor

    def close(self) -> None:
        self._handle = self._path = None


class TransformerLoader:
    """Reads each tensor of an `empty_transformer` from the model folder into place (see the module essay)."""

    def __init__(self, transformer: nn.Module, cfg, dtype: torch.dtype):
        folder = Path(cfg.path) / "transformer"
        try:
            self.files = _Files(folder)
        except (OSError, ValueError) as e:
            raise UserError(f"{folder}: could not read the safetensors index or headers ({e})") from None
        self.dtype = dtype
        # Module -> its state-dict prefix; peft's `base_layer` (LoRA injected after the build) is not in the file.
        self._root = transformer
        self.prefix = self._prefixes()
        self._scales: dict[int, torch.Tensor] = {}

    def _prefixes(self) -> dict[int, str]:
        return {id(m): (n + ".").replace("base_layer.", "") if n else "" for n, m in self._root.named_modules()}

    def _prefix(self, module: nn.Module) -> str:
        if id(module) not in self.prefix:  # a module added after the build (LoRA layers loaded for sampling)
            self.prefix = self._prefixes()
        return self.prefix[id(module)]

    def tensor(self, module: nn.Module, name: str, current: torch.Tensor) -> torch.Tensor:
        """The value of `module`'s tensor `name` (now `current`) on the CPU, in `current`'s dtype."""
        if isinstance(module, quant.QuantizedLinear) and name in ("weight", "weight_scale"):
            if name == "weight_scale" and id(module) in self._scales:
                return self._scales.pop(id(module))
            mode = "fp8" if module.weight.dtype == torch.float8_e4m3fn else "int8"
            w = self._read(self._prefix(module) + "weight", module.compute_dtype)
            q, scale = quant.quantize(w, mode)  # as the old path: quantize the model-dtype weight
            if name == "weight":
                self._scales[id(module)] = scale
                return q
            return scale
        key = self._prefix(module) + name
        if key not in self.files.where:
            if not is_placeholder(current):
                return current  # a buffer the model computes itself (not in the file)
            raise UserError(f"{self.files.where and next(iter(self.files.where.values())).parent}: no weight "
                            f"{key!r} in the safetensors files (a different {type(module).__name__} layout?)")
        return self._read(key, current.dtype)

    def _read(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        t = self.files.read(key)
        return t if t.dtype == dtype else t.to(dtype)

    def fill(self, block: int, entries, views: list[torch.Tensor]) -> None:  # noqa: ARG002 - the conductor's seam
        """Write one block's tensors (packing entries of allocators.BlockPacking) into `views` (arena or ring)."""
        with torch.no_grad():
            for e, v in zip(entries, views, strict=True):
                v.copy_(self.tensor(e.module, e.name, e.tensor()))

    def place(self, module: nn.Module, device: torch.device, skip: list[nn.Module] = ()) -> None:
        """Load every tensor of `module` outside the `skip` modules onto `device` (Parameter objects kept)."""
        skipped = {id(m) for m in skip}
        device = torch.device(device)

        def visit(m: nn.Module) -> None:
            if id(m) in skipped:
                return
            for name, p in m._parameters.items():
                if p is not None and (is_placeholder(p) or p.device != device):
                    p.data = _own(self.tensor(m, name, p), device)
            for name, b in m._buffers.items():
                if b is not None:
                    m._buffers[name] = _own(self.tensor(m, name, b), device)
            for child in m.children():
                visit(child)

        with torch.no_grad():
            visit(module)
        self.files.close()

    def close(self) -> None:
        self.files.close()
        self._scales.clear()


def _own(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`, not a view: safetensors hands out views of a byte buffer; a copy (one tensor, on the CPU
    only) keeps parameters plain tensors in 64-byte aligned memory, as the old path's `own_aligned_memory`
    (_diffusers.py says why alignment changes CPU results)."""
    if t.device != device:
        return t.to(device)
    return t.clone() if t._base is not None or t.data_ptr() % 64 else t


def release_host_memory() -> None:
    """Hand freed heap memory back to the OS (glibc `malloc_trim`; a no-op elsewhere), so RSS really drops once
    the VAE and text encoders are gone."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def load(adapter, cfg, dtype: torch.dtype, device: torch.device, stream_blocks: bool):
    """The transformer with its non-block weights on `device`, and its blocks too unless `stream_blocks` (then
    they keep placeholders until the conductor's `fill`). Returns (transformer, loader or None)."""
    tr = empty_transformer(adapter, cfg, dtype)
    loader = TransformerLoader(tr, cfg, dtype)
    try:
        loader.place(tr, device, skip=adapter.blocks(tr) if stream_blocks else ())
    except (OSError, ValueError) as e:  # a truncated or mismatched file
        raise UserError(f"{cfg.path}: could not load the {adapter.family} transformer: {e}") from e
    if not stream_blocks:
        loader.close()
        return tr, None
    return tr, loader
