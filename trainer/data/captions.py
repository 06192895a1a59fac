"""Caption handling: several captions per image, tag shuffling, tag dropout and a trigger word.

What the user gets. A source may give each image several captions (`several_captions: true`: every non-empty line of
the `.txt` is one; in metadata.jsonl a `"caption"` list always is). Comma-separated tags can be shuffled each time
(`shuffle_tags`) with the first `keep_tokens` tags held in place, each tag can be left out with `tag_dropout`, and a
`trigger_word` is put first, outside the shuffle and the dropout. `caption_prefix` is part of the caption text (it is
a tag like the others when shuffling: put it inside `keep_tokens`).

How it stays cached. The text cache is keyed by the final caption text, so every text a batch can hold must be known
before training and encoded once; nothing is encoded during training and the text encoders are freed as before.

- Several captions, no shuffle or tag dropout: the finite set of captions is encoded, and each time the image is
  drawn one of them is picked.
- With shuffle or tag dropout the set of possible texts is huge (n! orders), so `data.caption_variants` (N) variants
  per image are made up front, each drawn from (train.seed, image content, variant number) and cycling through the
  image's captions; each time the image is drawn, one of its N variants is picked. The cache holds N embeddings per
  image (a T5-XXL embedding of 512 tokens is 4 MiB in bf16: N = 8 and 1,000 images is 32 GiB on disk, and in RAM
  with `data.cache: false`), so the variety is N orders per image, not a new order every epoch.

The pick is a hash of (train.seed, sampler position, slot in the batch), so a batch depends only on its position:
runs are reproducible and a resumed run trains on the same texts. Caption dropout (the empty caption) is drawn
by the sampler as before and wins over all of this.
"""

from __future__ import annotations

import hashlib

import numpy as np


def _rng(*parts) -> np.random.Generator:
    digest = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def split_tags(caption: str) -> list[str]:
    return [t.strip() for t in caption.split(",") if t.strip()]


def with_trigger(trigger: str, caption: str) -> str:
    """The trigger word first, then the caption, comma-separated."""
    trigger = trigger.strip()
    if not trigger:
        return caption
    return f"{trigger}, {caption}" if caption else trigger


def transform(caption: str, rng: np.random.Generator, *, shuffle: bool, keep_tokens: int, tag_dropout: float) -> str:
    """Shuffle the tags after the first `keep_tokens` and drop each of those with probability `tag_dropout`."""
    tags = split_tags(caption)
    head, tail = tags[:keep_tokens], tags[keep_tokens:]
    if tag_dropout > 0:
        tail = [t for t, r in zip(tail, rng.random(len(tail)), strict=True) if r >= tag_dropout]
    if shuffle:
        tail = [tail[i] for i in rng.permutation(len(tail))]
    return ", ".join(head + tail)


def caption_texts(captions: tuple[str, ...], src, variants: int, seed: int, sha: str) -> tuple[str, ...]:
    """Every final text one image may train on (its cache entries), in a fixed order.

    `src` is the image's SourceConfig; `sha` the image's content hash (so two images with the same caption get
    different variants)."""
    caps = captions or ("",)
    if not (src.shuffle_tags or src.tag_dropout > 0):
        out = [with_trigger(src.trigger_word, c) for c in caps]
    else:
        out = []
        for v in range(max(variants, len(caps))):
            rng = _rng("caption", seed, sha, v)
            text = transform(caps[v % len(caps)], rng, shuffle=src.shuffle_tags, keep_tokens=src.keep_tokens,
                             tag_dropout=src.tag_dropout)
            out.append(with_trigger(src.trigger_word, text))
    return tuple(dict.fromkeys(out))  # unique, order kept


def pick(texts: tuple[str, ...], seed: int, position: int, slot: int) -> str:
    """The text a sample trains on: a pure function of (seed, sampler position, slot in the batch)."""
    if len(texts) == 1:
        return texts[0]
    return texts[int(_rng("pick", seed, position, slot).integers(len(texts)))]
