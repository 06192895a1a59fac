"""Wan 2.2 A14B, `model.expert: both` (issue 39; trainer/train/experts.py): both experts trained in one run, on a
tiny two-expert Wan of 6 blocks each (so that fractions 0.5 and 1.0 stream different blocks). Each step trains the
expert that owns the timesteps it drew, and the other expert's LoRA and optimizer state do not move; streamed with
parking (only the running expert in the ring) the run is bitwise the resident one; it resumes bitwise; its two
files load into WanPipeline as diffusers users load them, and its samples are WanPipeline's pixels."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_train_support import losses, pixels
from test_wan import PROMPT, _frames
from test_wan22 import _pipeline_frames

from trainer.config import Config
from trainer.data.video import write_video
from trainer.errors import UserError
from trainer.lora_format import peft_state_dict, read_lora_file
from trainer.sample import SampleRequest, run_sample
from trainer.sampling.output import frame_sheet
from trainer.train.objective import FlowMatching, shift_timesteps
from trainer.train.trainer import Trainer

FAMILY = "wan2.2-a14b"
STEPS = 8
FILES = ("lora-high_noise.safetensors", "lora-low_noise.safetensors")


@pytest.fixture(scope="module")
def a14b(tmp_path_factory) -> Path:
    """The tiny A14B with 6 blocks per expert (the registry's has 2: every fraction would keep both in the ring)."""
    from diffusers import WanPipeline, WanTransformer3DModel

    from trainer.models.wan22 import tiny_pipeline_a14b

    base = tiny_pipeline_a14b()
    experts = []
    for seed in (5, 6):
        torch.manual_seed(seed)
        experts.append(WanTransformer3DModel.from_config(base.transformer.config, num_layers=6))
    pipe = WanPipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae,
                       transformer=experts[0], transformer_2=experts[1], scheduler=base.scheduler,
                       boundary_ratio=base.config.boundary_ratio)
    folder = tmp_path_factory.mktemp("tiny-wan22-both") / "wan22-a14b"
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("wan22-both-data")
    write_video([f.resize((32, 32)) for f in _frames(9)], d / "clip.mp4", 16)
    (d / "clip.txt").write_text(PROMPT)
    return d


def _config(folder: Path, data: Path, out: Path, **sections) -> Config:
    d = {
        "model": {"family": FAMILY, "path": str(folder), "dtype": "fp32", "expert": "both"},
        "train": {"method": "lora", "steps": STEPS, "batch_size": 1, "grad_accum": 2, "seed": 0, "log_every": 1,
                  "checkpoint_every": STEPS // 2, "device": "cpu"},
        "lora": {"rank": 4, "alpha": 4},
        "optimizer": {"lr": 5e-2, "weight_decay": 0.1},
        "data": {"sources": [{"path": str(data)}], "resolutions": [32], "cache_dir": str(out.parent / "cache"),
                 "clip_frames": 5, "clips": "first"},
        "sample": {"prompts": [PROMPT], "steps": 2, "width": 32, "height": 32, "frames": 5, "guidance": 5.0,
                   "seed": 3, "every": STEPS},
        "output": {"dir": str(out), "tensorboard": False},
    }
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    return Config.model_validate(d)


def _experts(out: Path) -> list[str]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x["expert"] for x in lines if "loss" in x]


def _lora(path: Path) -> dict[str, torch.Tensor]:
    return peft_state_dict(read_lora_file(path, FAMILY))


def _snapshot(t: Trainer) -> dict[str, dict[str, torch.Tensor]]:
    """Per expert: its LoRA weights and their optimizer state (AdamW's step, exp_avg, exp_avg_sq), copied."""
    state = t.optim.optimizer.state
    out = {}
    for name, model in t.transformer.experts.items():
        snap = {}
        for n, p in model.named_parameters():
            if p.requires_grad:
                snap[n] = p.detach().clone()
                snap.update({f"{n}/{k}": torch.as_tensor(v).clone() for k, v in state.get(p, {}).items()})
        out[name] = snap
    return out


