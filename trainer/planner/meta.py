"""A model's sizes without its weights: the transformer's config, the transformer (with LoRA) built on the meta
device, the text encoders' bytes and the optimizer state's bytes.

Configs and text-encoder sizes come from the model folder (`transformer/config.json`, the text encoders'
safetensors headers) when it is at hand; otherwise from the family's adapter (`full_config`,
`text_encoder_params` in trainer/models/), which is how presets and `dittrain plan` size full-size models; a
missing folder whose name contains another published size's name (`preset_variants`: Wan2.1-T2V-1.3B) plans that
size's config, as that size's presets name it in model.path.

What of a text encoder reaches RAM and the GPU (`text_encoder_sizes`): from a folder, the encoder is built on the
meta device from its own config.json exactly as the loader builds it (the family's `text_encoder_config`, then
`slim_text_encoder`) and split into the blocks the placement streams (`text_encoder_blocks`) and the rest. Without
a folder, the family's declared shares of its full-size encoder say the same (`shared_sizes`). Applying the
full-size shares to a folder's own bytes was wrong where the folder already lacks a part the shares remove: the
bench's Flux.2-dev folder has 31 of Mistral-3's 40 layers, and the shares took the 9 unloaded layers off a second
time, 3.2 GB under the measured text-caching peak at offload.text_encoders 0.45 (bench/history/2026-11-25.md, 2026-11-25).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..dtypes import DTYPES
from ..errors import UserError
from ..lora_format.kinds import LORA_KINDS
from ..models import adapter_class
from ..offload.plan import capacity_for
from ..optim.specs import optimizer_spec, state_bytes, state_layout


def transformer_class(family: str) -> type:
    """The family's diffusers transformer class, from its model adapter (the single place that names it)."""
    return adapter_class(family).transformer_cls


def default_lora_targets(family: str, references: int = 0) -> tuple[str, ...]:
    """The family's default LoRA targets, from its model adapter (with `references` reference images per target:
    `ModelAdapter.lora_targets`)."""
    return adapter_class(family)(references=references).lora_targets()


def meta_transformer(family: str, config: dict, dtype: torch.dtype) -> nn.Module:
    """The transformer on the meta device (no memory), parameters in `dtype` but the modules diffusers keeps in
    fp32 (`_keep_in_fp32_modules`: Krea 2's and Flux.3's norms), as the loader builds it
    (trainer/models/stream_load.py)."""
    cls = transformer_class(family)
    known = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.device("meta"):
        model = cls.from_config(known)
    nn.Module.to(model, dtype)  # torch's: ModelMixin's warns on the user's terminal that it casts those modules
    keep = cls._keep_in_fp32_modules or []
    if keep and dtype in (torch.float16, torch.bfloat16):  # diffusers' rule: a name part in the list stays fp32
        for n, p in model.named_parameters():
            if any(m in n.split(".") for m in keep):
                p.data = p.data.to(torch.float32)
    return model


def blocks_of(family: str, transformer: nn.Module, references: int = 0) -> list[nn.Module]:
    """Blocks in execution order, from the family's adapter (the units offloading streams), for a run with
    `references` reference images per target."""
    return adapter_class(family)(references=references).blocks(transformer)


class _ComputeDtypeLora:
    """The trainer's LoRA forward under `lora.compute_dtype: auto` (trainer/train/model.py `ComputeDtypeLora`, which
    the planner may not import: tests/test_layout.py), swapped onto the meta model's peft LoRA Linears: the branch
    runs in the input's dtype, the fp32 matrices cast at use, so autograd saves the layer's bf16 input and the two
    cast matrices (peft's own forward saves an fp32 copy of the input). The LoRA Linears are still called as
    modules (`functional_call` with the cast weight), so the trace's matmul counting sees them.
    tests/test_planner_saved.py compares the bytes saved with the trainer's class."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        from torch.func import functional_call

        result = self.base_layer(x, *args, **kwargs)
        out_dtype = result.dtype
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            a, b = self.lora_A[name], self.lora_B[name]
            h = functional_call(a, {"weight": a.weight.to(x.dtype)}, (self.lora_dropout[name](x),))
            result = result + functional_call(b, {"weight": b.weight.to(x.dtype)}, (h,)) * self.scaling[name]
        return result.to(out_dtype)


_SWAPPED: dict[type, type] = {}


def add_meta_lora(transformer: nn.Module, targets: tuple[str, ...], rank: int, alpha: float,
                  compute_in_input_dtype: bool = False, *, kind: str = "lora", dora: bool = False) -> int:
    """Inject the adapter of LoRA kind `kind` as the trainer does (the kind's peft config, trainer/lora_format/kinds.py;
    fp32 weights) on the meta model; returns its parameter count. `compute_in_input_dtype`: the branch in the
    activations' dtype, as the trainer runs plain LoRA under `lora.compute_dtype: auto` (`_ComputeDtypeLora`); else
    peft's forward (compute_dtype fp32, DoRA, LoKr, LoHa). Dropout is left out (it saves no more here)."""
    from types import SimpleNamespace

    from peft import inject_adapter_in_model
    from peft.tuners.lora import Linear as LoraLinear

    section = SimpleNamespace(rank=rank, alpha=alpha, dropout=0.0, dora=dora)  # the fields of config.LoraConfig it reads
    with torch.device("meta"):
        inject_adapter_in_model(LORA_KINDS[kind].build(section, list(targets)), transformer)
    n = 0
    for p in transformer.parameters():
        if p.requires_grad:  # the adapter's (peft marks only its own trainable)
            p.data = p.data.float()
            n += p.numel()
    if compute_in_input_dtype:
        for m in transformer.modules():
            if isinstance(m, LoraLinear) and not isinstance(m, _ComputeDtypeLora):
                cls = type(m)
                if cls not in _SWAPPED:
                    _SWAPPED[cls] = type(f"Meta{cls.__name__}", (_ComputeDtypeLora, cls), {})
                m.__class__ = _SWAPPED[cls]
    return n


