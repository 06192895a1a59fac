"""The vision-language model of `dittrain caption`: loading it, placing it (its decoder layers streamed by the offload
conductor), and one batched `generate` call.

Loading. Any local transformers folder whose `config.json` is an image-text-to-text model
(`AutoModelForImageTextToText`) and whose processor has a chat template, read with `local_files_only`. transformers
5 builds its Auto image processors and the Qwen-VL video processors only with torchvision installed; without it the
processor is assembled as the family text encoders' are (trainer/models/qwen_image_21.py `load_processor`), here
for any processor class: its tokenizer, the PIL variant of its image processor, a plain video processor (no video
goes through it: a video's frames are given as images) and the folder's processor settings and chat template.

Loading with `--quantize` (`load_quantized`): not through `from_pretrained`, which holds the whole model in the
model dtype in RAM before anything is quantized (Qwen2.5-VL-7B, fp8 on an H100: peak RSS 28.6 GB, 1.72 x its
16.6 GB, the bf16 model, its 8-bit copies and the arena together; bench/history/2026-11-27.md 23:14). The model is
built on `meta`, its Linears made 8-bit there (shapes and dtypes), its weights placeholders
(trainer/models/stream_load.py); each tensor outside the decoder layers is then read from the safetensors files,
cast to the model dtype and quantized one at a time, 4,096 rows at a time (stream_load's `TransformerLoader`,
`quant.quantize_rows`: the 152k-row head's fp32 temporaries would be 3 x 2.2 GB at once), and the layers are read
only when `place` puts them: at a fraction above 0 by the conductor's `fill`, straight into the arena and ring, at 0
onto the device. The files are read with plain reads, not mmap (their pages stay in the page cache, out of RSS:
mmap'd, a whole shard would count), and the heap is trimmed after each layer (glibc keeps freed temporaries under
its mmap threshold, up to 32 MB, in the heap otherwise). Keys are renamed as `from_pretrained` renames them
(`file_names`: the renamings of transformers' conversion mapping, the base-model prefix; Qwen2.5-VL folders keep
the original `model.layers.` names, Qwen3-VL ones the module's); a tied head reads the embedding's key; a folder
that needs more than renaming (a converter that merges or splits tensors) loads through `from_pretrained`, then is
quantized, as before. The weights are bitwise those of `from_pretrained` + `quantize_decoder` + `quantize_outside`
and the captions the same (tests/test_caption_load.py). Host RAM is then the 8-bit layers (the arena), the parts
outside them until they move to the device, and one tensor's temporaries: on the CPU, a random Qwen2.5-VL 1024
wide with 8 layers (0.22 GB bf16 on disk) raises the peak RSS by 0.65 x its bytes to load and place at fraction 1
(from_pretrained: 3.0 x, the fp32 model and more), tests/test_caption_load.py. Without `--quantize`,
`from_pretrained` as before (1.09 x measured, 14:05).

Streaming. The decoder layers (the largest `nn.ModuleList` of `model.get_decoder()`, e.g. Qwen2.5-VL's 28 layers)
are the conductor's blocks, attached in "sample" mode; the head and the norms stay on the device, the vision
tower's blocks stream through a second conductor's ring of two blocks (`vision_blocks`: they run in a batch's
prefill only, one image at a time, so a batch copies them once per image, while every new token needs the decoder
layers their VRAM now holds; Qwen3-VL-8B's 27 are 0.41 GB in 8 bits, two decoder layers, Qwen2.5-VL-7B's 32 are
0.63 GB; by arithmetic, not measured, a 1024 px image's pass is 3.4 / 6.9 TFLOP of their matmuls against 8 / 13 ms
of copy at 50 GB/s), the input embedding in CPU RAM (`cpu_embedding`: a lookup of a few rows per token, looked up there and the rows
copied over; Qwen2.5-VL-7B's is 1.1 GB; on the device where the head shares its weight). The sampling plan is
cyclic forward, and that is exactly what `generate` runs: the prefill is one forward of every layer in order, and
so is each new token. The KV cache needs no special handling: it holds activations (each layer's keys and values),
not weights; transformers' `DynamicCache` keeps them on the device beside the ring and each layer reads and extends
its own entry while the conductor has pointed that layer's weights at its ring region. So the streamed share of the
weights crosses the bus once per generated token, and `--batch` images share that pass: the batch is what amortises
the streaming (tests/test_caption_command.py: the same captions at every fraction, every layer run once per token).

Bounded prefill (`bound_prefill`, at every fraction). A batch's prefill is the largest allocation of a run: the
vision tower over every image of the batch at once (Qwen2.5-VL: 5,476 patches of a 1024 px image, each carrying
its qkv, fp32 rotary copies and MLP intermediates) and each decoder layer's MLP over batch x ~1,500 tokens (three
temporaries of 18,944 wide). Both are per image / per token, so they run in pieces: the tower one image (one
`grid_thw` row: a picture or a video frame) at a time, the outputs joined in order (Qwen-VL towers attend within an
image: windows and full-attention layers bounded per image); each layer's MLP `MLP_ROWS` tokens at a time. The same
values in exact arithmetic; on a CPU in fp32 the tower's features agree to float32's resolution and the captions
byte for byte (tests/test_caption_prefill.py). `generate` keeps the logits of the last position only
(transformers' `logits_to_keep=1`).

8-bit weights (`--quantize fp8|int8`). Every `nn.Linear` of the decoder layers becomes trainer/quant.py's
`QuantizedLinear`, as `model.quantize_text_encoders` makes a family's text encoder (Qwen-Image's Qwen2.5-VL): a
frozen float8_e4m3fn / int8 weight with one fp32 scale per output channel, dequantized to the model dtype one Linear
at a time to multiply (one temporary of that layer's size: the up-cast, scaled in place). The conductor packs
those bytes as they are, so the pinned arena, each copy over the bus and the ring hold half the bf16 bytes: at
fraction 1 each new token streams half as much, and `auto` counts the 8-bit sizes, so under the same cap more layers
stay resident. The Linears outside the layers are held so too (`quantize_outside`: the vision tower's, its
merger's, the head's; Qwen2.5-VL-7B: 2.4 GB in bf16, half of it in 8 bits), the head dequantized `HEAD_ROWS` output
rows at a time (its whole 152k x 3584 weight would be a 1.1 GB temporary). The embedding, the norms and the
patch convolution keep the model dtype.

Auto fraction (`--offload auto`, on a GPU): the smallest fraction of `block_grid` (one per count of resident
layers, printed to 0.001; the planner's 0.05 grid would step over some: each of Qwen3-VL-8B's 36 layers is 2.8 %)
whose `estimate` `ring + the weights outside the layers on the device (streaming: without the embedding, the
tower's blocks as their two-block ring) + KV cache + 1.35 x the prefill's activations + one 8-bit Linear's
dequantized temporary + workspace` fits the budget (the card less 1 GB or the process's cap:
`presets.device_budget_bytes`, as `dittrain sample`) less the planner's 3 % margin, with the image at
`files.IMAGE_PIXELS` and the batch that will run (`--batch`, or fewer where fewer files are left):
the KV cache and the activations grow with it. `activation_bytes` counts what transformers'
default attention (sdpa) allocates: no attention scores (flash / memory-efficient kernels), the batch x tokens x
tokens mask, keys and values repeated to every head; the batch's pixels and image features, plus the larger of one
image's pass through the vision tower and one decoder layer's attention or MLP phase over the batch. Against the
three measured runs of Qwen2.5-VL-7B at batch 4 (before the bounded prefill, the CPU embedding and the 8-bit head / tower: `estimate(bounded=False)`),
reserved vs estimated: bf16 at fraction 1 under 7 GB 6.74 vs 7.06 GB, fp8 at 1 under 7 GB 6.27 vs 6.87, bf16 at
0.45 under 15 GB 12.80 vs 13.12 (tests/test_caption_prefill.py keeps each estimate at or up to 10 % above its
measurement; bench/history/2026-11-27.md 22:25 and 14:05). For the same model with fp8 under a 7 GB cap (the budget
is the cap), before the streamed tower, the one dequantized temporary and `block_grid`: 0.4 for a batch of 4 and
0.55 for a batch of 8, estimated 6.46 and 6.40 GB against 6.39 and 5.83 GB reserved on an H200
(bench/history/2026-11-28.md 04:04); with them 0.285 and 0.428 (estimated 6.7 and 6.6 GB; not yet measured for
Qwen2.5-VL-7B; Qwen3-VL-8B at batch 8: 0.555, estimated 6.79 GB against 6.61 reserved, 2026-11-28 17:10).
`streamed_bytes` is what a pass then copies over the bus (`bench_caption --estimate` prints it per row).

Default batch (8 without `--batch`, halved while auto's estimate does not fit it even with every layer streamed:
captioner.py `_default_batch`). Streamed, a token step's cost is the streamed bytes, shared by the batch's rows. By
the estimate for Qwen2.5-VL-7B (28 layers of 0.47 GB bf16, 0.23 GB 8-bit) a batch of 8 keeps a few layers fewer
resident than a batch of 4 (its KV cache and prefill are larger) but streams fewer bytes per image and token (the
streamed bytes per token over the batch; `python -m bench.program.bench_caption --estimate` prints them): fp8
under 7 GB 0.428 against 0.285 (3.27 against 2.33 GB per token: 30 % fewer per image), bf16 under 7 GB 0.75 against
0.678 (45 %), bf16 under 15 GB 0.178 against 0.107 (30 %). Resident, a
larger batch is faster too (1.25 images/s at 4, 1.82 at 16 on an H200, bench/history/2026-11-27.md 22:25);
streamed, fp8 under 7 GB on an H200: 0.981 images/s at 8 against 0.642 at 4 (bench/history/2026-11-28.md 04:04).
Under 7 GB the fp8 model would fit a batch of 16 as well (0.714), bf16 too (0.892); a default above 8 is not
measured. Qwen3-VL-8B under 7 GB fits 8 in bf16 (0.833) and fp8 (0.555), 16 in fp8 (0.916), not in bf16.

Decode placement (`--offload auto` on a GPU with `CaptionRequest.decode_placement`, off in `dittrain caption`:
measured slower, below; `decode_fraction`, `Placement.decode_at`). The prefill's activations
(the 1.35 x above, the tower's pass) are gone once it is done, and the decode steps that follow (one token a row,
`max_new_tokens` of them) each copy the streamed layers again. So the decode steps get their own, smaller fraction:
the smallest of `block_grid`, at most the prefill's, whose `estimate(decode=True)` fits the same budget
(`decode_activation_bytes` instead of the prefill's: the batch's pixels `generate` holds throughout, the keys and
values repeated to every head for sdpa, one layer's cache grown by `torch.cat`), printed as a second `offload: auto
-> ...` line with the bytes per new token at both. A forward pre-hook on the model switches: a forward whose KV
cache already holds tokens (a decode step) calls the conductor's `hold(decode fraction)`, any other (a batch's
prefill, before its vision tower) `hold(None)`. `hold` keeps the ring, its fixed layers and their offsets, and holds
as many of the streamed layers as the decode fraction's extra bytes take, each in its own allocation outside the
ring, copied once from the arena (plan.py `held_plan`; one allocation per layer, not one block of all of them, fits
memory the prefill left in pieces); `hold(None)` frees them (their host bytes are current: frozen) before the next
prefill allocates. Each switch restarts the ring's plan at its step 0 (its first streamed layers copied again, as
`unpark`): per batch, the held layers once plus about four layers, against the held layers' copies saved at each of
the decode steps. Where a held layer cannot be allocated (an OutOfMemoryError: the allocator could not find the
bytes among what the batch left), nothing is held and that batch decodes with the prefill's placement (said once);
out of memory later in a batch (a decode step's, as the KV cache grows by `torch.cat` in memory the prefill left in
pieces) ends the decode placement for the run and that batch runs again (captioner.py `_caption_in_memory`: greedy,
the same captions; one line). Greedy captions are the resident model's (tests/test_caption_decode.py: both families,
bf16 and fp8, decode fractions 0.25 and 0, two batches; every decode step copies exactly one layer fewer at 0.25,
none at 0; an out of memory in a decode step). By the estimate, at a 7 GB cap with fp8, batch 8, 1024 px images and
64 new tokens: Qwen3-VL-8B prefills at 0.555 and decodes at 0.5 (4.25 -> 3.86 GB per new token), Qwen2.5-VL-7B 0.428
and 0.321 (3.27 -> 2.57 GB). Measured for Qwen3-VL-8B on an H200 (bench/history/2026-11-28.md 17:10): slower,
0.915 images/s against 1.087 at the prefill's placement, 6.81 GB reserved against 6.61 in the 7 GB cap; our reading
(not profiled) is the caching allocator at the cap's edge giving blocks back and retrying as the KV cache grows by
`torch.cat`. Hence off by default; the mechanism stays for a placement that leaves the allocator room.

Decoding is greedy (`do_sample=False`, the model's own repetition penalty kept): captions are then a function of
the image, the prompt and the weights, equal with and without streaming.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from .. import quant
from ..errors import UserError
from ..models.base import text_encoder_blocks
from ..offload import attach_offload, move_outside_blocks
from ..progress import shown

#: `--quantize`: trainer/quant.py's modes, as `model.quantize_text_encoders` names them
QUANTIZE = quant.MODES
#: the chat template some image-text-to-text folders lack (Florence-2 reads task tokens such as
#: <MORE_DETAILED_CAPTION>, not a chat)
#: prefill tokens of one decoder layer's MLP at a time (`bound_prefill`): its temporaries stay about
#: 3 x MLP_ROWS x intermediate_size whatever the batch (Qwen2.5-VL-7B: 0.23 GB in bf16)
MLP_ROWS = 2048
#: output rows of the 8-bit head dequantized at a time (`RowChunkedQuantizedLinear`; 3584 wide: 0.12 GB in bf16)
HEAD_ROWS = 16384
NO_TEMPLATE = ("its processor has no chat template (Florence-2 and other task-token models are not chat models): "
               "dittrain caption needs a chat model such as Qwen2.5-VL or Qwen3-VL Instruct")


def _config(folder: Path) -> dict:
    if not (folder / "config.json").is_file():
        raise UserError(f"--model {folder}: no config.json there (a local transformers model folder is needed)")
    return json.loads((folder / "config.json").read_text())


def check_model_folder(folder: Path) -> str:
    """The folder's model type, after checking that transformers reads it as an image-text-to-text model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    kind = _config(folder).get("model_type", "")
    if kind not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        raise UserError(f"--model {folder}: model_type {kind or '(none)'!r} is not an image-text-to-text model of "
                        "transformers (AutoModelForImageTextToText)")
    return kind


