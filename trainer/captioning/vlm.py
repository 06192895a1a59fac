"""The vision-language model of `dittrain caption`: loading it, placing it (its decoder layers streamed by the offload
conductor), and one batched `generate` call.

Loading. Any local transformers folder whose `config.json` is an image-text-to-text model
(`AutoModelForImageTextToText`) and whose processor has a chat template, read with `local_files_only`. transformers
5 builds its Auto image processors and the Qwen-VL video processors only with torchvision installed; without it the
processor is assembled as the family text encoders' are (trainer/models/qwen_image_21.py `load_processor`), here
for any processor class: its tokenizer, the PIL variant of its image processor, a plain video processor (no video
goes through it: a video's frames are given as images) and the folder's processor settings and chat template.

Streaming. The decoder layers (the largest `nn.ModuleList` of `model.get_decoder()`, e.g. Qwen2.5-VL's 28 layers)
are the conductor's blocks, attached in "sample" mode; everything else (the vision tower, the embedding, the head:
about 1.8 B parameters of Qwen2.5-VL-7B) stays on the device. The sampling plan is cyclic forward, and that is
exactly what `generate` runs: the prefill is one forward of every layer in order, and so is each new token. The KV
cache needs no special handling: it holds activations (each layer's keys and values), not weights; transformers'
`DynamicCache` keeps them on the device beside the ring and each layer reads and extends its own entry while the
conductor has pointed that layer's weights at its ring region. So the streamed share of the weights crosses the
bus once per generated token, and `--batch` images share that pass: the batch is what amortises the streaming
(tests/test_caption_command.py: the same captions at every fraction, every layer run once per token).

8-bit decoder layers (`--quantize fp8|int8`). Every `nn.Linear` of the decoder layers becomes trainer/quant.py's
`QuantizedLinear`, as `model.quantize_text_encoders` makes a family's text encoder (Qwen-Image's Qwen2.5-VL): a
frozen float8_e4m3fn / int8 weight with one fp32 scale per output channel, dequantized to the model dtype one Linear
at a time to multiply (two temporaries of that layer's size: the up-cast and the scaled weight). The conductor packs
those bytes as they are, so the pinned arena, each copy over the bus and the ring hold half the bf16 bytes: at
fraction 1 each new token streams half as much, and `auto` counts the 8-bit sizes, so under the same cap more layers
stay resident. Everything outside the layers (the vision tower, the embedding, the head, the norms) keeps the model
dtype.

Auto fraction (`--offload auto`, on a GPU): the smallest fraction on the planner's 0.05 grid whose estimate
`ring + everything outside the layers + KV cache + the prefill's activations` fits the budget (the card less 1 GB,
as `dittrain sample`), with the image at `files.IMAGE_PIXELS` and the batch that will run (`--batch`, or fewer
where fewer files are left): the KV cache and the activations grow with it, so a larger batch may stream more. The
activation term is coarse (the MLP's intermediate and the attention's scores of one layer over the batch's prompt,
plus workspace and, with `--quantize`, one dequantized Linear); compared with one GPU run (Qwen2.5-VL-7B, batch
4: estimated 13.5 GB at the 0.45 it picked under a 15 GB cap, 12.8 GB reserved; bench/history/2026-11-27.md 14:05).

Decoding is greedy (`do_sample=False`, the model's own repetition penalty kept): captions are then a function of
the image, the prompt and the weights, equal with and without streaming.
"""

from __future__ import annotations

import copy
import json
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


def load_model(folder: Path, dtype: torch.dtype) -> nn.Module:
    """The model in CPU RAM, frozen (the conductor packs only weights that need no gradient), in eval mode."""
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


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def auto_fraction(model: nn.Module, blocks: list[nn.Module], budget: float, batch: int, tokens: int,
                  say: Callable[[str], None]) -> float:
    """`--offload auto` on a GPU (see the module essay): the smallest grid fraction whose estimate fits `budget`
    bytes with the planner's margin; 1.0 with a warning where none does. `batch`: the rows of one `generate`;
    `tokens`: a prompt's length, new tokens included. The layers' bytes as they are held (8-bit after
    `quantize_decoder`)."""
    from ..offload.plan import capacity_for
    from ..planner.prediction import ALLOCATOR_OVERHEAD, GB, PREDICTION_MARGIN, WORKSPACE, first_fit

    sizes = [_bytes(b.parameters()) + _bytes(b.buffers()) for b in blocks]
    inside = {id(t) for b in blocks for t in (*b.parameters(), *b.buffers())}
    outside = _bytes(t for t in (*model.parameters(), *model.buffers()) if id(t) not in inside)
    text = model.config.get_text_config()
    elem = model.get_input_embeddings().weight.element_size()  # the model dtype: the KV cache's and activations'
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv = batch * tokens * len(blocks) * 2 * heads * head_dim * elem
    act = batch * tokens * (3 * getattr(text, "intermediate_size", 4 * text.hidden_size) * elem
                            + text.num_attention_heads * tokens * 4)
    # --quantize: one Linear dequantized at a time, its up-cast and its scaled copy in the model dtype
    deq = 2 * max((m.weight.numel() * elem for b in blocks for m in b.modules()
                   if isinstance(m, quant.QuantizedLinear)), default=0)
    limit = budget * (1 - PREDICTION_MARGIN)

    def need(f: float) -> float:
        return capacity_for(sizes, f) + outside + kv + ALLOCATOR_OVERHEAD * act + deq + WORKSPACE

    fit = first_fit(lambda f: need(f) <= limit)
    if fit is None:
        say(f"offload: auto -> 1.0, but the estimate ({need(1.0) / GB:.1f} GB) exceeds the {budget / GB:.1f} GB "
            "budget: it may run out of memory (lower --batch)")
        return 1.0
    say(f"offload: auto -> {fit:g} for a batch of {batch} (estimated {need(fit) / GB:.1f} GB of the "
        f"{budget / GB:.1f} GB budget)")
    return fit


def place(model: nn.Module, blocks: list[nn.Module], device: torch.device, fraction: float):
    """Resident at fraction 0 (returns None), else the layers streamed: returns the handle to close."""
    if fraction <= 0:
        model.to(device)
        return None
    move_outside_blocks(model, blocks, device)
    return attach_offload(blocks, device, fraction, mode="sample")


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
