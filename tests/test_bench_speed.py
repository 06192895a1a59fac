"""bench/speed/bench_speed.py --smoke: the GPU benchmark's script runs end to end on the CPU (measures nothing)."""

from __future__ import annotations

import json

import pytest
from test_train_support import bench_module


def test_bench_speed_smoke(tmp_path):
    mod = bench_module("bench_speed")
    rows = mod.main(["--smoke", "--backend", "eager", "--only", "offload 0.5, compiled;sample: dittrain resident, compiled",
                     "--out", str(tmp_path)])
    names = [r["name"] for r in rows]
    assert names == ["plain diffusers + peft, bf16 LoRA, eager, resident", "dittrain offload 0.5, compiled",
                     "sample: dittrain resident, compiled"]
    assert rows[1]["graphs"] >= 2 and rows[0]["compile_s"] is None
    md = (tmp_path / "speed_flux.md").read_text()
    assert "| dittrain offload 0.5, compiled |" in md and "<= 0.85" in md
    assert len(json.loads((tmp_path / "speed_flux.json").read_text())) == 3


def test_bench_speed_smoke_fp8_rows(tmp_path):
    """The fp8 + modulation rows, training and sampling (CPU smoke)."""
    mod = bench_module("bench_speed")
    rows = mod.main(["--smoke", "--backend", "eager", "--only", "modulation", "--out", str(tmp_path)])
    names = [r["name"] for r in rows]
    assert names[1:] == ["dittrain offload 1.0 + act, fp8 base + modulation, compiled",
                         "sample: dittrain offload 1.0, fp8 + modulation, compiled"]
    assert all(r["spec"]["modulation"] and r["spec"]["quant"] == "fp8" for r in rows[1:])
    specs = {s["name"] for s in mod.row_specs("flux")}
    assert {"sample: dittrain offload 1.0, fp8, compiled", "dittrain offload 1.0 + act, fp8 base, compiled"} <= specs


def test_bench_speed_smoke_issue29_rows(tmp_path):
    """Issue 29's table (CPU smoke): checkpointing auto from the planner, fp8 matmul rows, ratios to plain
    compiled, the PCIe-floor columns."""
    mod = bench_module("bench_speed")
    rows = mod.main(["--smoke", "--backend", "eager", "--rows", "issue29", "--only",
                     "compile_repeated_blocks;checkpointing auto;fp8 base, fp8 matmul", "--out", str(tmp_path)])
    names = [r["name"] for r in rows]
    assert names == ["plain diffusers + peft, bf16 LoRA, eager, resident", "plain + compile_repeated_blocks",
                     "dittrain offload 0, compiled, checkpointing auto",
                     "dittrain offload 1.0 + act, fp8 base, fp8 matmul, compiled",
                     "dittrain offload 1.0 + act, fp8 base, fp8 matmul, ring 3 blocks, compiled",
                     "plain + compile_repeated_blocks, no checkpointing"]
    assert rows[4]["spec"]["ring"] == 3 and "ring" not in rows[3]["spec"]
    assert rows[3]["spec"]["fp8mm"] and "h2d_bytes" in rows[3]  # (the smoke ring may hold all three blocks)
    md = (tmp_path / "speed_flux_issue29.md").read_text()
    assert "| vs plain compiled |" in md and "<= 0.8 x plain compiled" in md
    every = {s["name"] for s in mod.issue29_specs("flux")}
    assert {"dittrain offload 0, compiled, checkpointing none", "dittrain offload 1.0 + act, compiled"} <= every
    assert "dittrain offload 1.0 + act, compiled" not in {s["name"] for s in mod.issue29_specs("qwen_image")}


