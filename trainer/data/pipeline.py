"""From a config to batches: scan -> buckets -> caches -> sampler -> `Batch`.

`plan_data` does everything that needs no model weights (scan, bucket assignment, bad-input report, cache
keys); `prepare_data` then makes sure the caches are complete (calling `load_encoders` only if they are not),
builds the sampler and returns `TrainData`. A batch is read back from the stores by the sampler's position
alone, so its content depends only on (seed, position): resume is exact and nothing is random at batch time.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import UserError
from ..words import count
from .buckets import BucketSampler, Entry, Slot, assign_buckets
from .cache import (
    DiskStore,
    EncodeResult,
    LatentJob,
    MemoryStore,
    TextJob,
    cache_stages,
    clip_id,
    ensure_encoded,
    finite,
    latent_key,
    model_identity,
    text_key,
)
from .captions import caption_texts, pick
from .sources import Item, ScanReport, check_report, scan_sources
from .validation import ValidationData, ValidationPlan, holdout, plan_validation, reference_jobs
from .video import clip_starts


@dataclass
class Batch:
    """One training micro-batch, all from one bucket.

    latents: (B, C, h, w) float32 on the CPU, as `adapter.encode_images` returned them (move and cast them
    yourself); for a video family (B, C, F, h, w), every sample a clip of the same frames (`Entry.group`); text: `adapter.collate_text` of the cached entries (CPU, in the text encoders' dtype); captions:
    the caption each sample trains on ("" where dropped); files: the image of each sample; size: (height, width)
    of the bucket in pixels (for `adapter.timestep_shift`); position: the global sampler position this batch was
    drawn at; mask: with data.masked_loss, (B, 1, h, w) float32 per-latent-cell loss weights (unmasked_weight +
    (1 - unmasked_weight) * mask; 1 for an image without a mask), else None.

    Pairs (`pairs_run`: edit families, and Flux.2 on data with references): `text` also holds `control_latents`
    (B, C, h, w) float32, the reference images' latents (same bucket as the targets), which `adapter.predict` joins
    to the sequence; they travel with the text entries so the loop moves them like any other conditioning. With
    several references per image (`adapter.max_references` > 1) it is (B, K, C, h, w), in reference order."""

    latents: torch.Tensor
    text: dict[str, torch.Tensor]
    captions: list[str]
    files: list[str]
    size: tuple[int, int]
    position: int
    mask: torch.Tensor | None = None


@dataclass
class DataPlan:
    """Everything known before any encoder runs."""

    cfg: object  # Config
    report: ScanReport
    entries: list[Entry]
    latent_store: DiskStore | MemoryStore
    text_store: DiskStore | MemoryStore
    divisor: int
    validation: ValidationPlan | None = None  # data.validation's held-out set (trainer/data/validation.py)
    #: the text encoder sees each item's reference (`adapter.text_uses_reference`): text entries per (caption,
    #: reference as cut for the entry's bucket), see cache.TextJob
    text_ref: bool = False

    @property
    def items(self) -> list[Item]:
        return self.report.items

    def latent_key(self, e: Entry) -> str:
        it = self.items[e.item]
        clip = clip_id(self.cfg.data.fps, e.start, e.frames) if it.frames else ""
        return latent_key(it.sha, e.bucket, e.box, it.mask_sha, clip)

    def control_key(self, e: Entry) -> str:
        """The (first) reference's latent: keyed like any image (content, bucket, box), so it shares entries with
        itself."""
        return self.control_job(e).key

    def control_job(self, e: Entry) -> LatentJob:
        return self.control_jobs(e)[0]

    def control_jobs(self, e: Entry) -> list[LatentJob]:
        """One latent job per reference of entry `e`, in order (empty without references): validation.py
        `reference_jobs`."""
        return reference_jobs(self.items[e.item], e)

    def text_id(self, e: Entry, caption: str) -> str:
        """The text-cache key entry `e` reads for `caption` (with its reference where the text encoder sees it)."""
        if self.text_ref and self.items[e.item].control:
            return text_key(caption, self.control_key(e))
        return text_key(caption)

    def text_label(self, e: Entry, caption: str) -> str:
        """What `EncodeResult.bad_texts` names this text by (TextJob.label)."""
        return self.text_id(e, caption) if self.text_ref and self.items[e.item].control else caption

    def latent_jobs(self) -> list[LatentJob]:
        """Training entries (and their references), then the validation set's (encoded in the same pass)."""
        jobs = [LatentJob(self.latent_key(e), self.items[e.item].file, e.bucket, e.box, self.items[e.item].mask,
                          e.frames, e.start, self.cfg.data.fps, e.audio)
                for e in self.entries]
        jobs += [j for e in self.entries for j in self.control_jobs(e)]
        return jobs + (self.validation.latent_jobs() if self.validation else [])

    def item_texts(self, i: int) -> tuple[str, ...]:
        """Every final caption text item i may train on (captions.py); each is one text-cache entry."""
        it = self.items[i]
        return caption_texts(it.all_captions, self.cfg.data.sources[it.source], self.cfg.data.caption_variants,
                             self.cfg.train.seed, it.sha)

    def captions(self) -> list[str | TextJob]:
        """Every text to encode: caption strings, or TextJobs with their reference (`text_ref`: each entry's
        captions and the empty one for caption dropout, with the entry's reference)."""
        val = set(self.validation.captions) if self.validation else set()
        if self.text_ref:
            jobs = {j.key: j for e in self.entries for c in (*self.item_texts(e.item), "")
                    for j in [TextJob(c, self.control_job(e) if self.items[e.item].control else None)]}
            return sorted(jobs.values(), key=lambda j: (j.caption, j.key)) + sorted(val)
        return sorted({t for i in range(len(self.items)) for t in self.item_texts(i)} | val)

    def summary(self) -> str:
        d = self.cfg.data
        srcs = d.sources
        found = ", ".join(f"{s.path}: {n} found" + (f" x{s.repeats}" if s.repeats > 1 else "")
                          for s, n in zip(srcs, self.report.found, strict=True))
        lines = [f"data: {count(len(self.items), 'image')} from {count(len(srcs), 'source')} ({found}); "
                 f"{len(self.report.bad)} left out"]
        per: Counter = Counter()
        imgs: Counter = Counter()
        for e in self.entries:
            per[(e.resolution, e.bucket, e.frames)] += srcs[self.items[e.item].source].repeats
            imgs[(e.resolution, e.bucket, e.frames)] += 1
        bs = self.cfg.train.batch_size
        for r in sorted(set(d.resolutions)):
            keys = sorted(k for k in per if k[0] == r)
            n_used = len({e.item for e in self.entries if e.resolution == r})
            small = len(self.items) - n_used
            lines.append(f"  resolution {r} (sides divisible by {self.divisor}): {count(len(keys), 'bucket')}"
                         + (f"; {count(small, 'image')} {'is' if small == 1 else 'are'} too small for it (and "
                            f"{'trains' if small == 1 else 'train'} at the other resolutions)" if small else ""))
            for k in keys:
                w, h = k[1]
                n_img, n_batch = imgs[k], -(-per[k] // bs)
                what = ('image' if n_img == 1 else 'images') if k[2] == 1 else ('clip' if n_img == 1 else 'clips')
                size = f"{w}x{h}" + (f"x{k[2]}f" if k[2] > 1 else "")
                lines.append(f"    {size:<11} {n_img:>6} {what}, {per[k]:>6} per "
                             f"epoch, {n_batch:>5} {'batch' if n_batch == 1 else 'batches'}")
        lines.append(f"  {count(sum(-(-n // bs) for n in per.values()), 'batch', 'batches')} per epoch at batch size {bs} "
                     f"(remainder: {d.remainder})")
        videos = sum(1 for it in self.items if it.frames)
        if videos:
            clips = sum(1 for e in self.entries if self.items[e.item].frames)
            lines.append(f"  videos: {count(videos, 'video')} give {count(clips, 'clip')} of {d.clip_frames} frames at "
                         f"{d.fps or 'their own'} fps (data.clips: {d.clips}); images are 1-frame clips")
        refs = max((len(it.references) for it in self.items), default=0)
        if refs:
            lines.append(f"  pairs: each image trains with {'its reference image' if refs == 1 else f'{refs} reference images'} "
                         "(control/ or a \"control\" metadata key)")
        empty = sum(1 for it in self.items if not it.caption)
        if empty:
            lines.append(f"  {count(empty, 'image')} {'has' if empty == 1 else 'have'} an empty caption (trained "
                         "unconditionally)")
        lines += [f"  hint: {h}" for h in self.report.hints]
        if self.report.bad:
            lines.append(f"left out {count(len(self.report.bad), 'file')} (data.strict: true stops instead):")
            lines += self.report.bad_lines()
        return "\n".join(lines)

    def encode_summary(self, res: EncodeResult) -> str:
        where = "memory" if isinstance(self.latent_store, MemoryStore) else str(self.cfg.data.cache_dir)
        s = (f"cache ({where}): latents {res.latents_hit} reused, {res.latents_new} encoded; captions "
             f"{res.texts_hit} reused, {res.texts_new} encoded")
        if res.reencoded:
            s += f"; {res.reencoded} non-finite entries re-encoded"
        if res.bad_latents or res.bad_texts:
            s += f"; {len(res.bad_latents) + len(res.bad_texts)} could not be encoded (see above)"
        return s


def plan_data(cfg, adapter, *, force_disk: bool = False, progress: bool = True) -> DataPlan:
    """Scan the sources, assign buckets and list bad input. Loads no model. Raises UserError on an empty or
    missing data set, or on any bad file under data.strict."""
    d = cfg.data
    if d is None:
        raise UserError("the config has no data: section (data.sources lists the image folders)")
    disk = d.cache or force_disk
    pairs = pairs_run(adapter, d)
    videos = bool(getattr(adapter, "video", False))
    if videos and not adapter.valid_frames(d.clip_frames):
        k = (d.clip_frames - 1) // adapter.frame_step
        lo, hi = k * adapter.frame_step + 1, (k + 1) * adapter.frame_step + 1
        raise UserError(f"data.clip_frames {d.clip_frames}: {adapter.family} trains clips of {adapter.frame_step}k+1 "
                        f"frames (its VAE encodes the first frame, then groups of {adapter.frame_step}): use {lo} or {hi}")
    report = scan_sources(d.sources, index_dir=Path(d.cache_dir) if disk else None, progress=progress,
                          masks=d.masked_loss, controls=pairs, videos=videos, fps=d.fps)
    if videos:  # shorter than one clip: left out with its frame count, before anything else sees it
        short = [(i, it) for i, it in enumerate(report.items) if it.frames and it.frames < d.clip_frames]
        for _, it in short:
            report.bad.append((it.file, f"{it.frames} frames at {d.fps or 'its own'} fps, shorter than one clip of "
                                        f"{d.clip_frames} (lower data.clip_frames or data.fps)"))
        _keep_items(report, [], {i for i, _ in short})
        if d.validation is not None and any(it.frames for it in report.items):
            raise UserError("data.validation does not take videos yet: remove data.validation, or keep videos out of "
                            "the sources")
    held = []
    if d.validation is not None and d.validation.fraction > 0:  # held out before bucketing: never trained on
        report.items, held = holdout(report.items, d.validation.fraction, cfg.train.seed)
    divisor = int(adapter.resolution_divisor)
    entries, too_small = assign_buckets(
        report.items, d.resolutions, divisor, crop=d.crop, seed=cfg.train.seed, max_upscale=d.max_upscale,
        max_aspect=d.max_aspect, step=d.bucket_step,
        clips=(lambda it: (d.clip_frames, clip_starts(it.frames, d.clip_frames, d.clips, d.clips_per_video)))
        if videos else None,
    )
    if videos and getattr(adapter, "trains_sound", False):  # clips of videos with a track train their sound too
        entries = [replace(e, audio=True) if e.frames > 1 and report.items[e.item].audio else e for e in entries]
    refs = max((len(it.references) for it in report.items), default=0)
    if refs > 1 and refs > adapter.max_references:  # (one reference: every edit family takes it)
        raise UserError(f"data.sources: the images have {refs} reference images each ({refs - 1} more in control2/ ... "
                        f"or a \"control\" list), {adapter.family} takes at most {adapter.max_references}")
    for idx, reason in too_small:
        report.bad.append((report.items[idx].file, reason))
    entries = _keep_items(report, entries, {idx for idx, _ in too_small})
    check_report(report, d.strict)
    text_ref = adapter.text_uses_reference
    if text_ref and d.validation is not None:
        raise UserError(f"data.validation is not supported for {adapter.family} yet (its captions are encoded with "
                        f"their reference images): remove data.validation")
    if disk:
        latent_store = DiskStore(Path(d.cache_dir) / "latents" / model_identity(cfg.model, adapter, "vae"))
        text_store = DiskStore(Path(d.cache_dir) / "text" / model_identity(cfg.model, adapter, "text"))
    else:
        latent_store, text_store = MemoryStore(), MemoryStore()
    val = None
    if d.validation is not None:
        val = plan_validation(cfg, divisor, held, report.items, Path(d.cache_dir) if disk else None, progress,
                              controls=pairs)
    return DataPlan(cfg, report, entries, latent_store, text_store, divisor, val, text_ref)


def pairs_run(adapter, data_cfg) -> bool:
    """Whether this run trains (reference, target, caption) pairs: always for an edit family, and for a family whose
    reference is optional (`reference_optional`: Flux.2) when the data has references."""
    return adapter.takes_reference and (not adapter.reference_optional or data_cfg.has_references())


def _keep_items(report: ScanReport, entries: list[Entry], drop: set[int]) -> list[Entry]:
    """Remove items `drop` from the report and renumber the entries of the others."""
    if not drop:
        return entries
    new_index, kept = {}, []
    for i, it in enumerate(report.items):
        if i not in drop:
            new_index[i] = len(kept)
            kept.append(it)
    report.items = kept
    return [replace(e, item=new_index[e.item]) for e in entries if e.item in new_index]


class TrainData:
    """What the training loop holds: the scan report, the sampler and batches read from the caches."""

    def __init__(self, plan: DataPlan, adapter, encode: EncodeResult, rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.rank, self.world_size = rank, world_size
        self.plan = plan
        self.report = plan.report
        self.encode = encode
        self._adapter = adapter
        cfg = plan.cfg
        srcs = cfg.data.sources
        self.entries = plan.entries
        self._lat_keys = [plan.latent_key(e) for e in self.entries]
        self._ctrl_keys = [[j.key for j in plan.control_jobs(e)] for e in self.entries]
        self._texts = [plan.item_texts(i) for i in range(len(plan.items))]
        self._seed = cfg.train.seed
        self._masked, self._unmasked = cfg.data.masked_loss, cfg.data.unmasked_weight
        # some latent frames are not the model's to predict (ModelAdapter.frame_loss_weights)
        self._frame_weights = getattr(adapter, "frame_loss_weights", lambda _: None)(2) is not None
        items = plan.items
        self.sampler = BucketSampler(
            [e.group for e in self.entries],
            [srcs[items[e.item].source].repeats for e in self.entries],
            [srcs[items[e.item].source].caption_dropout for e in self.entries],
            batch_size=cfg.train.batch_size,
            seed=cfg.train.seed,
            remainder=cfg.data.remainder,
            fingerprint="|".join(self._lat_keys + [k for keys in self._ctrl_keys for k in keys]),
        )
        self.validation = None
        if plan.validation is not None:
            bad = set(encode.bad_latents) | {text_key(c) for c in encode.bad_texts}
            self.validation = ValidationData(plan.validation, adapter, plan.latent_store, plan.text_store,
                                             cfg.train.batch_size, self._masked, self._unmasked, bad)

    def state_dict(self) -> dict:
        """JSON-able; the sampler's state (see BucketSampler.state_dict)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)

    @property
    def batches_per_epoch(self) -> int:
        return self.sampler.batches_per_epoch

    @property
    def epoch(self) -> int:
        return self.sampler.position * self.world_size // self.sampler.batches_per_epoch

    def next_batch(self) -> Batch:
        """The next batch; advances the sampler (checkpoint `state_dict()` after the step).

        With several ranks the sampler position counts rounds: in round p rank r trains the global batch
        p * world_size + r, so the ranks together see the single-process sequence, and every rank saves the
        same state."""
        pos = self.sampler.position
        batch = self.batch_at(pos * self.world_size + self.rank)
        self.sampler.position = pos + 1
        return batch

    def batch_at(self, position: int) -> Batch:
        """The batch at any position, without moving the sampler."""
        slots: list[Slot] = self.sampler.batch_at(position)
        lats, masks, texts, caps, files, ctrls, conds = [], [], [], [], [], [], []
        for n, s in enumerate(slots):
            e = self.entries[s.entry]
            it = self.plan.items[e.item]
            cap = "" if s.dropped else pick(self._texts[e.item], self._seed, position, n)
            entry = self._read(self.plan.latent_store, self._lat_keys[s.entry], it.file)
            lats.append(entry["latent"])
            conds.append({k: v for k, v in entry.items() if k not in ("latent", "mask")})  # adapter.encode_conditions
            refs = [self._read(self.plan.latent_store, k, f)["latent"]
                    for k, (f, _, _) in zip(self._ctrl_keys[s.entry], it.references, strict=True)]
            if refs:  # one reference: (C, h, w); several: (K, C, h, w)
                ctrls.append(refs[0] if len(refs) == 1 else torch.stack(refs))
            if self._masked or self._frame_weights:
                m = entry.get("mask")
                m = torch.ones_like(entry["latent"][:1]) if m is None or not self._masked \
                    else self._unmasked + (1 - self._unmasked) * m
                masks.append(_frame_weighted(m, self._adapter, entry["latent"]))
            texts.append(self._read(self.plan.text_store, self.plan.text_id(e, cap), it.file))
            caps.append(cap)
            files.append(it.file)
        bucket = self.entries[slots[0].entry].bucket
        # Host-side stack of small cached tensors; the loop moves the batch to the device.
        cond = self._adapter.collate_text(texts)
        if ctrls:
            cond["control_latents"] = torch.stack(ctrls)
        for k in conds[0]:  # an image-to-video family's first-frame conditioning (adapter.encode_conditions)
            cond[k] = torch.stack([c[k] for c in conds])
        return Batch(torch.stack(lats), cond, caps, files, (bucket[1], bucket[0]), position,
                     torch.stack(masks) if masks else None)

    def _read(self, store, key: str, file: str) -> dict[str, torch.Tensor]:
        if not store.has(key):
            raise UserError(f"cache entry {store.where(key)} for {file} disappeared during the run; restart to re-encode it")
        t = store.get(key)
        if not finite(t):
            store.drop(key)
            raise UserError(
                f"cache entry {store.where(key)} for {file} has NaN/inf values; it was deleted: resume the run "
                "(or `dittrain cache`) to re-encode it"
            )
        return t


def _frame_weighted(mask: torch.Tensor, adapter, latent: torch.Tensor) -> torch.Tensor:
    """An entry's loss mask times the family's per-frame loss weights (`frame_loss_weights`), for a clip's
    (C, F, h, w) latent: (1, F, h, w); unchanged where the family weighs every frame alike."""
    weights = getattr(adapter, "frame_loss_weights", None)
    w = weights(latent.shape[1]) if weights is not None and latent.ndim == 4 else None
    if w is None:
        return mask
    return mask * w.to(mask.dtype).view(1, -1, 1, 1)


def prepare_data(
    cfg,
    adapter,
    load_encoders=None,
    *,
    device: torch.device | str | None = None,
    progress: bool = True,
    rank: int = 0,
    world_size: int = 1,
) -> TrainData:
    """Scan, bucket, fill the caches (loading the encoders only if something is missing), build the sampler.

    `load_encoders`: a `cache.EncoderStages` (text encoders, freed, then the VAE), or a callable returning
    Components with the vae, text encoders and tokenizers; default: the adapter's own two-stage loader on
    `device` (default train.device). Prints the data summary (tqdm.write) and returns `TrainData`.

    Several processes (rank / world_size): call it on rank 0 first, then (after a barrier) on the others, which
    find the cache complete and load no encoder; each rank then draws its own share of every round."""
    if load_encoders is None:
        load_encoders = cache_stages(cfg, adapter, device)
    plan = plan_data(cfg, adapter, progress=progress)
    if rank == 0:
        tqdm.write(plan.summary(), file=sys.stderr)
        if plan.validation is not None:
            tqdm.write(plan.validation.summary(), file=sys.stderr)
    res = ensure_encoded(
        adapter, load_encoders, plan.latent_store, plan.text_store, plan.latent_jobs(), plan.captions(),
        batch_size=cfg.data.encode_batch_size, verify_latents=True, progress=progress,
    )
    drop_encoding_failures(plan, res)
    tqdm.write(plan.encode_summary(res), file=sys.stderr)
    return TrainData(plan, adapter, res, rank=rank, world_size=world_size)


def drop_encoding_failures(plan: DataPlan, res: EncodeResult) -> None:
    """Leave out entries whose latent or caption could not be encoded; items left with no entry are listed as
    bad. Under data.strict any such failure stops the run."""
    if not res.bad_latents and not res.bad_texts:
        return
    keep, reasons = [], {}
    for e in plan.entries:
        ctrl = next((res.bad_latents[j.key] for j in plan.control_jobs(e) if j.key in res.bad_latents), None)
        texts = (*plan.item_texts(e.item), "") if plan.text_ref else plan.item_texts(e.item)
        why = res.bad_latents.get(plan.latent_key(e)) or (ctrl and f"reference image: {ctrl}") or next(
            (res.bad_texts[lb] for lb in (plan.text_label(e, t) for t in texts) if lb in res.bad_texts), None)
        if why:
            reasons.setdefault(e.item, why)
        else:
            keep.append(e)
    kept_items = {e.item for e in keep}
    gone = {i for i in reasons if i not in kept_items}
    for i in sorted(gone):
        plan.report.bad.append((plan.items[i].file, reasons[i]))
        tqdm.write(f"left out: {plan.items[i].file}: {reasons[i]}", file=sys.stderr)
    plan.entries = _keep_items(plan.report, keep, gone)
    check_report(plan.report, plan.cfg.data.strict)
