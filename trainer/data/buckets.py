"""Aspect-ratio buckets and the deterministic batch sampler.

**Buckets.** For each target resolution R the bucket sizes are the (w, h) pairs with w a multiple of the step
d, h = the multiple of d closest to R^2 / w, and a side ratio of at most `max_aspect`, plus each pair turned
sideways. The step is `data.bucket_step` (64 px, as most LoRA trainers use: finer steps scatter a data set over
so many buckets that batches rarely fill) capped at R/4 and rounded to a multiple of the family's divisor, so
both sides always divide by the divisor, which is what the VAE (x8) and the transformer's patching (x1 or x2)
need. Every bucket's area is within max(w, h)*d/2 pixels of R^2. An image goes to the bucket at R whose
aspect ratio is closest to its own in log space (1:2 and 2:1 are equally far from 1:1), is resized with one scale
to cover it and cropped (see images.py). With several resolutions an image is used at each one it is large
enough for.

**Too small.** An image is used at R only if covering its bucket needs no enlargement beyond `max_upscale`
(default 1.0: never upscale). An image too small for every resolution is left out with that reason. This is
the "image smaller than the smallest bucket" case of the scan.

**Sampler.** An epoch is a pure function of (seed, epoch number, the entry layout): a generator seeded with
(seed, epoch) shuffles each bucket's entries (each repeated `repeats` times), cuts them into batches of
`batch_size`, shuffles the order of all batches across buckets and draws each slot's caption dropout. Every entry
appears in every epoch exactly `repeats` times: a bucket's remainder trains as a smaller last batch
(`remainder: smaller`) or is filled up from the start of the same bucket's shuffled list (`remainder: wrap`,
those images then appear once more that epoch). The sampler's only state is the position (batches handed out
since the start), so `state_dict()` is `{"position": p, ...}` and a resumed run sees exactly the batches the
uninterrupted run would have seen, across epoch boundaries, without replaying anything.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .images import crop_box
from .sources import Item

log = logging.getLogger(__name__)


def bucket_step(resolution: int, divisor: int, step: int = 64) -> int:
    """Side increment between buckets: `step` capped at resolution/4, rounded down to a multiple of `divisor`."""
    return max(divisor, (min(step, resolution // 4) // divisor) * divisor)


def bucket_sizes(resolution: int, divisor: int, max_aspect: float = 4.0, step: int = 64) -> list[tuple[int, int]]:
    """All (w, h) buckets for one resolution, sorted from tallest to widest."""
    area = resolution * resolution
    d = bucket_step(resolution, divisor, step)
    out = set()
    w = d
    while w <= resolution * math.sqrt(max_aspect) + d:
        h = max(d, round(area / w / d) * d)
        if max(w / h, h / w) <= max_aspect + 1e-9:
            out.update({(w, h), (h, w)})  # both orientations, so portrait and landscape match
        w += d
    if not out:  # divisor larger than the resolution: the one square bucket of one divisor
        out.add((d, d))
    return sorted(out, key=lambda s: s[0] / s[1])


def nearest_bucket(width: int, height: int, sizes: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The bucket closest in log aspect ratio; ties go to the one whose area is closest to the image's."""
    target = math.log(width / height)
    return min(sizes, key=lambda s: (round(abs(math.log(s[0] / s[1]) - target), 9), abs(s[0] * s[1] - width * height)))


@dataclass(frozen=True)
class Entry:
    """One (image, resolution) pair: which bucket it trains in and where its crop sits. For a video (video
    families) one (clip, resolution) pair: `frames` frames from frame `start` at data.fps (video.py)."""

    item: int
    resolution: int
    bucket: tuple[int, int]  # (w, h) pixels
    box: tuple[int, int]  # (left, top) of the crop inside the covering resize
    frames: int = 1  #: frames of the clip (1: an image)
    start: int = 0  #: first frame of the clip at data.fps
    #: the clip trains its sound too (a family that trains sound, `ModelAdapter.trains_sound`, on a video with an
    #: audio track): batched apart from clips without, whose batches train the picture alone
    audio: bool = False

    @property
    def group(self) -> tuple[int, ...]:
        """What a batch shares: the bucket (w, h), and for a clip its frames (w, h, frames), with sound (w, h,
        frames, 1)."""
        return self.bucket if self.frames == 1 else (*self.bucket, self.frames, *((1,) if self.audio else ()))


