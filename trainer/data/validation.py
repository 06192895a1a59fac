"""The held-out set of `data.validation`: which images, their cache entries, and their batches in a fixed order.

Which images. Either `data.validation.sources` (folders scanned like the training sources), or `fraction` of the
training images held out: each image is ranked by sha256(train.seed, its content hash) and the first
max(1, round(fraction * n)) are taken out of the training set before bucketing, so the same images are held out
at every run and resume, whatever order the folders list them in. A validation image whose content is also a
training image (the same bytes, anywhere) is reported: its loss is not a held-out loss.

Cache entries. The validation entries are keyed like training ones (image content, bucket, crop; caption text)
and live in the same stores, so `dittrain cache` and `fit` encode them with the training set in one pass of the
encoders. Every validation image is center-cropped (never a random crop) and scored at every data.resolution it
is big enough for, with its first caption (no dropout, no shuffled variant). In a run of pairs (edit families,
Flux.2 on data with references) a validation image carries its references as in training (`reference_jobs`: cut
like the target, keyed like any image), so its loss is the loss the model is trained on.

Batches. Entries are grouped by (resolution, bucket) in a fixed order and cut into batches of train.batch_size;
`ValidationData.batches()` yields them with each sample's entry index, which seeds its fixed noise
(trainer/train/validation_loss.py). Nothing here draws random numbers.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import UserError
from ..words import count
from .buckets import Entry, assign_buckets
from .cache import LatentJob, finite, latent_key, text_key
from .captions import caption_texts
from .images import crop_box
from .sources import Item, scan_sources


def reference_jobs(it: Item, e: Entry) -> list[LatentJob]:
    """One latent job per reference image of item `it` at entry `e`, in order (none without): each is cut from its
    covering resize at the target's box when both images have one size (the pair stays aligned, random crops
    included), else centred, and keyed like any image (content, bucket, box). Training (pipeline.py) and
    validation batches read the same entries."""
    jobs = []
    for file, sha, size in it.references:
        box = e.box if size == (it.width, it.height) else crop_box(*size, e.bucket, "center")
        jobs.append(LatentJob(latent_key(sha, e.bucket, box), file, e.bucket, box))
    return jobs


def holdout(items: list[Item], fraction: float, seed: int) -> tuple[list[Item], list[Item]]:
    """(training items, held-out items): the seeded `fraction` of `items` by content (see the module essay)."""
    n = len(items)
    k = max(1, round(fraction * n))
    if k >= n:
        raise UserError(f"data.validation.fraction: {fraction} of {n} images leaves none to train on; lower it or "
                        "give data.validation.sources")
    rank = sorted(range(n), key=lambda i: hashlib.sha256(f"{seed}/{items[i].sha}".encode()).hexdigest())
    held = set(rank[:k])
    return [it for i, it in enumerate(items) if i not in held], [items[i] for i in sorted(held)]


@dataclass
class ValidationPlan:
    items: list[Item]
    entries: list[Entry]
    captions: list[str]  # per item: the one caption it is scored with
    overlap: list[str] = field(default_factory=list)  # validation files whose content is also a training image

    def latent_jobs(self) -> list[LatentJob]:
        return [LatentJob(self.latent_key(e), self.items[e.item].file, e.bucket, e.box, self.items[e.item].mask)
                for e in self.entries] + [j for e in self.entries for j in reference_jobs(self.items[e.item], e)]

    def latent_key(self, e: Entry) -> str:
        it = self.items[e.item]
        return latent_key(it.sha, e.bucket, e.box, it.mask_sha)

    def summary(self) -> str:
        s = f"validation: {count(len(self.items), 'image')}, {count(len(self.entries), 'entry', 'entries')}"
        if self.overlap:
            s += (f"; note: {len(self.overlap)} of them are also training images (same content, e.g. "
                  f"{self.overlap[0]}): their loss is not a held-out loss")
        return s


def plan_validation(cfg, divisor: int, held: list[Item], train_items: list[Item], index_dir: Path | None,
                    progress: bool = True, controls: bool = False) -> ValidationPlan:
    """Scan data.validation.sources (or take the held-out `held` items), bucket them, pick their captions.
    `controls`: a run of pairs; the validation sources' images need their references too."""
    d, v = cfg.data, cfg.data.validation
    if v.sources:
        report = scan_sources(v.sources, index_dir=index_dir, progress=progress, masks=d.masked_loss,
                              controls=controls)
        items, sources = report.items, v.sources
        for f, why in report.bad:
            tqdm.write(f"validation: left out {f}: {why}", file=sys.stderr)
    else:
        items, sources = held, d.sources
    entries, too_small = assign_buckets(items, d.resolutions, divisor, crop="center", seed=cfg.train.seed,
                                        max_upscale=d.max_upscale, max_aspect=d.max_aspect, step=d.bucket_step)
    for idx, why in too_small:
        tqdm.write(f"validation: left out {items[idx].file}: {why}", file=sys.stderr)
    if not entries:
        raise UserError("data.validation: no usable validation image (see the lines above)")
    captions = [caption_texts(it.all_captions, sources[it.source], d.caption_variants, cfg.train.seed, it.sha)[0]
                for it in items]
    trained = {it.sha for it in train_items}
    overlap = [it.file for it in items if it.sha in trained]
    return ValidationPlan(items, entries, captions, overlap)


