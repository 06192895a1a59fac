"""Caption files as editors write them: UTF-8 with or without a BOM, UTF-16 with a BOM (Windows Notepad's
"Unicode") are read; Latin-1 is refused with the command that converts it; a missing source folder names the path
it was looked for at."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from trainer.config import SourceConfig
from trainer.data.sources import read_caption, scan_sources
from trainer.errors import UserError


def _image(path: Path) -> None:
    Image.fromarray(np.full((32, 32, 3), 128, np.uint8)).save(path)


@pytest.mark.parametrize(("encoding", "prefix"), [("utf-8", b""), ("utf-8", b"\xef\xbb\xbf"),
                                                  ("utf-16-le", b"\xff\xfe"), ("utf-16-be", b"\xfe\xff")])
def test_utf8_and_utf16_captions_with_a_bom_are_read(tmp_path, encoding, prefix):
    text = "ein Café, ein Bär: 猫"
    (tmp_path / "a.txt").write_bytes(prefix + text.encode(encoding))
    assert read_caption(tmp_path / "a.txt") == text
    _image(tmp_path / "a.png")
    rep = scan_sources([SourceConfig(path=tmp_path)], progress=False)
    assert not rep.bad and [it.caption for it in rep.items] == [text]


def test_a_latin1_caption_is_refused_with_the_command_that_converts_it(tmp_path):
    (tmp_path / "a.txt").write_bytes("ein Café".encode("latin-1"))
    (tmp_path / "b.txt").write_text("fine", encoding="utf-8")
    _image(tmp_path / "a.png")
    _image(tmp_path / "b.png")
    rep = scan_sources([SourceConfig(path=tmp_path)], progress=False)
    assert rep.bad == [(str(tmp_path / "a.png"), "caption a.txt is not UTF-8 text (Latin-1? convert it: "
                                                 "`iconv -f latin1 -t utf-8 a.txt > new.txt`, then replace the old one)")]


def test_a_missing_folder_is_named_as_written_and_as_the_path_tried(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        scan_sources([SourceConfig(path=Path("data/mine"))], progress=False)
    assert str(e.value) == (f"data.sources[0].path: folder 'data/mine' not found (looked for "
                            f"{Path(os.getcwd()) / 'data' / 'mine'})")
