"""Finding the images and captions of every source, and the bad-input scan.

A source is either a folder of images with same-named `.txt` captions beside them (searched recursively unless
`recursive: false`), or a folder plus a `metadata.jsonl` whose lines are `{"file": "rel/path.png", "caption":
"..."}` (file relative to the folder). Both give a list of `Item`s: one usable image with its captions (prefix
applied; several with `several_captions: true`, one per non-empty line of the .txt, or a `"caption"` list in
metadata.jsonl), its upright size and its content hash. What is made of the captions at training time (shuffle,
tag dropout, trigger word) is `captions.py`'s.

Masks (`data.masked_loss`). An image's mask is `<source>/masks/<same relative path and name>` (any image suffix), or
the file named by a `"mask"` key of its metadata.jsonl line (relative to the source folder). The `masks/` folder is
not scanned for training images. An image without a mask trains on every pixel; a mask that is unreadable or not
the image's size is a bad file (the image is left out, or `strict` stops); a `"mask"` that names a missing file too.

Pairs (edit families, `adapter.takes_reference`; for a family whose reference is optional, `reference_optional`,
only when the data has references: `DataConfig.has_references`). An image's reference is `<source>/control/<same
relative path and name>` (any image suffix), or the file named by a `"control"` key of its metadata.jsonl line. The
`control/` folder is not scanned for training images. An image without a readable reference is a bad file.
Families that join several references (`adapter.max_references` > 1: Flux.2) take more per image: the same name in
`control2/`, `control3/`, ... (each folder one more reference, in order), or a list under `"control"`. Every image
of a run needs as many references as the image with the most (a batch stacks them): one with fewer is a bad file.

The scan runs before any model is loaded and decodes every image completely, so a corrupt, truncated,
zero-byte or unreadable file, a missing caption or a bad metadata line is found in seconds, not hours into a
run. Each such file becomes a `(file, reason)` line in the report. The bucket step adds images too small for
every bucket. What happens next (leave them out and say how many, or stop under `data.strict`) is decided by
`check_report`.

Decoding thousands of images on every start would be slow, so with the cache on, the scan keeps
`<cache_dir>/scan-index.json`: per file its size, modification time, content hash and size in pixels. A file
whose size and mtime are unchanged is not decoded again. Bad files are never indexed (they are re-checked every
run, so a fixed file is picked up).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..config import CONTROL_DIR
from ..errors import UserError
from ..progress import bar as progress_bar
from ..words import count
from .images import IMAGE_SUFFIXES, BadImage, open_image
from .video import VIDEO_SUFFIXES, has_audio, is_video, probe_video

INDEX_NAME = "scan-index.json"
MASK_DIR = "masks"


@dataclass(frozen=True)
class Item:
    """One usable image: path, first caption, which source, upright size in pixels, sha256 of the bytes, and all
    its captions (prefix applied; `()` means just `caption`)."""

    file: str
    caption: str
    source: int
    width: int
    height: int
    sha: str
    captions: tuple[str, ...] = ()
    #: the mask file and its content hash ("" without a mask)
    mask: str = ""
    mask_sha: str = ""
    #: edit families: the reference image, its content hash and upright size ("" / 0 without one)
    control: str = ""
    control_sha: str = ""
    control_size: tuple[int, int] = (0, 0)
    #: further reference images (families with `max_references` > 1), as (file, sha256, upright size)
    more_controls: tuple[tuple[str, str, tuple[int, int]], ...] = ()
    #: a video (video families): its frames at data.fps; 0 for an image
    frames: int = 0
    #: a video with an audio track (video.py `has_audio`)
    audio: bool = False

    @property
    def references(self) -> tuple[tuple[str, str, tuple[int, int]], ...]:
        """Every reference image in order, as (file, sha256, upright size); () without one."""
        return ((self.control, self.control_sha, self.control_size), *self.more_controls) if self.control else ()

    @property
    def all_captions(self) -> tuple[str, ...]:
        return self.captions or (self.caption,)


@dataclass
class ScanReport:
    items: list[Item] = field(default_factory=list)
    #: (file, reason) for every file left out
    bad: list[tuple[str, str]] = field(default_factory=list)
    #: per source: how many candidate images it listed
    found: list[int] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)

    def bad_lines(self, limit: int = 50) -> list[str]:
        lines = [f"  {f}: {r}" for f, r in self.bad[:limit]]
        if len(self.bad) > limit:
            lines.append(f"  ... and {len(self.bad) - limit} more")
        return lines


def join_caption(prefix: str, caption: str) -> str:
    """`caption_prefix` + caption, with one space between unless the prefix already ends in whitespace."""
    if not prefix:
        return caption
    if not caption:
        return prefix.strip()
    return prefix + caption if prefix[-1].isspace() else f"{prefix} {caption}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _caption_lines(text: str, several: bool) -> list[str]:
    if not several:
        return [text.strip()]
    return [line.strip() for line in text.splitlines() if line.strip()] or [""]


def _folder_mask(root: Path, image: Path) -> Path | None:
    stem = root / MASK_DIR / image.relative_to(root).with_suffix("")
    return next((m for m in (stem.with_suffix(s) for s in IMAGE_SUFFIXES) if m.is_file()), None)


def _control_dir(k: int) -> str:
    """The folder of the k-th reference (1-based): control/, control2/, control3/, ..."""
    return CONTROL_DIR if k == 1 else f"{CONTROL_DIR}{k}"


def _folder_controls(root: Path, image: Path) -> list[Path]:
    """The image's references: its name in control/, then in control2/, ... while that folder exists and has it."""
    out, rel = [], image.relative_to(root).with_suffix("")
    for k in range(1, 1000):
        if not (root / _control_dir(k)).is_dir():
            break
        stem = root / _control_dir(k) / rel
        found = next((m for m in (stem.with_suffix(s) for s in IMAGE_SUFFIXES) if m.is_file()), None)
        if found is None:
            break
        out.append(found)
    return out


