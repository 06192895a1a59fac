"""Loading the transformer without ever holding a copy of it in ordinary RAM.

Why. diffusers' `from_pretrained` materialises the whole model in CPU RAM; the offload conductor then copies the
streamed blocks into its pinned arena, so a streamed run would peak at about twice the model (the whole
model in RAM beside its arena). Here every weight is read once, from the safetensors files, straight to where it
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

Single files. A `model.transformer_file` whose keys, after stripping one common prefix (`model.diffusion_model.`,
`transformer.`, ... found from the header: `file_prefix`), cover the transformer's state-dict keys is read the
same way, tensor by tensor from the one file. An fp8 file (`float8_e4m3fn`, with or without per-tensor
`scale_weight` keys) gives what `from_single_file` + `quant.prepare_transformer` give, bitwise
(tests/test_stream_load_file.py): with `quantize: fp8` each block Linear is built as `quant.adopt_fp8` would
leave it, decided from the header (fp8 in the file: adopted, the file's 8-bit values and scale) or, for a
higher-precision weight, from its values (read once at build: adopted if they are all fp8 values, else quantized
per channel, or kept for modulation); every other scaled fp8 weight is up-cast with its scale applied.

Original layout. A single file in the original checkpoint layout (BFL / Stability key names, optionally under
ComfyUI's `model.diffusion_model.` prefix, bf16 or fp8 with per-tensor `scale_weight`) streams the same way: its
diffusers tensors are row ranges of the file's tensors, found once by running diffusers' own converter on row ids
(trainer/models/original_layout.py), and each is read from just those rows when its block is filled.

Left out: a file whose layout neither maps (another layout, or a converter that does more than move rows, such as
Flux.1's on a model narrower than 3072) keeps the old `from_single_file` path and loads whole into RAM
(`whole_file_note` is the line the trainer logs); so does resuming a full fine-tune (its weights come from the
checkpoint, not the model folder). `loads_whole` is the one rule for both, used by the trainer and by the planner's
RAM count.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import quant
from ..errors import UserError
from . import original_layout

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
    """Whether the ModelConfig `cfg` loads through this module: a diffusers folder, or a single file whose keys
    are the transformer's diffusers keys (`file_prefix`) or whose original-layout keys map onto them row by row
    (trainer/models/original_layout.py); any other file keeps `from_single_file` (whole into RAM)."""
    return cfg.transformer_file is None or file_layout(cfg) is not None


def whole_file_note(cfg) -> str | None:
    """The one line to log when the ModelConfig `cfg`'s single file loads whole into RAM (its layout), else None."""
    if cfg.transformer_file is None or file_layout(cfg) is not None:
        return None
    return (f"{cfg.transformer_file}: its keys are neither the {cfg.family} transformer's diffusers keys nor an "
            f"original layout that diffusers' converter maps row by row, so diffusers converts it and it loads "
            f"whole into RAM before its blocks stream")


def file_prefix(cfg) -> str | None:
    """The prefix to strip from the keys of the ModelConfig `cfg`'s `transformer_file` ("" for none, or e.g.
    "model.diffusion_model.") so that they cover the transformer's diffusers state-dict keys; None when no single
    prefix does (the original layout, another layout) or the file or the folder's config cannot be read."""
    layout = file_layout(cfg)
    return layout.prefix if layout is not None and layout.runs is None else None


def file_layout(cfg) -> _Layout | None:
    """How the keys of the ModelConfig `cfg`'s `transformer_file` reach the diffusers keys: a prefix to strip
    (diffusers layout; `runs` None) or the original layout's row map (`runs`); None when neither works or the file
    or the folder's config cannot be read (the old path reports it)."""
    f = Path(cfg.transformer_file)
    try:
        st = f.stat()
        return _file_layout(str(cfg.path), cfg.family, str(f), st.st_size, st.st_mtime_ns)
    except (OSError, ValueError, KeyError, struct.error):
        return None


@dataclass(frozen=True)
class _Layout:
    prefix: str
    runs: original_layout.Runs | None = None


