"""Caption handling: several captions per image, tag shuffling with keep_tokens, tag dropout, a trigger word; the
text cache keyed by the final caption text; picks that depend only on (seed, position)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from pydantic import ValidationError
from test_data_cache import FakeAdapter, config, make_images, make_model, prepare
from test_train_support import write_images

from trainer.config import SourceConfig, load_config
from trainer.data.cache import text_key
from trainer.data.captions import caption_texts, pick, transform


def test_transform_keeps_the_front_tags_and_shuffles_or_drops_the_rest():
    cap = "ohwx, person, red hat, blue coat, smiling, outdoors, tree, sky"
    seen = set()
    for s in range(40):
        out = transform(cap, np.random.default_rng(s), shuffle=True, keep_tokens=2, tag_dropout=0.0)
        tags = out.split(", ")
        assert tags[:2] == ["ohwx", "person"] and sorted(tags[2:]) == sorted(cap.split(", ")[2:])
        seen.add(out)
    assert len(seen) > 20  # it does shuffle
    lens = [len(transform(cap, np.random.default_rng(s), shuffle=False, keep_tokens=1, tag_dropout=0.5).split(", "))
            for s in range(200)]
    assert min(lens) >= 1 and max(lens) <= 8 and abs(np.mean(lens) - 4.5) < 0.4  # the kept tag + about half of 7


def test_caption_texts_finite_set_trigger_and_variants():
    plain = SourceConfig(path=".", trigger_word="sks")
    assert caption_texts(("a dog", "a brown dog"), plain, 8, 0, "abc") == ("sks, a dog", "sks, a brown dog")
    shuf = SourceConfig(path=".", shuffle_tags=True, keep_tokens=1, trigger_word="sks")
    texts = caption_texts(("dog, brown, grass, sun, ball",), shuf, 5, 0, "abc")
    assert 1 < len(texts) <= 5 and all(t.startswith("sks, dog, ") for t in texts)
    assert texts == caption_texts(("dog, brown, grass, sun, ball",), shuf, 5, 0, "abc")  # seeded
    assert texts != caption_texts(("dog, brown, grass, sun, ball",), shuf, 5, 1, "abc")  # by train.seed
    # picks: a function of (seed, position, slot) only, and every text gets picked
    picks = [pick(texts, 0, p, 0) for p in range(200)]
    assert picks == [pick(texts, 0, p, 0) for p in range(200)] and set(picks) == set(texts)


def test_several_captions_each_cached_and_drawn(tmp_path):
    make_model(tmp_path / "model")
    files = make_images(tmp_path / "imgs", n=3)
    for i, f in enumerate(files):
        f.with_suffix(".txt").write_text(f"first caption {i}\n\nsecond caption {i}\nthird caption {i}\n")
    cfg = config(tmp_path, sources=[{"path": str(tmp_path / "imgs"), "several_captions": True, "trigger_word": "tw"}])
    data, adapter, _ = prepare(cfg)
    want = {f"tw, {w} caption {i}" for i in range(3) for w in ("first", "second", "third")}
    assert set(adapter.prompts) == want | {""}  # each caption encoded once, at cache time
    got: dict[str, set[str]] = {}
    for p in range(data.batches_per_epoch * 12):
        b = data.batch_at(p)
        for n, (f, cap) in enumerate(zip(b.files, b.captions, strict=True)):
            got.setdefault(f, set()).add(cap)
            # the batch's embedding is the one encoded for exactly this text
            emb = FakeAdapter().encode_prompts(None, [cap])
            assert torch.equal(b.text["pooled"][n], emb["pooled"][0])
    assert {f: len(c) for f, c in got.items()} == {str(f): 3 for f in files}
    # a second TrainData (a resumed run) sees the same texts at the same positions, with no encoder
    again, adapter2, loader = prepare(cfg)
    assert loader.calls == 0
    assert [again.batch_at(p).captions for p in range(20)] == [data.batch_at(p).captions for p in range(20)]


def test_shuffle_caches_caption_variants_per_image(tmp_path):
    make_model(tmp_path / "model")
    files = make_images(tmp_path / "imgs", n=2)
    for f in files:
        f.with_suffix(".txt").write_text("person, red hat, blue coat, smiling, outdoors, tree")
    src = {"path": str(tmp_path / "imgs"), "shuffle_tags": True, "keep_tokens": 1, "tag_dropout": 0.1}
    data, adapter, _ = prepare(config(tmp_path, sources=[src], caption_variants=3))
    per_item = [data.plan.item_texts(i) for i in range(2)]
    assert all(len(t) == 3 for t in per_item) and set(per_item[0]) != set(per_item[1])  # content hash seeds them
    assert set(adapter.prompts) == set(per_item[0]) | set(per_item[1]) | {""}
    for texts in per_item:
        for t in texts:
            assert data.plan.text_store.has(text_key(t)) and t.startswith("person")
    caps = {c for p in range(40) for c in data.batch_at(p).captions}
    assert caps == set(per_item[0]) | set(per_item[1])


def test_metadata_caption_list(tmp_path):
    make_model(tmp_path / "model")
    make_images(tmp_path / "imgs", n=2)
    (tmp_path / "imgs" / "meta.jsonl").write_text(
        json.dumps({"file": "img0.png", "caption": ["one", "two"]}) + "\n"
        + json.dumps({"file": "img1.png", "caption": "three"}) + "\n"
        + json.dumps({"file": "img1.png", "caption": [1, 2]}) + "\n"
    )
    data, adapter, _ = prepare(config(tmp_path, sources=[{"path": str(tmp_path / "imgs"), "metadata": "meta.jsonl"}]))
    assert sorted(adapter.prompts) == ["", "one", "three", "two"]
    assert any("list of strings" in r for _, r in data.report.bad)


def test_caption_options_train_end_to_end_from_yaml(tiny_models, tmp_path):
    from trainer.train.trainer import Trainer

    imgs = write_images(tmp_path / "imgs")
    for i, txt in enumerate(sorted(imgs.glob("*.txt"))):
        txt.write_text(f"shape {i}, red, blue, round, small\nanother caption {i}, green, big\n")
    raw = {
        "model": {"family": "flux", "path": str(tiny_models / "flux"), "dtype": "fp32"},
        "train": {"method": "lora", "steps": 3, "batch_size": 2, "seed": 0},
        "lora": {"rank": 2, "alpha": 2},
        "data": {"sources": [{"path": str(imgs), "several_captions": True, "trigger_word": "ohwx",
                              "shuffle_tags": True, "keep_tokens": 1, "tag_dropout": 0.2}],
                 "resolutions": [64], "cache_dir": str(tmp_path / "cache"), "caption_variants": 4},
        "output": {"dir": str(tmp_path / "out"), "tensorboard": False},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    t = Trainer(load_config(path))
    t.setup()
    texts = [t.data.plan.item_texts(i) for i in range(4)]
    assert all(len(x) == 4 and all(s.startswith("ohwx, ") for s in x) for x in texts)
    assert {s.split(", ")[1].split()[0] for x in texts for s in x} == {"shape", "another"}  # both captions used
    out = t.fit()
    assert out.is_file()
    with pytest.raises(ValidationError):  # a tag_dropout of 1 would leave nothing to train on
        SourceConfig(path=".", tag_dropout=1.0)