def _with_controls(root: Path, cands, report: ScanReport, meta: dict | None = None):
    """Pairs: each candidate with its reference images appended (folder rule, or `meta[path]` from metadata)."""
    out = []
    for path, caps, mask in cands:
        ctrls = meta.get(path) if meta is not None and path in meta else _folder_controls(root, path)
        missing = next((c for c in ctrls if not c.is_file()), None)
        if not ctrls:
            report.bad.append((str(path), f"missing reference image ({CONTROL_DIR}/{path.relative_to(root).with_suffix('')}"
                                          f".* or a \"control\" metadata key)"))
        elif missing is not None:
            report.bad.append((str(path), f"reference image {missing} not found"))
        else:
            out.append((path, caps, mask, tuple(ctrls)))
    return out


def read_caption(path: Path) -> str:
    """A caption file's text: UTF-8 (with or without the byte-order mark some editors write), or UTF-16 with its
    byte-order mark (Windows Notepad's "Unicode"). Anything else raises UnicodeDecodeError (Latin-1 is not told
    apart from UTF-8 by its bytes alone, so it is refused, not guessed)."""
    raw = path.read_bytes()
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return raw.decode("utf-16")  # the BOM says the byte order; decode drops it
    return raw.decode("utf-8-sig")  # a UTF-8 BOM is dropped, plain UTF-8 read as it is


def _suffixes(videos: bool) -> tuple[str, ...]:
    return IMAGE_SUFFIXES + VIDEO_SUFFIXES if videos else IMAGE_SUFFIXES


def _folder_candidates(
    i: int, root: Path, recursive: bool, several: bool, masks: bool, report: ScanReport, controls: bool = False,
    videos: bool = False,
) -> list[tuple[Path, list[str], Path | None]]:
    walk = root.rglob("*") if recursive else root.glob("*")
    images = sorted(p for p in walk if p.suffix.lower() in _suffixes(videos) and not p.is_dir())
    skip = {d for d, on in ((MASK_DIR, masks), (CONTROL_DIR, controls)) if on}
    if skip:  # control2/, control3/, ... hold further references
        images = [p for p in images if p.relative_to(root).parts[0] not in skip
                  and not (controls and re.fullmatch(rf"{CONTROL_DIR}[0-9]+", p.relative_to(root).parts[0]))]
    out: list[tuple[Path, list[str], Path | None]] = []
    missing = 0
    for p in images:
        txt = p.with_suffix(".txt")
        if not txt.is_file():
            report.bad.append((str(p), f"missing caption ({txt.name} not found)"))
            missing += 1
            continue
        try:
            out.append((p, _caption_lines(read_caption(txt), several), _folder_mask(root, p) if masks else None))
        except UnicodeDecodeError:
            report.bad.append((str(p), f"caption {txt.name} is not UTF-8 text (Latin-1? convert it: `iconv -f latin1 "
                                       f"-t utf-8 {txt.name} > new.txt`, then replace the old one)"))
        except OSError as e:
            report.bad.append((str(p), f"caption {txt.name} unreadable ({e.strerror or e})"))
    if missing and (root / "metadata.jsonl").is_file():
        report.hints.append(
            f"data.sources[{i}]: {count(missing, 'image')} {'has' if missing == 1 else 'have'} no .txt caption but {root / 'metadata.jsonl'} exists; "
            "set metadata: metadata.jsonl to use it"
        )
    report.found.append(len(images))
    return out


