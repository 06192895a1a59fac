"""Tiny random-weight models of every family, written in full diffusers format.

How: each family's real architecture classes (the diffusers transformer and VAE, the transformers text encoders)
are built with tiny configs and seeded random weights, the tokenizers are trained here with the `tokenizers`
package on a small built-in corpus, and the whole set is saved through the family's own pipeline
(`save_pretrained`), so `model_index.json`, the sub-folders and the file names are exactly what a real
download has. Loading them goes through the very code path real weights use.

Why: tests and the demo must run offline on a laptop CPU in seconds, yet exercise the real classes, the real
latent packing and the real tokenizer wiring. A model that is only "shaped like" Flux would hide exactly the
bugs this project is likely to have.

Left out: the weights are noise, so images are noise too; the tokenizers know only the corpus below (other
words still encode, byte by byte or via <unk>). The VAEs downscale by 8 like the real ones but have 4 latent
channels (the real ones have 16), and the transformers' `in_channels` follow from that (x4 where latents are
packed 2x2).

Where: each family's builder is in its own module (`ModelAdapter.tiny_builders`: folder name -> function returning
a diffusers pipeline); this module holds what they share (the corpus, the trained tokenizers, tiny CLIP / T5
text encoders, the KL VAE, the flow-matching scheduler) and `make_tiny_models`, which writes every registered
family's folders (trainer/models/__init__.py `ADAPTERS`, in registry order).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

QWEN_TEMPLATE_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)

_CORPUS = """\
a red square on a blue background
a green circle on a white background
a yellow triangle on a black background
a photo of a cat sitting on a wooden table
a painting of a dog running in the park
a small house next to a tall tree under a cloudy sky
two blue circles and one orange square
a portrait of a woman with long hair, soft light
a close-up photo of a flower, shallow depth of field
an astronaut riding a horse on the moon, digital art
a city street at night with neon lights and rain
a bowl of fruit: apples, bananas and grapes
the quick brown fox jumps over the lazy dog
a minimalist logo with the text hello in bold letters
a mountain lake at sunrise, mist over the water
Describe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships of the objects and background
"""


def _corpus() -> list[str]:
    lines = [s for s in _CORPUS.splitlines() if s.strip()]
    # Repeating the Qwen system prompt makes each of its words one token, so the template prefix is exactly the
    # 34 tokens the pipeline drops (`prompt_template_encode_start_idx`), as with the real tokenizer.
    return lines * 4 + [QWEN_TEMPLATE_PREFIX + s + "<|im_end|>\n<|im_start|>assistant\n" for s in lines] * 8


def corpus() -> list[str]:
    """The lines the tiny tokenizers are trained on (for a family that trains a tokenizer of its own)."""
    return _corpus()


def _bpe_vocab_merges(tok) -> tuple[dict[str, int], list[tuple[str, str]]]:
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


def _learn_bpe(words: dict[tuple[str, ...], int], merges: int) -> list[tuple[str, str]]:
    """Plain BPE merge learning with deterministic tie-breaking (highest count, then the smallest pair).

    Used for CLIP, whose end-of-word suffix makes the `tokenizers` trainer number its initial symbols in hash
    order (different on every run); the corpus is tiny, so a direct loop is fast enough."""
    words = dict(words)
    out = []
    for _ in range(merges):
        pairs: dict[tuple[str, str], int] = {}
        for w, n in words.items():
            for pair in zip(w, w[1:], strict=False):
                pairs[pair] = pairs.get(pair, 0) + n
        if not pairs:
            break
        best = min(pairs, key=lambda pr: (-pairs[pr], pr))
        out.append(best)
        joined = best[0] + best[1]
        new = {}
        for w, n in words.items():
            sym, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    sym.append(joined)
                    i += 2
                else:
                    sym.append(w[i])
                    i += 1
            new[tuple(sym)] = new.get(tuple(sym), 0) + n
        words = new
    return out


def clip_tokenizer():
    from tokenizers import Regex, normalizers, pre_tokenizers
    from transformers import CLIPTokenizer

    # The same normalizer and pre-tokenizer as transformers' CLIPTokenizer; they come from `tokenizers`, the merge
    # learning is `_learn_bpe`.
    norm = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()])
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(
            Regex(r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""),
            behavior="removed",
            invert=True,
        ),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    words: dict[tuple[str, ...], int] = {}
    for line in _corpus():
        for w, _ in pre.pre_tokenize_str(norm.normalize_str(line)):
            key = (*w[:-1], w[-1] + "</w>")
            words[key] = words.get(key, 0) + 1
    merges = _learn_bpe(words, 300)
    # Vocabulary laid out like the real one: 256 byte symbols, the same with </w>, merges, specials last.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + [c + "</w>" for c in alphabet] + [a + b for a, b in merges]
    tokens = list(dict.fromkeys(tokens)) + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(tokens)}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


def t5_tokenizer():
    from tokenizers import pre_tokenizers
    from transformers import T5Tokenizer

    # A sentencepiece-style unigram vocabulary estimated by counting: every corpus word (with its "▁" word-start
    # marker) and every character, scored by log relative frequency. The `tokenizers` UnigramTrainer gives
    # slightly different scores and piece orders on every run (EM over hash-ordered candidates); counting is
    # exact, so the same corpus always yields the same files.
    pre = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)]
    )
    counts: dict[str, int] = {}
    for line in _corpus():
        for w, _ in pre.pre_tokenize_str(line):
            for piece in (w, *w):
                counts[piece] = counts.get(piece, 0) + 1
    total = sum(counts.values())
    pieces = sorted(((p, round(math.log(n / total), 6)) for p, n in counts.items()), key=lambda ps: (-ps[1], ps[0]))
    specials = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]  # ids 0, 1, 2 as in T5
    return T5Tokenizer(vocab=specials + pieces, extra_ids=0, model_max_length=512)


QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]


#: a chat template that renders image items as Qwen-VL's does, for the tiny Qwen tokenizer (the real folders ship
#: their own): `dittrain caption`'s tests and bench/program/bench_caption.py
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for c in message['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_tokenizer(extra_lines: tuple[str, ...] = ()):
    """The tiny Qwen2 byte-level BPE tokenizer, trained on the corpus (and `extra_lines`, for a family whose
    pipeline cuts a fixed number of template tokens: each of their words then becomes one token, as with the real
    tokenizer)."""
    from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = BpeTrainer(
        vocab_size=700, special_tokens=QWEN_SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus() + list(extra_lines), trainer=trainer)
    vocab, merges = _bpe_vocab_merges(tok)
    vocab = {k: v for k, v in vocab.items() if k not in QWEN_SPECIAL}
    out = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=2048)
    out.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL[1:]], special_tokens=True)
    return out


# ---------------------------------------------------------------------------------------------- components


def kl_vae(shift: float, scale: float):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, sample_size=64, layers_per_block=1, norm_num_groups=4,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),  # 3 downsamples: 8x, like the real VAEs
        use_quant_conv=False, use_post_quant_conv=False, shift_factor=shift, scaling_factor=scale,
    )


def clip_text(tokenizer, hidden: int, projection: int | None, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=projection or hidden,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg).eval()


def t5_text(tokenizer, d_model: int):
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(
        vocab_size=len(tokenizer), d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0,
    )
    torch.manual_seed(3)
    return T5EncoderModel(cfg).eval()


def flow_scheduler(**kw):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, **kw)


def name_processor_as_transformers_does(folder: Path, processor, sub: str = "processor") -> None:
    """The processor is saved from our torchvision-free subclass; name it after the transformers class it extends
    (Qwen2VLProcessor, Qwen3VLProcessor), as a real folder does. `sub`: its component (and sub-folder) name."""
    folder = Path(folder)
    name = next(c.__name__ for c in type(processor).__mro__ if c.__module__.startswith("transformers."))
    for rel, key in (("model_index.json", sub), (f"{sub}/processor_config.json", "processor_class")):
        p = folder / rel
        if p.is_file():
            d = json.loads(p.read_text())
            d[key] = ["transformers", name] if key == sub else name
            p.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")


def make_tiny_models(out: str | Path, families: list[str] | None = None) -> list[Path]:
    """Write tiny random models into out/<folder>/ (each family's `tiny_builders`) and return the folders written.
    `families`: registry keys (or their other spellings, `canonical_family`); None: every family."""
    from . import ADAPTERS, adapter_class, canonical_family

    out = Path(out)
    families = [canonical_family(f, "make-tiny --family") for f in families] if families else list(ADAPTERS)
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # deterministic tokenizer training
    from ._diffusers import _quiet

    _quiet()
    written = []
    for fam in families:
        for name, build in adapter_class(fam).own_tiny_builders().items():
            pipe = build()
            folder = out / name
            folder.mkdir(parents=True, exist_ok=True)
            pipe.save_pretrained(folder, safe_serialization=True)
            if (folder / "processor").is_dir():
                name_processor_as_transformers_does(folder, pipe.processor)
            written.append(folder)
    return written
