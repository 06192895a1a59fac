"""What a new user trips over (issue 30): resume that never tracebacks, messages that tell the truth, and quiet,
readable output. One test per rough edge, each on the tiny models in a few seconds."""

from __future__ import annotations

import json

import pytest
from test_train_support import make_config, write_images

from trainer.errors import UserError
from trainer.train.trainer import Trainer


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("newcomer-images"))


def _cfg(tiny_models, images, tmp_path, **sections):
    sections.setdefault("train", {})
    sections["train"] = {"steps": 2, "checkpoint_every": 2, **sections["train"]}
    return make_config(tiny_models, images, tmp_path / "run", tmp_path / "cache", "flux", **sections)


# ---------------------------------------------------------------------------------------------- resume


def test_resume_with_a_changed_lora_rank_is_one_line_naming_the_key(tiny_models, images, tmp_path, monkeypatch):
    Trainer(_cfg(tiny_models, images, tmp_path)).fit()
    changed = _cfg(tiny_models, images, tmp_path, lora={"rank": 8}, train={"steps": 4})
    from trainer.train import trainer

    real = trainer.get_adapter
    monkeypatch.setattr(trainer, "get_adapter", lambda *a: pytest.fail("loaded a model before checking the shapes"))
    with pytest.raises(UserError, match=r"lora\.rank 4 -> 8 .*--set lora\.rank=4"):
        Trainer(changed, resume="latest").fit()
    # A checkpoint without its config (older runs): the shapes are compared tensor by tensor, still one line
    monkeypatch.setattr(trainer, "get_adapter", real)
    state = tmp_path / "run" / "checkpoints" / "step-000002" / "state.json"
    s = json.loads(state.read_text())
    del s["config"]
    state.write_text(json.dumps(s))
    with pytest.raises(UserError, match=r"LoRA weights have other shapes than this lora config makes"):
        Trainer(changed, resume="latest").fit()


