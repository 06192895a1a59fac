"""Training data: sources, aspect-ratio buckets, latent and text caches, and the batches the loop trains on.

The interface the training loop uses (everything else here is internal):

    from trainer.data import prepare_data

    data = prepare_data(cfg, adapter)                      # or prepare_data(cfg, adapter, load_encoders, device=...)
    data.report.bad                                        # [(file, reason)] left out by the scan
    data.batches_per_epoch, data.epoch
    data.load_state_dict(state["data"])                    # on resume (same as data.sampler.load_state_dict)
    batch = data.next_batch()                              # once per micro-batch (grad_accum times a step)
    state["data"] = data.state_dict()                      # JSON-able; save it after the step

`prepare_data(cfg, adapter, load_encoders=None, *, device=None, progress=True) -> TrainData`:

1. scans every source (no model loaded): images + captions (and videos for a video family: video.py), bad files
   with reasons; `data.strict` stops on any, and an empty data set or a missing folder stops with one line
   (`UserError`);
2. assigns aspect-ratio buckets (sides divisible by `adapter.resolution_divisor`) and prints the summary;
3. makes sure every latent and caption embedding is cached (in `data.cache_dir`, or in memory with
   `data.cache: false`); only if something is missing it calls `load_encoders()` (default: `adapter.load(
   cfg.model, parts={"vae", "text"}, dtype=model.dtype, device=device or train.device)`) and frees the
   encoders afterwards. Images whose latent or caption comes out non-finite are left out (listed);
4. builds the deterministic `BucketSampler` (`data.sampler`).

`Batch` (from `next_batch()` / `batch_at(position)`): `latents` (B, C, h, w) float32 CPU tensor from
`adapter.encode_images`, `text` = `adapter.collate_text` of the cached per-caption entries (CPU), `captions`
(the text each sample trained on, "" where caption dropout fired), `files`, `size` = (height, width) of the
bucket in pixels, `position` (the sampler position it was drawn at). All samples of a batch share one bucket.
The loop moves and casts the tensors itself.

Determinism: a batch's content depends only on (train.seed, sampler position, the data set): bucket order,
shuffling and caption-dropout draws come from a generator seeded with (seed, epoch), so resuming from
`state_dict()` continues with exactly the batches the uninterrupted run would have seen, across epochs.

`run_cache(cfg)` (trainer/data/cache.py) is the `dittrain cache` command: the same steps 1-3 on disk, also
re-checking every cached text entry. `bucket_sizes(resolution, divisor)` lists one resolution's buckets (the
offload planner can size activations from the largest).
"""

from .buckets import BucketSampler, bucket_sizes, nearest_bucket
from .cache import run_cache
from .pipeline import Batch, TrainData, plan_data, prepare_data
from .sources import Item, ScanReport

__all__ = [
    "Batch",
    "BucketSampler",
    "Item",
    "ScanReport",
    "TrainData",
    "bucket_sizes",
    "nearest_bucket",
    "plan_data",
    "prepare_data",
    "run_cache",
]