def optimizer_state_bytes(name: str, params, masters: bool = False) -> int:
    """Bytes of optimizer state for `params`, fp32 as trainer/optim keeps it: what the optimizer's spec says it keeps
    per parameter (trainer/optim/specs.py `state`; checked against a real step there), and with `masters`
    (optimizer.master_weights) 4 bytes per bf16/fp16 parameter for its fp32 master, kept in the same state. The
    same in pinned RAM (trainer/optim StateOffload's buffers are exactly sized: trainer/offload `pinned_exact`)."""
    return state_bytes(name, params, masters)


def packed_state_layout(name: str, masters: bool = False):
    """p -> {state name: (shape, dtype)} of the optimizer state the trainer packs beside each streamed weight
    (trainer/optim FusedBackPass.state_layout: the spec's `state`, and the fp32 master with `masters`), or None when
    the trainer keeps that optimizer's state in RAM instead (a spec that is not `packed`: 8-bit AdamW's layout is not
    known before a step)."""
    if not optimizer_spec(name).packed:
        return None
    return functools.partial(state_layout, name, masters=masters)


def transformer_config(cfg) -> tuple[dict, str]:
    path = Path(cfg.model.path) / "transformer" / "config.json"
    if path.is_file():
        try:
            return json.loads(path.read_text()), str(path)
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"{path}: cannot read the transformer config ({e})") from None
    cls = adapter_class(cfg.model.family)
    root = Path(cfg.model.path)
    why = (f"model.path {root} does not exist" if not root.exists()
           else f"{path} not found")
    size = cls.size_named(root.name)  # a folder named after another published size (Wan2.1-T2V-1.3B): that size
    if size is not None:
        cls = cls.sized(size)
        return dict(cls.full_config), (f"NOT your model: {why}, so this plans the built-in {cls.full_name} config "
                                       "(model.path's folder name names that size); point model.path at your model folder "
                                       "to plan that")
    return dict(cls.full_config), (f"NOT your model: {why}, so this plans the built-in full-size {cfg.model.family} "
                                   "config (the published model's sizes); point model.path at your model folder to "
                                   "plan that")


def text_encoder_bytes(cfg) -> list[tuple[str, int]]:
    """(name, bytes in the model dtype): from safetensors headers when the folder has them, else built in."""
    nbytes = torch.tensor([], dtype=DTYPES[cfg.model.dtype]).element_size()
    root = Path(cfg.model.path)
    found = []
    for d in sorted(root.glob("text_encoder*")):
        numel = 0
        for f in d.glob("*.safetensors"):
            with open(f, "rb") as fh:
                header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
            numel += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
        if numel:
            found.append((d.name, numel * nbytes))
    if found:
        return found
    return [(name, n * nbytes) for name, n in adapter_class(cfg.model.family).text_encoder_params]


#: streamed blocks per text encoder the shares assume when a family does not declare `text_encoder_layers`
DEFAULT_TEXT_BLOCKS = 24


@dataclass(frozen=True)
class TextEncoderSize:
    """One text encoder's bytes in the model dtype, as the run holds them while captions are encoded."""

    name: str
    loaded: float  #: in CPU RAM as loaded (without what `text_encoder_config` never builds)
    outside: float  #: on the GPU outside the streamed blocks (embeddings, final norm)
    blocks: tuple[float, ...]  #: the streamed blocks (`text_encoder_blocks`), execution order, after slimming

    @property
    def gpu(self) -> float:
        """Bytes placed on the GPU when nothing streams."""
        return self.outside + sum(self.blocks)

    def on_gpu(self, fraction: float) -> float:
        """Bytes on the GPU at offload.text_encoders `fraction`: the non-block bytes and the ring of the blocks
        (`capacity_for`: whole blocks, as the conductor rounds them)."""
        if fraction <= 0 or not self.blocks:
            return self.gpu
        return self.outside + capacity_for(list(self.blocks), fraction)