def _metadata_path(i: int, root: Path, metadata: Path) -> Path:
    # Relative paths are taken from the current directory like every path in a config; a bare name that only
    # exists inside the source folder ("metadata.jsonl") is found there too.
    if metadata.is_file():
        return metadata
    if not metadata.is_absolute() and (root / metadata).is_file():
        return root / metadata
    raise UserError(f"data.sources[{i}].metadata: file '{metadata}' not found (looked in . and in {root})")


def _metadata_candidates(
    i: int, root: Path, metadata: Path, masks: bool, report: ScanReport, controls: dict | None = None,
    videos: bool = False,
) -> list[tuple[Path, list[str], Path | None]]:
    meta = _metadata_path(i, root, metadata)
    out: list[tuple[Path, list[str], Path | None]] = []
    lines = meta.read_text(encoding="utf-8", errors="replace").splitlines()
    n = 0
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        n += 1
        where = f"{meta}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            report.bad.append((where, f"not valid JSON ({e.msg})"))
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("file"), str):
            report.bad.append((where, 'expected an object with a "file" string'))
            continue
        path = root / rec["file"]
        caption = rec.get("caption")
        if isinstance(caption, list) and caption and all(isinstance(c, str) for c in caption):
            captions = [c.strip() for c in caption]
        elif isinstance(caption, str):
            captions = [caption.strip()]
        else:
            report.bad.append((str(path), f'missing caption (no "caption" string or list of strings at {where})'))
            continue
        if path.suffix.lower() not in _suffixes(videos):
            report.bad.append((str(path), f"not a JPEG/PNG/WebP{'/video' if videos else ''} file name ({where})"))
            continue
        if not path.exists():
            report.bad.append((str(path), f"file not found ({where})"))
            continue
        mask = None
        if masks:
            if isinstance(rec.get("mask"), str):
                mask = root / rec["mask"]
                if not mask.is_file():
                    report.bad.append((str(path), f"mask {mask} not found ({where})"))
                    continue
            else:
                mask = _folder_mask(root, path)
        ctrl = rec.get("control")
        if controls is not None and (isinstance(ctrl, str) or (isinstance(ctrl, list) and ctrl
                                                               and all(isinstance(c, str) for c in ctrl))):
            controls[path] = [root / c for c in ([ctrl] if isinstance(ctrl, str) else ctrl)]
        out.append((path, captions, mask))
    report.found.append(n)
    return out