def torchvision_free(cls: type) -> type:
    """`cls` accepting a plain `BaseVideoProcessor` (the Qwen-VL processors insist on their torchvision one)."""
    from transformers.video_processing_utils import BaseVideoProcessor

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and isinstance(argument, BaseVideoProcessor):
            return type(argument)
        return cls.check_argument_for_proper_class(self, argument_name, argument)

    return type(cls.__name__, (cls,), {"check_argument_for_proper_class": check_argument_for_proper_class})


def _assembled_processor(folder: Path):
    """The folder's processor built without torchvision (see the module essay)."""
    import transformers
    from transformers.video_processing_utils import BaseVideoProcessor

    name = None
    for f in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        if (folder / f).is_file():
            name = name or json.loads((folder / f).read_text()).get("processor_class")
    cls = getattr(transformers, name or "", None)
    if cls is None:
        raise UserError(f"--model {folder}: no processor class named in its processor files; install torchvision "
                        "(pip install torchvision) for transformers' AutoProcessor")
    settings, kwargs = cls.get_processor_dict(folder, local_files_only=True)
    args = []
    for attr in cls.get_attributes():
        if "tokenizer" in attr:
            args.append(transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True))
        elif attr == "image_processor":
            conf = settings.get("image_processor") or json.loads((folder / "preprocessor_config.json").read_text())
            pil = getattr(transformers, conf["image_processor_type"].removesuffix("Fast") + "Pil", None)
            if pil is None:
                raise UserError(f"--model {folder}: its image processor {conf['image_processor_type']} needs "
                                "torchvision here: pip install torchvision")
            args.append(pil.from_pretrained(folder, local_files_only=True))
        elif attr == "video_processor":
            args.append(BaseVideoProcessor())
        else:
            raise UserError(f"--model {folder}: its processor's {attr} needs torchvision: pip install torchvision")
    return torchvision_free(cls).from_args_and_dict(args, settings, **kwargs)


