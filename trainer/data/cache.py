"""Latent and text-embedding caches, and the `dittrain cache` command.

Training never needs the VAE or the text encoders once every image's latent and every caption's embedding is
stored: they are computed once here and read back each step. Entries are safetensors files (no pickle) under
`data.cache_dir`:

    <cache_dir>/latents/<vae id>/<k[:2]>/<k>.safetensors     k = hash(image content, bucket w x h, crop box[, mask])
    <cache_dir>/text/<text id>/<k[:2]>/<k>.safetensors       k = hash(final caption text[, reference latent key])

The model id is a hash of what determines the encoder's output: family, dtype, the adapter's
`max_sequence_length` (text), and the folder's config files (by content) and weight files (by name and size)
for the VAE (`vae/`) or the text encoders and tokenizers (`text_encoder*/`, `tokenizer*/`). Weights are not
hashed by content (gigabytes on every start): weights replaced by others of exactly the same file size keep the
old entries; delete `cache_dir` after such a swap. So a changed image misses only its own entry (its content hash changed), a
different VAE or dtype misses every latent but keeps the text entries, and a moved model folder still hits.
Old entries are never deleted automatically (another config may share the folder); `cache_dir` can be removed
at any time.

The empty caption is always encoded too: caption dropout trains on its embedding. An image with several captions,
or with shuffled / dropped-out tags, has several final texts (captions.py): each is its own entry.

**Random crops.** With `data.crop: random` each image gets one random crop, drawn from (train.seed, image
content), fixed for the life of the cache; the crop box is part of the key. It varies between images, not between
epochs (a new crop each epoch would need the VAE in every step, which is what caching avoids).

**Non-finite values.** A latent or embedding with NaN or inf is never written: the image (or every image with
that caption) is left out with the reason, typically an fp16 overflow in the encoder. An entry that reads back
non-finite (written by something else, or damaged) is deleted and re-encoded at start-up; `prepare_data` checks
every latent at start-up and `dittrain cache` also every text entry; the batch loader checks what it reads.

**Masks.** With `data.masked_loss` an image's mask goes through the same resize and crop, is averaged down to the
latent's height and width (area interpolation: a latent cell's weight is the share of its 8x8 pixels the mask
covers) and is stored as `mask` (1, h, w) in the latent's entry; the mask's content hash is part of the key, so a
changed mask re-encodes its image.

**References in the text.** Families whose text encoder sees the reference image with the instruction
(`adapter.text_uses_reference`: qwen-image-edit) encode `TextJob`s: a caption with its reference image as cut
for the target's bucket. The key then hashes the caption and the reference's latent key (its content, bucket and
crop), so the same instruction with another reference is another entry. The empty caption (caption dropout) is
encoded with each reference too.

With `data.cache: false` the same code encodes into a dict in memory at start-up and keeps nothing.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..dtypes import DTYPES
from ..errors import Interrupted, UserError
from ..models.stream_load import release_host_memory
from ..phase_log import LOG, Phase
from ..progress import bar as progress_bar
from ..words import count
from .images import BadImage, load_mask, load_pixels
from .video import is_video, load_clip, read_audio

CACHE_VERSION = "1"
_SMALL_FILE = 1 << 20  # config / tokenizer files up to this size are hashed by content, weights by name + size


# ---------------------------------------------------------------------------------------------- identity


def model_identity(model_cfg, adapter, part: str) -> str:
    """Short hash naming the encoder that produced a cache entry ("vae" or "text")."""
    root = Path(model_cfg.path)
    if hasattr(adapter, "cache_dirs"):  # a ModelAdapter's (base.py); duck-typed adapters name the usual folders
        dirs = adapter.cache_dirs(part)
    elif part == "vae":
        dirs = ["vae"]
    else:
        te = list(adapter.text_encoder_dirs or ("text_encoder",))
        dirs = te + [d.replace("text_encoder", "tokenizer") for d in te] + list(adapter.extra_text_dirs)
    # The adapter's own encoding settings count too (a longer T5 sequence gives different embeddings; LTX-2's
    # entries with sound).
    seq = adapter.max_sequence_length
    variant = adapter.cache_variant(part) if hasattr(adapter, "cache_variant") else ""
    extra = f"{seq if part == 'text' and seq is not None else ''}{variant}"
    # `cache_family`: the name the family had when its caches were first written (a renamed family keeps it)
    h = hashlib.sha256(f"{CACHE_VERSION}|{part}|{adapter.cache_family()}|{model_cfg.dtype}|{extra}".encode())
    for d in dirs:
        folder = root / d
        h.update(f"|dir:{d}".encode())
        if not folder.is_dir():
            h.update(b"<missing>")
            continue
        for f in sorted(p for p in folder.rglob("*") if p.is_file()):
            size = f.stat().st_size
            h.update(f"|{f.relative_to(folder).as_posix()}:{size}".encode())
            if size <= _SMALL_FILE:
                h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


def latent_key(sha: str, bucket: tuple[int, int], box: tuple[int, int], mask_sha: str = "", clip: str = "") -> str:
    """`clip`: a video clip's rate, first frame and length (`clip_id`); "" for an image."""
    mask = f"|mask:{mask_sha}" if mask_sha else ""
    clip = f"|clip:{clip}" if clip else ""
    return hashlib.sha256(f"{sha}|{bucket[0]}x{bucket[1]}|{box[0]},{box[1]}{mask}{clip}".encode()).hexdigest()[:32]


