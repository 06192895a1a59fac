"""`make demo`'s pieces: the exact VAE, the demo model and config training together, the picture and the plot."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from trainer.demo import comparison, loss_plot, write_report
from trainer.models.demo_model import exact_vae, make_demo_model

ROOT = Path(__file__).resolve().parents[1]


def test_the_demo_vae_encodes_to_the_pooled_picture_and_decodes_it_back():
    vae = exact_vae(shift=0.0, scale=1.5).eval()
    torch.manual_seed(0)
    x = torch.rand(2, 3, 16, 24).mul(2).sub(1).repeat_interleave(4, 2).repeat_interleave(4, 3)  # 4x4 blocks
    x[0, :, :8] = torch.rand(3, 8, 96) * 2 - 1  # and a band of pixel noise, which the pooling averages
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mode()
        back = vae.decode(z).sample
    pooled = torch.nn.functional.avg_pool2d(x, 4)
    assert z.shape == (2, 3, 16, 24)
    assert (z - pooled).abs().max() < 1e-3
    assert (back - pooled.repeat_interleave(4, 2).repeat_interleave(4, 3)).abs().max() < 1e-3
    assert (back[1] - x[1]).abs().max() < 1e-3  # a picture made of 4x4 blocks round-trips


def test_the_demo_model_and_config_train_and_the_report_is_written(tiny_models, tmp_path, monkeypatch):
    from trainer.config import load_config
    from trainer.sampling.output import save_png
    from trainer.train.trainer import Trainer

    model = make_demo_model(tmp_path / "flux-demo", tiny=tiny_models / "flux")
    assert not (tmp_path / "flux-demo.partial").exists()
    monkeypatch.chdir(ROOT)  # the config's data/ path is relative to the repository
    out = tmp_path / "out"
    cfg = load_config(ROOT / "configs/tiny/flux-demo.yaml", [
        f"model.path={model}", "train.steps=2", "train.checkpoint_every=0", f"output.dir={out}",
        f"data.cache_dir={tmp_path / 'cache'}", "output.tensorboard=false"])
    Trainer(cfg).fit()
    assert (out / "lora.safetensors").is_file()
    # The samples `make demo` makes with `dittrain sample`, stood in for by flat pictures with the prompt in them.
    prompts = cfg.sample.prompts
    for sub, colour in (("untrained", (128, 128, 128)), ("trained", (1, 254, 3))):
        for k, p in enumerate(prompts[:-1]):  # the last prompt has no trained sample: its cell stays empty
            save_png(Image.new("RGB", (64, 64), colour), out / sub / f"{k}.png", {"prompt": p})
    config = tmp_path / "c.yaml"
    config.write_text((ROOT / "configs/tiny/flux-demo.yaml").read_text().replace("dir: out/demo", f"dir: {out}"))
    picture, plot = write_report(config)
    assert picture == out / "demo.png" and plot == out / "loss.png"
    sheet = np.asarray(Image.open(picture))
    assert sheet.shape[1] == 8 + 3 * (64 * 3 + 8)  # three columns: training image, untrained, trained
    assert sheet.shape[0] > len(prompts) * 64 * 3
    assert (sheet == [1, 254, 3]).all(-1).sum() == 3 * (64 * 3) ** 2  # three trained cells, drawn 3x


def test_the_loss_plot_draws_the_curve_where_the_numbers_say(tmp_path):
    m = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 2.0 / s, "loss_smoothed": 2.0 / s} for s in range(1, 41)]
    rows.insert(5, {"step": 5, "val_loss": 9.0})  # validation lines have no "loss": left out
    m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    img = np.asarray(loss_plot(m, size=(400, 300))).astype(int)
    blue = (img[..., 2] > 150) & (img[..., 0] < 80)
    ys, xs = np.nonzero(blue)
    assert len(xs) > 100
    left, right = ys[xs < xs.min() + 20].mean(), ys[xs > xs.max() - 20].mean()
    assert left < right - 100  # a falling loss: high (small y) on the left, low on the right
    with pytest.raises(ValueError, match="no loss"):
        (tmp_path / "empty.jsonl").write_text('{"step": 1, "val_loss": 1.0}\n')
        loss_plot(tmp_path / "empty.jsonl")


def test_comparison_has_one_row_per_prompt_and_blank_cells_for_missing_images(tmp_path):
    a = tmp_path / "a.png"
    Image.new("RGB", (64, 32), "blue").save(a)
    sheet = np.asarray(comparison(["p", "q"], {"x": {"p": a}, "y": {}}, 32))
    assert sheet.shape[1] == 8 + 2 * (32 * 3 + 8)
    assert (sheet == [0, 0, 255]).all(-1).sum() == (32 * 3) ** 2  # centre-cropped to a square, drawn 3x


def test_the_demo_trains_on_the_pictures_it_samples_and_the_readme_says_so(monkeypatch):
    """README's demo paragraph describes this config's picture: the four sampled captions are the captions of the
    pictures the demo trains on (all of them), and the step count it names is the config's."""
    from trainer.config import load_config
    from trainer.demo import _training_images

    monkeypatch.chdir(ROOT)  # the config's data/ paths are relative to the repository
    cfg = load_config(ROOT / "configs/tiny/flux-demo.yaml")
    trained = _training_images(cfg.data.sources)
    assert sorted(cfg.sample.prompts) == sorted(trained) and len(trained) == 4
    readme = (ROOT / "README.md").read_text()
    demo = " ".join(readme[readme.index("**The demo.**"):].split("\n\n")[0].split())
    assert f"after {cfg.train.steps} steps" in demo
    for caption in cfg.sample.prompts:  # "a red square on a blue background": the picture is "red on blue"
        words = caption.split()
        assert f"{words[1]} on {words[-2]}" in demo
