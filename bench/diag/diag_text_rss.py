#!/usr/bin/env python3
"""Diagnostic (issue 14): where `dittrain cache` holds anonymous RAM while the T5-XXL encoder is loaded and placed
for streaming. Writes a full-size random T5-XXL (9.5 GB) with bench_program's writer, then, in this process, prints
RssAnon after each step: from_pretrained, the conductor's arena filled, the arena page-locked, placed, one encode
batch, closed.

    python -m bench.diag.diag_text_rss --work /tmp/diag [--fraction 0.55]
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import torch


def anon() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) * 1024 / 1e9
    return 0.0


class Peak:
    def __init__(self):
        self.peak, self.stop = 0.0, False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while not self.stop:
            self.peak = max(self.peak, anon())
            time.sleep(0.02)

    def take(self, label: str) -> None:
        time.sleep(0.05)
        print(f"{label:<40} anon {anon():6.2f} GB   peak since last {self.peak:6.2f} GB", flush=True)
        self.peak = anon()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/diag-text-rss"))
    ap.add_argument("--fraction", type=float, default=0.55)
    args = ap.parse_args()
    from transformers import T5EncoderModel

    from bench.program.bench_program import _meta, _save, _t5_cfg
    from trainer.data.cache import place_encoder
    from trainer.models.tiny import make_tiny_models
    from trainer.offload import conductor

    flux = next(p for p in make_tiny_models(args.work / "tiny", ["flux"]) if p.name == "flux")
    folder = args.work / "t5"
    if not (folder / "config.json").is_file():
        enc = _meta(lambda: T5EncoderModel(_t5_cfg(flux / "tokenizer_2")))
        _save(folder, enc, enc.config, "model", torch.bfloat16, 0)
    p = Peak()
    p.take("start")
    enc = T5EncoderModel.from_pretrained(folder, dtype=torch.bfloat16, local_files_only=True).eval()
    enc.requires_grad_(False)  # as the adapter loads it: the conductor packs frozen weights
    p.take("from_pretrained")
    real_pin = conductor.HostArena.pin

    def pin(self):
        p.take(f"arena filled ({self.nbytes / 1e9:.1f} GB)")
        real_pin(self)
        p.take("arena page-locked")

    conductor.HostArena.pin = pin
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    h = place_encoder(enc, dev, args.fraction)
    p.take("placed")
    with torch.no_grad():
        ids = torch.randint(0, 32000, (4, 512), device=dev)
        enc(input_ids=ids)
    p.take("encoded a batch of 4 x 512")
    if h is not None:
        h.close(keep_weights=False)
    del enc
    p.take("closed")
    p.stop = True


if __name__ == "__main__":
    main()
