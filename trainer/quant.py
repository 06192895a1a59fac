"""Quantized frozen base: 8-bit Linear weights that are stored, pinned, streamed and kept on the GPU as 8 bits.

How. `quantize_module(block, "fp8" | "int8")` turns each eligible `nn.Linear` of a block into a `QuantizedLinear`
in place, by swapping the instance's class: the module stays an `nn.Linear` (peft's LoRA dispatch checks
`isinstance(layer, nn.Linear)`), keeps its name and its `weight` / `bias` state-dict keys, and gains one buffer,
`weight_scale`. `weight` becomes a frozen Parameter of dtype `float8_e4m3fn` or `int8`, one scale per output
channel (fp32): w ~= weight * weight_scale[:, None]. Symmetric absmax scaling maps each row's largest |w| onto the
format's largest value (448 for e4m3fn, 127 for int8). The offload packer (`trainer/offload/allocators.py`)
packs every parameter and buffer of a block, of any dtype, into one byte range, so the quantized weight and its
scale live in the pinned arena, cross PCIe and sit in the ring as 8-bit bytes with no change to the conductor.

Forward is dequantize-then-matmul: `weight.to(x.dtype) * weight_scale[:, None]` (exact up-cast, then one rounding
of the product), then `F.linear`. The dequantized matrix is a temporary of the compute dtype, one Linear at a
time: it costs one layer's bf16 weight in activation memory, never the block's.

fp8 matmuls (W8A8, `model.fp8_matmul`). With the switch an fp8 Linear multiplies in fp8: the weight as
it is stored (e4m3fn, its per-output-channel scale as the row-wise `scale_b`), the bf16 activations quantized per
row on the fly (absmax / 448, `scale_a`), `torch._scaled_mm` with a bf16 output, the bias added apart. Hopper's
fp8 tensor cores run twice the bf16 rate; the cost is the activations' rounding to e4m3 (relative error <= 2^-4
per element, the same order as the weight's). Under `train.compile` the per-row quantization fuses into one
kernel with its neighbours. Backward (the gradient a LoRA upstream needs; the weight is frozen) multiplies by
the dequantized weight in bf16, as the default path does. The LoRA branch beside the layer (peft's wrapper
around it) stays in bf16. Where torch has no fp8 matmul for the input (a CUDA GPU before sm89, an input that is
not bf16, widths not multiples of 16) the layer falls back to dequantize-then-matmul, so the switch never fails
a run. The switch is per layer (`use_scaled_mm(module, on)`, set by the loaders from the config); env
`DITTRAIN_SCALED_MM=1` / `set_scaled_mm(True)` is the process-wide default for layers the config did not set.
Off by default until measured faster (bench/speed/bench_speed.py).

Which modules. Only Linears inside the family's blocks (`adapter.blocks`): attention projections, MLPs and the
blocks' output projections, i.e. nearly all the bytes. Embedders, the final layer, norms and biases stay in the
model dtype. So do, by default, the modulation Linears (each family declares which: its adapter's
`modulation_linears`, e.g. `norm*.linear` in Flux / SD3, `*_mod.1` in Qwen-Image):
they set per-sample scale, shift and gate, where an error acts on every token. They are big, though: 3.2 B of
Flux's 12 B parameters (27 % of its block bytes) and 6.8 B of Qwen-Image's 20 B, because each maps the time
embedding to six (double block) or three (single block) model-width vectors. `modulation=True`
(`model.quantize_modulation`) quantizes them like the rest, per output channel, which makes each of those vectors
an fp8 / int8 rounding of itself: Flux's fp8 blocks go from 15.08 to 11.85 GB, Qwen-Image's from 27.2 to 20.4 GB.
Measured on random full-width blocks on the CPU (bench/diag/quant_block_error.py, bench/history/2026-11-23.md): the modulation
output's error against fp32 goes from 0.3 % (bf16) to 2.6 % (fp8) / 0.9 % (int8), and the block update's error from
about 4 % to about 5 % in fp8 (1.5 % to 1.9 % in int8); real weights, with their outlier channels, are not measured
yet. Text encoders (`model.quantize_text_encoders`) quantize every Linear they have but the ones their family
keeps (`text_encoder_keep_linears`: T5's `wo`, whose input transformers casts to the weight's dtype, and an unused
language-model head). Callers pass their family's pattern: this module never reads the family registry.

Why plain torch dtypes, not torchao / optimum-quanto. Both represent a quantized weight as a wrapper tensor
subclass (torchao `AffineQuantizedTensor` / `Float8Tensor`, quanto `QBytesTensor`) whose bytes live in inner
tensors (`_data`, `_scale`). The offload packer re-points `param.data` at a view of a uint8 arena region; a wrapper
subclass has no storage of its own to view, so it can neither be packed nor streamed without teaching the
conductor about each library's internals. A float8 / int8 Parameter plus a scale buffer are ordinary tensors.

Frozen only. LoRA adapters on top stay full precision (peft creates them in `compute_dtype`, the model dtype,
like on a bf16 base; the trainer then keeps them fp32). Full fine-tuning of a quantized base is refused by the
config. Single-file fp8 checkpoints (`float8_e4m3fn` weights, optionally per-tensor `scale_weight`) are taken as
they are: `adopt_fp8` keeps the file's 8-bit values and its scale instead of quantizing again.

Left out: fp8 matmuls in backward (the `_scaled_mm` path quantizes activations only in forward: an fp8
gradient matmul would need the weight transposed in memory, a copy as large as the dequantized one), fp8 e5m2,
int4, and quantizing non-block modules (the final layer's modulation `norm_out.linear` included). The planner
counts an fp8 file's blocks as the switch says, not as the file holds them.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("none", "fp8", "int8")
_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
_QMAX = {"fp8": 448.0, "int8": 127.0}

#: a pattern of Linear names: a regular expression (string or compiled), matched with `re.search` against the
#: name relative to its block / text encoder with a "." appended; "" matches none. The families declare theirs on
#: their adapters (`ModelAdapter.modulation_linears`, `text_encoder_keep_linears`), which the callers pass
Pattern = str | re.Pattern


def _pattern(pattern: Pattern) -> re.Pattern:
    return re.compile(pattern or r"(?!)") if isinstance(pattern, str) else pattern

_scaled_mm = os.environ.get("DITTRAIN_SCALED_MM", "0") == "1"


def set_scaled_mm(on: bool) -> None:
    """Use `torch._scaled_mm` for fp8 Linears on CUDA devices that have it (process-wide switch)."""
    global _scaled_mm
    _scaled_mm = bool(on)


def quantize(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) weight -> (8-bit weight, fp32 per-output-channel scale). All-zero rows get scale 1."""
    if w.is_meta:  # the planner's and the streamed loader's meta models: the same shapes and dtypes, no arithmetic
        # (torch runs most meta kernels in Python: the six ops below took ~10 ms a Linear, 20-50 s for a 2k-Linear model)
        return (torch.empty(w.shape, dtype=_DTYPES[mode], device="meta"),
                torch.empty(w.shape[0], dtype=torch.float32, device="meta"))
    w32 = w.detach().float()
    amax = w32.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / _QMAX[mode], torch.ones_like(amax))
    q = w32 / scale[:, None]
    if mode == "int8":
        q = q.round_().clamp_(-127, 127)
    return q.to(_DTYPES[mode]), scale