def load_processor(folder: Path):
    """AutoProcessor where transformers can build it, else the assembled one; left padding for batches."""
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    else:
        processor = _assembled_processor(folder)
    if not getattr(processor, "chat_template", None):
        raise UserError(f"--model {folder}: {NO_TEMPLATE}")
    tok = processor.tokenizer
    tok.padding_side = "left"  # generation continues every row from its last column
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return processor


#: the attribute of a model `load_model` left with placeholder decoder layers: the loader `place` fills them with
LOADER = "_caption_loader"
_INDEX = "model.safetensors.index.json"


def load_model(folder: Path, dtype: torch.dtype, quantize: str = "none") -> nn.Module:
    """The model in CPU RAM, frozen (the conductor packs only weights that need no gradient), in eval mode, its
    Linears 8-bit with `quantize` (`quantize_decoder`, `quantize_outside`). With `quantize`, read layer by layer
    from the safetensors files and quantized as read (`load_quantized`: the decoder layers stay placeholders until
    `place`); where that cannot map the folder's keys, transformers' `from_pretrained`, then quantized."""
    if quantize != "none" and (model := load_quantized(folder, dtype, quantize)) is not None:
        return model
    model = _from_pretrained(folder, dtype)
    quantize_decoder(decoder_blocks(model), quantize)
    quantize_outside(model, quantize)
    return model