def _share(counts: tuple[int, ...], i: int, params: int) -> float:
    return counts[i] / params if i < len(counts) and params else 0.0


#: share of a text encoder's bytes outside its blocks when the family declares none (T5-XXL's embedding: 2.8 %)
TEXT_NONBLOCK_SHARE = 0.03


def shared_sizes(family: str, text_encoders: list[tuple[str, int]]) -> list[TextEncoderSize]:
    """Sizes from the family's facts about its full-size encoders, as shares (parameters `text_encoder_config`
    never builds, parameters `slim_text_encoder` drops, parameters outside the streamed blocks) of `text_encoders`'
    bytes, in `text_encoder_layers` equal blocks (24 where undeclared). Right for the full-size encoder; the
    planner uses it only where there is no folder to build the encoder from."""
    cls = adapter_class(family)
    out = []
    for i, (name, nbytes) in enumerate(text_encoders):
        params = cls.text_encoder_params[i][1] if i < len(cls.text_encoder_params) else 0
        nonblock = (_share(cls.text_encoder_nonblock_params, i, params) if i < len(cls.text_encoder_nonblock_params)
                    else TEXT_NONBLOCK_SHARE)
        outside = nbytes * nonblock
        kept = nbytes * (1.0 - _share(cls.text_encoder_unused_params, i, params))
        n = cls.text_encoder_layers[i] if i < len(cls.text_encoder_layers) else DEFAULT_TEXT_BLOCKS
        loaded = nbytes * (1.0 - _share(cls.text_encoder_unloaded_params, i, params))
        out.append(TextEncoderSize(name, loaded, outside, ((kept - outside) / n,) * n))
    return out


def _built_size(cfg, i: int, folder: Path) -> TextEncoderSize | None:
    """Text encoder `i` built on the meta device from the folder's config as the loader builds it
    (trainer/models/_diffusers.py `load`); None where the family names no transformers class for it or the
    folder has no readable config (the shares then apply)."""
    import transformers

    from ..models.base import text_encoder_blocks

    cls = adapter_class(cfg.model.family)
    if i >= len(cls.text_encoder_classes) or not (folder / "config.json").is_file():
        return None
    enc_cls = getattr(transformers, cls.text_encoder_classes[i], None)
    if enc_cls is None:
        return None
    adapter = cls(cfg.model)
    try:
        config = adapter.text_encoder_config(enc_cls.config_class.from_pretrained(folder, local_files_only=True))
        with torch.device("meta"):
            enc = enc_cls(config)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    esize = torch.tensor([], dtype=DTYPES[cfg.model.dtype]).element_size()
    loaded = sum(p.numel() for p in enc.parameters()) * esize
    enc = adapter.slim_text_encoder(enc)
    blocks = text_encoder_blocks(enc)
    inside = {id(p) for b in blocks for p in b.parameters()}
    outside = sum(p.numel() for p in enc.parameters() if id(p) not in inside) * esize
    return TextEncoderSize(folder.name, loaded, outside, tuple(sum(p.numel() for p in b.parameters()) * esize
                                                               for b in blocks))


def text_encoder_sizes(cfg) -> list[TextEncoderSize] | None:
    """Each text encoder as the loader builds it from the folder (`_built_size`), or None where any cannot be
    built that way (no folder: the planner applies `shared_sizes` to `text_encoder_bytes`)."""
    root = Path(cfg.model.path)
    dirs = adapter_class(cfg.model.family).text_encoder_dirs
    if not dirs or not all((root / d).is_dir() for d in dirs):
        return None
    sizes = [_built_size(cfg, i, root / d) for i, d in enumerate(dirs)]
    if any(s is None for s in sizes):
        return None
    extra = _extra_text_bytes(cfg, root)  # loaded with the first encoder (LTX-2's connectors): its RAM, not its blocks
    if extra:
        first = sizes[0]
        sizes[0] = TextEncoderSize(first.name, first.loaded + extra, first.outside, first.blocks)
    return sizes


def _extra_text_bytes(cfg, root: Path) -> int:
    """Bytes of the family's `extra_text_dirs` (modules the loader builds beside the text encoders and keeps in CPU
    RAM with them: LTX-2's text connectors, 2.86 GB at full size) in the model dtype, counted from their safetensors
    headers; 0 where the folder has none. The shares' path counts them in `text_encoder_params`."""
    from safetensors import safe_open

    esize = torch.tensor([], dtype=DTYPES[cfg.model.dtype]).element_size()
    n = 0
    for d in adapter_class(cfg.model.family).extra_text_dirs:
        for f in sorted((root / d).glob("*.safetensors")):
            with safe_open(f, "pt") as h:
                n += sum(math.prod(h.get_slice(k).get_shape()) for k in h.keys())
    return n * esize