@functools.lru_cache(maxsize=8)
def _file_layout(path: str, family: str, file: str, size: int, mtime: int) -> _Layout | None:  # noqa: ARG001 - cache keys
    from accelerate import init_empty_weights

    from . import adapter_class

    header = quant._header(file)
    keys = set(header)
    cls = adapter_class(family).transformer_cls
    config = cls.load_config(path, subfolder="transformer", local_files_only=True)
    with init_empty_weights():
        want = {k: v.shape for k, v in cls.from_config(config).state_dict().items()}
    if not want:
        return None
    k0 = next(iter(want))
    candidates = sorted({k[: len(k) - len(k0)] for k in keys if k.endswith(k0)}, key=len)
    for p in candidates:
        if (p == "" or p.endswith(".")) and all(p + k in keys for k in want):
            return _Layout(p)
    m = original_layout.row_map(cls, dict(config), header, want, quant._is_scale_key)
    if m is None:
        return None
    if any(quant._is_scale_key(k) for k in header):  # one per-tensor scale per weight: a single scaled source
        for k, r in m.runs.items():
            if k.endswith(".weight") and len({o for o, _, _ in r}) > 1 and any(
                    m.prefix + o[: -len("weight")] + "scale_weight" in header for o, _, _ in r):
                return None
    return _Layout(m.prefix, m.runs)


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


def empty_transformer(adapter, cfg, dtype: torch.dtype, files: _Files | None = None) -> nn.Module:
    """The family's transformer with placeholders for weights, its blocks quantized per `cfg.quantize` (for an
    fp8 single file with quantize fp8: the Linears `adopt_fp8` would adopt are fp8 with the file's scale)."""
    from accelerate import init_empty_weights

    adapter._check(cfg, {"transformer"})
    config = adapter.transformer_cls.load_config(str(cfg.path), subfolder=adapter.transformer_dir,
                                                 local_files_only=True)
    with init_empty_weights():  # parameters on meta, buffers real (rotary tables and the like)
        tr = adapter.transformer_cls.from_config(config)
    nn.Module.to(tr, dtype)  # torch's, not ModelMixin's (it warns about the fp32 modules kept just below)
    keep = adapter.transformer_cls._keep_in_fp32_modules or []
    if keep and dtype in (torch.float16, torch.bfloat16):  # diffusers' rule: a name part in the list stays fp32
        for n, p in tr.named_parameters():  # (Krea 2's norms), so files load as `from_pretrained` loads them
            if any(m in n.split(".") for m in keep):
                p.data = p.data.to(torch.float32)
    if files is not None and files.fp8 and cfg.quantize == "fp8":
        names = {id(m): n for n, m in tr.named_modules()}
        for b in adapter.blocks(tr):
            _adopt_on_meta(b, names[id(b)], files, dtype, cfg.quantize_modulation, adapter.modulation_linears)
    else:
        quant.quantize_blocks(adapter.blocks(tr), cfg.quantize, cfg.quantize_modulation,  # on meta: shapes, dtypes
                              adapter.modulation_linears)
    if getattr(cfg, "fp8_matmul", False):  # model.fp8_matmul: W8A8 matmuls (a layer attribute)
        quant.use_scaled_mm(tr, True)
    return with_placeholders(tr)


def with_placeholders(module: nn.Module) -> nn.Module:
    """`module` with every `meta` parameter and buffer (quantize's weight_scale) replaced by a placeholder of its
    shape and dtype (see the module essay); returns it."""
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is not None and p.is_meta:
                mod._parameters[name] = nn.Parameter(placeholder(p.shape, p.dtype), requires_grad=p.requires_grad)
        for name, b in mod._buffers.items():
            if b is not None and b.is_meta:
                mod._buffers[name] = placeholder(b.shape, b.dtype)
    return module