def test_the_first_draw_picks_the_expert_and_the_step_stays_on_its_side():
    cfg = _config(Path("m"), Path("d"), Path("o")).train
    obj = FlowMatching(cfg, lambda h, w: 3.0, split=0.875)
    x0 = torch.zeros(4, 4, 2, 4, 4)
    sides = []
    for _ in range(400):
        obj.start_step()
        t = torch.cat([obj.noise(x0).t, obj.noise(x0).t])  # two micro-batches of one step
        high = t * 1000.0 >= 875.0
        assert bool(high.all()) or not bool(high.any())  # one expert per step
        assert obj.side == bool(high[0])
        sides.append(obj.side)
    # each expert's share of the steps is its share of the shifted-timestep distribution: P(shift(u) >= 0.875)
    u = FlowMatching(cfg, seed=1).sample_t(200_000)  # train.timestep_sampling's draws, before the shift
    share = float((shift_timesteps(u, 3.0) >= 0.875).float().mean())
    assert abs(np.mean(sides) - share) < 0.06
    again = FlowMatching(cfg, lambda h, w: 3.0, split=0.875)
    again.start_step()
    obj2 = FlowMatching(cfg, lambda h, w: 3.0, split=0.875)
    obj2.start_step()
    assert torch.equal(again.noise(x0).t, obj2.noise(x0).t)  # fixed by the seed


def test_what_both_does_not_do_is_refused_in_one_line(a14b, clip, tmp_path):
    for section, why in ((("train", {"method": "full"}), "trains LoRAs only"),
                         (("optimizer", {"name": "prodigy"}), "needs an optimizer that steps each weight from its own state"),
                         (("train", {"ema": {"decay": 0.9}}), "has no EMA yet")):
        cfg = _config(a14b, clip, tmp_path / "out", **{section[0]: section[1]})
        with pytest.raises(UserError, match=rf"model.expert: both {re.escape(why)}"):
            Trainer(cfg).fit()
    from trainer.config import ModelConfig
    from trainer.models import get_adapter

    with pytest.raises(UserError, match="wan has one transformer"):
        get_adapter(ModelConfig(family="wan", path=a14b, expert="both"))


@pytest.fixture(scope="module")
def fitted(a14b, clip, tmp_path_factory):
    """The resident `both` fit, every step watched: the expert it trained, its timesteps, and both experts'
    LoRA weights and optimizer state before and after."""
    out = tmp_path_factory.mktemp("wan22-both") / "out"
    seen = []
    step, noise = Trainer.train_step, FlowMatching.noise
    ts = []

    def watched_noise(self, *a, **k):
        n = noise(self, *a, **k)
        ts.append(n.t.clone())
        return n

    def watched(self):
        before, ts[:] = _snapshot(self), []
        metrics = step(self)
        seen.append((metrics["expert"], self.objective.side, torch.cat(ts), before, _snapshot(self)))
        return metrics

    mp = pytest.MonkeyPatch()
    mp.setattr(Trainer, "train_step", watched)
    mp.setattr(FlowMatching, "noise", watched_noise)
    try:
        Trainer(_config(a14b, clip, out)).fit()
    finally:
        mp.undo()
    return out, seen


def test_each_step_trains_the_expert_that_owns_its_timesteps_and_leaves_the_other_alone(fitted):
    out, seen = fitted
    experts = [e for e, *_ in seen]
    assert experts == _experts(out) and set(experts) == {"high_noise", "low_noise"}
    assert len({(a, b) for a, b in zip(experts, experts[1:], strict=False)}) > 1  # the experts take turns as drawn
    for expert, side, t, before, after in seen:
        assert len(t) == 2 and side == (expert == "high_noise")
        assert bool((t * 1000.0 >= 875.0).all()) == side and bool((t * 1000.0 >= 875.0).any()) == side
        other = "low_noise" if expert == "high_noise" else "high_noise"
        # the other expert: weights and AdamW state (steps, moments; weight decay 0.1 not applied) bitwise still
        assert before[other].keys() == after[other].keys()
        assert all(torch.equal(before[other][k], after[other][k]) for k in before[other])
        assert any(not torch.equal(before[expert][k], after[expert][k]) for k in before[expert])
    # one checkpoint holds both; the final files are each expert's, as a run of it alone names them
    ckpt = out / "checkpoints" / f"step-{STEPS:06d}"
    assert (ckpt / "high_noise" / "adapter-state.safetensors").is_file()
    assert (ckpt / "low_noise" / "adapter-state.safetensors").is_file()
    assert all((out / f).is_file() for f in FILES) and not (out / "lora.safetensors").exists()