def test_bench_speed_smoke_wan_reference_rows(tmp_path):
    """Wan (issue 39): the reference rows (plain diffusers + peft, eager and compile_repeated_blocks) on a clip
    (CPU smoke: 96x64 x 5 frames); the full-size inputs are a 480x832x81 clip's latents; the streamed rows are
    among the family's rows, and the 1.3 B transformer is a variant of the family's."""
    mod = bench_module("bench_speed")
    rows = mod.main(["--smoke", "--backend", "eager", "--family", "wan", "--only", "=plain + compile_repeated_blocks",
                     "--out", str(tmp_path)])
    assert [r["name"] for r in rows] == ["plain diffusers + peft, bf16 LoRA, eager, resident",
                                         "plain + compile_repeated_blocks"]
    assert "wan, 96x64 x 5 frames, LoRA r4" in (tmp_path / "speed_wan.md").read_text()
    adapter, m = mod.build("wan", "meta", False, variant="1.3b")
    assert len(m.blocks) == 30 and m.blocks[0].norm2.weight.dtype == mod.torch.float32  # kept fp32, as loaded
    kw = mod.model_inputs(adapter, m, mod.torch.device("meta"), 1024, (832, 480), 81)
    assert tuple(kw["hidden_states"].shape) == (1, 16, 21, 60, 104) and kw["encoder_hidden_states"].shape[1] == 512
    names = [s["name"] for s in mod.row_specs("wan")]
    assert names[:4] == ["plain diffusers + peft, bf16 LoRA, eager, resident", "dittrain offload 0, compiled",
                         "dittrain offload 1.0 + act, compiled", "dittrain offload 1.0 + act, fp8 base, compiled"]


def test_bench_speed_smoke_profile(tmp_path):
    mod = bench_module("bench_speed")
    rows = mod.main(["--smoke", "--profile", "--out", str(tmp_path)])
    assert [r["name"] for r in rows] == ["plain diffusers + peft, bf16 LoRA, eager, resident",
                                         "dittrain offload 0, eager"]
    text = (tmp_path / "profile_flux.txt").read_text()
    assert "'dittrain offload 0, eager' minus 'plain diffusers" in text and "Self CPU" in text
    # the device timeline (bench/common/timeline.py): the CPU profiler records no kernels or copies, and says so
    assert text.count("timeline: no device events in this profile") == 2
    saved = json.loads((tmp_path / "speed_flux_profile.json").read_text())
    assert [r["timeline"]["steps"] for r in saved] == [1, 1] and saved[1]["timeline"]["device_events"] == 0


def test_bench_speed_smoke_chroma_mask_rows(tmp_path, monkeypatch):
    """Chroma's attention-mask rows (CPU smoke; flex's CPU device check lifted: torch has no CPU flex backward
    kernel, its unfused reference runs); the plain row 'mask in every block' computes what the pipeline
    computes (no checkpointing) under diffusers' checkpointing, which alone gives the single blocks no mask."""
    from types import SimpleNamespace

    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
    mod = bench_module("bench_speed")
    rows = mod.main(["--smoke", "--backend", "eager", "--rows", "issue29", "--family", "chroma", "--only",
                     "flash mask;flex mask;auto, no attention mask", "--out", str(tmp_path)])
    assert [r["name"] for r in rows[1:]] == ["dittrain offload 0, compiled, checkpointing auto, flash mask",
                                             "dittrain offload 0, compiled, checkpointing auto, flex mask",
                                             "dittrain offload 0, compiled, checkpointing auto, no attention mask"]
    assert all(r["step_s"] for r in rows)
    names = [s["name"] for s in mod.issue29_specs("chroma")]
    assert {"plain + compile_repeated_blocks, mask in every block (as the pipeline)",
            "plain + compile_repeated_blocks, no attention mask",
            "dittrain offload 0, compiled, every block recomputed, flex"} <= set(names)
    assert "flash mask" not in str(mod.issue29_specs("flux")) and "flex" not in str(mod.issue29_specs("flux"))
    args = SimpleNamespace(family="chroma", smoke=True, rank=4, backend="eager", res=64)
    outs = []
    for spec in (dict(kind="plain", compile=False, ckpt=False), dict(kind="plain", compile=False),
                 dict(kind="plain", compile=False, mask_all=True)):
        adapter, m = mod.build("chroma", mod.torch.device("cpu"), True)
        kw = mod.model_inputs(adapter, m, "cpu", 64)
        kw["attention_mask"][:, 3:8] = 0  # padded caption tokens
        mod.plain_setup(adapter, m, args, spec)
        outs.append(m(**kw)[0])
    assert not mod.torch.equal(outs[1], outs[0]) and mod.torch.equal(outs[2], outs[0])


def test_bench_speed_smoke_profile_of_compiled_rows(tmp_path):
    """--profile with --only profiles the rows named (compiled ones, Chroma's), in the order named (not the table's),
    each against the first."""
    mod = bench_module("bench_speed")
    rows = mod.main(["--smoke", "--backend", "eager", "--profile", "--rows", "issue29", "--family", "chroma",
                     "--only", "=dittrain offload 0, compiled, checkpointing auto;=plain + compile_repeated_blocks",
                     "--out", str(tmp_path)])
    assert [r["name"] for r in rows] == ["dittrain offload 0, compiled, checkpointing auto",
                                         "plain + compile_repeated_blocks"]
    assert "'plain + compile_repeated_blocks' minus 'dittrain offload 0, compiled, checkpointing auto'" in (
        tmp_path / "profile_chroma.txt").read_text()