def assign_buckets(
    items: Sequence[Item],
    resolutions: Sequence[int],
    divisor: int,
    *,
    crop: str = "center",
    seed: int = 0,
    max_upscale: float = 1.0,
    max_aspect: float = 4.0,
    step: int = 64,
    clips=None,
) -> tuple[list[Entry], list[tuple[int, str]]]:
    """Entries for every item at every resolution it is big enough for, and (item index, reason) for items too
    small for all of them. `clips(item) -> (frames, [start, ...])` for a video item (video families): one entry
    per clip, each of `frames` frames; None: every item is an image."""
    tables = {r: bucket_sizes(r, divisor, max_aspect, step) for r in sorted(set(resolutions))}
    entries: list[Entry] = []
    too_small: list[tuple[int, str]] = []
    for idx, it in enumerate(items):
        used = False
        smallest = None
        for r, sizes in tables.items():
            b = nearest_bucket(it.width, it.height, sizes)
            need = max(b[0] / it.width, b[1] / it.height)
            if need > max_upscale + 1e-9:
                smallest = smallest or (r, b, need)
                continue
            box = crop_box(it.width, it.height, b, crop, seed_text=f"{seed}|{it.sha}")
            if clips is not None and it.frames:
                frames, starts = clips(it)
                entries += [Entry(idx, r, b, box, frames, s) for s in starts]
            else:
                entries.append(Entry(idx, r, b, box))
            used = True
        if not used:
            r, b, need = smallest
            too_small.append(
                (idx, f"{it.width}x{it.height} is smaller than its {b[0]}x{b[1]} bucket at resolution {r} "
                 f"(needs {need:.2f}x enlargement; lower data.resolutions or raise data.max_upscale)")
            )
    return entries, too_small


@dataclass(frozen=True)
class Slot:
    """One sample of a batch: the entry and whether its caption is dropped (trained on the empty caption)."""

    entry: int
    dropped: bool


class BucketSampler:
    """Deterministic batches of one bucket each. See the module docstring for the rules.

    `weights[e]` is how often entry e appears per epoch (its source's repeats); `dropout[e]` its caption-dropout
    probability."""

    def __init__(
        self,
        buckets: Sequence[tuple[int, int]],
        weights: Sequence[int],
        dropout: Sequence[float],
        batch_size: int,
        seed: int,
        remainder: str = "smaller",
        fingerprint: str = "",
    ):
        if not (len(buckets) == len(weights) == len(dropout)) or not buckets:
            raise ValueError("one bucket, weight and dropout per entry, at least one entry")
        self.batch_size = batch_size
        self.seed = seed
        self.remainder = remainder
        self._dropout = list(dropout)
        groups: dict[tuple[int, int], list[int]] = {}
        for e, (b, w) in enumerate(zip(buckets, weights, strict=True)):
            groups.setdefault(tuple(b), []).extend([e] * w)
        self.groups = dict(sorted(groups.items()))
        self.batches_per_epoch = sum(math.ceil(len(v) / batch_size) for v in self.groups.values())
        self.fingerprint = hashlib.sha256(
            json.dumps([fingerprint, [list(b) for b in buckets], list(weights), list(dropout), batch_size, seed,
                        remainder]).encode()
        ).hexdigest()[:16]
        self.position = 0
        self._plan: tuple[int, list[list[Slot]]] | None = None

    # ------------------------------------------------------------------------------------------ epochs

    def epoch_plan(self, epoch: int) -> list[list[Slot]]:
        """All batches of `epoch`, in order. Pure in (seed, epoch, layout); the last one is memoised."""
        if self._plan is not None and self._plan[0] == epoch:
            return self._plan[1]
        rng = np.random.default_rng([self.seed & (2**63 - 1), epoch, 0xB0C7])
        batches: list[list[int]] = []
        for ids in self.groups.values():
            order = [ids[i] for i in rng.permutation(len(ids))]
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                if self.remainder == "wrap" and len(chunk) < self.batch_size:
                    chunk = chunk + [order[i % len(order)] for i in range(self.batch_size - len(chunk))]
                batches.append(chunk)
        batches = [batches[i] for i in rng.permutation(len(batches))]
        plan = [[Slot(e, bool(rng.random() < self._dropout[e])) for e in b] for b in batches]
        self._plan = (epoch, plan)
        return plan

    def batch_at(self, position: int) -> list[Slot]:
        """The batch handed out at `position` (0-based count of batches since the start of training)."""
        epoch, i = divmod(position, self.batches_per_epoch)
        return self.epoch_plan(epoch)[i]

    def next(self) -> list[Slot]:
        """The next batch; advances the position."""
        batch = self.batch_at(self.position)
        self.position += 1
        return batch

    @property
    def epoch(self) -> int:
        return self.position // self.batches_per_epoch

    # ------------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """JSON-able state: position (batches handed out), plus seed and layout fingerprint to check on resume."""
        return {"position": self.position, "seed": self.seed, "fingerprint": self.fingerprint,
                "batches_per_epoch": self.batches_per_epoch}

    def load_state_dict(self, state: dict) -> None:
        """Continue at `state["position"]`. A different data set or batch layout cannot resume exactly: warn, and
        continue at the same position of the new layout."""
        if state.get("fingerprint") != self.fingerprint or state.get("seed") != self.seed:
            log.warning(
                "the data set, buckets, batch size or seed changed since this checkpoint: resuming at batch %d "
                "of the new layout; the batches will differ from the original run's",
                int(state["position"]),
            )
        self.position = int(state["position"])