def _watch_steps(monkeypatch, record) -> list:
    """Stream on the CPU (the conductor's CPU ring) and append `record(trainer.offload, metrics)` after every
    training step to the returned list."""
    monkeypatch.setattr(Trainer, "_can_stream", lambda self: True)
    step, seen = Trainer.train_step, []

    def watched(self):
        metrics = step(self)
        seen.append(record(self.offload, metrics))
        return metrics

    monkeypatch.setattr(Trainer, "train_step", watched)
    return seen


def test_streamed_with_parking_is_bitwise_the_resident_run(fitted, a14b, clip, tmp_path, monkeypatch):
    out, _ = fitted
    parked = _watch_steps(monkeypatch, lambda h, metrics: (
        metrics["expert"], {n: x.parked for n, x in h.handles.items()},
        {n: x.stats()["offloaded_bytes"] for n, x in h.handles.items()}))
    for f, fmt in ((1.0, "diffusers"), (0.5, "comfy")):
        run = tmp_path / f"f{f}"
        parked.clear()
        Trainer(_config(a14b, clip, run, offload={"transformer": f}, output={"lora_format": fmt})).fit()
        assert losses(run) == losses(out) and _experts(run) == _experts(out)
        for name in FILES:  # comfy at 0.5: the same weights in ComfyUI's layout
            a, b = _lora(out / name), _lora(run / name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        if fmt == "comfy":
            assert all(k.startswith("diffusion_model.") for k in load_file(str(run / FILES[1])))
        for expert, is_parked, offloaded in parked:  # only the running expert holds a ring
            assert is_parked == {n: n != expert for n in is_parked}
            assert all(v > 0 for v in offloaded.values())  # blocks stream at either fraction (6 blocks)


def test_parked_on_disk_is_bitwise_parked_in_ram_and_the_idle_expert_holds_no_host_bytes(a14b, clip, tmp_path,
                                                                                           monkeypatch):
    """offload.park: disk (trainer/train/experts.py, the conductor's `park(disk=True)`): the idle expert's arena is
    freed and its blocks hollow, and each switch reads them again from its safetensors files; the losses, the experts
    drawn and both LoRA files are bitwise those of park: ram over steps that change expert several times, and the
    idle expert holds 0 host bytes (its arena and parking buffer) where in RAM it holds its blocks, and no bytes of
    its frozen non-block weights (placeholders, read back from its files at a switch) where in RAM it holds them."""
    from trainer.models.stream_load import is_placeholder

    def frozen_outside(h, name):  # bytes of the expert's frozen non-block weights (embedders) that hold memory
        inside = {id(p) for b in h.blocks[name] for p in b.parameters()}
        return sum(p.numel() * p.element_size() for p in h.models[name].parameters()
                   if id(p) not in inside and not p.requires_grad and not is_placeholder(p))

    seen = _watch_steps(monkeypatch, lambda h, metrics: (
        metrics["expert"], {n: {**x.stats(), "outside": frozen_outside(h, n)} for n, x in h.handles.items()},
        h.stats()))
    runs = {}
    for f in (0.5, 0.0):  # 0: every block in the ring, none in an arena (the parking buffer's case)
        for park in ("ram", "disk"):
            run = tmp_path / f"{park}-{f}"
            seen.clear()
            t = Trainer(_config(a14b, clip, run, offload={"transformer": f, "park": park}, sample={"every": 0}))
            t.fit()
            # closed with the model kept: every weight readable again (a parked expert's read back from its files)
            assert not any(is_placeholder(p) for p in t.transformer.parameters())
            runs[park] = run
            experts = [e for e, *_ in seen]
            assert sum(a != b for a, b in zip(experts, experts[1:], strict=False)) >= 2  # several switches
            for i, (expert, per, both) in enumerate(seen):
                idle = [s for n, s in per.items() if n != expert]
                assert per[expert]["parked_on"] is None and all(s["parked_on"] == park for s in idle)
                assert per[expert]["outside"] > 0 and all(s["outside"] == (0 if park == "disk" else
                                                                           per[expert]["outside"]) for s in idle)
                if park == "disk":
                    assert all(s["host_bytes"] == 0 for s in idle)
                    assert both["host_bytes"] == per[expert]["host_bytes"]  # one expert's blocks on the host
                else:  # the idle expert keeps every block on the host (arena + parking buffer)
                    assert all(s["host_bytes"] == s["block_bytes"] for s in idle)
                # every change of expert so far counted (and logged: the first ones and every 100th)
                assert both["park"] == park and both["switches"] == sum(
                    a != b for a, b in zip(experts[: i + 1], experts[1 : i + 1], strict=False))
        assert losses(runs["disk"]) == losses(runs["ram"]) and _experts(runs["disk"]) == _experts(runs["ram"])
        for name in FILES:
            a, b = load_file(str(runs["ram"] / name)), load_file(str(runs["disk"] / name))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_park_auto_takes_disk_exactly_where_the_runs_ram_peak_in_ram_does_not_fit_and_on_disk_does(a14b, clip,
                                                                                                  tmp_path,
                                                                                                  monkeypatch):
    """offload.park: auto decides by the planner's whole-run host-RAM peak with either park (planner/phases.py
    `run_ram_peaks`: the largest phase of `fit`, offloaded activations included) against offload.host_ram_gb: disk
    exactly where ram's peak exceeds it and disk's does not; the line says which, both peaks and the budget; the
    trainer's choice is the planner's own prediction's (`parks_on_disk_at`)."""
    from dataclasses import replace

    from trainer.planner import analyze, predict
    from trainer.planner.phases import run_ram_peaks
    from trainer.train import experts

    lines = []
    monkeypatch.setattr(experts, "say", lines.append)
    gb = 1e9
    fill = lambda *a: None  # noqa: E731 - the loader's, present: blocks can be read back

    def at(host_gb, park="auto", **offload):
        return _config(a14b, clip, tmp_path / "o", offload={"transformer": 1.0, "activations": True,
                                                             "host_ram_gb": host_gb, "park": park, **offload})

    cfg = at(4.0)
    peaks = run_ram_peaks(cfg, 1.0, analyze(cfg))
    assert 0 < peaks["disk"] < peaks["ram"]
    between = (peaks["disk"] + peaks["ram"]) / 2 / gb
    for host_gb, want in ((peaks["ram"] / gb, False), (between, True), (peaks["disk"] / gb * 0.99, False)):
        c = at(host_gb)
        disk, why = experts.park_on_disk(c, fill, 1.0, 1, 2)  # the planner's numbers, not the blocks given
        assert disk is want and f"auto -> {'disk' if want else 'ram'}" in why and f"{host_gb:.1f} GB" in why
        assert f"{peaks['ram'] / gb:.1f} GB with the idle expert in RAM, {peaks['disk'] / gb:.1f} GB on disk" in why
        assert analyze(c).parks_on_disk_at(1.0) is want  # the planner's prediction says the same
    # given peaks decide alone: over the budget in RAM and within it on disk
    c = at(10.0)
    assert experts.park_on_disk(c, fill, 1.0, 1, 2, {"ram": 11 * gb, "disk": 9 * gb})[0] is True
    assert experts.park_on_disk(c, fill, 1.0, 1, 2, {"ram": 10 * gb, "disk": 9 * gb})[0] is False
    assert experts.park_on_disk(c, fill, 1.0, 1, 2, {"ram": 12 * gb, "disk": 11 * gb})[0] is False
    # the activations count: the run's peak is at least the training step's, its offloaded activations included
    # (tests/test_planner_video.py: at 720p x 81 they decide between ram and disk)
    facts = analyze(cfg)
    step = predict(replace(facts, park="ram"), 1.0, max(facts.resolutions), True)
    assert step.act_checkpoint_host > 0 and peaks["ram"] >= step.ram_peak
    # and the same blocks at a larger clip need more RAM in either mode (in the training step;
    # the tiny model's whole-run peak is its text caching, the process and the encoders, which no clip changes)
    big = replace(analyze(cfg), frames=9)
    from trainer.planner.phases import predict_phases

    def step_ram(facts, park):
        return next(p.ram for p in predict_phases(cfg, 1.0, replace(facts, park=park)) if p.name == "training step")

    assert all(step_ram(big, m) > step_ram(analyze(cfg), m) for m in ("ram", "disk"))
    assert run_ram_peaks(cfg, 1.0, big)["ram"] >= peaks["ram"]
    assert experts.park_on_disk(cfg, None, 1.0, 1, 2)[0] is False  # loaded whole: nothing to read back
    assert experts.park_on_disk(at(4.0, "ram"), fill, 1.0, int(10 * gb), 2)[0] is False
    with pytest.raises(UserError, match="loads whole"):
        experts.park_on_disk(at(4.0, "disk"), None, 1.0, 1, 2)


def test_resume_is_bitwise_the_uninterrupted_run(fitted, a14b, clip, tmp_path):
    import shutil

    out, _ = fitted
    run = Path(shutil.copytree(out, tmp_path / "out"))
    cfg = _config(a14b, clip, run)
    Trainer(cfg, resume=str(run / "checkpoints" / f"step-{STEPS // 2:06d}")).fit()
    assert losses(run) == losses(out) and _experts(run) == _experts(out)
    for name in FILES:
        a, b = load_file(str(out / name)), load_file(str(run / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_both_files_load_in_wan_pipeline_and_samples_are_its_pixels(fitted, a14b, tmp_path):
    from diffusers import WanPipeline

    out, _ = fitted
    loras = [out / f for f in FILES]
    pipe = WanPipeline.from_pretrained(str(a14b), torch_dtype=torch.float32, local_files_only=True)
    pipe.load_lora_weights(str(loras[0]), adapter_name="high")
    pipe.load_lora_weights(str(loras[1]), adapter_name="low", load_into_transformer_2=True)
    assert pipe.get_list_adapters() == {"transformer": ["high"], "transformer_2": ["low"]}
    cfg = _config(a14b, out, out)
    want, ran = _pipeline_frames(cfg, loras, seed=3)
    assert ran == ["transformer"] * 2 + ["transformer_2"] * 2
    # sampled during the fit, at its last step (each expert with its LoRA as trained)
    np.testing.assert_array_equal(pixels(out / "samples" / f"step-{STEPS:06d}-0.png"), np.asarray(frame_sheet(want)))
    # `dittrain sample` with both files (model.expert: both samples as every config of the family does)
    _, sheet = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, loras=[str(p) for p in loras],
                                             out=tmp_path / "s"))
    np.testing.assert_array_equal(pixels(sheet), np.asarray(frame_sheet(want)))


def test_i2v_a14b_trains_both_experts_and_samples_as_its_pipeline(tmp_path):
    """Wan 2.2 I2V A14B (the first frame conditions both experts; boundary 0.9): a `both` fit, its in-fit sample
    and `dittrain sample --image` with both LoRAs are WanImageToVideoPipeline's pixels."""
    from diffusers import WanImageToVideoPipeline, WanPipeline
    from PIL import Image

    from trainer.models._diffusers import own_aligned_memory
    from trainer.models.tiny import make_tiny_models

    family = "wan2.2-a14b-i2v"
    (model,) = make_tiny_models(tmp_path / "m", [family])
    data = tmp_path / "data"
    data.mkdir()
    frames = [f.resize((32, 32)) for f in _frames(9)]
    write_video(frames, data / "clip.mp4", 16)
    (data / "clip.txt").write_text(PROMPT)
    frames[0].save(tmp_path / "first.png")
    out = tmp_path / "out"
    cfg = _config(model, data, out, model={"family": family}, train={"steps": 4, "checkpoint_every": 0},
                  sample={"every": 4, "image": str(tmp_path / "first.png")})
    Trainer(cfg).fit()
    assert set(_experts(out)) <= {"high_noise", "low_noise"} and len(_experts(out)) == 4
    loras = [out / f for f in FILES]
    pipe = WanImageToVideoPipeline.from_pretrained(str(model), torch_dtype=torch.float32, local_files_only=True)
    for tr in (pipe.transformer, pipe.transformer_2):
        own_aligned_memory(tr)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(loras[0]))
    pipe.load_lora_weights(str(loras[1]), load_into_transformer_2=True)
    s = cfg.sample
    with torch.no_grad():  # as tests/test_wan_i2v.py encodes the prompt for this pipeline
        pe, npe = (WanPipeline._get_t5_prompt_embeds(pipe, prompt=p, max_sequence_length=512) for p in (PROMPT, ""))
    image = Image.open(tmp_path / "first.png").convert("RGB")
    want = pipe(image=image, prompt_embeds=pe, negative_prompt_embeds=npe, height=s.height, width=s.width,
                num_frames=s.frames, num_inference_steps=s.steps, guidance_scale=s.guidance,
                generator=torch.Generator().manual_seed(3), output_type="pil").frames[0]
    np.testing.assert_array_equal(pixels(out / "samples" / "step-000004-0.png"), np.asarray(frame_sheet(want)))
    _, sheet = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=3, loras=[str(p) for p in loras],
                                             out=tmp_path / "s"))
    np.testing.assert_array_equal(pixels(sheet), np.asarray(frame_sheet(want)))


