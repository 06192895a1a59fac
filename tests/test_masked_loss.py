"""Masked loss: masks found beside the images or named in metadata.jsonl, resized and cropped with their image,
averaged down to latent cells and cached with the latent; bad masks named and skipped; the loss weighted by them."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from PIL import Image
from test_data_cache import config, make_images, make_model, prepare
from test_train_support import write_images

from trainer.config import TrainConfig, load_config
from trainer.errors import UserError
from trainer.train.objective import FlowMatching, Noised


def _noised(b=2, c=4, h=4, w=6):
    g = torch.Generator().manual_seed(0)
    t = torch.rand(b, generator=g)
    return Noised(torch.zeros(b, c, h, w), t, torch.randn(b, c, h, w, generator=g), torch.rand(b, generator=g) + 0.5)


def test_loss_weighted_by_the_mask():
    n = _noised()
    pred = torch.randn(2, 4, 4, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    assert torch.equal(FlowMatching.loss(pred, n, mask=torch.ones(2, 1, 4, 6)), FlowMatching.loss(pred, n))
    mask = torch.zeros(2, 1, 4, 6)
    mask[:, :, :, :3] = 1.0
    mask[1, :, 0, 4] = 0.25
    got = FlowMatching.loss(pred, n, mask=mask)
    err = (pred.detach() - n.target).pow(2) * mask
    want = (err.flatten(1).mean(1) * n.weight).mean()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    got.backward()
    assert (pred.grad[:, :, :, 3:][mask[:, :, :, 3:].expand(-1, 4, -1, -1) == 0] == 0).all()  # masked-out cells learn nothing
    assert (pred.grad[:, :, :, :3] != 0).all()
    FlowMatching(TrainConfig(seed=0))  # the object still builds from the config alone


@pytest.fixture
def masked_set(tmp_path):
    make_model(tmp_path / "model")
    files = make_images(tmp_path / "imgs", n=3)  # img0 64x64, img1 128x64, img2 64x128
    (tmp_path / "imgs" / "masks").mkdir()
    m = Image.new("L", (64, 64), 0)
    m.paste(255, (0, 0, 32, 64))  # left half
    m.save(tmp_path / "imgs" / "masks" / "img0.png")
    return tmp_path, files


def test_masks_are_cropped_downsampled_and_cached_with_the_latent(masked_set):
    tmp_path, files = masked_set
    cfg = config(tmp_path, masked_loss=True, unmasked_weight=0.2)
    data, adapter, _ = prepare(cfg)
    assert len(data.report.items) == 3 and not data.report.bad  # masks/ is not scanned as training images
    seen = set()
    for p in range(data.batches_per_epoch):
        b = data.batch_at(p)
        assert b.mask.shape == (b.latents.shape[0], 1, *b.latents.shape[-2:])
        for i, f in enumerate(b.files):
            seen.add(f)
            if f == str(files[0]):
                assert torch.equal(b.mask[i, 0, :, :4], torch.ones(8, 4))
                torch.testing.assert_close(b.mask[i, 0, :, 4:], torch.full((8, 4), 0.2))
            else:  # no mask: every pixel trains
                assert torch.equal(b.mask[i], torch.ones_like(b.mask[i]))
    assert len(seen) == 3
    # a changed mask re-encodes its image's latent only; the unchanged ones are reused
    Image.new("L", (64, 64), 255).save(tmp_path / "imgs" / "masks" / "img0.png")
    data2, adapter2, _ = prepare(cfg)
    assert len(adapter2.images) == 1
    b = next(data2.batch_at(p) for p in range(10) if str(files[0]) in data2.batch_at(p).files)
    assert torch.equal(b.mask[b.files.index(str(files[0]))], torch.ones(1, 8, 8))
    # masked_loss off: no masks, and the old latents (keyed without the mask) serve
    data3, _, _ = prepare(config(tmp_path))
    assert data3.batch_at(0).mask is None


def test_bad_masks_are_named_and_skipped(masked_set):
    tmp_path, files = masked_set
    Image.new("L", (32, 32), 255).save(tmp_path / "imgs" / "masks" / "img1.png")  # img1 is 128x64
    (tmp_path / "imgs" / "masks" / "img2.png").write_bytes(b"not a png")
    data, _, _ = prepare(config(tmp_path, masked_loss=True))
    assert [it.file for it in data.report.items] == [str(files[0])]
    bad = dict(data.report.bad)
    assert "32x32" in bad[str(files[1])] and "img1.png" in bad[str(files[1])]
    assert "img2.png" in bad[str(files[2])] and "cannot identify" in bad[str(files[2])]
    with pytest.raises(UserError, match="data.strict is true and 2 input files are bad"):
        prepare(config(tmp_path, masked_loss=True, strict=True))


def test_metadata_mask_column(masked_set):
    tmp_path, files = masked_set
    Image.new("L", (128, 64), 0).save(tmp_path / "imgs" / "m1.png")
    (tmp_path / "imgs" / "meta.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"file": "img0.png", "caption": "zero"},  # falls back to masks/img0.png
        {"file": "img1.png", "caption": "one", "mask": "m1.png"},
        {"file": "img2.png", "caption": "two", "mask": "gone.png"},
    ]))
    src = [{"path": str(tmp_path / "imgs"), "metadata": "meta.jsonl"}]
    data, _, _ = prepare(config(tmp_path, sources=src, masked_loss=True))
    assert [it.mask for it in data.report.items] == [str(tmp_path / "imgs" / "masks" / "img0.png"),
                                                     str(tmp_path / "imgs" / "m1.png")]
    assert "gone.png not found" in dict(data.report.bad)[str(files[2])]
    b = next(data.batch_at(p) for p in range(10) if str(files[1]) in data.batch_at(p).files)
    i = b.files.index(str(files[1]))
    assert torch.equal(b.mask[i], torch.zeros(1, *b.latents.shape[-2:]))  # its bucket, black everywhere


# flux / qwen-image / flux2 / chroma / krea2 / flux3 pack latents 2x2 into tokens inside predict, z-image's transformer
# patchifies lists, qwen-image-2.1 flattens 16x latents unpacked
@pytest.mark.parametrize("family", ["flux", "qwen-image", "flux2", "z-image", "chroma", "qwen-image-2.1", "krea2", "flux3"])
def test_masked_training_end_to_end_from_yaml(family, tiny_models, tmp_path):
    from trainer.train.trainer import Trainer

    imgs = write_images(tmp_path / "imgs")
    (imgs / "masks").mkdir()
    m = Image.new("L", (64, 64), 0)
    m.paste(255, (16, 16, 48, 48))
    m.save(imgs / "masks" / "img0.png")
    raw = {
        "model": {"family": family, "path": str(tiny_models / family), "dtype": "fp32"},
        "train": {"method": "lora", "steps": 2, "batch_size": 2, "seed": 0},
        "lora": {"rank": 2, "alpha": 2},
        "data": {"sources": [{"path": str(imgs)}], "resolutions": [64], "cache_dir": str(tmp_path / "cache"),
                 "masked_loss": True, "unmasked_weight": 0.1},
        "output": {"dir": str(tmp_path / "out"), "tensorboard": False},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    t = Trainer(load_config(path))
    t.setup()
    b = next(t.data.batch_at(p) for p in range(8) if str(imgs / "img0.png") in t.data.batch_at(p).files)
    m0 = b.mask[b.files.index(str(imgs / "img0.png")), 0]
    side = 64 // t.adapter.vae_scale_factor  # latents of 8 (or 16) pixels; the mask is white at pixels 16-48
    assert m0.shape == b.latents.shape[-2:] == (side, side)
    assert m0[side // 4: 3 * side // 4, side // 4: 3 * side // 4].eq(1).all() and m0[0].eq(0.1).all()
    # the loss the trainer computes is the masked one: same noise, with and without the mask
    fm = FlowMatching(t.cfg.train, seed=3)
    n = fm.noise(b.latents, t.dtype)
    with torch.no_grad():
        pred = t.adapter.predict(t.transformer, n.noisy, n.t, b.text)
    assert FlowMatching.loss(pred, n, mask=b.mask) < FlowMatching.loss(pred, n)
    assert t.fit().is_file()