def scan_sources(sources, index_dir: Path | None = None, progress: bool = True, masks: bool = False,
                 controls: bool = False, videos: bool = False, fps: float | None = None) -> ScanReport:
    """Scan every source (a list of `SourceConfig`). Raises `UserError` for a missing folder or an empty data set.

    `index_dir`: where to keep the scan index (None: decode everything, keep nothing). `masks`: find and check
    each image's mask (data.masked_loss). `controls`: pairs; find and check each image's reference image.
    `videos`: video families; the sources' videos (video.py `VIDEO_SUFFIXES`) are items too, decoded whole and
    counted in frames at `fps` (`Item.frames`)."""
    report = ScanReport()
    per_source: list[list[tuple[Path, list[str], Path | None]]] = []
    for i, src in enumerate(sources):
        root = Path(src.path)
        if not root.exists():
            tried = f" (looked for {root.resolve()})" if not root.is_absolute() else ""
            raise UserError(f"data.sources[{i}].path: folder '{root}' not found{tried}")
        if not root.is_dir():
            raise UserError(f"data.sources[{i}].path: '{root}' is a file, expected a folder of images")
        meta_ctrl: dict | None = {} if controls and src.metadata is not None else None
        if src.metadata is not None:
            cands = _metadata_candidates(i, root, Path(src.metadata), masks, report, meta_ctrl, videos)
        else:
            cands = _folder_candidates(i, root, src.recursive, src.several_captions, masks, report, controls, videos)
        per_source.append(_with_controls(root, cands, report, meta_ctrl) if controls else [(*c, None) for c in cands])
    if sum(report.found) == 0:
        where = ", ".join(str(s.path) for s in sources)
        raise UserError(f"no images ({' '.join(_suffixes(videos))}) found in {where}")

    index_file = index_dir / INDEX_NAME if index_dir is not None else None
    index = _read_index(index_file)
    flat = [(i, path, caps, mask, ctrl) for i, cands in enumerate(per_source) for path, caps, mask, ctrl in cands]
    bar = progress_bar(total=len(flat), desc="scanning images", unit="img", enabled=progress and len(flat) >= 50,
                       leave=False)
    new_index: dict[str, dict] = {}
    # Decoding and hashing release the GIL: threads make the first scan of a large folder several times faster.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        probes = pool.map(lambda c: (_probe(c[1], index, fps if videos else None), c[3] and _probe(c[3], index),
                                     c[4] and [_probe(r, index) for r in c[4]]), flat)
        for (i, path, caps, mask, ctrl), (got, got_mask, got_ctrl) in zip(flat, probes, strict=True):
            bar.update(1)
            if isinstance(got, str):
                report.bad.append((str(path), got))
                continue
            key, rec = got
            new_index[key] = rec
            mask_sha = ""
            if mask is not None:
                if isinstance(got_mask, str):
                    report.bad.append((str(path), f"mask {mask}: {got_mask}"))
                    continue
                mkey, mrec = got_mask
                new_index[mkey] = mrec
                if (mrec["w"], mrec["h"]) != (rec["w"], rec["h"]):
                    report.bad.append((str(path), f"mask {mask} is {mrec['w']}x{mrec['h']}, the image "
                                       f"{rec['w']}x{rec['h']} (a mask must have its image's size)"))
                    continue
                mask_sha = mrec["sha"]
            refs = []
            for r, got_r in zip(ctrl or (), got_ctrl or (), strict=True):
                if isinstance(got_r, str):
                    report.bad.append((str(path), f"reference image {r}: {got_r}"))
                    break
                new_index[got_r[0]] = got_r[1]
                refs.append((str(r), got_r[1]["sha"], (got_r[1]["w"], got_r[1]["h"])))
            if ctrl and len(refs) < len(ctrl):
                continue
            first = refs[0] if refs else ("", "", (0, 0))
            caps = tuple(join_caption(sources[i].caption_prefix, c) for c in caps)
            report.items.append(Item(str(path), caps[0], i, rec["w"], rec["h"], rec["sha"], caps if len(caps) > 1 else (),
                                     str(mask) if mask is not None else "", mask_sha, *first, tuple(refs[1:]),
                                     rec.get("frames", 0), bool(rec.get("audio", False))))
    bar.close()
    _same_reference_count(report)
    if index_file is not None and any(index.get(k) != v for k, v in new_index.items()):
        _write_index(index_file, {**index, **new_index})
    return report


def _same_reference_count(report: ScanReport) -> None:
    """Pairs with several references: every image needs as many as the image with the most (a batch stacks
    them); one with fewer is a bad file."""
    most = max((len(it.references) for it in report.items), default=0)
    if most < 2:
        return
    keep = []
    for it in report.items:
        if len(it.references) < most:
            report.bad.append((it.file, f"{count(len(it.references), 'reference image')}, other images have {most} "
                                        f"({', '.join(_control_dir(k) + '/' for k in range(1, most + 1))} or a "
                                        f"\"control\" list of {most}): every image needs as many"))
        else:
            keep.append(it)
    report.items = keep


def _probe(path: Path, index: dict[str, dict], fps: float | None = None) -> tuple[str, dict] | str:
    """(index key, {size, mtime_ns, w, h, sha}) of a good image, or the reason it is bad. A video (video families
    only list them) also gets `frames` at `fps`, and its index key names the rate."""
    try:
        st = path.stat()
        video = is_video(path)
        key = str(path.resolve()) + (f"|fps={fps}" if video else "")
        hit = index.get(key)
        if hit and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns:
            # a video indexed before the index said whether it has sound: its header tells (no decoding)
            return key, hit if not video or "audio" in hit else {**hit, "audio": has_audio(path)}
        if video:
            w, h, n = probe_video(path, fps)
            return key, {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "w": w, "h": h, "sha": _sha256(path),
                         "frames": n, "audio": has_audio(path)}
        w, h = open_image(path).size
        return key, {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "w": w, "h": h, "sha": _sha256(path)}
    except BadImage as e:
        return str(e)
    except OSError as e:
        return f"unreadable ({e.strerror or e})"


def check_report(report: ScanReport, strict: bool) -> None:
    """`data.strict`: any bad file stops the run. Always: nothing usable left stops the run."""
    if report.bad and strict:
        raise UserError(
            f"data.strict is true and {len(report.bad)} input files are bad (fix or remove them, or set "
            "data.strict: false to train without them):\n" + "\n".join(report.bad_lines(20))
        )
    if not report.items:
        raise UserError(
            f"no usable images: all {len(report.bad)} were left out:\n" + "\n".join(report.bad_lines(20))
        )


def _read_index(path: Path | None) -> dict[str, dict]:
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # a damaged index only costs a re-scan


def _write_index(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, sort_keys=True))
    os.replace(tmp, path)  # atomic: a crash never leaves half an index