def test_the_last_two_recomputed_blocks_keep_their_inputs_on_the_device_bitwise_and_counted(a14b, clip, tmp_path):
    """Activation offloading leaves the checkpoint inputs of the last two recomputed blocks on the device
    (offload/plan.py `inputs_on_device`: backward needs them first and holds two blocks' inputs there anyway). On the
    tiny Wan 2.2 expert (6 blocks, every block streamed, LoRA, AdamW), training with it gives bitwise the losses and
    LoRA of offloading every block; the host holds exactly those two blocks' inputs fewer; and the planner's host
    count for the clip (`act_checkpoint_host`, what `fit`'s RAM peak adds) is the bytes that went to the host."""
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig

    from trainer.offload import attach_offload
    from trainer.offload.plan import INPUTS_ON_DEVICE, inputs_on_device
    from trainer.planner import analyze, predict
    from trainer.planner.trace import forward_inputs

    cfg = _config(a14b, clip, tmp_path / "o", offload={"transformer": 1.0, "activations": True})
    facts = analyze(cfg)
    res = max(facts.resolutions)
    width, height, frames = facts.size(res)

    def run(keep: int):
        model = WanTransformer3DModel.from_pretrained(str(a14b / "transformer"))  # fp32, as cfg's model.dtype
        model.requires_grad_(False)
        torch.manual_seed(0)
        model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                     init_lora_weights=False))
        blocks = list(model.blocks)
        inputs = []  # per block call: its hidden states' bytes (fp32)

        def remember(module, args, kwargs):
            inputs.append((kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).numel() * 4)

        for b in blocks:
            b.register_forward_pre_hook(remember, with_kwargs=True)
        h = attach_offload(blocks, "cpu", 1.0, activations=True, activation_min_bytes=0, inputs_on_device=keep)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2)
        losses, offloaded, went = [], [], []
        for step in range(4):
            torch.manual_seed(100 + step)
            kw = forward_inputs(FAMILY, model, 1, height, width, facts.text_tokens, torch.float32, "cpu",
                                frames=frames)
            out = model(**kw, return_dict=False)[0]
            loss = torch.nn.functional.mse_loss(out, torch.randn_like(out))
            went.append(sorted(h._c.activations._by_block))
            offloaded.append(h._c.activations.offloaded_bytes)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        h.close()
        return torch.stack(losses), lora, offloaded, went, inputs[: len(blocks)]

    l0, lora0, off0, went0, sizes = run(0)
    l2, lora2, off2, went2, _ = run(INPUTS_ON_DEVICE)
    assert INPUTS_ON_DEVICE == 2 and inputs_on_device([True] * 6) == {4, 5}
    assert torch.equal(l0, l2) and lora0.keys() == lora2.keys() and all(torch.equal(lora0[k], lora2[k]) for k in lora0)
    assert went0 == [[1, 2, 3, 4, 5]] * 4 and went2 == [[1, 2, 3]] * 4  # block 0's input needs no grad
    assert all(a - b == sizes[4] + sizes[5] > 0 for a, b in zip(off0, off2, strict=True))
    assert off2 == [sum(sizes[1:4])] * 4
    assert predict(facts, 1.0, res, activation_offload=True).act_checkpoint_host == off2[0]


