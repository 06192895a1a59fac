"""Subprocess side of tests/test_stream_load.py's host-RAM test (a fresh process, so its peak RSS is its own).

    python tests/_stream_load_runner.py make TINY_FLUX OUT   # a ~1.4 GB random Flux, sharded, tiny's other parts
    python tests/_stream_load_runner.py fit MODEL WORK [old]  # setup + 1 streamed LoRA step on the CPU; prints JSON

`make` writes the transformer shard by shard (one ~256 MB shard in memory at a time) with the index.json diffusers
writes, and links the tiny model's VAE, text encoders, tokenizers and scheduler beside it. `fit` (setup and one streamed LoRA step) imports
everything first, takes the baseline anonymous RSS, then samples `RssAnon` and `VmRSS` (anonymous plus the file-backed pages of mapped safetensors) from
/proc every 5 ms in a thread while
the Trainer (streaming on through the conductor's CPU path) sets up and trains, and prints the peak over the
baseline with the conductor's arena and ring bytes. `old` loads through `from_pretrained` (the path before
trainer/models/stream_load.py), to show what the test would catch.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

BIG = dict(num_layers=4, num_single_layers=10, attention_head_dim=128, num_attention_heads=12, axes_dims_rope=(16, 56, 56))
SHARD = 256 << 20
# The weights are cut from one pool of random values (32 MB, each tensor from its own offset): drawing the model's
# 0.7 G values one by one took ~15 s of one core, and what the test measures is where the bytes live, not what they are.
POOL = 1 << 24


def _cut(pool: torch.Tensor, n: int, i: int) -> torch.Tensor:
    """`n` values of `pool` (repeated if `n` is larger) from tensor `i`'s offset, in a storage of their own."""
    src = pool if n <= len(pool) else pool.repeat(-(-n // len(pool)))
    start = (i * 104_729) % (len(src) - n + 1)
    return src[start:start + n].clone()


def make(tiny: Path, out: Path) -> None:
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    for item in tiny.iterdir():
        if item.name != "transformer":
            os.symlink(item.resolve(), out / item.name)
    cfg = json.loads((tiny / "transformer" / "config.json").read_text())
    cfg.update(BIG)
    (out / "transformer").mkdir()
    (out / "transformer" / "config.json").write_text(json.dumps(cfg))
    with init_empty_weights():
        model = FluxTransformer2DModel.from_config(cfg)
    pool = (torch.randn(POOL, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, weight_map, files = 0, {}, []

    def flush() -> None:
        name = f"diffusion_pytorch_model-{len(files) + 1:05d}.safetensors"
        save_file(shards[0], str(out / "transformer" / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update(dict.fromkeys(shards[0], name))
        shards[0] = {}

    for i, (k, p) in enumerate(model.state_dict().items()):
        t = _cut(pool, p.numel(), i).view(p.shape)
        n = t.numel() * 2
        if shards[0] and size + n > SHARD:
            flush()
            size = 0
        shards[0][k] = t
        size += n
    flush()
    total = sum((out / "transformer" / f).stat().st_size for f in files)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "transformer" / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))


def _rss() -> tuple[int, int]:
    """(anonymous, total) resident bytes; total adds the file-backed pages of mapped safetensors files."""
    v = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("RssAnon:", "VmRSS:")):
            v[line.split(":")[0]] = int(line.split()[1]) * 1024
    return v.get("RssAnon", 0), v.get("VmRSS", 0)


def fit(model: Path, work: Path, old: bool) -> None:
    import diffusers  # noqa: F401 - imported before the baseline: their code is not the model
    import peft  # noqa: F401
    import transformers  # noqa: F401
    from PIL import Image

    from trainer.config import Config
    from trainer.models import stream_load
    from trainer.models.flux import FluxAdapter
    from trainer.train.trainer import Trainer

    data = work / "images"
    data.mkdir(parents=True)
    for i in range(2):
        Image.new("RGB", (16, 16), (40 * i, 100, 200)).save(data / f"{i}.png")
        (data / f"{i}.txt").write_text(f"a red square {i}")
    cfg = Config.model_validate({
        "model": {"family": "flux", "path": str(model), "dtype": "bf16"},
        "train": {"method": "lora", "steps": 2, "batch_size": 1, "seed": 0, "checkpoint_every": 0,
                  "gradient_checkpointing": True},
        "lora": {"rank": 4, "alpha": 4},
        "data": {"sources": [{"path": str(data)}], "resolutions": [16], "cache_dir": str(work / "cache")},
        "offload": {"transformer": 1.0},
        "output": {"dir": str(work / "out"), "tensorboard": False},
    })  # fmt: skip
    Trainer._can_stream = lambda self: True  # the conductor's CPU path
    # 1 image token (16 px) + 2 text tokens: the step's time is the tokens times the weights, and its memory the
    # weights (a CPU without AVX-512 BF16 multiplies bf16 gradients by the frozen weights ~25x slower than it runs
    # the forward; measured: 4 + 8 tokens 20.7 s a step, 1 + 2 tokens 5.1 s, the same peaks to 0.1 %)
    FluxAdapter.max_sequence_length = 2
    if old:
        stream_load.supported = lambda cfg: False
    stream_load.release_host_memory()
    base = _rss()
    peak = list(base)
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[:] = map(max, peak, _rss())
            time.sleep(0.005)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t = Trainer(cfg)
    t.setup()
    stats = t.offload.stats()
    t.train_step()  # one step: the ring cycles through every block, forward and backward
    stop.set()
    th.join()
    peak[:] = map(max, peak, _rss())
    print(json.dumps({"anon_over_baseline": peak[0] - base[0], "rss_over_baseline": peak[1] - base[1],
                      "baseline": base, "arena": stats["offloaded_bytes"], "ring": stats["ring_bytes"],
                      "block_bytes": stats["block_bytes"]}))


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        fit(Path(sys.argv[2]), Path(sys.argv[3]), old=len(sys.argv) > 4 and sys.argv[4] == "old")