def clip_id(fps: float | None, start: int, frames: int) -> str:
    """What names one clip of a video inside its latent key."""
    return f"{fps}|{start}+{frames}"


def text_key(caption: str, reference: str = "") -> str:
    """`reference`: the reference image's latent key, for families whose text encoder sees it ("": none)."""
    ref = f"\0ref:{reference}" if reference else ""
    return hashlib.sha256(f"{caption}{ref}".encode()).hexdigest()[:32]


# ---------------------------------------------------------------------------------------------- stores


class MemoryStore:
    """`data.cache: false`: entries live in a dict for this run only."""

    def __init__(self) -> None:
        self._d: dict[str, dict[str, torch.Tensor]] = {}

    def has(self, key: str) -> bool:
        return key in self._d

    def get(self, key: str) -> dict[str, torch.Tensor]:
        return self._d[key]

    def put(self, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        self._d[key] = tensors

    def drop(self, key: str) -> None:
        self._d.pop(key, None)

    def where(self, key: str) -> str:
        return "memory"


class DiskStore:
    """One safetensors file per entry, written atomically (temp file + rename)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def where(self, key: str) -> str:
        return str(self.folder / key[:2] / f"{key}.safetensors")

    def has(self, key: str) -> bool:
        return os.path.isfile(self.where(key))

    def get(self, key: str) -> dict[str, torch.Tensor]:
        try:
            return load_file(self.where(key))
        except (OSError, SafetensorError) as e:
            raise UserError(f"cache entry {self.where(key)} is unreadable ({e}): delete it and run again") from None

    def put(self, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        path = Path(self.where(key))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
        os.replace(tmp, path)

    def drop(self, key: str) -> None:
        Path(self.where(key)).unlink(missing_ok=True)


def finite(tensors: dict[str, torch.Tensor]) -> bool:
    # CPU tensors: no device sync.
    return all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())


# ---------------------------------------------------------------------------------------------- encoding


@dataclass
class LatentJob:
    """One latent to have in the store: the image, its bucket and crop, and who asked (for error reports)."""

    key: str
    file: str
    bucket: tuple[int, int]
    box: tuple[int, int]
    mask: str = ""  #: the mask file ("" without one)
    #: a video's clip (video.py): its frames from frame `start` at `fps`; an image has frames 1
    frames: int = 1
    start: int = 0
    fps: float | None = None
    audio: bool = False  #: the clip's sound is encoded too (`Entry.audio`)


@dataclass(frozen=True)
class TextJob:
    """One text embedding to have in the store: a caption, with its reference image for families whose text
    encoder sees it (`ref`: the reference's LatentJob, i.e. file, bucket and crop; None: text only)."""

    caption: str
    ref: LatentJob | None = None

    @property
    def key(self) -> str:
        return text_key(self.caption, self.ref.key if self.ref else "")

    @property
    def label(self) -> str:
        """What `EncodeResult.bad_texts` is keyed by: the caption, or the key when a reference belongs to it."""
        return self.key if self.ref else self.caption


@dataclass
class EncodeResult:
    latents_new: int = 0
    latents_hit: int = 0
    texts_new: int = 0
    texts_hit: int = 0
    reencoded: int = 0
    #: latent keys / captions (`TextJob.label`) that could not be encoded, with the reason
    bad_latents: dict[str, str] = field(default_factory=dict)
    bad_texts: dict[str, str] = field(default_factory=dict)
    loaded_encoders: bool = False


def _missing(store, keys: Iterable[str], verify: bool, res: EncodeResult) -> list[str]:
    out = []
    for k in keys:
        if store.has(k):
            if verify and not finite(store.get(k)):
                store.drop(k)  # NaN / inf on disk: never train on it, encode it again
                res.reencoded += 1
                out.append(k)
        else:
            out.append(k)
    return out


def ensure_encoded(
    adapter,
    load_encoders: Callable[[], object],
    latent_store,
    text_store,
    jobs: Sequence[LatentJob],
    captions: Iterable[str | TextJob],
    *,
    batch_size: int = 4,
    verify_latents: bool = True,
    verify_texts: bool = False,
    progress: bool = True,
) -> EncodeResult:
    """Make sure every job's latent and every caption's embedding is in its store; encode what is missing.

    `load_encoders`: an `EncoderStages` (one model group on the device at a time: the text encoders, freed, then
    the VAE), or a plain callable returning Components with both, called at most once, only when something is
    missing. Everything loaded is freed before returning. Each stage runs as a named phase
    (trainer/phase_log.py: out of memory there is one line naming the phase and the fix)."""
    res = EncodeResult()
    unique_jobs = list({j.key: j for j in jobs}.values())
    todo_lat = set(_missing(latent_store, (j.key for j in unique_jobs), verify_latents, res))
    text_jobs = {j.key: j for j in (c if isinstance(c, TextJob) else TextJob(c) for c in captions)}
    if not any(j.ref for j in text_jobs.values()):
        text_jobs.setdefault(text_key(""), TextJob(""))  # caption dropout (with references: one per reference)
    caps = sorted(text_jobs.values(), key=lambda j: (j.caption, j.key))
    todo_txt_set = set(_missing(text_store, (j.key for j in caps), verify_texts, res))
    todo_caps = [j for j in caps if j.key in todo_txt_set]
    res.latents_hit = len(unique_jobs) - len(todo_lat)
    res.texts_hit = len(caps) - len(todo_caps)
    if not todo_lat and not todo_caps:
        return res

    stages = load_encoders if isinstance(load_encoders, EncoderStages) else _AllAtOnce(load_encoders)
    res.loaded_encoders = True
    try:
        _encode_stages(adapter, stages, latent_store, text_store, unique_jobs, todo_lat, todo_caps, batch_size,
                       progress, res)
    except KeyboardInterrupt as e:  # Ctrl-C / SIGTERM: every entry written so far is whole (DiskStore.put)
        raise CachingInterrupted(e, sum(map(text_store.has, todo_txt_set)), sum(map(latent_store.has, todo_lat)),
                                 (latent_store, text_store)) from None
    if "" in res.bad_texts:
        raise UserError(f"the empty caption's embedding is not finite ({res.bad_texts['']}); try model.dtype: bf16 or fp32")
    return res


class CachingInterrupted(KeyboardInterrupt):
    """Caching stopped by a signal (still a KeyboardInterrupt): how many entries this run wrote, and the folder
    that keeps them (None: in memory, data.cache: false), for the line that says what is kept and how to go on."""

    def __init__(self, cause: KeyboardInterrupt, captions: int, latents: int, stores) -> None:
        super().__init__(*cause.args)  # the signal's name, as faults.StopFlag raised it
        self.captions, self.latents = captions, latents  # entries written by this run (counted on disk)
        disk = all(isinstance(s, DiskStore) for s in stores)
        self.kept = os.path.commonpath([str(s.folder) for s in stores]) if disk else None

    def kept_words(self) -> str:
        """What was kept, e.g. "the 8 captions and 3 latents encoded so far are kept in cache/x and reused"."""
        if self.kept is None:
            return "nothing is kept (data.cache: false encodes in memory)"
        if not self.captions + self.latents:
            return f"nothing new was written to {self.kept} yet"
        return (f"the {count(self.captions, 'caption')} and {count(self.latents, 'latent')} encoded so far are kept "
                f"in {self.kept} and reused")


def _encode_stages(adapter, stages, latent_store, text_store, unique_jobs, todo_lat, todo_caps, batch_size,
                   progress, res) -> None:
    try:
        # Text first, then the VAE: each stage loads its models, encodes and frees them before the next. Each bar
        # opens before its models load, so a log (no terminal: progress lines) says what runs while they do.
        if todo_caps:
            with _bar(len(todo_caps), "encoding captions", "cap", progress) as bar, Phase("text caching"), \
                    stages.text() as comps:
                _encode_texts(adapter, comps, text_store, todo_caps, batch_size, bar, res)
                del comps
        if todo_lat:
            with _bar(len(todo_lat), "encoding latents", "img", progress) as bar, \
                    Phase("latent caching") as phase, stages.vae() as vae:
                # the VAE's load apart from the encoding (bench/program/bench_video_cache.py: time per clip)
                phase.mark("VAE loaded")
                _encode_latents(adapter, vae, latent_store, [j for j in unique_jobs if j.key in todo_lat],
                                batch_size, bar, res, getattr(stages, "extras", {}).get("sound_encoder"),
                                getattr(stages, "tile_vae", None))
                del vae
    finally:
        stages.close()
        _free()


def _bar(total: int, desc: str, unit: str, progress: bool):
    # closed however the stage ends: a bar left open is redrawn below the line an interrupt prints
    return progress_bar(total=total, desc=desc, unit=unit, enabled=progress, lines=True)


def _device_dtype(module) -> tuple[torch.device, torch.dtype]:
    p = next(iter(module.parameters()), None)
    return (p.device, p.dtype) if p is not None else (torch.device("cpu"), torch.float32)


def _encode_latents(adapter, vae, store, jobs: list[LatentJob], batch_size: int, bar, res, sound=None,
                    tile_vae=None) -> None:
    """`sound`: the family's sound encoder (loaded with the VAE where it trains sound), for the clips whose sound
    trains (`LatentJob.audio`). `tile_vae`: `EncoderStages.tile_vae`."""
    if vae is None:
        raise RuntimeError("load_encoders() returned Components without a vae")
    device, dtype = _device_dtype(vae)
    video = bool(getattr(adapter, "video", False))
    by_bucket: dict[tuple, list[LatentJob]] = {}
    for j in jobs:  # a batch stacks one shape: one bucket, one clip length, with or without sound
        by_bucket.setdefault((*j.bucket, j.frames, j.audio), []).append(j)
    chunks = [g[i : i + batch_size] for g in by_bucket.values() for i in range(0, len(g), batch_size)]
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:  # decoding releases the GIL
        for chunk in chunks:
            pixels, masks, waves, ok = [], [], [], []
            got = pool.map(lambda j: _with_sound(j, adapter, sound), chunk)
            for j, px in zip(chunk, got, strict=True):
                if isinstance(px, str):
                    res.bad_latents[j.key] = px
                else:
                    pixels.append(px[0])
                    masks.append(px[1])
                    waves.append(px[2])
                    ok.append(j)
            if ok:
                (w, h), frames = chunk[0].bucket, chunk[0].frames
                vae_memory_mode(vae, w * h, tile=tile_vae(vae, w, h, frames, len(ok)) if tile_vae else None)
                # video families: (B, 3, F, H, W), an image as one frame; the VAE chunks time itself (its adapter)
                batch = torch.stack([p if p.ndim == 4 or not video else p.unsqueeze(1) for p in pixels])
                batch = batch.to(device=device, dtype=dtype)
                with torch.no_grad():
                    enc = adapter.encode_videos if video else adapter.encode_images
                    lat = enc(vae, batch).float().cpu()  # device->host sync, once per chunk
                    # image-to-video families: the first frame's conditioning, cached beside the latent
                    conds = {k: v.float().cpu() for k, v in adapter.encode_conditions(vae, batch).items()} \
                        if getattr(adapter, "first_frame_conditions", False) else {}
                    if waves[0] is not None:  # the clips' sound (a chunk is all with or all without)
                        j0 = ok[0]
                        wave = torch.stack(waves).to(_device_dtype(sound)[0])
                        conds |= {k: v.float().cpu() for k, v in
                                  adapter.encode_sound(sound, wave, j0.frames, j0.fps).items()}
                for i, (j, x, m) in enumerate(zip(ok, lat, masks, strict=True)):
                    t = {"latent": x.clone(), **{k: v[i].clone() for k, v in conds.items()}}
                    if m is not None:  # pixel mask -> latent cells: the share of each cell it covers
                        t["mask"] = torch.nn.functional.interpolate(m[None], size=x.shape[-2:], mode="area")[0]
                        if x.ndim == 4:  # (C, F, h, w): one mask for every frame of the clip, (1, 1, h, w)
                            t["mask"] = t["mask"][:, None]
                    if not finite(t):
                        res.bad_latents[j.key] = "VAE latent has NaN/inf (fp16 overflow? try model.dtype: bf16 or fp32)"
                        continue
                    store.put(j.key, t, {"file": j.file, "bucket": f"{j.bucket[0]}x{j.bucket[1]}",
                                         "crop": f"{j.box[0]},{j.box[1]}", "version": CACHE_VERSION})
                    res.latents_new += 1
            bar.update(len(chunk))


def _with_sound(job: LatentJob, adapter, sound) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | str:
    """`_pixels_or_reason`, and the clip's stretch of the audio track where its sound trains (`job.audio`): (2,
    samples) at the sound encoder's rate (video.py `read_audio`), else None."""
    px = _pixels_or_reason(job)
    if isinstance(px, str) or not job.audio:
        return px if isinstance(px, str) else (*px, None)
    if sound is None:
        raise RuntimeError("a clip's sound is to be encoded but the VAE stage loaded no sound encoder")
    try:
        return (*px, read_audio(job.file, job.fps, job.start, job.frames, adapter.sound_rate(sound)))
    except BadImage as e:
        return f"{e} (changed since the scan?)"


def _pixels_or_reason(job: LatentJob) -> tuple[torch.Tensor, torch.Tensor | None] | str:
    try:
        if is_video(job.file):  # (3, F, H, W)
            px = load_clip(job.file, job.bucket, job.box, job.fps, job.start, job.frames)
        else:
            px = load_pixels(job.file, job.bucket, job.box)
    except BadImage as e:
        return f"{e} (changed since the scan?)"
    if not job.mask:
        return px, None
    try:
        return px, load_mask(job.mask, job.bucket, job.box)
    except BadImage as e:
        return f"mask {job.mask}: {e} (changed since the scan?)"


def _reference_or_reason(job: TextJob):
    """The reference image as the text encoder sees it (PIL, cut for the target's bucket), or why not."""
    from .images import cover_and_crop, open_image

    try:
        return cover_and_crop(open_image(job.ref.file), job.ref.bucket, job.ref.box)
    except BadImage as e:
        return f"reference image {job.ref.file}: {e} (changed since the scan?)"


def _encode_texts(adapter, comps, store, captions: list[TextJob], batch_size: int, bar, res) -> None:
    plain, with_ref = [j for j in captions if j.ref is None], [j for j in captions if j.ref is not None]
    chunks = [g[i : i + batch_size] for g in (plain, with_ref) for i in range(0, len(g), batch_size)]
    for chunk in chunks:
        kw = {}
        bar.update(len(chunk))
        if chunk[0].ref is not None:
            refs = [_reference_or_reason(j) for j in chunk]
            for j, r in zip(chunk, refs, strict=True):
                if isinstance(r, str):
                    res.bad_texts[j.label] = r
            chunk, kw = [j for j, r in zip(chunk, refs, strict=True) if not isinstance(r, str)], {
                "images": [r for r in refs if not isinstance(r, str)]}
            if not chunk:
                continue
        with torch.no_grad():
            out = adapter.encode_prompts(comps, [j.caption for j in chunk], **kw)
        out = {k: v.detach().cpu() for k, v in out.items()}  # device->host sync, once per chunk
        for n, job in enumerate(chunk):
            # clone: one caption's slice must not keep the whole batch alive (and safetensors refuses views)
            t = {k: v[n].clone() for k, v in out.items()}
            if not finite(t):
                res.bad_texts[job.label] = "text embedding has NaN/inf (fp16 overflow? try model.dtype: bf16 or fp32)"
                continue
            meta = {"caption": job.caption, "version": CACHE_VERSION}
            if job.ref is not None:
                meta["reference"] = job.ref.file
            store.put(job.key, t, meta)
            res.texts_new += 1


# ---------------------------------------------------------------------------------------------- stages

#: buckets with more pixels than this encode with the VAE tiled (diffusers' `enable_tiling`; at or below it the
#: untiled encode of a batch-sliced 1024x1024 image needs about 1.5 GB in bf16, tiled about a quarter)
VAE_TILE_PIXELS = 1024 * 1024


def _free() -> None:
    """What a stage freed, handed back: its CUDA blocks, and its heap pages (`release_host_memory`: glibc keeps the
    pages of freed small tensors resident, a few hundred MB after a VAE stage's batches of decoded frames, measured
    on the tiny Wan at 832x480; without the trim the RSS after a stage is that, not what caching kept)."""
    release_host_memory()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def vae_memory_mode(vae, pixels: int, threshold: int = VAE_TILE_PIXELS, tile: bool | None = None) -> bool:
    """Slice batches always (one image at a time through the VAE: same latents, lower peak); tile images of more
    than `threshold` pixels, or as `tile` says where given (`EncoderStages.tile_vae`: a clip whose untiled encode
    does not fit the device). Returns whether tiling is on. Modules without the diffusers switches are left as
    they are."""
    if hasattr(vae, "enable_slicing"):
        vae.enable_slicing()
    tile = (pixels > threshold if tile is None else tile) and hasattr(vae, "enable_tiling")
    if tile:
        vae.enable_tiling()
    elif hasattr(vae, "disable_tiling"):
        vae.disable_tiling()
    return tile


class EncoderStages:
    """Loads the encoders in two stages, one on the device at a time: `text()` yields Components with the text
    encoders and tokenizers (no VAE), `vae()` the VAE. Subclasses implement `_load_text` / `_load_vae` and may
    keep per-stage handles in `self.handles` (closed when the stage ends)."""

    def __init__(self) -> None:
        self.handles: list = []
        #: what the VAE stage loaded beside the VAE (`Components.extras`: LTX-2's sound encoder), while it runs
        self.extras: dict = {}
        #: (vae, width, height, frames, batch) -> whether a batch of clips encodes tiled (trainer/sampling/placement.py
        #: `encode_tiles`: a video family's untiled encode that does not fit the GPU); None: tiled above
        #: VAE_TILE_PIXELS (`vae_memory_mode`)
        self.tile_vae = None

    def _load_text(self):
        raise NotImplementedError

    def _load_vae(self):
        raise NotImplementedError

    @contextmanager
    def text(self):
        comps = self._load_text()
        try:
            yield comps
        finally:
            comps.text_encoders.clear()
            del comps
            self._end_stage()

    @contextmanager
    def vae(self):
        vae = self._load_vae()
        try:
            yield vae
        finally:
            del vae
            self.extras = {}
            self._end_stage()

    def _end_stage(self) -> None:
        for h in self.handles:
            if h is not None:  # the stage's encoders are dropped: their streamed blocks are not copied back out
                h.close(keep_weights=False)
        self.handles.clear()
        _free()

    def close(self) -> None:
        self._end_stage()


class _AllAtOnce(EncoderStages):
    """A plain `load_encoders()` callable (tests, custom loaders): loaded once, both stages share it."""

    def __init__(self, load: Callable[[], object]) -> None:
        super().__init__()
        self._load, self._comps = load, None

    def _get(self):
        if self._comps is None:
            self._comps = self._load()
        return self._comps

    @contextmanager
    def text(self):
        yield self._get()

    @contextmanager
    def vae(self):
        self.extras = getattr(self._get(), "extras", {})
        yield self._get().vae

    def close(self) -> None:
        self._comps = None
        super().close()


def place_encoder(encoder, device: torch.device, fraction: float):
    """Put one text encoder on `device`: resident at fraction 0, else its blocks (`text_encoder_blocks`, the ones
    the planner sizes) streamed by the offload conductor. Returns the handle to close, or None. The text stage
    below and sampling (trainer/sampling/placement.py) place encoders with it."""
    from ..models.base import text_encoder_blocks
    from ..offload import attach_offload, move_outside_blocks

    blocks = text_encoder_blocks(encoder) if fraction > 0 else []
    if not blocks:
        encoder.to(device)
        return None
    move_outside_blocks(encoder, blocks, device)
    return attach_offload(blocks, device, fraction, mode="sample")


def resolve_device(device: torch.device | str) -> torch.device | str:
    """train.device's `auto` as the encoders take it: CUDA where there is one, else the CPU; anything else as given."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class StagedLoader(EncoderStages):
    """The adapter's own loader for the two stages on `device` (default train.device), text encoders streamed
    by `place_text(encoder, device)` when given (it returns a handle to close, or None)."""

    def __init__(self, cfg, adapter, device=None, dtype=None, place_text=None) -> None:
        super().__init__()
        self.cfg, self.adapter = cfg, adapter
        self.device = torch.device(resolve_device(device if device is not None else cfg.train.device))
        self.dtype = dtype or DTYPES[cfg.model.dtype]
        self.place_text = place_text

    def _load_text(self):
        if self.place_text is None:
            return self.adapter.load(self.cfg.model, parts={"text"}, dtype=self.dtype, device=self.device)
        comps = self.adapter.load(self.cfg.model, parts={"text"}, dtype=self.dtype, device="cpu")
        for enc in comps.text_encoders:
            self.handles.append(self.place_text(enc, self.device))
        return comps

    def _load_vae(self):
        comps = self.adapter.load(self.cfg.model, parts={"vae"}, dtype=self.dtype, device=self.device)
        self.extras = comps.extras  # a family's sound encoder (ModelAdapter.trains_sound)
        return comps.vae


# ---------------------------------------------------------------------------------------------- command

def encoder_loader(cfg, adapter, device: torch.device | str | None = None) -> Callable[[], object]:
    """The default `load_encoders`: VAE + text encoders of `cfg.model` on `device` (default: train.device)."""

    def load():
        dev = resolve_device(device if device is not None else cfg.train.device)
        return adapter.load(cfg.model, parts={"vae", "text"}, dtype=DTYPES[cfg.model.dtype], device=dev)

    return load


def run_cache(cfg, tile_vae=None) -> None:
    """`dittrain cache`: scan, then encode every missing latent and caption into data.cache_dir (`tile_vae`:
    `EncoderStages.tile_vae`)."""
    from ..models import get_adapter
    from .pipeline import drop_encoding_failures, plan_data

    if cfg.data is None:
        raise UserError("the config has no data: section; `dittrain cache` needs data.sources")
    adapter = get_adapter(cfg.model)
    plan = plan_data(cfg, adapter, force_disk=True)
    tqdm.write(plan.summary(), file=sys.stderr)
    if not cfg.data.cache:
        tqdm.write(f"note: data.cache is false, so fit will encode in memory and not read {cfg.data.cache_dir}",
                   file=sys.stderr)
    try:
        res = ensure_encoded(
            adapter, cache_stages(cfg, adapter, tile_vae=tile_vae), plan.latent_store, plan.text_store, plan.latent_jobs(),
            plan.captions(), batch_size=cfg.data.encode_batch_size, verify_latents=True, verify_texts=True,
        )
    except CachingInterrupted as e:
        name = Interrupted.signal_of(e)
        raise Interrupted(f"caching stopped by {name}: {e.kept_words()}; `dittrain cache` (or `dittrain fit`) with "
                          f"this config encodes the rest", name) from None
    drop_encoding_failures(plan, res)
    tqdm.write(plan.encode_summary(res), file=sys.stderr)
    if torch.cuda.is_available():
        for line in LOG.lines():
            tqdm.write(line, file=sys.stderr)


def cache_stages(cfg, adapter, device=None, dtype=None, fraction: float | None = None,
                 tile_vae=None) -> StagedLoader:
    """The two-stage loader of `dittrain cache` and `fit`: text encoders streamed at `fraction` (default
    offload.text_encoders on a GPU, 0 on the CPU; `place_encoder`), then the VAE (`tile_vae`:
    `EncoderStages.tile_vae`)."""
    loader = StagedLoader(cfg, adapter, device, dtype)
    loader.tile_vae = tile_vae
    if fraction is None:
        fraction = float(cfg.offload.text_encoders) if loader.device.type == "cuda" else 0.0
    f = fraction
    if f > 0:
        loader.place_text = lambda enc, dev: place_encoder(enc, dev, f)
    return loader