def test_the_activation_buffers_are_given_back_before_each_sample_and_checkpoint_save(a14b, clip, tmp_path,
                                                                                      monkeypatch):
    """The trainer gives the activation offloader's pinned buffers back (`release_activations`, every expert's
    handle) before each sampling pass and each checkpoint save, the phases the planner counts without them."""
    from trainer.sampling.training import TrainingSampler
    from trainer.train import experts

    events = []
    _watch_steps(monkeypatch, lambda h, metrics: events.append("step"))
    release, save, sample = experts.ExpertHandles.release_activations, Trainer._save, TrainingSampler.__call__

    def released(self):
        events.append("release")
        return release(self)

    def saved(self, final):
        events.append("save")
        return save(self, final)

    def sampled(self, *a, **k):
        events.append("sample")
        return sample(self, *a, **k)

    monkeypatch.setattr(experts.ExpertHandles, "release_activations", released)
    monkeypatch.setattr(Trainer, "_save", saved)
    monkeypatch.setattr(TrainingSampler, "__call__", sampled)
    Trainer(_config(a14b, clip, tmp_path / "o", offload={"transformer": 1.0, "activations": True})).fit()
    # a checkpoint at step 4, a sample at 8, the final save (step 8's checkpoint)
    assert events.count("step") == STEPS and events.count("save") == 2 and events.count("sample") == 1
    assert all(events[i - 1] == "release" for i, e in enumerate(events) if e in ("save", "sample"))


