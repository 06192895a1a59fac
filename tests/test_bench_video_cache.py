"""bench/program/bench_video_cache.py (issue 39: video caching flat in the clip count): the CPU smoke runs
`dittrain cache` on the tiny Wan over two clip counts and writes both rows, with the VAE's load apart from the
encoding (the "VAE loaded" mark of trainer/data/cache.py); the ratios, the `--clips` list and the data folders."""

from __future__ import annotations

import json

import pytest

from bench.program import bench_video_cache as bvc


def test_smoke_writes_a_row_per_clip_count(tmp_path, capsys):
    assert bvc.main(["--smoke", "--clips", "2,3", "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o")]) == 0
    (fam,) = json.loads((tmp_path / "o" / "video_cache.json").read_text())
    assert [r["clips"] for r in fam["rows"]] == [2, 3]
    for r in fam["rows"]:
        assert r["rc"] == 0 and r["anon_peak"] > 0 and r["anon_after"] > 0 and r["vram"] == 0  # the CPU: no VRAM
        # the phase split at its mark: the VAE's load, then the clips' encode
        assert 0 < r["vae_load_s"] < r["latent_caching_s"]
        assert r["encode_s_per_clip"] == pytest.approx((r["latent_caching_s"] - r["vae_load_s"]) / r["clips"])
    assert fam["ratios"]["from"] == 2 and fam["ratios"]["to"] == 3 and fam["ratios"]["encode_s_per_clip"] > 0
    table = (tmp_path / "o" / "video_cache.md").read_text()
    assert "| 2 | 0 |" in table and "| 3 | 0 |" in table and "3 clips against 2" in table
    assert table in capsys.readouterr().out
    assert not list((tmp_path / "w" / "wan-1.3b").glob("clips*"))  # without --keep the clips go, the caches stay
    assert len(list((tmp_path / "w" / "wan-1.3b" / "8gb-3clips" / "cache").rglob("*.safetensors"))) >= 3 + 4


def test_clip_counts_ratios_and_data_folders(tmp_path):
    assert bvc.clip_counts("100, 10,10") == [10, 100]
    for bad in ("ten", "0,10", ""):
        with pytest.raises(SystemExit, match="--clips"):
            bvc.clip_counts(bad)
    rows = [{"clips": 10, "encode_s_per_clip": 0.5, "anon_peak": 2e9, "anon_after": 1e9},
            {"clips": 100, "encode_s_per_clip": 0.55, "anon_peak": 2.09e9, "anon_after": 1e9}]
    r = bvc.ratios(rows)
    assert r["encode_s_per_clip"] == pytest.approx(1.1) and r["anon_peak"] == pytest.approx(1.045)
    assert r["anon_peak_mb_per_clip"] == pytest.approx(1.0) and r["anon_after_mb_per_clip"] == 0
    src = tmp_path / "clips"
    src.mkdir()
    for i in range(4):
        (src / f"clip{i}.mp4").write_bytes(b"x" * i)
        (src / f"clip{i}.txt").write_text(f"clip {i}")
    (tmp_path / "d" / "stale.mp4").parent.mkdir()
    (tmp_path / "d" / "stale.mp4").write_bytes(b"old")  # what an earlier run left: gone
    d = bvc.data_folder(src, tmp_path / "d", 2)
    assert sorted(p.name for p in d.iterdir()) == ["clip0.mp4", "clip0.txt", "clip1.mp4", "clip1.txt"]
    assert (d / "clip1.mp4").stat().st_ino == (src / "clip1.mp4").stat().st_ino  # a hard link, no copy