def _file_keys(folder: Path) -> dict[str, Path]:
    """Each tensor key of the folder's safetensors files -> its file (sharded with index.json or not)."""
    index = folder / _INDEX
    if index.is_file():
        return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    return {k: f for f in sorted(folder.glob("*.safetensors")) for k in quant._header(f)}


def file_names(model: nn.Module, folder: Path) -> dict[str, tuple[Path, str]] | None:
    """Each parameter key of `model` (built on `meta`, before `--quantize`) -> its file and the file's key, the
    keys renamed as transformers' `from_pretrained` renames them (the model's conversion mapping: its renamings,
    the base model prefix added or stripped); a tied weight -> the key of the weight it shares. None where a key
    needs more than a renaming (a converter that merges or splits tensors) or is in no file: `from_pretrained`
    loads those folders."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    meta = model.state_dict()
    where: dict[str, tuple[Path, str]] = {}
    for key, f in _file_keys(folder).items():
        name, converted = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        if converted is not None:
            return None
        where.setdefault(name, (f, key))
    first: dict[int, str] = {}
    for key, p in model.named_parameters(remove_duplicate=False):
        if key not in where and id(p) in first and first[id(p)] in where:
            where[key] = where[first[id(p)]]  # tied (a head sharing the embedding's weight)
        first.setdefault(id(p), key)
        if key not in where:
            return None
    return where


def load_quantized(folder: Path, dtype: torch.dtype, mode: str) -> nn.Module | None:
    """`--quantize` without the model dtype's copy in RAM (module essay, Loading): the model built on `meta`,
    its Linears made 8-bit there (shapes and dtypes), its weights placeholders (trainer/models/stream_load.py);
    then every weight outside the decoder layers read from the files, cast to `dtype` and quantized one tensor
    at a time (trainer/models/stream_load.py's `TransformerLoader`: the values `from_pretrained` + `quantize_*`
    give, bitwise), the layers left to `place` (straight into the conductor's arena, or onto the device). None
    where `file_names` cannot map the folder."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForImageTextToText, GenerationConfig

    from ..models.stream_load import TransformerLoader, _Files, with_placeholders

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with init_empty_weights():  # parameters on meta, buffers real (the rotary tables)
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    names = file_names(model, folder)
    if names is None:
        return None
    blocks = decoder_blocks(model)
    quantize_decoder(blocks, mode)
    quantize_outside(model, mode)
    with_placeholders(model.eval().requires_grad_(False))
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)
    loader = TransformerLoader(model, None, dtype, _Files.renamed(folder, names))
    loader.place(model, torch.device("cpu"), skip=blocks)
    model.__dict__[LOADER] = loader
    return model


def _from_pretrained(folder: Path, dtype: torch.dtype) -> nn.Module:
    """transformers' `from_pretrained`: the whole model in the model dtype in CPU RAM."""
    from transformers import AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    quiet = not shown() and hf_logging.is_progress_bar_enabled()  # its loading bar, only on a terminal
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True, dtype=dtype)
    finally:
        if quiet:
            hf_logging.enable_progress_bar()
    return model.eval().requires_grad_(False)


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder layers the conductor streams: the largest ModuleList of the language model."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    return text_encoder_blocks(decoder)


def quantize_decoder(blocks: list[nn.Module], mode: str) -> int:
    """`--quantize` (see the module essay): every Linear of the decoder layers held as 8 bits, in place; returns
    how many ("none": 0). Before `auto_fraction` and `place`, so that both count and pack the 8-bit bytes."""
    return quant.quantize_blocks(blocks, mode, modulation=False, pattern="")