@pytest.mark.parametrize("park", ["disk", "ram"])
def test_the_sampling_pass_holds_one_experts_blocks_and_no_activation_buffer_as_the_planner_counts(a14b, clip,
                                                                                                   tmp_path,
                                                                                                   monkeypatch,
                                                                                                   park):
    """Sampling during training with activation offloading (forced on here: the trainer offloads them only on a GPU),
    every block streamed and the idle expert parked: the sampling phase starts with the activation buffers already
    given back (its measured RAM peak starts without them), no denoising forward takes them again, and the host
    holds one expert's arena (park disk) or both (ram) beside the idle expert's LoRA and optimizer state (and, in
    RAM, its frozen non-block weights). Those bytes, at their largest over each pass (both experts run in it), are
    the planner's sampling-phase RAM less the process (`HOST_BASE`) and the VAE: the structures 04:24's GPU run
    (bench/history/2026-11-28.md) found 30 GB above, which were the activation buffers taken back by the first
    denoising forward. (The rotary tables, buffers of a few KB, are left out on both sides: the planner counts
    parameters.)"""
    from trainer.models.stream_load import is_placeholder
    from trainer.offload.allocators import BumpArena
    from trainer.planner import analyze
    from trainer.planner.phases import component_ram, predict_phases
    from trainer.planner.prediction import HOST_BASE
    from trainer.sampling.training import TrainingSampler
    from trainer.train import streaming

    attach = streaming.attach_offload
    monkeypatch.setattr(streaming, "attach_offload", lambda *a, **k: attach(
        *a, **{**k, "activations": True, "activation_min_bytes": 0}))
    _watch_steps(monkeypatch, lambda h, metrics: None)
    trainer, at_entry, passes = {}, [], []

    def held(t) -> dict[str, int]:
        """Host bytes of each structure: arenas and parking buffers, the idle expert's resident part, activations."""
        h, state = t.offload, t.optim.optimizer.state
        out = {"activations": sum(c.nbytes for a in {x._c.activations for x in h.handles.values()}
                                   for c in a.arena.chunks)}
        for n, x in h.handles.items():
            out[f"{n} blocks"] = x.stats()["host_bytes"]
            if x.parked:
                inside = {id(p) for b in h.blocks[n] for p in b.parameters()}
                frozen = sum(p.numel() * p.element_size() for p in h.models[n].parameters()
                             if id(p) not in inside and not p.requires_grad and not is_placeholder(p))
                lora = sum(p.numel() * p.element_size() for p in h.params[n])
                moments = sum(v.numel() * v.element_size() for p in h.params[n] for v in state[p].values()
                              if isinstance(v, torch.Tensor) and v.dim() > 0)
                out[f"{n} idle"] = frozen + lora + moments
        return out

    phase = Trainer._phase

    def entered(self, name, *a, **k):
        trainer["t"] = self
        if name == "sampling":
            at_entry.append(held(self)["activations"])
        return phase(self, name, *a, **k)

    call = TrainingSampler.__call__

    def sampled(self, transformer, *a, **k):
        seen = []
        hooks = [m.register_forward_pre_hook(lambda _m, _a: seen.append(held(trainer["t"])))
                 for m in transformer.experts.values()]  # after the experts' own pre-hook (the switch)
        try:
            return call(self, transformer, *a, **k)
        finally:
            for x in hooks:
                x.remove()
            passes.append(seen)

    monkeypatch.setattr(Trainer, "_phase", entered)
    monkeypatch.setattr(TrainingSampler, "__call__", sampled)
    taken = []  # the activation buffers the training steps take (so that there is something to give back)
    alloc = BumpArena.alloc
    monkeypatch.setattr(BumpArena, "alloc", lambda self, n: taken.append(n) or alloc(self, n))
    cfg = _config(a14b, clip, tmp_path / "o", train={"steps": 4, "checkpoint_every": 0},
                  offload={"transformer": 1.0, "activations": True, "park": park}, sample={"every": 2})
    Trainer(cfg).fit()
    assert taken and len(passes) == 2 and at_entry == [0, 0]
    facts = analyze(cfg)
    predicted = next(p.ram for p in predict_phases(cfg, 1.0, facts) if p.name == "sampling")
    vae = facts.adapter.vae_params * 4  # fp32 (the planner's full-size VAE: not the tiny one's)
    blocks = sum(facts.packed)
    for seen in passes:
        # a conditional and an unconditional forward per denoising step (guidance 5), none with activation buffers
        assert len(seen) == 2 * cfg.sample.steps and all(s["activations"] == 0 for s in seen)
        assert {n for s in seen for n in s if n.endswith(" idle")} == {"high_noise idle", "low_noise idle"}
        arenas = {sum(v for n, v in s.items() if n.endswith(" blocks")) for s in seen}
        assert arenas == {blocks if park == "disk" else 2 * blocks}
        assert max(sum(s.values()) for s in seen) == predicted - HOST_BASE - vae - component_ram(facts)