def test_bench_speed_smoke_profile_interleaved_qwen(tmp_path):
    """--profile --interleave --layers --no-mask (Qwen-Image, issue 29's eager question): both rows built at once
    with 3 blocks, timed in turn; the all-ones text mask dropped."""
    mod = bench_module("bench_speed")
    kw = {"encoder_hidden_states_mask": 1, "attention_mask": 2, "hidden_states": 3}
    mod.drop_mask(kw)
    assert kw == {"hidden_states": 3}
    rows = mod.main(["--smoke", "--profile", "--interleave", "--layers", "3", "--no-mask", "--family", "qwen_image",
                     "--out", str(tmp_path)])
    assert [r["name"] for r in rows] == ["plain diffusers + peft, bf16 LoRA, eager, resident",
                                         "dittrain offload 0, eager"]
    assert all(r["step_s"] > 0 and r["kernel_s"] >= 0 for r in rows)
    text = (tmp_path / "profile_qwen_image.txt").read_text()
    assert "interleaved (1 rounds, every model built at once, 3 blocks each)" in text and "no text mask" in text
    adapter, m = mod.build("qwen_image", mod.torch.device("cpu"), True, layers=3)
    assert len(adapter.blocks(m)) == 3


@pytest.mark.parametrize("family", ["lumina2", "anima", "ernie-image", "ideogram4", "hidream"])
def test_bench_speed_smoke_issue42_families(tmp_path, family):
    """Issue 42's image families (CPU smoke): the offload-0 compiled step beside plain diffusers + peft compiled,
    resident, in one process, through the generic path (the family's config at SMOKE's widths, its dummy inputs,
    its default LoRA targets); the table holds the offload-0 row to 0.85 x plain compiled."""
    mod = bench_module("bench_speed")
    rows = mod.main(["--smoke", "--backend", "eager", "--rows", "issue29", "--family", family, "--only",
                     "=plain + compile_repeated_blocks;=dittrain offload 0, compiled", "--out", str(tmp_path)])
    assert [r["name"] for r in rows] == ["plain diffusers + peft, bf16 LoRA, eager, resident",
                                         "plain + compile_repeated_blocks", "dittrain offload 0, compiled"]
    assert all(r["step_s"] > 0 for r in rows) and rows[2]["graphs"] >= 1
    md = (tmp_path / f"speed_{family}_issue29.md").read_text()
    assert "| dittrain offload 0, compiled |" in md and "<= 0.85 x plain compiled" in md


def test_bench_speed_ideogram4_plain_inputs():
    """Ideogram 4's plain rows take the text features over the whole sequence (zero on the image rows), as diffusers'
    forward does; the family's class gives the same output from the text rows alone (dittrain's rows)."""
    mod = bench_module("bench_speed")
    torch = mod.torch
    adapter, m = mod.build("ideogram4", torch.device("cpu"), True)
    kw = mod.model_inputs(adapter, m, "cpu", 64)
    full = mod.plain_inputs("ideogram4", kw)
    s, n = kw["hidden_states"].shape[1], kw["encoder_hidden_states"].shape[1]
    assert full["encoder_hidden_states"].shape[1] == s > n and not full["encoder_hidden_states"][:, n:].any()
    assert mod.plain_inputs("lumina2", kw) is kw
    with torch.no_grad():
        torch.testing.assert_close(m(**full)[0], m(**kw)[0])


def test_bench_speed_inputs_on_the_device(monkeypatch):
    """Every input of a step is on the step's device, as the trainer's batches are (Lumina 2's `dummy_inputs` gives
    its text mask on the CPU, for the planner's meta trace, which a GPU step's attention cannot take); a meta
    trace's inputs keep their devices."""
    mod = bench_module("bench_speed")
    torch = mod.torch
    adapter, m = mod.build("lumina2", torch.device("meta"), True)
    kw = mod.model_inputs(adapter, m, torch.device("meta"), 64)
    assert kw["encoder_attention_mask"].device.type == "cpu" and kw["hidden_states"].device.type == "meta"
    # on the CPU (the one device here), every tensor of the step is handed to `.to(the step's device)`
    moved, real_to = [], torch.Tensor.to

    def to(self, *a, **k):
        moved.append((tuple(self.shape), a[0] if a else k.get("device")))
        return real_to(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "to", to)
    kw = mod.model_inputs(adapter, m, torch.device("cpu"), 64)
    monkeypatch.undo()
    assert (tuple(kw["encoder_attention_mask"].shape), torch.device("cpu")) in moved
    assert all(v.device.type == "cpu" for v in kw.values() if isinstance(v, torch.Tensor))


