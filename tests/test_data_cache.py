"""Latent / text caches and `prepare_data`, through a fake adapter that counts what it encodes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from trainer.config import Config
from trainer.data import prepare_data
from trainer.data.images import load_pixels
from trainer.errors import UserError
from trainer.models.base import Components


class FakeAdapter:
    """Implements the protocol methods the data pipeline uses. Latents: 8x average pool plus a mean channel;
    a pure-white image encodes to NaN (to test the non-finite path). Text: numbers derived from the caption."""

    family = "fake"
    text_encoder_dirs = ("text_encoder",)
    resolution_divisor = 16
    # the family facts the data pipeline reads (trainer/models/base.py ModelAdapter declares each with its default)
    extra_text_dirs: tuple = ()
    max_sequence_length = None
    takes_reference = text_uses_reference = False

    @classmethod
    def cache_family(cls):
        return cls.family

    def __init__(self):
        self.images: list[tuple[int, int]] = []  # (h, w) of every image encoded
        self.prompts: list[str] = []

    def encode_images(self, vae, pixels):
        self.images += [tuple(pixels.shape[-2:])] * pixels.shape[0]
        lat = torch.nn.functional.avg_pool2d(pixels, 8)
        lat = torch.cat([lat, lat.mean(1, keepdim=True)], 1)
        white = (pixels.amin(dim=(1, 2, 3)) > 0.99).view(-1, 1, 1, 1)
        return torch.where(white, torch.full_like(lat, float("nan")), lat)

    def encode_prompts(self, comps, prompts):
        self.prompts += prompts
        codes = torch.tensor([[len(p), sum(map(ord, p)) % 101, p.count(" ")] for p in prompts], dtype=torch.float32)
        return {"prompt_embeds": codes[:, None, :].repeat(1, 5, 1), "pooled": codes.clone()}

    def collate_text(self, items):
        return {k: torch.stack([i[k] for i in items]) for k in items[0]}


def make_model(root: Path, vae_cfg=None, te_cfg=None) -> Path:
    for d, c in (("vae", vae_cfg or {"block_out_channels": [8, 8]}), ("text_encoder", te_cfg or {"d": 8})):
        (root / d).mkdir(parents=True, exist_ok=True)
        (root / d / "config.json").write_text(json.dumps(c))
    (root / "tokenizer").mkdir(exist_ok=True)
    (root / "tokenizer" / "vocab.json").write_text("{}")
    return root


def make_images(folder: Path, n=5) -> list[Path]:
    sizes = [(64, 64), (128, 64), (64, 128), (96, 64), (80, 80), (64, 64), (128, 64)]
    out = []
    for i in range(n):
        p = folder / f"img{i}.png"
        p.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", sizes[i % len(sizes)], (30 * i, 100, 200 - 20 * i)).save(p)
        p.with_suffix(".txt").write_text(f"picture number {i}")
        out.append(p)
    return out


def config(tmp_path, sources=None, **data) -> Config:
    return Config.model_validate({
        "model": {"family": "flux", "path": str(tmp_path / "model"), "dtype": "fp32"},
        "train": {"batch_size": 2, "seed": 7},
        "data": {"sources": sources or [{"path": str(tmp_path / "imgs")}], "resolutions": [64],
                 "cache_dir": str(tmp_path / "cache"), **data},
        "output": {"dir": str(tmp_path / "out")},
    })


class Loader:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return Components(vae=torch.nn.Linear(1, 1), text_encoders=[torch.nn.Linear(1, 1)], tokenizers=[None])


def prepare(cfg, adapter=None):
    adapter = adapter or FakeAdapter()
    loader = Loader()
    return prepare_data(cfg, adapter, loader, progress=False), adapter, loader


@pytest.fixture
def setup(tmp_path):
    make_model(tmp_path / "model")
    files = make_images(tmp_path / "imgs")
    return tmp_path, files


def test_batches_hold_the_encoded_crops(setup):
    tmp_path, files = setup
    data, adapter, loader = prepare(config(tmp_path))
    assert loader.calls == 1 and len(adapter.images) == 5
    assert "" in adapter.prompts  # the empty caption is always cached (caption dropout)
    seen = set()
    for _ in range(data.batches_per_epoch):
        b = data.next_batch()
        h, w = b.size
        assert b.latents.shape == (len(b.files), 4, h // 8, w // 8)
        assert b.text["prompt_embeds"].shape == (len(b.files), 5, 3) and b.text["pooled"].shape == (len(b.files), 3)
        for i, f in enumerate(b.files):
            it = next(x for x in data.report.items if x.file == f)
            e = next(e for e in data.entries if data.plan.items[e.item] is it)
            want = adapter.encode_images(None, load_pixels(f, e.bucket, e.box)[None])[0]
            torch.testing.assert_close(b.latents[i], want)
            assert b.captions[i] == it.caption
            seen.add(f)
    assert seen == {str(f) for f in files}  # no image dropped in an epoch


def test_second_run_hits_and_needs_no_encoders(setup):
    tmp_path, _ = setup
    cfg = config(tmp_path)
    first, _, _ = prepare(cfg)
    data, adapter, loader = prepare(cfg)
    assert loader.calls == 0 and adapter.images == [] and adapter.prompts == []
    assert data.encode.latents_hit == 5 and data.encode.texts_hit == 6
    for p in range(first.batches_per_epoch + 2):
        a, b = first.batch_at(p), data.batch_at(p)
        assert a.files == b.files and torch.equal(a.latents, b.latents)


def test_changed_image_reencodes_only_its_entry(setup):
    tmp_path, files = setup
    cfg = config(tmp_path)
    prepare(cfg)
    Image.new("RGB", (64, 64), (1, 2, 3)).save(files[0])
    data, adapter, loader = prepare(cfg)
    assert loader.calls == 1 and len(adapter.images) == 1 and adapter.prompts == []
    assert data.encode.latents_new == 1 and data.encode.latents_hit == 4
    files[1].with_suffix(".txt").write_text("a new caption")
    data, adapter, _ = prepare(cfg)
    assert adapter.images == [] and adapter.prompts == ["a new caption"]


def test_changed_model_misses_only_its_part(setup):
    tmp_path, _ = setup
    cfg = config(tmp_path)
    prepare(cfg)
    make_model(tmp_path / "model", vae_cfg={"block_out_channels": [8, 8, 8]})
    data, adapter, _ = prepare(cfg)
    assert len(adapter.images) == 5 and adapter.prompts == []  # new VAE: every latent, no caption
    make_model(tmp_path / "model", vae_cfg={"block_out_channels": [8, 8, 8]}, te_cfg={"d": 16})
    data, adapter, _ = prepare(cfg)
    assert adapter.images == [] and len(adapter.prompts) == 6
    dtype_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"dtype": "bf16"})})
    _, adapter, _ = prepare(dtype_cfg)
    assert len(adapter.images) == 5  # dtype is part of the model identity
    moved = tmp_path / "moved"
    (tmp_path / "model").rename(moved)
    moved_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": moved})})
    _, adapter, loader = prepare(moved_cfg)
    assert loader.calls == 0  # same files elsewhere: still hits


def test_crop_and_resolution_are_part_of_the_key(setup):
    tmp_path, _ = setup
    prepare(config(tmp_path))
    _, adapter, _ = prepare(config(tmp_path, crop="random"))
    assert 0 < len(adapter.images) <= 5  # only images with room to crop get a different box
    _, adapter, _ = prepare(config(tmp_path, resolutions=[64, 80]))
    assert len(adapter.images) > 0 and adapter.prompts == []


def test_cache_false_encodes_in_memory(setup):
    tmp_path, _ = setup
    cfg = config(tmp_path, cache=False)
    data, adapter, loader = prepare(cfg)
    assert loader.calls == 1 and len(adapter.images) == 5
    assert not (tmp_path / "cache").exists()
    b = data.next_batch()
    assert b.latents.ndim == 4
    _, _, loader = prepare(cfg)
    assert loader.calls == 1  # nothing kept between runs


def test_nan_in_cached_latent_is_reencoded(setup):
    tmp_path, _ = setup
    cfg = config(tmp_path)
    prepare(cfg)
    (entry,) = list((tmp_path / "cache" / "latents").rglob("*.safetensors"))[:1]
    t = load_file(entry)
    t["latent"][0, 0, 0] = float("nan")
    save_file(t, entry)
    data, adapter, loader = prepare(cfg)
    assert data.encode.reencoded == 1 and len(adapter.images) == 1
    assert torch.isfinite(load_file(entry)["latent"]).all()


def test_nan_read_during_training_names_the_file(setup):
    tmp_path, _ = setup
    data, _, _ = prepare(config(tmp_path))
    key = data._lat_keys[data.sampler.batch_at(0)[0].entry]
    path = Path(data.plan.latent_store.where(key))
    save_file({"latent": torch.full((4, 8, 8), float("nan"))}, path)
    with pytest.raises(UserError) as e:
        data.batch_at(0)
    file = data.plan.items[data.entries[data.sampler.batch_at(0)[0].entry].item].file
    assert "NaN" in str(e.value) and file in str(e.value)
    assert not path.exists()  # deleted, so the next start re-encodes it


def test_encoder_nan_leaves_the_image_out_or_stops_in_strict(setup):
    tmp_path, _ = setup
    white = tmp_path / "imgs" / "white.png"
    Image.new("RGB", (64, 64), (255, 255, 255)).save(white)
    white.with_suffix(".txt").write_text("white")
    data, _, _ = prepare(config(tmp_path))
    assert [(Path(f).name, "NaN" in r) for f, r in data.report.bad] == [("white.png", True)]
    assert all(str(white) not in data.batch_at(p).files for p in range(data.batches_per_epoch))
    assert len({data.plan.items[e.item].file for e in data.entries}) == 5
    with pytest.raises(UserError, match="white.png"):
        prepare(config(tmp_path, strict=True))


def test_bad_files_left_out_or_strict(setup):
    tmp_path, _ = setup
    (tmp_path / "imgs" / "zero.png").write_bytes(b"")
    (tmp_path / "imgs" / "zero.txt").write_text("z")
    Image.new("RGB", (32, 32)).save(tmp_path / "imgs" / "tiny.png")
    (tmp_path / "imgs" / "tiny.txt").write_text("too small")
    data, _, _ = prepare(config(tmp_path))
    reasons = {Path(f).name: r for f, r in data.report.bad}
    assert "zero-byte" in reasons["zero.png"] and "smaller than" in reasons["tiny.png"]
    assert len(data.report.items) == 5
    with pytest.raises(UserError) as e:
        prepare(config(tmp_path, strict=True))
    assert "zero.png" in str(e.value) and "tiny.png" in str(e.value)


def test_resume_gives_the_same_batches_with_dropout_and_repeats(tmp_path):
    make_model(tmp_path / "model")
    make_images(tmp_path / "a", n=4)
    make_images(tmp_path / "b", n=3)
    sources = [{"path": str(tmp_path / "a"), "caption_dropout": 0.5},
               {"path": str(tmp_path / "b"), "repeats": 2, "caption_prefix": "sks"}]
    cfg = config(tmp_path, sources=sources)
    ref, _, _ = prepare(cfg)
    n = ref.batches_per_epoch
    want = [ref.next_batch() for _ in range(2 * n + 1)]
    assert any(c == "" for b in want for c in b.captions) and any(c.startswith("sks ") for b in want for c in b.captions)
    per_file = {}
    for b in want[:n]:
        for f in b.files:
            per_file[f] = per_file.get(f, 0) + 1
    assert sorted(per_file.values()) == [1, 1, 1, 1, 2, 2, 2]  # repeats counted, nothing dropped

    run, _, _ = prepare(cfg)
    got = [run.next_batch() for _ in range(n - 1)]
    state = json.loads(json.dumps(run.state_dict()))
    resumed, _, loader = prepare(cfg)
    resumed.load_state_dict(state)
    got += [resumed.next_batch() for _ in range(n + 2)]
    assert loader.calls == 0
    for a, b in zip(want, got, strict=True):
        assert (a.files, a.captions, a.position) == (b.files, b.captions, b.position)
        assert torch.equal(a.latents, b.latents)
        assert all(torch.equal(a.text[k], b.text[k]) for k in a.text)
    dropped = [b for b in got for c in b.captions if c == ""]
    assert dropped and all(torch.equal(b.text["pooled"][b.captions.index("")],
                                       FakeAdapter().encode_prompts(None, [""])["pooled"][0]) for b in dropped)


def test_bundled_demo_data_at_resolution_64(tmp_path):
    make_model(tmp_path / "model")
    root = Path(__file__).resolve().parents[1] / "data"
    cfg = config(tmp_path, sources=[{"path": str(root / "shapes")}], cache=False)
    data, _, _ = prepare(cfg)
    assert data.report.bad == [] and len(data.report.items) == 12
    assert len({e.bucket for e in data.entries}) >= 4


def test_ranks_split_the_single_process_sequence(setup):
    tmp_path, _ = setup
    cfg = config(tmp_path, remainder="wrap")
    single, _, _ = prepare(cfg)
    want = [single.next_batch().files for _ in range(8)]
    ranks = [prepare_data(cfg, FakeAdapter(), Loader(), progress=False, rank=r, world_size=2) for r in (0, 1)]
    got = []
    for _ in range(4):
        got += [r.next_batch().files for r in ranks]
    assert got == want
    assert ranks[0].state_dict() == ranks[1].state_dict()
    assert ranks[0].epoch == 8 // single.batches_per_epoch


def test_text_sequence_length_is_part_of_the_text_identity(setup):
    tmp_path, _ = setup
    cfg = config(tmp_path)
    prepare(cfg)
    longer = FakeAdapter()
    longer.max_sequence_length = 512
    _, adapter, _ = prepare(cfg, longer)
    assert adapter.images == [] and len(adapter.prompts) == 6


def test_each_caching_stage_hands_its_freed_heap_back(setup, monkeypatch):
    """glibc keeps the pages of freed small tensors resident: after the VAE stage's batches of decoded frames, a
    few hundred MB on the tiny Wan at 832x480, bounded but not what caching kept. Each stage ends with
    `release_host_memory` (the latent caching phase then records the RSS of what is left), after its encoders are
    dropped and before the next stage loads."""
    from trainer.data import cache
    from trainer.data.pipeline import plan_data

    events = []
    monkeypatch.setattr(cache, "release_host_memory", lambda: events.append("trim"))

    class Stages(cache.EncoderStages):
        def _load_text(self):
            events.append("text")
            return Components(vae=None, text_encoders=[torch.nn.Linear(1, 1)], tokenizers=[None])

        def _load_vae(self):
            events.append("vae")
            return torch.nn.Linear(1, 1)

    tmp_path, _ = setup
    adapter = FakeAdapter()
    plan = plan_data(config(tmp_path), adapter, progress=False)
    res = cache.ensure_encoded(adapter, Stages(), plan.latent_store, plan.text_store, plan.latent_jobs(),
                               plan.captions(), progress=False)
    assert res.latents_new == 5 and res.texts_new == 6
    assert events[:4] == ["text", "trim", "vae", "trim"]