def test_each_switch_of_experts_hands_the_freed_copies_heap_pages_back(a14b, clip, tmp_path, monkeypatch):
    """A switch moves the outgoing expert's LoRA and optimizer moments to the CPU and frees the incoming one's CPU
    copies: small tensors, in glibc's heap, whose freed pages stay resident unless trimmed (stream_load.py
    `trim_heap`; 0.92 GB at Wan 14B rank 16, the planner counts one parked set). Every switch ends with a trim, once
    the other expert is parked and this one's copies are gone."""
    from trainer.train import experts

    trims = []

    def trim():
        trims.append({n: x.parked for n, x in trainer["t"].offload.handles.items()})

    trainer = {}
    init = Trainer.__init__

    def kept(self, *a, **k):
        trainer["t"] = self
        init(self, *a, **k)

    monkeypatch.setattr(Trainer, "__init__", kept)
    monkeypatch.setattr(experts, "trim_heap", trim)
    seen = _watch_steps(monkeypatch, lambda h, metrics: (metrics["expert"], h.stats()["switches"]))
    Trainer(_config(a14b, clip, tmp_path / "o", offload={"transformer": 1.0, "park": "disk"},
                    sample={"every": 0})).fit()
    assert seen[-1][1] >= 2 and len(trims) == seen[-1][1]  # one trim per switch, none at the first activation
    assert all(sorted(parked.values()) == [False, True] for parked in trims)  # after the switch: the other parked


