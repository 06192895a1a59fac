"""Sources, image decoding and the bad-input scan (no model involved)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from trainer.config import SourceConfig
from trainer.data import images as img_mod
from trainer.data.images import open_image
from trainer.data.sources import check_report, join_caption, scan_sources
from trainer.errors import UserError

DATA = Path(__file__).resolve().parents[1] / "data"


def write(path: Path, size=(64, 64), colour=(200, 30, 30), fmt=None, caption: str | None = "a thing", mode="RGB"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, colour).save(path, format=fmt)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption)
    return path


def src(path, **kw) -> SourceConfig:
    return SourceConfig(path=path, **kw)


# ---------------------------------------------------------------------------------------------- sources


def test_folder_source_recursive_and_not(tmp_path):
    write(tmp_path / "a.png", caption="first")
    write(tmp_path / "b.jpg", fmt="JPEG", caption="  second\n")
    write(tmp_path / "sub" / "c.webp", fmt="WEBP", caption="third")
    (tmp_path / "notes.txt").write_text("not an image")
    rep = scan_sources([src(tmp_path)])
    assert sorted((Path(i.file).name, i.caption) for i in rep.items) == [
        ("a.png", "first"), ("b.jpg", "second"), ("c.webp", "third")]
    assert rep.bad == [] and rep.found == [3]
    flat = scan_sources([src(tmp_path, recursive=False)])
    assert sorted(Path(i.file).name for i in flat.items) == ["a.png", "b.jpg"]


def test_metadata_source_and_bad_lines(tmp_path):
    write(tmp_path / "x.png", caption=None)
    write(tmp_path / "d" / "y.png", caption=None)
    lines = [
        json.dumps({"file": "x.png", "caption": "an x"}),
        json.dumps({"file": "d/y.png", "caption": "a y"}),
        "{not json",
        json.dumps({"file": "x.png"}),
        json.dumps({"file": "gone.png", "caption": "missing"}),
        json.dumps({"caption": "no file"}),
        "",
    ]
    (tmp_path / "metadata.jsonl").write_text("\n".join(lines))
    rep = scan_sources([src(tmp_path, metadata=Path("metadata.jsonl"), caption_prefix="ohwx")])
    assert sorted((Path(i.file).name, i.caption) for i in rep.items) == [("x.png", "ohwx an x"), ("y.png", "ohwx a y")]
    reasons = [r for _, r in rep.bad]
    assert len(reasons) == 4
    assert any("not valid JSON" in r for r in reasons)
    assert any("missing caption" in r for r in reasons)
    assert any("file not found" in r for r in reasons)
    assert any('"file" string' in r for r in reasons)
    assert rep.found == [6]


def test_bundled_sample_sets():
    rep = scan_sources([src(DATA / "shapes"), src(DATA / "shapes_meta", metadata=Path("metadata.jsonl"))])
    assert rep.bad == []
    assert rep.found == [12, 4]
    sizes = {(i.width, i.height) for i in rep.items}
    assert {(64, 64), (128, 64), (64, 128)} <= sizes and len(sizes) >= 6
    assert any("nested" in i.file for i in rep.items)
    assert {Path(i.file).suffix for i in rep.items} == {".png", ".jpg", ".webp"}
    assert all(i.caption.startswith(("a ", "an ")) for i in rep.items)


def test_several_sources_keep_their_index_and_prefix(tmp_path):
    write(tmp_path / "s1" / "a.png", caption="cat")
    write(tmp_path / "s2" / "b.png", caption="dog")
    rep = scan_sources([src(tmp_path / "s1", caption_prefix="sks,"), src(tmp_path / "s2", repeats=3)])
    got = {Path(i.file).name: (i.source, i.caption) for i in rep.items}
    assert got == {"a.png": (0, "sks, cat"), "b.png": (1, "dog")}


def test_join_caption():
    assert join_caption("", "a cat") == "a cat"
    assert join_caption("ohwx", "a cat") == "ohwx a cat"
    assert join_caption("ohwx, ", "a cat") == "ohwx, a cat"
    assert join_caption("ohwx", "") == "ohwx"


# ---------------------------------------------------------------------------------------------- decoding


def test_exif_rotation_applied(tmp_path):
    im = Image.new("RGB", (40, 20), (10, 200, 10))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 on display
    im.save(tmp_path / "r.jpg", exif=exif.tobytes())
    assert open_image(tmp_path / "r.jpg").size == (20, 40)
    (tmp_path / "r.txt").write_text("rot")
    (item,) = scan_sources([src(tmp_path)]).items
    assert (item.width, item.height) == (20, 40)


def test_alpha_flattened_on_white(tmp_path):
    im = Image.new("RGBA", (8, 8), (255, 0, 0, 0))  # fully transparent red
    im.putpixel((0, 0), (255, 0, 0, 255))
    im.save(tmp_path / "a.png")
    out = np.asarray(open_image(tmp_path / "a.png"))
    assert out.shape == (8, 8, 3)
    assert tuple(out[0, 0]) == (255, 0, 0) and tuple(out[4, 4]) == (255, 255, 255)
    # palette image with a transparent index
    p = Image.new("P", (4, 4), 0)
    p.putpalette([0, 0, 255] + [0, 0, 0] * 255)
    p.save(tmp_path / "p.png", transparency=0)
    assert tuple(np.asarray(open_image(tmp_path / "p.png"))[0, 0]) == (255, 255, 255)


def test_grayscale_cmyk_16bit_converted(tmp_path):
    Image.new("L", (8, 8), 100).save(tmp_path / "g.png")
    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(tmp_path / "c.jpg")
    Image.fromarray(np.full((8, 8), 32768, dtype=np.uint16)).save(tmp_path / "s.png")
    Image.new("LA", (8, 8), (50, 255)).save(tmp_path / "la.png")
    g, c, s, la = (np.asarray(open_image(tmp_path / n)) for n in ("g.png", "c.jpg", "s.png", "la.png"))
    assert all(a.shape == (8, 8, 3) and a.dtype == np.uint8 for a in (g, c, s, la))
    assert tuple(g[0, 0]) == (100, 100, 100)
    assert c[0, 0, 0] > 200 and c[0, 0, 1] < 60  # CMYK red -> RGB red
    assert 120 <= s[0, 0, 0] <= 135  # half of 16-bit range, not clipped to white
    assert tuple(la[0, 0]) == (50, 50, 50)


def test_to_tensor_range_and_crop(tmp_path):
    write(tmp_path / "w.png", size=(100, 50), colour=(255, 0, 0))
    px = img_mod.load_pixels(tmp_path / "w.png", (64, 32), (0, 0))
    assert px.shape == (3, 32, 64)
    assert px[0].min() == 1.0 and px[1].max() == -1.0
    # center crop of a 100x50 image into 48x48: covering size 96x48, box at (24, 0)
    assert img_mod.crop_box(100, 50, (48, 48), "center") == (24, 0)
    boxes = {img_mod.crop_box(100, 50, (48, 48), "random", seed_text=f"0|{i}") for i in range(20)}
    assert len(boxes) > 3 and all(0 <= x <= 48 and y == 0 for x, y in boxes)
    assert img_mod.crop_box(100, 50, (48, 48), "random", "0|a") == img_mod.crop_box(100, 50, (48, 48), "random", "0|a")


# ---------------------------------------------------------------------------------------------- bad input


def make_bad_folder(root: Path) -> dict[str, str]:
    """One file of every bad kind; returns name -> expected reason fragment."""
    write(root / "good.png")
    (root / "zero.png").write_bytes(b"")
    (root / "zero.txt").write_text("zero")
    good = (root / "good.png").read_bytes()
    (root / "trunc.png").write_bytes(good[: len(good) // 2])
    (root / "trunc.txt").write_text("t")
    write(root / "tj.jpg", size=(64, 64), fmt="JPEG")
    data = (root / "tj.jpg").read_bytes()
    (root / "tj.jpg").write_bytes(data[: len(data) // 2])
    (root / "junk.png").write_bytes(os.urandom(300))
    (root / "junk.txt").write_text("j")
    write(root / "nocap.png", caption=None)
    os.symlink(root / "does-not-exist.png", root / "dangling.png")
    (root / "dangling.txt").write_text("d")
    return {
        "zero.png": "zero-byte",
        "trunc.png": "truncated",
        "tj.jpg": "truncated",
        "junk.png": "corrupt",
        "nocap.png": "missing caption",
        "dangling.png": "unreadable",
    }


def test_every_bad_kind_listed_with_reason(tmp_path):
    expect = make_bad_folder(tmp_path)
    rep = scan_sources([src(tmp_path)])
    assert [Path(i.file).name for i in rep.items] == ["good.png"]
    got = {Path(f).name: r for f, r in rep.bad}
    assert set(got) == set(expect)
    for name, frag in expect.items():
        assert frag in got[name], (name, got[name])
    check_report(rep, strict=False)  # default: continue without them
    with pytest.raises(UserError) as e:
        check_report(rep, strict=True)
    msg = str(e.value)
    assert "data.strict" in msg and all(name in msg for name in expect)


def test_wrong_folder_and_empty_dataset_are_one_line_errors(tmp_path):
    with pytest.raises(UserError) as e:
        scan_sources([src(tmp_path / "nope")])
    assert "data.sources[0].path" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "file.png").write_bytes(b"x")
    with pytest.raises(UserError, match="is a file"):
        scan_sources([src(tmp_path / "file.png")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError) as e:
        scan_sources([src(tmp_path / "empty")])
    assert "no images" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="metadata"):
        scan_sources([src(tmp_path / "empty", metadata=Path("metadata.jsonl"))])


def test_all_bad_is_an_error(tmp_path):
    (tmp_path / "z.png").write_bytes(b"")
    (tmp_path / "z.txt").write_text("z")
    rep = scan_sources([src(tmp_path)])
    with pytest.raises(UserError, match="no usable images"):
        check_report(rep, strict=False)


def test_missing_caption_hints_at_metadata(tmp_path):
    write(tmp_path / "a.png", caption=None)
    (tmp_path / "metadata.jsonl").write_text(json.dumps({"file": "a.png", "caption": "x"}))
    rep = scan_sources([src(tmp_path)])
    assert rep.bad and any("metadata: metadata.jsonl" in h for h in rep.hints)


def test_scan_index_skips_unchanged_files(tmp_path, monkeypatch):
    for n in range(3):
        write(tmp_path / "d" / f"{n}.png", colour=(n * 40, 0, 0))
    idx = tmp_path / "cache"
    first = scan_sources([src(tmp_path / "d")], index_dir=idx)
    calls = []
    real = img_mod.open_image
    monkeypatch.setattr("trainer.data.sources.open_image", lambda p: calls.append(Path(p).name) or real(p))
    again = scan_sources([src(tmp_path / "d")], index_dir=idx)
    assert calls == [] and again.items == first.items
    write(tmp_path / "d" / "1.png", size=(70, 64), colour=(1, 2, 3))
    os.utime(tmp_path / "d" / "1.png", ns=(1, 1))  # a different mtime even on coarse clocks
    changed = scan_sources([src(tmp_path / "d")], index_dir=idx)
    assert calls == ["1.png"]
    new = {Path(i.file).name: i for i in changed.items}
    old = {Path(i.file).name: i for i in first.items}
    assert new["1.png"].sha != old["1.png"].sha and new["1.png"].width == 70
    assert new["0.png"] == old["0.png"]
