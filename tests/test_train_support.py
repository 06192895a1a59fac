"""Shared pieces of the training tests (no tests here): a small image set of their own (so golden losses do not
move when data/ changes), configs for the tiny models, and reading metrics back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from trainer.config import Config

CAPTIONS = [
    "a red square on a blue background",
    "a green circle on a white background",
    "a yellow triangle on a black background",
    "two blue circles and one orange square",
]


def write_images(folder: Path, n: int = 4, size: int = 64) -> Path:
    """`n` deterministic RGB images with same-named .txt captions."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size]
    for i in range(n):
        bg = rng.integers(0, 256, 3)
        fg = rng.integers(0, 256, 3)
        img = np.empty((size, size, 3), np.uint8)
        img[:] = bg
        c = size // 2 + (i - n // 2) * 4
        mask = (xx - c) ** 2 + (yy - size // 2) ** 2 < (size // 4) ** 2 if i % 2 else (abs(xx - c) < size // 4) & (abs(yy - size // 2) < size // 4)
        img[mask] = fg
        Image.fromarray(img).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(CAPTIONS[i % len(CAPTIONS)])
    return folder


def make_config(models: Path, data: Path, out: Path, cache: Path, family: str, method: str = "lora", **sections) -> Config:
    """A config for the tiny `family` model; `sections` update sections, e.g. train={"steps": 4}."""
    base: dict = {
        "model": {"family": family, "path": str(models / family), "dtype": "fp32"},
        "train": {"method": method, "steps": 6, "batch_size": 2, "seed": 0, "checkpoint_every": 0,
                  "gradient_checkpointing": True, "timestep_sampling": "logit_normal"},
        "lora": {"rank": 4, "alpha": 8},
        "optimizer": {"lr": 1e-3 if method == "lora" else 1e-4},
        "data": {"sources": [{"path": str(data)}], "resolutions": [64], "cache_dir": str(cache)},
        "output": {"dir": str(out), "tensorboard": False},
    }
    if method == "full":
        base["optimizer"].update({"fused_back_pass": True, "max_grad_norm": None})
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return Config.model_validate(base)


def losses(out: Path) -> list[float]:
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def peek_batches(trainer, n: int) -> list:
    """The next `n` batches of a set-up trainer, without moving its sampler."""
    pos = trainer.data.sampler.position
    return [trainer.data.batch_at(pos + i) for i in range(n)]


def fit_scored(cfg: Config):
    """Train `cfg` to the end: (trainer, final weights' path, eval loss on its first two batches before, after)."""
    from trainer.train.trainer import Trainer

    t = Trainer(cfg)
    t.setup()
    batches = peek_batches(t, 2)
    before = eval_loss(t, batches)
    path = t.fit()
    return t, path, before, eval_loss(t, batches)


def eval_loss(trainer, batches, seed: int = 1234) -> float:
    """Loss of the trainer's model on fixed batches with fixed noise and timesteps (no grad, eval mode)."""
    import torch

    from trainer.train.objective import FlowMatching

    fm = FlowMatching(trainer.cfg.train.model_copy(update={"shift": 1.0, "timestep_sampling": "uniform"}), seed=seed)
    tr = trainer.transformer
    was_training = tr.training
    tr.eval()
    total = 0.0
    with torch.no_grad():
        for b in batches:
            n = fm.noise(b.latents.to(trainer.device), trainer.dtype)
            text = {k: v.to(trainer.device) for k, v in b.text.items()}
            pred = trainer.adapter.predict(tr, n.noisy, n.t, text, guidance=trainer.cfg.model.guidance)
            total += FlowMatching.loss(pred, n).item()
    tr.train(was_training)
    return total / len(batches)


def lora_predictions(trainer, lora_path: Path):
    """(ours, diffusers', untrained): the trained transformer's prediction on the first batch, the family's diffusers
    pipeline's after `load_lora_weights(lora_path)`, and the base model's, with the same seeded noise (fp32)."""
    import torch

    from trainer.train.objective import FlowMatching

    cfg, t = trainer.cfg, trainer
    # a Qwen3-VL processor loads only with torchvision: hand the pipeline the adapter's (trainer/models/qwen_image_21.py)
    extra = {}
    if (Path(cfg.model.path) / "processor").is_dir():
        extra["processor"] = t.adapter.load(cfg.model, parts={"text"}, dtype=torch.float32).tokenizers[-1]
    pipe = t.adapter.pipeline_cls.from_pretrained(str(cfg.model.path), torch_dtype=torch.float32, local_files_only=True,
                                                  **extra)
    base = type(pipe.transformer).from_pretrained(str(cfg.model.path), subfolder="transformer").eval()
    pipe.load_lora_weights(str(lora_path))
    b = t.data.batch_at(0)
    n = FlowMatching(cfg.train.model_copy(update={"timestep_sampling": "uniform"}), seed=5).noise(b.latents)
    t.transformer.eval()
    with torch.no_grad():
        return tuple(t.adapter.predict(m, n.noisy, n.t, b.text, guidance=cfg.model.guidance)
                     for m in (t.transformer, pipe.transformer.eval(), base))


def bench_module(name: str):
    """The bench module named `name` (bench/<group>/<name>.py, e.g. "bench_speed"): the tests call its `main`."""
    import bench

    return bench.module(name)


def pixels(path: Path) -> np.ndarray:
    """An image file's RGB pixels (a sample `dittrain sample` or a fit wrote)."""
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB")).copy()