def _tb_losses(folder) -> list[tuple[int, float]]:
    """Every train/loss event in every event file, as a plain reader sees them (no purge markers applied)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    found = []
    for f in sorted(folder.glob("events.out.tfevents.*")):
        for e in EventFileLoader(str(f)).Load():
            for v in e.summary.value:
                if v.tag == "train/loss":
                    found.append((e.step, round(float(v.tensor.float_val[0] if v.HasField("tensor") else
                                                      v.simple_value), 6)))
    return sorted(found)


def test_resume_continues_the_smoothed_loss_and_tensorboard_holds_each_step_once(tiny_models, images, tmp_path):
    cfg = _cfg(tiny_models, images, tmp_path, train={"steps": 4}, output={"tensorboard": True})
    Trainer(cfg).fit()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    tb = _tb_losses(tmp_path / "run" / "tensorboard")
    assert [s for s, _ in tb] == [1, 2, 3, 4]
    Trainer(cfg, resume=str(tmp_path / "run" / "checkpoints" / "step-000002")).fit()
    again = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss_smoothed"] for r in again] == [r["loss_smoothed"] for r in rows]
    assert _tb_losses(tmp_path / "run" / "tensorboard") == tb  # steps 3 and 4 once, not once per run


# ---------------------------------------------------------------------------------------------- a failed fit


def test_a_missing_model_folder_is_named_and_the_failed_fit_leaves_no_run_json(tiny_models, images, tmp_path):
    cfg = _cfg(tiny_models, images, tmp_path, model={"path": str(tmp_path / "nowhere")})
    with pytest.raises(UserError, match=rf"model\.path {tmp_path / 'nowhere'} does not exist: point it at"):
        Trainer(cfg).fit()
    assert not (tmp_path / "run").exists()  # the folder the run made is gone again
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="does not exist"):
        Trainer(cfg).fit()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["notes.txt"]


def test_overwrite_says_what_it_deletes_and_keeps_images_made_by_dittrain_sample(tiny_models, images, tmp_path,
                                                                                 capsys):
    from PIL import Image

    from trainer.sampling.output import image_metadata, save_png

    cfg = _cfg(tiny_models, images, tmp_path)
    Trainer(cfg).fit()
    samples = tmp_path / "run" / "samples"  # as a fit's sampling (Trainer.sample) and `dittrain sample` write them
    save_png(Image.new("RGB", (8, 8)), samples / "step-000002-0.png", image_metadata(prompt="x", training_step=2))
    mine = save_png(Image.new("RGB", (8, 8)), samples / "step-000002-cat.png", image_metadata(prompt="a cat", seed=1))
    capsys.readouterr()
    Trainer(cfg, overwrite=True).fit()
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("--overwrite: deleted"))
    for what in ("checkpoints/ (1 checkpoint)", "lora.safetensors", "metrics.jsonl", "1 sample image in samples/",
                 "run.json", "kept 1 image made by `dittrain sample`"):
        assert what in line, line
    assert mine.is_file()


# ---------------------------------------------------------------------------------------------- messages


def test_a_cross_field_error_caused_by_set_blames_set_not_the_yaml_line(tmp_path):
    from trainer.config import load_config
    from trainer.errors import ConfigError

    f = tmp_path / "c.yaml"
    f.write_text("model:\n  family: flux\n  path: m\noffload:\n  transformer: 0\noutput:\n  dir: o\n")
    with pytest.raises(ConfigError) as e:
        load_config(f, ["offload.transformer=auto"])
    assert str(e.value).startswith("--set offload.transformer=auto: offload.transformer: auto needs "
                                   "offload.vram_budget_gb"), str(e.value)
    f.write_text("model:\n  family: flux\n  path: m\noffload:\n  transformer: auto\noutput:\n  dir: o\n")
    with pytest.raises(ConfigError, match=rf"^{f}: offload.transformer: auto needs"):
        load_config(f, ["train.steps=3"])  # the file's own value: the file is blamed


def test_a_lora_weight_that_is_not_a_number_is_what_the_error_names(tmp_path):
    from trainer.sampling.request import parse_lora

    with pytest.raises(UserError, match=r"--lora x\.safetensors:abc: the weight 'abc' is not a number; write "
                                        r"PATH:WEIGHT, e\.g\. x\.safetensors:0\.8"):
        parse_lora("x.safetensors:abc")
    assert parse_lora("x.safetensors:0.5").weight == 0.5 and parse_lora("dir:name").path.name == "dir:name"


def test_the_data_summary_counts_in_the_singular_and_plural(tiny_models, tmp_path):
    from PIL import Image

    from trainer.data.pipeline import plan_data
    from trainer.models import get_adapter

    folder = write_images(tmp_path / "imgs", n=1, size=64)
    Image.new("RGB", (32, 32), (200, 10, 10)).save(folder / "small.png")
    (folder / "small.txt").write_text("a small red picture")
    cfg = make_config(tiny_models, folder, tmp_path / "run", tmp_path / "cache", "flux", train={"batch_size": 1})
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"resolutions": [32, 64]})})
    text = plan_data(cfg, get_adapter(cfg.model), progress=False).summary()
    assert "data: 2 images from 1 source (" in text
    assert "resolution 64 (sides divisible by 16): 1 bucket; 1 image is too small for it (and trains at the other " \
           "resolutions)" in text, text
    assert " 1 image,      1 per epoch,     1 batch" in text and "1 buckets" not in text and "1 images" not in text


# ---------------------------------------------------------------------------------------------- dittrain plan


def _plan_cfg(path, **model):
    from trainer.config import Config

    return Config.model_validate({
        "model": {"family": "flux", "path": str(path), "dtype": "bf16", **model}, "lora": {"rank": 4, "alpha": 4},
        "data": {"sources": [{"path": "unused"}], "resolutions": [64]}, "output": {"dir": "unused"}})


def _blocks_row(lines) -> list[str]:
    return next(x for x in lines if x.startswith("transformer blocks")).split()


def test_plan_counts_parameters_not_bytes_says_how_the_base_is_stored_and_when_it_is_not_your_model(tmp_path):
    """Issue 30 items 3 and 10, on the built-in full-size Flux (a model.path that does not exist)."""
    from trainer.planner import report

    plain, _ = report(_plan_cfg(tmp_path / "no-model"))
    fp8, _ = report(_plan_cfg(tmp_path / "no-model", quantize="fp8"))
    # columns: name (3 words), params, dtype, GB, ...: the same parameters, fewer bytes, the dtypes named
    a, b = _blocks_row(plain), _blocks_row(fp8)
    assert a[3] == b[3] and float(a[3]) > 10 and a[4] == "bf16" and b[4] == "fp8+bf16" and float(b[5]) < float(a[5])
    assert plain[1] == "base bf16; LoRA fp32"
    assert fp8[1] == ("base block Linears fp8 e4m3 with per-channel fp32 scales (modulation in bf16; the rest bf16), "
                      "computed in bf16; LoRA fp32")
    assert plain[2] == (f"model: NOT your model: model.path {tmp_path / 'no-model'} does not exist, so this plans the "
                        "built-in full-size flux config (the published model's sizes); point model.path at your "
                        "model folder to plan that")


def test_plan_exits_non_zero_when_the_ram_does_not_fit(tiny_models, tmp_path):
    import yaml
    from typer.testing import CliRunner

    from trainer.cli import app

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_plan_cfg(tiny_models / "flux").model_dump(mode="json")))
    small = CliRunner().invoke(app, ["plan", str(path), "--ram", "0.0001"])
    assert small.exit_code == 1 and "does NOT fit: a lower offload.transformer pins less RAM" in small.stderr
    assert "error" not in small.stderr  # the verdict, not a failure of the command
    assert CliRunner().invoke(app, ["plan", str(path), "--ram", "1000"]).exit_code == 0


def test_the_fit_log_says_what_the_base_and_the_lora_are_stored_and_computed_in(tiny_models, images, tmp_path):
    from trainer.train.method import method_for

    def storage(method="lora", **model):
        cfg = _cfg(tiny_models, images, tmp_path, model={"dtype": "bf16", **model}, train={"method": method})
        return method_for(cfg).storage()

    assert storage() == "base bf16; LoRA fp32 (matmuls in bf16)"
    assert storage(quantize="fp8", quantize_modulation=True) == (
        "base block Linears fp8 e4m3 with per-channel fp32 scales (modulation too; the rest bf16), computed in "
        "bf16; LoRA fp32 (matmuls in bf16)")
    assert storage(quantize="int8").startswith("base block Linears int8 with per-channel fp32 scales (modulation "
                                               "in bf16;")
    assert "), forward matmuls in fp8 (activations rounded per row; bf16 where the GPU has no fp8 matmul); LoRA" \
        in storage(quantize="fp8", fp8_matmul=True)
    assert storage("full") == "weights bf16 (all trained)"


def test_an_offload_fraction_on_the_cpu_is_said_to_be_ignored(tiny_models, images, tmp_path, capsys):
    from trainer.train.streaming import transformer_fraction

    cfg = _cfg(tiny_models, images, tmp_path, offload={"transformer": 0.5})
    assert transformer_fraction(cfg, can_stream=False) == 0.0
    assert "note: offload.transformer 0.5 is ignored on the CPU: the transformer stays in RAM" in capsys.readouterr().err
    assert transformer_fraction(_cfg(tiny_models, images, tmp_path), can_stream=False) == 0.0
    assert capsys.readouterr().err == ""  # nothing asked, nothing said


def test_phase_lines_report_the_peak_anonymous_rss_apart_from_file_pages(tmp_path):
    import mmap
    import time

    import torch

    from trainer.phase_log import Phase, PhaseLog, anon_rss

    if not anon_rss():
        pytest.skip("no RssAnon in /proc/self/status")
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\1" * (96 * 2**20))
    log = PhaseLog()
    with Phase("load", log=log), open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
        sum(m[i] for i in range(0, len(m), 4096))  # 96 MiB of file pages resident: RSS, not anonymous
        x = torch.ones(48 * 2**20, dtype=torch.uint8)  # 48 MiB anonymous, touched, then freed inside the phase
        time.sleep(0.2)  # the sampler sees it
        del x
    p = log.peaks["load"]
    assert p.anon >= 48 * 2**20 and p.rss - p.anon >= 64 * 2**20  # the file's pages are not in the anonymous peak
    assert (f"peak anonymous RSS {p.anon / 1e9:.1f} GB (all RSS with file pages {p.rss / 1e9:.1f} GB)"
            in log.lines()[0])


# ---------------------------------------------------------------------------------------------- status


def _step(loss: float = 1.4571, step_time: float = 12.34) -> dict:
    return {"loss": loss, "lr": 1e-3, "step_time": step_time, "samples_per_s": 0.4}


def test_the_progress_bar_fits_80_columns_with_its_bar_and_postfix_whole(tmp_path, capsys, monkeypatch):
    import sys

    from trainer.train.monitor import Monitor

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    monkeypatch.setenv("COLUMNS", "81")  # tqdm reads the width from here when stderr is no terminal device
    monkeypatch.setenv("LINES", "24")
    m = Monitor(tmp_path, total=50000, start=12344, tensorboard=False, epoch=lambda: 123)
    m.log(12345, _step(), write=False)
    m.bar.refresh()
    m.close()
    drawn = [x for x in capsys.readouterr().err.replace("\x1b[A", "").split("\r") if "12345/50000" in x][-1].rstrip()
    assert len(drawn) <= 80, drawn
    bar = drawn.split("|")[1]
    assert len(bar) == 10 and drawn.endswith("loss 1.4571, ep 123, 12.3 s/step"), drawn


def test_without_a_terminal_a_status_line_comes_at_least_every_30_seconds(tmp_path, capsys, monkeypatch):
    import sys

    from trainer.train import monitor

    clock = [0.0]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    monkeypatch.setattr(monitor, "_now", lambda: clock[0])
    m = monitor.Monitor(tmp_path, total=1000, start=0, tensorboard=False)  # 5 %: every 50 steps
    for s in range(1, 11):
        clock[0] += 5.0 if s <= 5 else 31.0  # steps 1-5 take 25 s in all, then one step every 31 s
        m.log(s, _step(), write=False)
    m.close()
    said = [x.split(":")[0] for x in capsys.readouterr().err.splitlines() if x.startswith("step ")]
    assert said == [f"step {s}/1000" for s in (6, 7, 8, 9, 10)]


def test_long_prompts_get_one_line_of_ours_instead_of_clip_truncation_warnings(tiny_models, tmp_path, capfd):
    from trainer.config import Config
    from trainer.sample import SampleRequest, run_sample

    cfg = Config.model_validate({
        "model": {"family": "flux", "path": str(tiny_models / "flux"), "dtype": "fp32"},
        "sample": {"steps": 1, "width": 32, "height": 32}, "train": {"device": "cpu"},
        "output": {"dir": str(tmp_path / "out")}})
    long = " ".join(["a red square beside a blue circle on a white table"] * 12)
    capfd.readouterr()
    run_sample(cfg, SampleRequest(prompts=[long, long + " again", "short"]))
    err = capfd.readouterr().err
    assert "truncated" not in err and "Token indices" not in err, err
    assert "note: 2 prompts are longer than CLIP's 77 tokens; CLIP reads only the start" in err


def test_kontext_samples_are_the_size_asked_for_with_and_without_a_reference(tiny_models, tmp_path):
    """FluxKontextPipeline rescales to max_area (1024**2 by default): 64x64 came out 1024x1024, in `dittrain
    sample` and in samples during a Kontext fit (both go through `generate`)."""
    import torch
    from PIL import Image

    from trainer.config import ModelConfig
    from trainer.models import get_adapter
    from trainer.sampling.engine import generate
    from trainer.sampling.request import SampleSettings

    adapter = get_adapter(ModelConfig(family="flux-kontext", path=tiny_models / "flux-kontext", dtype="fp32"))
    pipe = adapter.pipeline(adapter.load(adapter.cfg, parts={"transformer", "vae", "text", "scheduler"},
                                         dtype=torch.float32, device="cpu"))
    Image.new("RGB", (40, 40), (200, 10, 10)).save(tmp_path / "ref.png")
    for image in (None, str(tmp_path / "ref.png")):
        settings = SampleSettings(steps=1, guidance=3.5, width=48, height=32, image=image)
        (out,) = generate(pipe, adapter, ["a red square"], settings=settings, seeds=[0])
        assert out.size == (48, 32), (image, out.size)
