"""Aspect-ratio buckets and the deterministic bucket sampler (pure: no images, no model)."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest

from trainer.data.buckets import BucketSampler, assign_buckets, bucket_sizes, bucket_step, nearest_bucket
from trainer.data.sources import Item


def item(w, h, n=0):
    return Item(f"img{n}.png", f"caption {n}", 0, w, h, f"{n:064x}")


@pytest.mark.parametrize("divisor", [8, 16, 32])
@pytest.mark.parametrize("res", [64, 256, 512, 768, 1024])
def test_bucket_areas_and_divisibility(res, divisor):
    sizes = bucket_sizes(res, divisor)
    step = bucket_step(res, divisor)
    assert step % divisor == 0
    assert (res, res) in sizes or res % step
    assert len(set(sizes)) == len(sizes) >= 3
    for w, h in sizes:
        assert w % divisor == 0 and h % divisor == 0
        assert max(w / h, h / w) <= 4.0 + 1e-9
        # h is the step multiple nearest res^2 / w (or sideways): the area error is at most half a step row
        assert abs(w * h - res * res) <= max(w, h) * step / 2 + 1e-9, (w, h)
        assert (h, w) in sizes  # portrait and landscape both exist
    if res >= 512:
        assert all(abs(w * h / res**2 - 1) < 0.13 for w, h in sizes)


def test_divisors_of_the_tiny_families(tiny_models):
    from trainer.config import ModelConfig
    from trainer.models import get_adapter

    for fam, folder in [("flux", "flux"), ("sd3", "sd3"), ("qwen-image", "qwen-image")]:
        d = get_adapter(ModelConfig(family=fam, path=tiny_models / folder)).resolution_divisor
        assert d >= 1
        for res in (64, 512):
            assert all(w % d == 0 and h % d == 0 for w, h in bucket_sizes(res, d))


def test_nearest_bucket_by_log_aspect():
    sizes = bucket_sizes(512, 16)
    assert nearest_bucket(1000, 1000, sizes) == (512, 512)
    wide = nearest_bucket(2000, 1000, sizes)
    tall = nearest_bucket(1000, 2000, sizes)
    assert wide == tall[::-1] and wide[0] > wide[1]
    assert abs(math.log(wide[0] / wide[1]) - math.log(2)) < 0.15
    assert nearest_bucket(5000, 100, sizes) == max(sizes, key=lambda s: s[0] / s[1])  # clamps to the widest


def test_assign_multi_resolution_and_too_small():
    items = [item(64, 64, 0), item(128, 64, 1), item(300, 300, 2), item(40, 40, 3), item(62, 64, 4)]
    entries, small = assign_buckets(items, [64, 256], 16)
    per = Counter(e.item for e in entries)
    assert per == {0: 1, 1: 1, 2: 2}  # the 300 px image trains at both resolutions
    assert sorted(i for i, _ in small) == [3, 4]
    assert all("smaller than" in r and "max_upscale" in r for _, r in small)
    for e in entries:
        it = items[e.item]
        assert it.width >= e.bucket[0] or it.height >= e.bucket[1]
    # allowing a little enlargement lets the 62x64 image in
    entries, small = assign_buckets(items, [64], 16, max_upscale=1.1)
    assert [i for i, _ in small] == [3]


def test_random_crop_is_seeded_per_image():
    items = [item(130, 100, n) for n in range(8)]
    a, _ = assign_buckets(items, [64], 16, crop="random", seed=1)
    b, _ = assign_buckets(items, [64], 16, crop="random", seed=1)
    c, _ = assign_buckets(items, [64], 16, crop="random", seed=2)
    assert a == b and a != c
    assert len({e.box for e in a}) > 1
    center, _ = assign_buckets(items, [64], 16, crop="center")
    assert len({e.box for e in center}) == 1


# ---------------------------------------------------------------------------------------------- sampler


def layout():
    # 7 entries in 3 buckets; entry 6 comes from a source with repeats 3; entries 4-5 have caption dropout
    buckets = [(64, 64)] * 3 + [(96, 48)] * 3 + [(48, 96)]
    weights = [1, 1, 1, 1, 1, 1, 3]
    dropout = [0, 0, 0, 0, 0.5, 0.5, 0]
    return buckets, weights, dropout


def sampler(batch_size=2, seed=0, remainder="smaller"):
    return BucketSampler(*layout(), batch_size=batch_size, seed=seed, remainder=remainder)


@pytest.mark.parametrize("batch_size", [1, 2, 3, 5])
def test_every_entry_appears_repeats_times_per_epoch(batch_size):
    s = sampler(batch_size)
    buckets, weights, _ = layout()
    for epoch in range(3):
        plan = s.epoch_plan(epoch)
        assert len(plan) == s.batches_per_epoch
        seen = Counter(slot.entry for b in plan for slot in b)
        assert seen == dict(enumerate(weights))  # nothing dropped, repeats counted
        for b in plan:
            assert len({buckets[slot.entry] for slot in b}) == 1  # one bucket per batch
            assert 1 <= len(b) <= batch_size
    # smaller last batch per bucket: 3 + 3 + 3 entries at batch size 2 -> 2 + 2 + 2 batches
    assert sampler(2).batches_per_epoch == 6


def test_wrap_remainder_fills_batches_without_dropping():
    s = sampler(2, remainder="wrap")
    plan = s.epoch_plan(0)
    assert all(len(b) == 2 for b in plan)
    seen = Counter(slot.entry for b in plan for slot in b)
    assert all(seen[e] >= w for e, w in enumerate(layout()[1]))


def test_order_depends_on_seed_and_epoch_only():
    def entries(s, n):
        return [[x.entry for x in s.next()] for _ in range(n)]

    a, b, c = sampler(seed=3), sampler(seed=3), sampler(seed=4)
    ea, eb, ec = entries(a, 18), entries(b, 18), entries(c, 18)
    assert ea == eb and ea != ec
    assert ea[:6] != ea[6:12]  # each epoch is shuffled anew


def test_resume_across_epoch_boundary_is_exact():
    full = sampler(seed=11)
    n = full.batches_per_epoch
    stop = n - 2  # stop two batches before the end of epoch 0, resume, run through epoch 2
    reference = [full.next() for _ in range(3 * n)]

    first = sampler(seed=11)
    got = [first.next() for _ in range(stop)]
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints store it as JSON
    resumed = sampler(seed=11)
    resumed.load_state_dict(state)
    got += [resumed.next() for _ in range(3 * n - stop)]
    assert got == reference
    assert resumed.epoch == 3 and resumed.state_dict()["position"] == 3 * n


def test_resume_with_changed_layout_warns(caplog):
    s = sampler(seed=1)
    s.next()
    other = sampler(seed=1, batch_size=3)
    other.load_state_dict(s.state_dict())
    assert other.position == 1 and "changed" in caplog.text


def test_caption_dropout_is_deterministic_and_at_rate():
    s = sampler(batch_size=1, seed=5)
    drops = Counter()
    for epoch in range(400):
        for b in s.epoch_plan(epoch):
            for slot in b:
                drops[slot.entry] += slot.dropped
    assert drops[0] == drops[6] == 0
    assert 150 < drops[4] < 250 and 150 < drops[5] < 250
    assert sampler(batch_size=1, seed=5).epoch_plan(7) == s.epoch_plan(7)