@dataclass
class ValidationBatch:
    latents: torch.Tensor  # (B, C, h, w) float32, CPU
    text: dict[str, torch.Tensor]
    mask: torch.Tensor | None  # (B, 1, h, w) loss weights with data.masked_loss, else None
    index: list[int]  # each sample's entry index: what seeds its noise
    files: list[str]


class ValidationData:
    """Batches of the held-out entries, read from the caches in a fixed order."""

    def __init__(self, vplan: ValidationPlan, adapter, latent_store, text_store, batch_size: int,
                 masked: bool = False, unmasked_weight: float = 0.0, bad_keys=frozenset()):
        self.plan, self._adapter = vplan, adapter
        self._lat, self._txt = latent_store, text_store
        self._masked, self._unmasked = masked, unmasked_weight
        keep = [i for i, e in enumerate(vplan.entries) if vplan.latent_key(e) not in bad_keys
                and text_key(vplan.captions[e.item]) not in bad_keys
                and not any(j.key in bad_keys for j in reference_jobs(vplan.items[e.item], e))]
        groups: dict[tuple, list[int]] = {}
        for i in keep:
            e = vplan.entries[i]
            groups.setdefault((e.resolution, e.bucket), []).append(i)
        self._batches = [g[j:j + batch_size] for _, g in sorted(groups.items()) for j in range(0, len(g), batch_size)]

    def __len__(self) -> int:
        return len(self._batches)

    def batches(self):
        for idx in self._batches:
            lats, masks, texts, files, ctrls, conds = [], [], [], [], [], []
            for i in idx:
                e = self.plan.entries[i]
                it = self.plan.items[e.item]
                entry = self._read(self._lat, self.plan.latent_key(e), it.file)
                lats.append(entry["latent"])
                conds.append({k: v for k, v in entry.items() if k not in ("latent", "mask")})  # encode_conditions
                refs = [self._read(self._lat, j.key, j.file)["latent"] for j in reference_jobs(it, e)]
                if refs:  # as training batches: (C, h, w) for one reference, (K, C, h, w) for several
                    ctrls.append(refs[0] if len(refs) == 1 else torch.stack(refs))
                if self._masked:
                    m = entry.get("mask")
                    masks.append(torch.ones_like(entry["latent"][:1]) if m is None
                                 else self._unmasked + (1 - self._unmasked) * m)
                texts.append(self._read(self._txt, text_key(self.plan.captions[e.item]), it.file))
                files.append(it.file)
            cond = self._adapter.collate_text(texts)
            if ctrls:
                cond["control_latents"] = torch.stack(ctrls)
            for k in conds[0]:  # an image-to-video family's first-frame conditioning, as in training batches
                cond[k] = torch.stack([c[k] for c in conds])
            yield ValidationBatch(torch.stack(lats), cond, torch.stack(masks) if self._masked else None, list(idx), files)

    @staticmethod
    def _read(store, key: str, file: str) -> dict[str, torch.Tensor]:
        if not store.has(key):
            raise UserError(f"validation cache entry {store.where(key)} for {file} disappeared during the run; restart "
                            "to re-encode it")
        t = store.get(key)
        if not finite(t):
            store.drop(key)
            raise UserError(f"validation cache entry {store.where(key)} for {file} has NaN/inf values; it was deleted: "
                            "resume the run (or `dittrain cache`) to re-encode it")
        return t
