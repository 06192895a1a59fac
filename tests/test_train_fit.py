"""Training the tiny models of every family end to end: LoRA and full fine-tuning lower the loss, first-step losses
are pinned, the LoRA file works in the diffusers pipeline exactly as in the trainer, the fused back pass is used."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_train_support import (
    eval_loss,
    fit_scored,
    lora_predictions,
    losses,
    make_config,
    peek_batches,
    write_images,
)

from trainer.lora_format import lora_metadata
from trainer.offload.block import StreamedBlock
from trainer.train.trainer import Trainer

FAMILIES = ["flux", "sd3", "qwen-image", "flux2", "flux2-klein"]

# (first, last) step losses of 8 training steps on the tests' own image set, seed 0 (tests/test_train_support.py).
# They change only on purpose: a change means the objective, the data pipeline, the adapters, the optimizer or the
# tiny models changed. The first loss is the untrained model's (LoRA B starts at zero), so LoRA and full agree.
GOLDEN_LOSSES = {
    ("flux", "lora"): (1.5445270538330078, 1.327577829360962),
    ("sd3", "lora"): (1.4446372985839844, 1.2604743242263794),
    ("qwen-image", "lora"): (1.5481176376342773, 1.3484065532684326),
    ("flux", "full"): (1.5445270538330078, 0.9987795352935791),
    ("sd3", "full"): (1.4446372985839844, 1.1152362823486328),
    ("qwen-image", "full"): (1.5481176376342773, 0.959783673286438),
    ("flux2", "lora"): (1.358278512954712, 1.1269481182098389),
    ("flux2", "full"): (1.358278512954712, 1.0862152576446533),
    ("flux2-klein", "lora"): (1.4068182706832886, 1.3640755414962769),
    ("flux2-klein", "full"): (1.4068182706832886, 1.249314546585083),
}
# LoRA learning rates of the 8-step test: Flux.2's tiny models (no biases, modulation shared outside the blocks) move
# more slowly at the others' 3e-3
LORA_LR = {"flux2": 2e-2, "flux2-klein": 3e-2}


@pytest.fixture(scope="session")
def train_images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("train-images"))


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("train-cache")


_train = fit_scored


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_training_lowers_the_loss_and_writes_a_lora(family, tiny_models, train_images, cache_root, tmp_path):
    cfg = make_config(tiny_models, train_images, tmp_path / "out", cache_root / family, family,
                      train={"steps": 8}, optimizer={"lr": LORA_LR.get(family, 3e-3)})
    t, path, before, after = _train(cfg)
    assert path == tmp_path / "out" / "lora.safetensors" and path.is_file()
    assert after < before * 0.95, (before, after)
    got = losses(tmp_path / "out")
    assert len(got) == 8
    assert (got[0], got[-1]) == pytest.approx(GOLDEN_LOSSES[(family, "lora")], rel=1e-5)
    meta = lora_metadata(path)
    assert meta["dittrain.rank"] == "4" and meta["dittrain.alpha"] == "8.0" and meta["dittrain.step"] == "8"
    assert meta["dittrain.config_digest"] == cfg.digest()
    # the file carries alpha / rank in its weights (trainer/lora_format: ComfyUI and diffusers apply the same update),
    # so the header diffusers reads says alpha = rank and the trained alpha stays in dittrain.alpha
    assert json.loads(meta["lora_adapter_metadata"])["transformer.lora_alpha"] == 4
    assert float(meta["dittrain.baked_scale"]) == 2.0
    # Only LoRA weights were trained: the base weights are bitwise those on disk.
    base = t.adapter.load(cfg.model, parts={"transformer"}, dtype=torch.float32).transformer.state_dict()
    live = {k.replace(".base_layer", ""): v for k, v in t.transformer.state_dict().items() if "lora_" not in k}
    assert set(live) == set(base)
    assert all(torch.equal(live[k], base[k]) for k in base)


@pytest.mark.parametrize("family", FAMILIES)
def test_full_training_lowers_the_loss_with_the_fused_back_pass(family, tiny_models, train_images, cache_root,
                                                                 tmp_path, monkeypatch):
    cfg = make_config(tiny_models, train_images, tmp_path / "out", cache_root / family, family, "full",
                      train={"steps": 8}, optimizer={"lr": 1e-3})
    # Every parameter must be stepped by its backward hook, once per step, and nothing else may step.
    from trainer.optim.fused import FusedBackPass

    stepped = []
    real = FusedBackPass.finish_step
    monkeypatch.setattr(FusedBackPass, "finish_step", lambda self: stepped.append(self.stepped) or real(self))
    t = Trainer(cfg)
    t.setup()
    initial = [p.detach().clone() for p in t.params]
    batches = peek_batches(t, 2)
    before = eval_loss(t, batches)
    path = t.fit()
    after = eval_loss(t, batches)
    # Parameters that get no gradient (e.g. Qwen-Image's last text-stream outputs, which feed nothing) are not
    # stepped; every other one is, by its hook, once per step (a zero gradient steps without changing it).
    changed = sum(not torch.equal(a, p) for a, p in zip(initial, t.params, strict=True))
    assert stepped == [stepped[0]] * 8 and changed <= stepped[0] <= len(t.params)
    assert changed > 0.8 * len(t.params)
    assert all(p.grad is None for p in t.params), "fused back pass frees every gradient inside backward"
    assert path == tmp_path / "out" / "transformer" and (path / "config.json").is_file()
    assert after < before, (before, after)
    got = losses(tmp_path / "out")
    assert (got[0], got[-1]) == pytest.approx(GOLDEN_LOSSES[(family, "full")], rel=1e-5)
    # The saved folder is a diffusers transformer with the trained weights.
    loaded = type(t.transformer).from_pretrained(str(path))
    sd = t.transformer.state_dict()
    assert all(torch.equal(v, sd[k]) for k, v in loaded.state_dict().items())


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_file_changes_the_diffusers_pipeline_exactly_as_in_the_trainer(family, tiny_models, train_images,
                                                                            cache_root, tmp_path):

    cfg = make_config(tiny_models, train_images, tmp_path / "out", cache_root / family, family,
                      train={"steps": 3}, optimizer={"lr": 1e-2}, lora={"rank": 4, "alpha": 2})
    t = Trainer(cfg)
    path = t.fit()
    ours, theirs, untrained = lora_predictions(t, path)
    assert torch.equal(ours, theirs)
    assert (theirs - untrained).abs().max() > 1e-4  # the LoRA does something (alpha/rank = 0.5 kept from the header)


def test_samples_tensorboard_and_metrics_do_not_disturb_training(tiny_models, train_images, cache_root, tmp_path):
    common = dict(train={"steps": 2}, sample={"prompts": ["a red square", "a cat"], "every": 2, "steps": 2,
                                               "width": 64, "height": 64})
    plain = make_config(tiny_models, train_images, tmp_path / "plain", cache_root / "flux", "flux", **common)
    Trainer(plain.model_copy(update={"sample": plain.sample.model_copy(update={"every": 0})})).fit()
    cfg = make_config(tiny_models, train_images, tmp_path / "out", cache_root / "flux", "flux", **common,
                      output={"dir": str(tmp_path / "out"), "tensorboard": True})
    Trainer(cfg).fit()
    assert losses(tmp_path / "out") == losses(tmp_path / "plain")
    pngs = sorted(p.name for p in (tmp_path / "out" / "samples").iterdir())
    assert pngs == ["step-000002-0.png", "step-000002-1.png"]
    from PIL import Image

    im = Image.open(tmp_path / "out" / "samples" / pngs[0])
    assert im.size == (64, 64) and im.text["prompt"] == "a red square"
    assert any((tmp_path / "out" / "tensorboard").glob("events.out.tfevents.*"))
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["lr"] == 1e-3 and r["grad_norm"] > 0 and r["samples_per_s"] > 0 for r in rows)


def test_gradient_accumulation_averages_the_micro_batches(tiny_models, train_images, cache_root, tmp_path, monkeypatch):
    from trainer.train.optimizer import Optim

    cfg = make_config(tiny_models, train_images, tmp_path / "out", cache_root / "flux", "flux",
                      train={"steps": 1, "batch_size": 1, "grad_accum": 2}, optimizer={"max_grad_norm": None})
    t = Trainer(cfg)
    t.setup()
    state = t.objective.state().clone()
    # The expected gradient, by hand: two micro-batches of one image, each loss halved, gradients summed.
    expected_losses = []
    for i in range(2):
        b = t.data.batch_at(i)
        n = t.objective.noise(b.latents)
        loss = t.objective.loss(t.adapter.predict(t.transformer, n.noisy, n.t, b.text, guidance=cfg.model.guidance), n)
        (loss / 2).backward()
        expected_losses.append(loss.item())
    expected = [p.grad.clone() for p in t.params]
    for p in t.params:
        p.grad = None
    t.objective.load_state(state)
    seen = {}
    real = Optim.step
    monkeypatch.setattr(Optim, "step", lambda self: seen.setdefault("g", [p.grad.clone() for p in t.params])
                        and real(self))
    metrics = t.train_step()
    assert t.data.sampler.position == 2
    assert all(torch.equal(a, b) for a, b in zip(seen["g"], expected, strict=True))
    assert metrics["loss"] == sum(expected_losses) / 2
    t.close()


def test_gradient_checkpointing_changes_no_number(tiny_models, train_images, cache_root, tmp_path):
    """Recomputing each block in backward gives bitwise the losses and weights of storing its activations."""
    runs = []
    for ckpt in (False, True):
        cfg = make_config(tiny_models, train_images, tmp_path / f"out-{ckpt}", cache_root / "flux", "flux",
                          train={"steps": 3, "gradient_checkpointing": ckpt})
        t = Trainer(cfg)
        t.setup()  # the offload handle checkpoints the blocks while it is attached (fit closes it)
        blocks = t.adapter.blocks(t.transformer)
        assert all(isinstance(b, StreamedBlock) == ckpt for b in blocks)
        t.fit()
        runs.append((losses(tmp_path / f"out-{ckpt}"), [p.detach().clone() for p in t.params]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))


def test_bf16_base_trains_fp32_lora_weights(tiny_models, train_images, cache_root, tmp_path):
    cfg = make_config(tiny_models, train_images, tmp_path / "out", cache_root / "flux-bf16", "flux",
                      model={"dtype": "bf16"}, train={"steps": 2})
    t = Trainer(cfg)
    path = t.fit()
    assert t.params and all(p.dtype == torch.float32 for p in t.params)
    frozen = [p for p in t.transformer.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    from safetensors.torch import load_file

    assert all(v.dtype == torch.float32 for v in load_file(str(path)).values())
    assert all(math.isfinite(x) for x in losses(tmp_path / "out"))


def test_lora_targets_that_match_nothing_are_a_user_error(tiny_models, train_images, cache_root, tmp_path):
    from trainer.errors import UserError

    cfg = make_config(tiny_models, train_images, tmp_path / "out", cache_root / "flux", "flux",
                      lora={"targets": ["to_qq"]})
    with pytest.raises(UserError, match=r"lora.targets \['to_qq'\]"):
        Trainer(cfg).fit()