#: output rows `quantize_rows` quantizes at a time
QUANTIZE_ROWS = 4096


def quantize_rows(w: torch.Tensor, mode: str, dtype: torch.dtype, rows: int = QUANTIZE_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize(w.to(dtype), mode)`, `rows` output rows at a time: the same values (each row is scaled by its own
    maximum), the model-dtype and fp32 temporaries those of a slice, not of the whole weight (a 152k-row head: 3 x
    2.2 GB in fp32 at once)."""
    if w.shape[0] <= rows:
        return quantize(w.to(dtype), mode)
    q = torch.empty(w.shape, dtype=_DTYPES[mode], device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for i in range(0, w.shape[0], rows):
        q[i:i + rows], scale[i:i + rows] = quantize(w[i:i + rows].to(dtype), mode)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight in `dtype`: exact up-cast of the 8-bit values, then one rounding of the product, scaled in place
    (allocation: one temporary of the weight's size, not an up-cast and a product)."""
    return q.to(dtype, copy=True).mul_(scale.to(dtype)[:, None])


class _ScaledMM(torch.autograd.Function):
    """fp8 x fp8 matmul with row-wise scales in forward; backward w.r.t. the input through the dequantized
    weight (the weight itself is frozen)."""

    @staticmethod
    def forward(ctx, x, q, scale, bias):
        x2 = x.reshape(-1, x.shape[-1])
        xs = (x2.abs().amax(dim=1, keepdim=True).float() / 448.0).clamp_(min=1e-12)  # allocation: (M, 1)
        xq = (x2.float() / xs).to(torch.float8_e4m3fn)  # allocation: the activations in fp8
        out = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=scale.float().view(1, -1), out_dtype=x.dtype)
        if bias is not None:  # added apart: not every torch build takes a bias with row-wise scales
            out = out + bias
        ctx.save_for_backward(q, scale)
        ctx.x_shape, ctx.dtype = x.shape, x.dtype
        return out.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, g):
        q, scale = ctx.saved_tensors
        gx = g @ dequantize(q, scale, ctx.dtype)
        return gx.view(ctx.x_shape), None, None, None


def _device_has_fp8_mm(x: torch.Tensor) -> bool:
    """torch has an fp8 matmul for tensors on this device: the CPU's kernel, or a CUDA GPU of sm89 or later."""
    if x.device.type == "cpu":
        return True
    if x.device.type != "cuda":
        return False
    key = x.device.index if x.device.index is not None else torch.cuda.current_device()
    ok = _FP8_DEVICES.get(key)
    if ok is None:
        ok = _FP8_DEVICES[key] = torch.cuda.get_device_capability(key) >= (8, 9)
    return ok


_FP8_DEVICES: dict[int, bool] = {}


def _scaled_mm_ok(x: torch.Tensor, q: torch.Tensor, on: bool) -> bool:
    return (
        on and q.dtype == torch.float8_e4m3fn and x.dtype == torch.bfloat16
        and q.shape[0] % 16 == 0 and q.shape[1] % 16 == 0 and _device_has_fp8_mm(x)
    )


def use_scaled_mm(module: nn.Module, on: bool) -> int:
    """Route every fp8 Linear of `module` to the fp8 matmul (`on`) or to dequantize-then-matmul; returns how many
    layers are fp8. Per layer, so one process can hold both (benchmarks); `model.fp8_matmul` sets it."""
    n = 0
    for m in module.modules():
        if isinstance(m, QuantizedLinear) and m.weight.dtype == torch.float8_e4m3fn:
            m.scaled_mm = bool(on)
            n += 1
    return n


class QuantizedLinear(nn.Linear):
    """An `nn.Linear` whose frozen `weight` is 8-bit with a per-output-channel `weight_scale` buffer. Made only by
    `quantize_linear` / `adopt_fp8` (class swap of an existing Linear); see the module essay."""

    weight_scale: torch.Tensor
    #: the dtype the layer computes in (peft creates LoRA weights in it, as bitsandbytes layers do)
    compute_dtype: torch.dtype
    #: fp8 matmul for this layer (`use_scaled_mm`); None: the process-wide default (`set_scaled_mm`)
    scaled_mm: bool | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        on = _scaled_mm if self.scaled_mm is None else self.scaled_mm
        if _scaled_mm_ok(x, self.weight, on):
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return _ScaledMM.apply(x, self.weight, self.weight_scale, bias)
        # allocation: one dequantized weight of this layer, freed after the matmul
        return F.linear(x, dequantize(self.weight, self.weight_scale, x.dtype), self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", weight={self.weight.dtype}"


def _become_quantized(lin: nn.Linear, q: torch.Tensor, scale: torch.Tensor, compute_dtype: torch.dtype) -> None:
    lin.weight = nn.Parameter(q, requires_grad=False)
    lin.register_buffer("weight_scale", scale.to(device=q.device, dtype=torch.float32))
    lin.compute_dtype = compute_dtype
    lin.__class__ = QuantizedLinear


def quantize_linear(lin: nn.Linear, mode: str) -> None:
    """Quantize one Linear in place (see the module essay)."""
    if isinstance(lin, QuantizedLinear):
        return
    if lin.weight.requires_grad:
        lin.weight.requires_grad_(False)
    dtype = lin.weight.dtype
    q, scale = quantize(lin.weight, mode)
    _become_quantized(lin, q, scale, dtype)


def is_modulation(name: str, pattern: Pattern) -> bool:
    """Whether the Linear called `name` inside a block is a modulation Linear (see the essay): `pattern` is the
    family's `modulation_linears`."""
    return bool(_pattern(pattern).search(name + "."))


def keeps_model_dtype(name: str, modulation: bool, pattern: Pattern) -> bool:
    """Whether the block Linear called `name` stays in the model dtype: a modulation Linear (`pattern`, as in
    `is_modulation`), unless `modulation` (`model.quantize_modulation`). The one rule for quantizing, adopting fp8
    files and the streamed loader."""
    return not modulation and is_modulation(name, pattern)


def quantize_module(module: nn.Module, mode: str, text_encoder: bool = False, modulation: bool = False, *,
                    keep: Pattern) -> int:
    """Quantize the Linears of one block (or, with `text_encoder`, of a whole text encoder) in place; returns
    how many. `mode` "none" does nothing. `modulation` quantizes a block's modulation Linears too
    (`model.quantize_modulation`). `keep`: the family's pattern of the Linears left alone (`modulation_linears`
    for a block, `text_encoder_keep_linears` for a text encoder). One Linear at a time: the peak is one layer's
    fp32 copy."""
    if mode == "none":
        return 0
    if mode not in _DTYPES:
        raise ValueError(f"quantize mode {mode!r}: choose from {MODES}")
    text_keep = _pattern(keep) if text_encoder else None

    def kept(name: str) -> bool:
        return bool(text_keep.search(name + ".")) if text_keep else keeps_model_dtype(name, modulation, keep)

    linears = [m for name, m in module.named_modules() if type(m) is nn.Linear and not kept(name)]
    for lin in linears:
        quantize_linear(lin, mode)
    return len(linears)


def describe(mode: str, modulation: bool, dtype: str, fp8_matmul: bool = False) -> str:
    """How the frozen base is held, in words, for the fit log and `dittrain plan`: `dtype` alone, or the 8-bit
    format with its per-channel scales, whether the modulation Linears are 8-bit too, and what the matmuls run in
    (`fp8_matmul`: fp8 forward matmuls where the GPU has them)."""
    if mode == "none":
        return f"base {dtype}"
    fmt = "fp8 e4m3" if mode == "fp8" else "int8"
    mod = "modulation too" if modulation else f"modulation in {dtype}"
    how = (f"forward matmuls in fp8 (activations rounded per row; {dtype} where the GPU has no fp8 matmul)"
           if fp8_matmul else f"computed in {dtype}")
    return f"base block Linears {fmt} with per-channel fp32 scales ({mod}; the rest {dtype}), {how}"


def quantize_blocks(blocks: list[nn.Module], mode: str, modulation: bool, pattern: Pattern) -> int:
    """`quantize_module` over a transformer's blocks, one block after another (`pattern`: the family's
    `modulation_linears`)."""
    return sum(quantize_module(b, mode, modulation=modulation, keep=pattern) for b in blocks)


# ---------------------------------------------------------------------------------------------- fp8 files


#: a safetensors header's dtype names (its "dtype" field), as torch dtypes
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I8": torch.int8, "U8": torch.uint8,
    "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}


def _header(path: str | Path) -> dict[str, dict]:
    """Tensor name -> {"dtype": "F8_E4M3" | "BF16" | ..., "shape": [...]} from the safetensors header alone."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def is_fp8_file(path: str | Path) -> bool:
    return any(v["dtype"] == "F8_E4M3" for v in _header(path).values())


def _is_scale_key(k: str) -> bool:
    return k.endswith(".scale_weight") or k == "scaled_fp8"


def single_file_source(path: str | Path) -> str | dict[str, torch.Tensor]:
    """What to hand diffusers' `from_single_file`: the path, or, for a scaled fp8 file, its tensors (memory-mapped,
    as diffusers itself loads them) without the `scale_weight` / `scaled_fp8` keys, which would stop diffusers
    from recognising diffusers-named keys. The scales are applied after loading (`prepare_transformer`)."""
    if not any(_is_scale_key(k) for k in _header(path)):
        return str(path)
    from safetensors.torch import load_file

    return {k: v for k, v in load_file(str(path)).items() if not _is_scale_key(k)}


def file_scales(path: str | Path, transformer: nn.Module) -> dict[str, torch.Tensor]:
    """Module name -> per-output-row fp32 scale of every fp8 weight of a file (all ones where a weight has no
    `scale_weight`); empty for an unscaled file. Diffusers-named files map directly; files in the original naming
    (BFL, Stability) go through `convert_scales`."""
    from safetensors import safe_open

    header = _header(path)
    with safe_open(str(path), framework="pt") as f:
        per_tensor = {k[: -len(".scale_weight")]: float(f.get_tensor(k).float().reshape(-1)[0])
                      for k in header if k.endswith(".scale_weight")}
    if not per_tensor:
        return {}
    rows = {k: (v["shape"] or [1])[0] for k, v in header.items() if not _is_scale_key(k)}
    fp8 = {k for k, v in header.items() if v["dtype"] == "F8_E4M3"}
    mods = dict(transformer.named_modules())
    if all(name in mods for name in per_tensor):
        return {k[: -len(".weight")]: torch.full((rows[k],), per_tensor.get(k[: -len(".weight")], 1.0))
                for k in fp8 if k.endswith(".weight")}
    return convert_scales(type(transformer), dict(transformer.config), rows, fp8, per_tensor)


def convert_scales(transformer_cls: type, config: dict, rows: dict[str, int], fp8: set[str],
                   per_tensor: dict[str, float]) -> dict[str, torch.Tensor]:
    """Scales of an original-format file, renamed and split exactly as diffusers converts its weights: every
    tensor of the file becomes a vector with one entry per output row (its scale for fp8 weights, NaN for other
    tensors) and goes through the family's own key converter, which renames, splits (fused qkv), concatenates and
    reorders (scale/shift) along that first axis only. Costs a few floats per row, never a weight."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    entry = SINGLE_FILE_LOADABLE_CLASSES.get(transformer_cls.__name__)
    if entry is None:
        raise ValueError(f"scaled fp8 file in non-diffusers key names: diffusers has no converter for "
                         f"{transformer_cls.__name__}")
    nan = float("nan")
    fake = {k: torch.full((n,), per_tensor.get(k[: -len(".weight")], 1.0) if k in fp8 else nan)
            for k, n in rows.items()}
    out = entry["checkpoint_mapping_fn"](checkpoint=fake, config=config)
    return {k[: -len(".weight")]: v.float() for k, v in out.items()
            if k.endswith(".weight") and not torch.isnan(v).any()}


def adopt_fp8(module: nn.Module, scales: dict[str, torch.Tensor], prefix: str, compute_dtype: torch.dtype,
              modulation: bool, pattern: Pattern) -> int:
    """Turn the Linears of one block, loaded from an fp8 file (diffusers up-casts e4m3fn exactly), back into fp8
    without quantizing again: the 8-bit values are the file's, the scale is the file's per-tensor `scale_weight`
    (`file_scales`; 1 when absent) on every output row. `prefix` is the block's name in the transformer. A weight
    that is not exactly an fp8 value (the file had it in higher precision) is quantized per channel instead,
    unless it is a modulation Linear (`pattern`, see the essay) and `modulation` is off: then it keeps the model
    dtype.
    A modulation weight the file holds in fp8 is adopted either way (its values are the file's; up-casting would
    only spend bytes). Returns how many Linears were adopted as they are."""
    kept = 0
    for name, lin in module.named_modules():
        if type(lin) is not nn.Linear:  # modulation too: its values are the file's fp8 ones either way
            continue
        w = lin.weight.detach()
        q = w.to(torch.float8_e4m3fn)
        if torch.equal(q.to(w.dtype), w):
            s = scales.get(f"{prefix}.{name}")
            lin.weight.requires_grad_(False)
            _become_quantized(lin, q, torch.ones(w.shape[0]) if s is None else s, compute_dtype)
            kept += 1
        elif not keeps_model_dtype(name, modulation, pattern):
            quantize_linear(lin, "fp8")
    return kept


def prepare_transformer(transformer: nn.Module, blocks: list[nn.Module], mode: str, dtype: torch.dtype,
                        file: str | Path | None, modulation: bool, pattern: Pattern) -> None:
    """What loading does after diffusers built the transformer in `dtype`: quantize the blocks one by one (their
    modulation Linears, the family's `pattern`, too with `modulation`), or, for an fp8 `file`, keep its 8-bit
    values and apply its per-tensor scales (see `adopt_fp8`)."""
    fp8_file = file is not None and is_fp8_file(file)
    if not fp8_file:
        quantize_blocks(blocks, mode, modulation, pattern)
        return
    if mode == "int8":
        raise ValueError(f"{file} holds float8 weights: use model.quantize: fp8 (kept as they are) or none "
                         f"(up-cast to model.dtype), not int8")
    scales = file_scales(file, transformer)
    if mode == "fp8":
        names = {id(m): n for n, m in transformer.named_modules()}
        for b in blocks:
            adopt_fp8(b, scales, names[id(b)], dtype, modulation, pattern)
    _apply_scales(transformer, scales)


def _apply_scales(transformer: nn.Module, scales: dict[str, torch.Tensor]) -> None:
    """Multiply scaled-fp8 weights that stay in the model dtype (outside the quantized blocks, or with quantize
    none) by their scale, so that every weight means what the file says."""
    mods = dict(transformer.named_modules())
    with torch.no_grad():
        for name, s in scales.items():
            m = mods[name]
            if isinstance(m, QuantizedLinear):  # the scale is its weight_scale
                continue
            if not torch.all(s == 1):
                m.weight.mul_(s.to(m.weight.dtype)[:, None])