class RowChunkedQuantizedLinear(quant.QuantizedLinear):
    """The 8-bit head: dequantized `HEAD_ROWS` output rows at a time, so its temporaries are those of a slice, not
    of the 152k-row vocabulary (2 x 1.1 GB for Qwen2.5-VL-7B). Each output column is its own dot product: the
    same values as the whole weight dequantized at once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.shape[0] <= HEAD_ROWS:
            return super().forward(x)
        out = []
        for i in range(0, self.weight.shape[0], HEAD_ROWS):
            w = quant.dequantize(self.weight[i:i + HEAD_ROWS], self.weight_scale[i:i + HEAD_ROWS], x.dtype)
            out.append(torch.nn.functional.linear(x, w, None if self.bias is None else self.bias[i:i + HEAD_ROWS]))
            del w
        return torch.cat(out, dim=-1)


def quantized_linears(model: nn.Module, blocks: list[nn.Module]) -> tuple[int, int]:
    """How many Linears are 8-bit inside the decoder layers and outside them."""
    inside = sum(isinstance(m, quant.QuantizedLinear) for b in blocks for m in b.modules())
    return inside, sum(isinstance(m, quant.QuantizedLinear) for m in model.modules()) - inside


def quantize_outside(model: nn.Module, mode: str) -> int:
    """`--quantize` outside the decoder layers (after `quantize_decoder`): every remaining Linear, i.e. the vision
    tower's, its merger's and the head's, held as 8 bits, in place; returns how many ("none": 0). The head
    dequantizes in slices (`RowChunkedQuantizedLinear`). The embedding is a lookup, not a Linear: it stays in the
    model dtype (and in CPU RAM while streaming, `place`). A head tied to the embedding gets its own 8-bit copy."""
    if mode == "none":
        return 0
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    for lin in linears:
        quant.quantize_linear(lin, mode)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, quant.QuantizedLinear):
        head.__class__ = RowChunkedQuantizedLinear
    return len(linears)


def _visual(model: nn.Module) -> nn.Module | None:
    inner = getattr(model, "model", model)
    return getattr(inner, "visual", None)


class _PerImage:
    """Mixed into the vision tower's class (`bound_prefill`): its forward run one image (one `grid_thw` row) at a
    time, the outputs concatenated in order. Exact in exact arithmetic: Qwen-VL towers attend within an image (its
    windows, its full-attention layers bounded by `cu_seqlens` per image) and everything else is per patch; its
    peak is then one image's."""

    def forward(self, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs):
        if grid_thw.shape[0] <= 1:
            return super().forward(hidden_states, grid_thw=grid_thw, **kwargs)
        sizes = grid_thw.prod(-1).tolist()
        return _concat([super(_PerImage, self).forward(h, grid_thw=grid_thw[i:i + 1], **kwargs)
                        for i, h in enumerate(torch.split(hidden_states, sizes))])


def _concat(outs: list):
    """Per-image outputs of a vision tower joined: tensors along rows, lists / tuples element by element, model
    outputs field by field."""
    first = outs[0]
    if torch.is_tensor(first):
        return torch.cat(outs, dim=0)
    if isinstance(first, dict):  # transformers' ModelOutput
        return type(first)(**{k: _concat([o[k] for o in outs]) for k in first.keys()})
    if isinstance(first, (list, tuple)):
        return type(first)(_concat([o[i] for o in outs]) for i in range(len(first)))
    return first


class _ChunkedRows:
    """Mixed into a decoder layer's MLP class (`bound_prefill`): at most `MLP_ROWS` tokens at a time (the prefill's
    batch x prompt would otherwise hold three batch x tokens x intermediate_size temporaries); the MLP is per
    token, so the rows are the same values."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= MLP_ROWS:
            return super().forward(x)
        return torch.cat([super(_ChunkedRows, self).forward(r) for r in torch.split(rows, MLP_ROWS)]) \
            .view(*x.shape[:-1], -1)


_MIXED: dict[tuple[type, type], type] = {}


def _mix(module: nn.Module, mixin: type) -> None:
    """`module`'s class becomes `mixin` over it (as trainer/quant.py swaps a Linear's class), once."""
    cls = type(module)
    if issubclass(cls, mixin):
        return
    if (cls, mixin) not in _MIXED:
        _MIXED[cls, mixin] = type(cls.__name__, (mixin, cls), {})
    module.__class__ = _MIXED[cls, mixin]


def bound_prefill(model: nn.Module, blocks: list[nn.Module]) -> None:
    """What a batch's prefill allocates, bounded (module essay): the vision tower one image at a time, each
    decoder layer's MLP `MLP_ROWS` tokens at a time. Idempotent."""
    visual = _visual(model)
    if visual is not None:
        _mix(visual, _PerImage)
    for b in blocks:
        mlp = getattr(b, "mlp", None)
        if mlp is not None:
            _mix(mlp, _ChunkedRows)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def activation_bytes(model: nn.Module, batch: int, tokens: int, *, mlp_rows: int | None = MLP_ROWS,
                     vision_images: int = 1) -> int:
    """The prefill's largest live activations, allocated bytes (before the allocator's overhead): the inputs held
    through it (the batch's pixels and image features, at most every token an image token), plus the larger of the
    vision tower's (`vision_images` images at once: 1 with `bound_prefill`) and one decoder layer's over `batch` x
    `tokens` rows (its MLP `mlp_rows` tokens at a time; None: all at once). Attention is transformers' default
    sdpa: no scores are materialized, the mask is batch x tokens x tokens; keys and values are counted repeated to
    every head (sdpa's GQA path without `enable_gqa`). Terms per phase:
    - vision, per patch of an image of at most `tokens` x merge^2 patches (a row's tokens all image tokens): its qkv and output (4 x width), q and k rotated in
      fp32 (2 x width x 4 B, twice: the product and the rotated half), the MLP's three intermediates, the residual
      and the normed input;
    - decoder attention: the residual, the normed input, q, k and v repeated, the attention output and o_proj's
      (3 x hidden + 4 x heads x head_dim per token) and the mask;
    - decoder MLP: the residual, the normed input and the joined output (3 x hidden per token), and three
      intermediates of `mlp_rows` tokens."""
    text = model.config.get_text_config()
    elem = model.get_input_embeddings().weight.element_size()  # the model dtype
    rows = batch * tokens
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    attention = rows * (3 * text.hidden_size + 4 * heads * head_dim) * elem + batch * tokens * tokens * elem
    inter = getattr(text, "intermediate_size", 4 * text.hidden_size)
    mlp = 3 * rows * text.hidden_size * elem + 3 * min(rows, mlp_rows or rows) * inter * elem
    vision = inputs = 0
    vc = getattr(model.config, "vision_config", None)
    if vc is not None:
        merge = getattr(vc, "spatial_merge_size", 2) ** 2
        patches = tokens * merge * vision_images
        width, vinter = vc.hidden_size, getattr(vc, "intermediate_size", 4 * vc.hidden_size)
        vision = patches * ((6 * width + 3 * vinter) * elem + 4 * width * 4)
        pixel = vc.in_channels * getattr(vc, "temporal_patch_size", 1) * vc.patch_size ** 2
        inputs = rows * (merge * pixel + text.hidden_size) * elem
    return inputs + max(vision, attention, mlp)