def test_smoke_checkpointing_auto_leaves_no_folder_behind(tmp_path, monkeypatch):
    """A smoke row's `checkpointing auto` plans the smoke widths from a config folder it makes in the temp folder;
    the folder is removed after (one per row was left in /tmp)."""
    import tempfile
    from types import SimpleNamespace

    mod = bench_module("bench_speed")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    spec = next(s for s in mod.issue29_specs("flux") if s["name"] == "dittrain offload 0, compiled, checkpointing auto")
    args = SimpleNamespace(family="flux", res=64, rank=4, smoke=True)
    got = mod.checkpointing(spec, args, mod.torch.device("cpu"))
    assert got is not None and list(tmp_path.iterdir()) == []


def test_bench_speed_smoke_hunyuan_and_ltx2_rows(tmp_path):
    """HunyuanVideo 1.5 and LTX-2 (issue 45): the plain rows build diffusers' own class (HunyuanVideo 1.5's trainer
    class computes its block in token-wise regions), LTX-2's inputs are a clip with its sound (the joint call; the
    loss takes both predictions, so the audio stream trains), and issue 29's rows add the streamed ones (CPU smoke)."""
    mod = bench_module("bench_speed")
    torch = mod.torch
    adapter, m = mod.build("hunyuan-video-1.5", "meta", False, plain=True)
    assert type(m).__module__.startswith("diffusers.") and type(m) is not type(mod.build("hunyuan-video-1.5", "meta",
                                                                                           False)[1])
    adapter, m = mod.build("ltx2", "meta", False)
    kw = mod.model_inputs(adapter, m, torch.device("meta"), 1024, (1280, 704), 121)
    assert tuple(kw["hidden_states"].shape) == (1, 16 * 22 * 40, 128) and kw["audio_num_frames"] == 126
    assert tuple(kw["audio_hidden_states"].shape) == (1, 126, 128) and kw["isolate_modalities"] is False
    a, b = torch.ones(2, 3), torch.full((4,), 2.0)
    assert mod.loss((a, b)).item() == 5.0 and mod.loss(([a, a],)).item() == 1.0
    names = [s["name"] for s in mod.issue29_specs("ltx2")]
    assert "dittrain offload 1.0 + act, compiled" in names and "dittrain offload 1.0 + act, fp8 base, compiled" in names
    rows = mod.main(["--smoke", "--backend", "eager", "--rows", "issue29", "--family", "ltx2", "--only",
                     "=dittrain offload 1.0 + act, compiled", "--out", str(tmp_path)])
    assert [r["name"] for r in rows] == ["plain diffusers + peft, bf16 LoRA, eager, resident",
                                         "dittrain offload 1.0 + act, compiled"]
    assert all(r["step_s"] for r in rows)


def test_issue45_target_is_the_larger_of_floor_and_resident_compute():
    """A video family's streamed row is held to 1.15 x max(its PCIe floor, the offload-0 compiled step)."""
    bs = bench_module("bench_speed")

    def row(name, step, h2d=None):
        return dict(name=name, step_s=step, first_s=1.0, compile_s=None, peak_gb=None, h2d_bytes=h2d)

    def mark(family, streamed_s, resident_s, floor_s):
        rows = [row("plain diffusers + peft, bf16 LoRA, eager, resident", 9.0),
                row("dittrain offload 0, compiled", resident_s),
                row("dittrain offload 1.0 + act, compiled", streamed_s, h2d=floor_s * 50e9)]
        return bs.table29(rows, 50e9, family).splitlines()[-1]

    assert "max(floor, offload 0 compiled) met (1.10 x 2.000 s)" in mark("ltx2", 2.2, 2.0, 1.0)  # compute-bound
    assert "MISSED (1.20 x 3.000 s)" in mark("hunyuan-video-1.5", 3.6, 2.0, 3.0)  # PCIe-bound
    assert "<= 1.1 x floor" in mark("flux", 2.2, 2.0, 1.0)  # image families keep issue 29's floor target