@pytest.mark.parametrize("checkpoint_every", [0, 2])
def test_the_planner_knows_which_checkpoint_saves_follow_a_phase_that_empties_the_cache(a14b, clip, tmp_path,
                                                                                       monkeypatch, checkpoint_every):
    """Sampling (and validation) empty the CUDA cache on their way out (phase_log.py `own_cache`), so a checkpoint
    save right after one reserves the step's static part alone, where one right after a training step keeps what
    the step reserved. The planner's `saves_after_emptied_cache` says which, from the config: on 3 steps with a
    sample at step 3, the only save (the final one) follows the sample (the bench's Wan 2.2 A14B run at 720p x 81
    measured 2.39 GB there, where the planner had printed the step's figure); with a checkpoint every 2 steps, the
    step-2 save follows its step. The order of phases `fit` runs is what the planner says, and the save's predicted
    VRAM is the step's static part and workspace, or the step's reserved peak."""
    from trainer.planner import analyze, predict
    from trainer.planner.phases import predict_phases, saves_after_emptied_cache
    from trainer.planner.prediction import WORKSPACE

    entered = []
    phase = Trainer._phase

    def watched(self, name, *a, **k):
        entered.append(name)
        return phase(self, name, *a, **k)

    monkeypatch.setattr(Trainer, "_phase", watched)
    cfg = _config(a14b, clip, tmp_path / "o", offload={"transformer": 1.0, "activations": True},
                  train={"steps": 3, "checkpoint_every": checkpoint_every}, sample={"every": 3})
    Trainer(cfg).fit()
    runs = [n for n in entered if n in ("training step", "sampling", "checkpoint save")]
    before = {runs[i - 1] for i, n in enumerate(runs) if n == "checkpoint save"}
    assert before == ({"sampling"} if checkpoint_every == 0 else {"training step", "sampling"})
    assert saves_after_emptied_cache(cfg) == (before == {"sampling"})
    facts = analyze(cfg)
    step = predict(facts, 1.0, max(facts.resolutions), True)
    save = next(p for p in predict_phases(cfg, 1.0, facts) if p.name == "checkpoint save")
    assert save.vram == (step.static + WORKSPACE if checkpoint_every == 0 else step.peak_reserved)
    assert step.static + WORKSPACE < step.peak_reserved