def decode_activation_bytes(model: nn.Module, batch: int, tokens: int) -> int:
    """A decode step's largest live activations (one new token per row, `tokens` cached), allocated bytes: the
    inputs `generate` holds through every step (the batch's pixels, as in `activation_bytes`), the keys and values
    repeated to every head for sdpa and the batch x tokens mask, and one layer's cache grown by `torch.cat`
    (DynamicCache: the old and the new keys and values at once). The rest (a row's hidden state, the last
    position's logits) is a few MB: the workspace's."""
    text = model.config.get_text_config()
    elem = model.get_input_embeddings().weight.element_size()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    repeated = 2 * batch * heads * tokens * head_dim * elem + batch * tokens * elem
    grown = 2 * kv_bytes(model, 1, batch, tokens)
    pixels = 0
    vc = getattr(model.config, "vision_config", None)
    if vc is not None:
        pixel = vc.in_channels * getattr(vc, "temporal_patch_size", 1) * vc.patch_size ** 2
        pixels = batch * tokens * getattr(vc, "spatial_merge_size", 2) ** 2 * pixel * elem
    return pixels + repeated + grown


def dequantized_bytes(model: nn.Module) -> int:
    """--quantize: the largest dequantized temporary of one 8-bit Linear (its weight in the model dtype, scaled in
    place: `quant.dequantize`; the head's `HEAD_ROWS` slice); 0 without."""
    elem = model.get_input_embeddings().weight.element_size()
    sizes = [min(m.weight.shape[0], HEAD_ROWS if isinstance(m, RowChunkedQuantizedLinear) else m.weight.shape[0])
             * m.weight.shape[1] for m in model.modules() if isinstance(m, quant.QuantizedLinear)]
    return max(sizes, default=0) * elem


def kv_bytes(model: nn.Module, layers: int, batch: int, tokens: int) -> int:
    text = model.config.get_text_config()
    elem = model.get_input_embeddings().weight.element_size()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return batch * tokens * layers * 2 * heads * head_dim * elem


def estimate(model: nn.Module, blocks: list[nn.Module], batch: int, tokens: int,
             bounded: bool = True, decode: bool = False) -> Callable[[float], float]:
    """Reserved bytes `--offload auto` expects at a fraction (module essay): the ring (`capacity_for`), the
    weights outside the layers on the device (when streaming: without the embedding, `cpu_embedding`, and with
    the vision tower's two-block ring instead of its blocks, `vision_blocks`), the KV cache, the allocator's
    overhead on `activation_bytes`, the dequantized temporary and the workspace. `bounded=False`: as runs before
    `bound_prefill`, the CPU embedding, the streamed tower and the in-place dequantize (the vision tower over the
    batch at once, the MLP over every token, the embedding and the tower on the device, two dequantized
    temporaries), to compare with those runs' measurements. `decode`: the decode steps' bytes, at the fraction of
    the layers they keep (`decode_fraction`): `decode_activation_bytes` instead of the prefill's."""
    from ..offload.plan import capacity_for
    from ..planner.prediction import ALLOCATOR_OVERHEAD, WORKSPACE

    sizes = block_sizes(blocks)
    inside = {id(t) for b in blocks for t in (*b.parameters(), *b.buffers())}
    outside = _bytes({id(t): t for t in (*model.parameters(), *model.buffers()) if id(t) not in inside}.values())
    emb = cpu_embedding(model) if bounded else None
    on_cpu = _bytes(emb.parameters()) if emb is not None else 0
    tower = block_sizes(vision_blocks(model)) if bounded else []
    off_device = on_cpu + sum(tower) - (capacity_for(tower, 1.0) if tower else 0)  # streamed: the tower's ring
    act = decode_activation_bytes(model, batch, tokens) if decode else activation_bytes(model, batch, tokens) \
        if bounded else activation_bytes(model, batch, tokens, mlp_rows=None, vision_images=batch)
    deq = dequantized_bytes(model) * (1 if bounded else 2)  # those runs' dequantize: an up-cast and a product
    rest = kv_bytes(model, len(blocks), batch, tokens) + ALLOCATOR_OVERHEAD * act + deq + WORKSPACE

    def need(f: float) -> float:
        return capacity_for(sizes, f) + outside - (off_device if f > 0 else 0) + rest

    return need