def _adopt_on_meta(block: nn.Module, prefix: str, files: _Files, dtype: torch.dtype, modulation: bool,
                   pattern: str) -> None:
    """`quant.adopt_fp8`'s choice for each Linear of one meta `block`, made from the file: adopted (fp8 in the
    file, or a higher-precision weight whose values are all fp8 values: read once here, one tensor), else
    quantized per channel, else (modulation: the family's `pattern`, unless `modulation`) kept in `dtype`. Shapes
    and dtypes only; `tensor` fills them."""
    for name, lin in block.named_modules():
        if type(lin) is not nn.Linear:
            continue
        key = f"{prefix}.{name}.weight"
        if files.dtype(key) == "F8_E4M3" or files.exact_fp8(key, dtype):
            rows = lin.weight.shape[0]
            q = torch.empty(lin.weight.shape, dtype=torch.float8_e4m3fn, device="meta")
            quant._become_quantized(lin, q, torch.empty(rows, device="meta"), dtype)
            files.adopted.add(key)
        elif not quant.keeps_model_dtype(name, modulation, pattern):
            quant.quantize_linear(lin, "fp8")


class _Files:
    """The transformer's safetensors files: key -> file, and one open handle at a time. A folder's files
    (sharded with index.json or not), or one `single` file whose keys carry `prefix`; for an fp8 single file, its
    dtypes and per-tensor scales (`scale_weight`, read once: one number each)."""

    def __init__(self, folder: Path, single: Path | None = None, prefix: str = "",
                 runs: original_layout.Runs | None = None):
        from safetensors import safe_open

        self.label, self.prefix = single or folder, prefix
        self.header: dict[str, dict] = {}
        self.scales: dict[str, float] = {}  # module name -> the file's per-tensor scale
        self.adopted: set[str] = set()  # weight keys kept as the file's fp8 values (_adopt_on_meta)
        # original layout (trainer/models/original_layout.py): diffusers key -> row ranges of the file's tensors
        self.runs = runs
        index = folder / _INDEX
        if single is not None:
            self.header = quant._header(single)
            if runs is not None:
                self.where = dict.fromkeys(runs, single)
            else:
                self.where = {k[len(prefix):]: single for k in self.header if k.startswith(prefix)}
            if any(quant._is_scale_key(k) for k in self.header):
                with safe_open(str(single), framework="pt") as h:
                    self.scales = {k[len(prefix): -len(".scale_weight")]: float(h.get_tensor(k).float().reshape(-1)[0])
                                   for k in self.header if k.endswith(".scale_weight") and k.startswith(prefix)}
        elif index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.where = {k: folder / f for k, f in weight_map.items()}
        else:
            self.where = {}
            for f in sorted(folder.glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as h:
                    self.where.update(dict.fromkeys(h.keys(), f))
        self.fp8 = any(v.get("dtype") == "F8_E4M3" for v in self.header.values())
        self.names: dict[str, str] = {}  # model key -> the file's key where they differ (`renamed`)
        self.plain = False  # read with plain reads, not mmap (`_read_plain`)
        self._path: Path | None = None
        self._handle = None

    @classmethod
    def renamed(cls, folder: Path, where: dict[str, tuple[Path, str]]) -> _Files:
        """The safetensors files of a folder whose keys are not the model's state-dict keys (a transformers
        checkpoint, renamed on load: trainer/captioning/vlm.py `file_names`): `where` maps each model key to its
        file and the file's key (one file key may serve several model keys: a tied head)."""
        files = cls.__new__(cls)
        files.label, files.prefix, files.header, files.scales, files.adopted, files.runs = folder, "", {}, {}, set(), None
        files.where = {k: f for k, (f, _) in where.items()}
        files.names = {k: n for k, (_, n) in where.items() if n != k}
        files.fp8, files._path, files._handle = False, None, None
        files.plain = True
        return files

    def _source(self, key: str) -> str:
        """The file's (unprefixed) key that holds diffusers `key`, or its first row range's (original layout)."""
        return key if self.runs is None or key not in self.runs else self.runs[key][0][0]

    def dtype(self, key: str) -> str | None:
        """The safetensors dtype name of `key` in a single file (None for folders)."""
        return self.header.get(self.prefix + self._source(key), {}).get("dtype")

    def exact_fp8(self, key: str, dtype: torch.dtype) -> bool:
        """Whether `key`, cast to `dtype`, survives the round trip through float8_e4m3fn (adopt_fp8's test)."""
        if key not in self.where:
            return False
        w = self.read(key).to(dtype)  # allocation: one tensor
        return torch.equal(w.to(torch.float8_e4m3fn).to(dtype), w)

    def scale(self, key: str) -> float | None:
        """The per-tensor scale of weight `key` that `quant.file_scales` gives (None: the weight has none)."""
        if not self.scales or self.dtype(key) != "F8_E4M3":
            return None
        return self.scales.get(self._source(key)[: -len(".weight")], 1.0)  # one source: _file_layout checks it

    def read(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        f = self.where.get(key)
        if f is None:
            raise KeyError(key)
        if f != self._path:
            self.close()  # unmaps the previous shard: its file-backed pages leave this process
            self._handle = _PlainFile(f) if self.plain else safe_open(str(f), framework="pt")
            self._path = f
        if self.plain:
            return self._handle.read(self.names.get(key, key))  # allocation: this one tensor
        if self.runs is None:
            return self._handle.get_tensor(self.prefix + self.names.get(key, key))  # allocation: this one tensor
        # original layout: only the rows this tensor is made of (get_slice reads just those bytes)
        parts = [self._rows(o, a, b) for o, a, b in self.runs[key]]
        return parts[0] if len(parts) == 1 else torch.cat(parts)  # allocation: this one tensor (and its parts)

    def _rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        shape = self.header[self.prefix + key]["shape"]
        if not shape or (start == 0 and stop == shape[0]):
            return self._handle.get_tensor(self.prefix + key)
        return self._handle.get_slice(self.prefix + key)[start:stop]

    def close(self) -> None:
        if isinstance(self._handle, _PlainFile):
            self._handle.file.close()
        self._handle = self._path = None


class _PlainFile:
    """One safetensors file read tensor by tensor with ordinary reads into a fresh tensor, not mmap: the file's
    pages stay in the page cache, out of this process's RSS (mmap'd, every page read counts in its RSS until the
    file is unmapped: a whole shard, up to a model's size with one file)."""

    def __init__(self, path: Path):
        self.file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by _Files.close
        (n,) = struct.unpack("<Q", self.file.read(8))
        self.header = json.loads(self.file.read(n))
        self.base = 8 + n

    def read(self, key: str) -> torch.Tensor:
        meta = self.header[key]
        start, stop = meta["data_offsets"]
        t = torch.empty(meta["shape"], dtype=quant.SAFETENSORS_DTYPES[meta["dtype"]])
        buf = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        self.file.seek(self.base + start)
        got = 0
        while got < stop - start:
            n = self.file.readinto(buf[got:])
            if not n:
                raise ValueError(f"{self.file.name}: truncated at {key!r}")
            got += n
        return t


def open_files(cfg, subfolder: str = "transformer") -> _Files:
    """The safetensors files of the ModelConfig `cfg`'s transformer (the folder's `subfolder`: an expert's, or its
    single file)."""
    folder = Path(cfg.path) / subfolder
    single = None if cfg.transformer_file is None else Path(cfg.transformer_file)
    layout = _Layout("") if single is None else file_layout(cfg)
    if layout is None:
        raise UserError(f"{single}: its keys are not the transformer's diffusers keys: it loads through "
                        f"from_single_file (stream_load.supported)")
    try:
        return _Files(folder, single, layout.prefix, layout.runs)
    except (OSError, ValueError, struct.error) as e:
        raise UserError(f"{single or folder}: could not read the safetensors index or headers ({e})") from None


class TransformerLoader:
    """Reads each tensor of an `empty_transformer` from the model's files into place (see the module essay)."""

    def __init__(self, transformer: nn.Module, cfg, dtype: torch.dtype, files: _Files | None = None):
        self.files = files if files is not None else open_files(cfg)
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
            key = self._prefix(module) + "weight"
            if key in self.files.adopted:  # an fp8 file's own values (quant.adopt_fp8)
                if name == "weight":
                    t = self.files.read(key)
                    if t.dtype == torch.float8_e4m3fn:
                        # The file's bytes as they are. The whole path's casts (to the model dtype and back) are
                        # the identity on every e4m3 value (bf16 holds them all; only -NaN comes back as NaN) and
                        # cost ~0.06 G values/s on one core: over 4 minutes of Flux.2-dev's load at torchrun's
                        # one thread a process.
                        return t
                    return t.to(module.compute_dtype).to(torch.float8_e4m3fn)
                s = self.files.scale(key)
                return torch.full((module.out_features,), 1.0 if s is None else s)
            if name == "weight_scale" and id(module) in self._scales:
                return self._scales.pop(id(module))
            mode = "fp8" if module.weight.dtype == torch.float8_e4m3fn else "int8"
            # as the old path: quantize the model-dtype weight (row slices of it: the same values, smaller temporaries)
            q, scale = quant.quantize_rows(self.files.read(key), mode, module.compute_dtype)
            if name == "weight":
                self._scales[id(module)] = scale
                return q
            return scale
        key = self._prefix(module) + name
        if key not in self.files.where:
            if not is_placeholder(current):
                return current  # a buffer the model computes itself (not in the file)
            raise UserError(f"{self.files.label}: no weight {key!r} in the safetensors files (a different "
                            f"{type(module).__name__} layout?)")
        t = self._read(key, current.dtype)
        s = self.files.scale(key) if name == "weight" else None
        if s is not None and s != 1.0:  # a scaled fp8 weight kept in the model dtype (quant._apply_scales)
            t = t.mul_(torch.full((t.shape[0],), s).to(t.dtype)[:, None])
        return t

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

    def release(self, module: nn.Module, skip: list[nn.Module] = ()) -> int:
        """The inverse of `place` for what does not train: every frozen parameter of `module` outside the `skip`
        modules that the files hold becomes a placeholder again (no bytes; `place` reads it back, the same values).
        Returns the bytes given back."""
        skipped = {id(m) for m in skip}
        freed = 0

        def visit(m: nn.Module) -> None:
            nonlocal freed
            if id(m) in skipped:
                return
            for name, p in m._parameters.items():
                if p is not None and not p.requires_grad and not is_placeholder(p) \
                        and self._prefix(m) + name in self.files.where:
                    freed += p.numel() * p.element_size()
                    p.data = placeholder(p.shape, p.dtype)
            for child in m.children():
                visit(child)

        visit(module)
        return freed

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
    trim_heap()


def trim_heap() -> None:
    """glibc `malloc_trim(0)` alone (no garbage collection: for callers whose tensors are already freed): the free
    pages inside the heap go back to the OS. Tensors under glibc's mmap threshold (at most 32 MB, raised as
    mmapped chunks are freed) live in the heap, and what is freed there stays resident: a switch of experts moves
    one expert's LoRA and AdamW moments (Wan 14B rank 16: 0.92 GB in 2,400 tensors of 0.3-0.9 MB) to the CPU and
    frees the other's, and without a trim the process holds both sets' pages from the first switch on (simulated on
    the CPU with those tensor shapes, 0.21 GB a set: RssAnon one set above the live bytes after each of 8 switches
    without a trim, at them with one)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def load(adapter, cfg, dtype: torch.dtype, device: torch.device, stream_blocks: bool):
    """The transformer with its non-block weights on `device`, and its blocks too unless `stream_blocks` (then
    they keep placeholders until the conductor's `fill`). Returns (transformer, loader or None)."""
    files = open_files(cfg, adapter.transformer_dir)
    if files.fp8 and cfg.quantize == "int8":  # quant.prepare_transformer's refusal, before a weight is read
        raise UserError(f"{cfg.transformer_file} holds float8 weights: use model.quantize: fp8 (kept as they are) "
                        f"or none (up-cast to model.dtype), not int8")
    tr = empty_transformer(adapter, cfg, dtype, files)
    loader = TransformerLoader(tr, cfg, dtype, files)
    try:
        loader.place(tr, device, skip=adapter.blocks(tr) if stream_blocks else ())
    except (OSError, ValueError) as e:  # a truncated or mismatched file
        raise UserError(f"{cfg.path}: could not load the {adapter.family} transformer: {e}") from e
    if not stream_blocks:
        loader.close()
        return tr, None
    return tr, loader