def auto_fraction(model: nn.Module, blocks: list[nn.Module], budget: float, batch: int, tokens: int,
                  say: Callable[[str], None]) -> float:
    """`--offload auto` on a GPU (see the module essay): the smallest fraction of `block_grid` whose `estimate`
    fits `budget` bytes with the planner's margin; 1.0 with a warning where none does. `batch`: the rows of one `generate`;
    `tokens`: a prompt's length, new tokens included. The bytes as they are held (8-bit after `quantize_decoder`
    and `quantize_outside`)."""
    from ..planner.prediction import GB, PREDICTION_MARGIN, first_fit

    need = estimate(model, blocks, batch, tokens)
    limit = budget * (1 - PREDICTION_MARGIN)
    fit = first_fit(lambda f: need(f) <= limit, block_grid(block_sizes(blocks)))
    if fit is None:
        say(f"offload: auto -> 1.0, but the estimate ({need(1.0) / GB:.1f} GB) exceeds the {budget / GB:.1f} GB "
            "budget: it may run out of memory (lower --batch)")
        return 1.0
    say(f"offload: auto -> {fit:g} for a batch of {batch} (estimated {need(fit) / GB:.1f} GB of the "
        f"{budget / GB:.1f} GB budget)")
    return fit


def decode_fraction(model: nn.Module, blocks: list[nn.Module], budget: float, batch: int, tokens: int,
                    fraction: float, say: Callable[[str], None]) -> float:
    """`--offload auto`'s placement for the decode steps (module essay, Decode placement): the smallest fraction
    of `block_grid`, at most the prefill's `fraction`, whose decode `estimate` fits `budget` with the planner's
    margin; `fraction` where none below it does (or it is 0)."""
    from ..planner.prediction import GB, PREDICTION_MARGIN, first_fit

    if fraction <= 0:
        return fraction
    need = estimate(model, blocks, batch, tokens, decode=True)
    limit = budget * (1 - PREDICTION_MARGIN)
    fit = first_fit(lambda f: need(f) <= limit, [f for f in block_grid(block_sizes(blocks)) if f <= fraction])
    fit = fraction if fit is None else fit
    say(f"offload: auto -> {fit:g} for the decode steps (estimated {need(fit) / GB:.1f} GB; "
        f"{streamed_bytes(blocks, fraction, fit) / GB:.2f} GB streamed per new token, "
        f"{streamed_bytes(blocks, fraction) / GB:.2f} at {fraction:g})")
    return fit


def block_sizes(blocks: list[nn.Module]) -> list[int]:
    """Each block's bytes as it is held (its parameters and buffers: 8-bit after `quantize_decoder`)."""
    return [_bytes(b.parameters()) + _bytes(b.buffers()) for b in blocks]


def block_grid(sizes: list[int]) -> list[float]:
    """`--offload auto`'s fractions, ascending: one per count of resident layers (the conductor keeps whole
    layers: `capacity_for`), each rounded down to 0.001 so that `--offload` given that number keeps the same
    layers. The planner's 0.05 grid would step over some counts (Qwen3-VL-8B's 36 layers: 2.8 % each)."""
    total, acc, grid = sum(sizes), 0, {0.0, 1.0}
    for s in sizes:
        acc += s
        grid.add(math.floor((1 - acc / total) * 1000) / 1000)
    return sorted(grid)


def streamed_bytes(blocks: list[nn.Module], fraction: float, decode: float | None = None) -> int:
    """Bytes the conductor copies over the bus per pass of the decoder (the prefill, then each new token) at
    `fraction`: its sampling plan's (`plan_for`), from the blocks' bytes as held (the packing's alignment apart);
    with `decode` (a smaller fraction), a decode step's: the plan holding what `decode` keeps (`held_plan`)."""
    from ..offload.plan import capacity_for, held_plan, plan_for

    sizes = block_sizes(blocks)
    if fraction <= 0:
        return 0
    plan = plan_for(sizes, capacity_for(sizes, fraction), "sample")
    if decode is not None and decode < fraction:
        plan = held_plan(plan, capacity_for(sizes, decode) - plan.capacity)
    return plan.bytes_per_step()


def cpu_embedding(model: nn.Module) -> nn.Module | None:
    """The embedding `place` keeps in CPU RAM while streaming: the model's input embedding unless the head shares
    its weight (then it must be on the device for the head anyway)."""
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(emb, nn.Embedding) or (head is not None and head.weight is emb.weight):
        return None
    return emb


def _lookup_on_cpu(emb: nn.Embedding, device: torch.device) -> None:
    """The ids go to the CPU, the looked-up rows come back to `device`: a copy of rows, the same values."""
    emb.register_forward_pre_hook(lambda m, args: (args[0].to("cpu"), *args[1:]))
    emb.register_forward_hook(lambda m, args, out: out.to(device))


def place(model: nn.Module, blocks: list[nn.Module], device: torch.device, fraction: float):
    """Resident at fraction 0 (returns None), else the layers streamed: returns the `Placement` to close.
    Streamed, the input embedding stays in CPU RAM (`cpu_embedding`) and the vision tower's blocks stream through
    a ring of two (`vision_blocks`: a batch's prefill is their only use). Either way the prefill is bounded
    (`bound_prefill`)."""
    bound_prefill(model, blocks)
    loader = model.__dict__.pop(LOADER, None)  # `load_quantized`: the layers are placeholders, read from the files
    if fraction <= 0:
        if loader is not None:
            for b in blocks:  # straight onto the device, one tensor at a time
                loader.place(b, torch.device(device))
            loader.close()
        model.to(device)
        return None
    emb = cpu_embedding(model)
    tower = vision_blocks(model)
    move_outside_blocks(model, [*blocks, *tower, *([emb] if emb is not None else [])], device)
    if emb is not None:
        _lookup_on_cpu(emb, torch.device(device))
    try:  # with a loader the conductor lays out arena and ring from the shapes and `fill` writes each layer
        decoder = attach_offload(blocks, device, fraction, mode="sample",
                                 fill=None if loader is None else _trimmed(loader.fill))
    finally:
        if loader is not None:
            loader.close()
    return Placement(decoder, attach_offload(tower, device, 1.0, mode="sample") if tower else None)


def vision_blocks(model: nn.Module) -> list[nn.Module]:
    """The vision tower's `blocks` (Qwen2.5-VL's 32, Qwen3-VL's 27; not the largest ModuleList: a small tower's
    deepstack mergers may outweigh them), which `place` streams at fraction 1 beside the decoder layers; [] where
    the tower has none."""
    tower = getattr(_visual(model), "blocks", None)
    return list(tower) if isinstance(tower, nn.ModuleList) else []


class Placement:
    """What `place` returns when streaming: the decoder layers' offload handle and the vision tower's (None
    without a tower). `stats` are the decoder's; `close` closes both."""

    def __init__(self, decoder, vision):
        self.decoder, self.vision = decoder, vision
        self._hook = None

    def stats(self) -> dict:
        return self.decoder.stats()

    def decode_at(self, model: nn.Module, fraction: float, say: Callable[[str], None]) -> None:
        """The decode placement (module essay): each forward of `model` whose KV cache holds tokens already (a
        decode step of `generate`) runs with the layers `fraction` keeps resident (the conductor's `hold`), every
        other one (a batch's prefill, before its vision tower) with those of `place`'s fraction. Where the held
        layers cannot be allocated, that batch decodes as it prefilled (said once)."""
        warned = []

        def switch(module, args, kwargs):
            cache = kwargs.get("past_key_values")
            decoding = cache is not None and cache.get_seq_length() > 0  # host-side length: no sync
            if not self.decoder.hold(fraction if decoding else None) and not warned:
                warned.append(1)
                say(f"offload: the decode steps' layers at {fraction:g} could not be allocated: those batches "
                    "decode with the prefill's")

        self._hook = model.register_forward_pre_hook(switch, with_kwargs=True)

    def decode_off(self) -> bool:
        """The decode placement ended (its layers given back, the decode steps at `place`'s fraction from now on);
        False where there was none."""
        if self._hook is None:
            return False
        self._hook.remove()
        self._hook = None
        self.decoder.hold(None)
        return True

    def close(self, keep_weights: bool = True) -> None:
        if self._hook is not None:
            self._hook.remove()
        self.decoder.close(keep_weights)
        if self.vision is not None:
            self.vision.close(keep_weights)


def _trimmed(fill):
    """`fill`, then the freed heap handed back (`release_host_memory`): a layer's read and quantize temporaries
    below glibc's mmap threshold (up to 32 MB: each Linear's model-dtype and fp32 copies, on a mid-size model)
    come from the heap, and freed between the 8-bit tensors kept they would stay in RSS, layer after layer."""
    from ..models.stream_load import release_host_memory

    def fill_layer(block, entries, views):
        fill(block, entries, views)
        release_host_memory()

    return fill_layer


def greedy_config(model: nn.Module, processor, max_new_tokens: int):
    """The model's generation config, greedy, `max_new_tokens` long, with a pad token for batches."""
    gc = copy.deepcopy(model.generation_config)
    gc.do_sample, gc.temperature, gc.top_p, gc.top_k = False, None, None, None
    gc.max_new_tokens = max_new_tokens
    if gc.pad_token_id is None:
        gc.pad_token_id = processor.tokenizer.pad_token_id
    return gc


def user_turn(prompt: str, pictures: int) -> list[dict]:
    """One chat: a user turn of `pictures` images, then the instruction."""
    return [{"role": "user", "content": [{"type": "image"}] * pictures + [{"type": "text", "text": prompt}]}]


def prepare(processor, device: torch.device, dtype: torch.dtype, pictures: list[list], prompts: list[str]) -> dict:
    """The model's inputs for a batch: row k is the chat of `pictures[k]` (one image, or a video's frames) and
    `prompts[k]`, left-padded. Errors of the processor (an image it refuses) propagate."""
    texts = [processor.apply_chat_template(user_turn(p, len(pics)), add_generation_prompt=True, tokenize=False)
             for p, pics in zip(prompts, pictures, strict=True)]
    inputs = processor(text=texts, images=[im for pics in pictures for im in pics], return_tensors="pt",
                       padding=True)
    return {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) if torch.is_tensor(v) else v
            for k, v in inputs.items()}


@torch.no_grad()
def generate(model: nn.Module, processor, gc, inputs: dict) -> list[str]:
    """One batched `generate`; the decoded new text of each row."""
    out = model.generate(**inputs, generation_config=gc)
    return processor.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
