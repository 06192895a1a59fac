"""Bad input to `dittrain sample`: each problem is one line naming the file or flag and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from trainer.cli import app
from trainer.config import Config
from trainer.errors import UserError
from trainer.models import canonical_family
from trainer.sample import SampleRequest, run_sample
from trainer.sampling.request import LoraSpec, check_size, parse_lora, plan_jobs, slug


def _cfg(tiny_models: Path, out: Path, family: str = "flux", **sample) -> Config:
    return Config.model_validate(
        {
            "model": {"family": family, "path": str(tiny_models / family), "dtype": "fp32"},
            "sample": {"steps": 1, "width": 32, "height": 32, **sample},
            "train": {"device": "cpu"},
            "output": {"dir": str(out)},
        }
    )


def _fails(cfg: Config, req: SampleRequest, *needles: str) -> str:
    with pytest.raises(UserError) as e:
        run_sample(cfg, req)
    msg = str(e.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_parse_lora_weights_and_paths():
    assert parse_lora("a/b.safetensors") == LoraSpec(Path("a/b.safetensors"), 1.0)
    assert parse_lora("a/b.safetensors:0.5") == LoraSpec(Path("a/b.safetensors"), 0.5)
    assert parse_lora("a/b.safetensors:-1") == LoraSpec(Path("a/b.safetensors"), -1.0)
    assert parse_lora("C:/x/b.safetensors") == LoraSpec(Path("C:/x/b.safetensors"), 1.0)  # a colon in a path


def test_size_checks_name_the_nearest_valid_sides():
    check_size(64, 48, 16, "flux")
    with pytest.raises(
        UserError, match=r"--width 100 is not a multiple of 16 \(needed by flux\): use 96 or 112"
    ):
        check_size(100, 64, 16, "flux")
    with pytest.raises(UserError, match=r"--height 8 is too small for flux: the smallest side is 16"):
        check_size(64, 8, 16, "flux")


def test_jobs_are_deterministic():
    jobs = plan_jobs(["A cat!", "dog"], num=2, seed=5)
    assert [(j.prompt, j.seed, j.filename) for j in jobs] == [
        ("A cat!", 5, "0000-seed5-a-cat.png"),
        ("A cat!", 6, "0001-seed6-a-cat.png"),
        ("dog", 7, "0002-seed7-dog.png"),
        ("dog", 8, "0003-seed8-dog.png"),
    ]
    assert slug("???") == "prompt" and len(slug("x" * 100)) == 40


def test_no_prompts(tiny_models, tmp_path):
    _fails(_cfg(tiny_models, tmp_path), SampleRequest(), "no prompts", "--prompt", "sample.prompts")
    _fails(_cfg(tiny_models, tmp_path), SampleRequest(prompts=["  "]), "--prompt is empty")


def test_missing_and_empty_prompt_files(tiny_models, tmp_path):
    cfg = _cfg(tiny_models, tmp_path)
    _fails(cfg, SampleRequest(prompts_file=tmp_path / "nope.txt"), "nope.txt: prompt file not found")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n# only a comment\n")
    _fails(cfg, SampleRequest(prompts_file=empty), "empty.txt: prompt file has no prompts")


def test_prompt_file_lines_and_flag_prompts_combine(tiny_models, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("# header\nfirst prompt\n\n  second prompt  \n")
    cfg = _cfg(tiny_models, tmp_path, prompts=["from the config"])
    written = run_sample(cfg, SampleRequest(prompts=["flag prompt"], prompts_file=f, out=tmp_path / "o"))
    from PIL import Image

    got = [Image.open(p).text.get("prompt") for p in written[:-1]]
    assert got == ["flag prompt", "first prompt", "second prompt"]
    assert written[-1].name == "contact_sheet.png"


def test_missing_or_pickled_lora(tiny_models, tmp_path):
    cfg = _cfg(tiny_models, tmp_path, prompts=["x"])
    _fails(
        cfg,
        SampleRequest(loras=[str(tmp_path / "gone.safetensors:0.5")]),
        "gone.safetensors: LoRA file not found",
    )
    pt = tmp_path / "old.pt"
    pt.write_bytes(b"\0")
    _fails(cfg, SampleRequest(loras=[str(pt)]), "old.pt: a LoRA must be a .safetensors file")


def _lora_for(tiny_models: Path, family: str, path: Path) -> Path:
    from peft import LoraConfig

    from trainer.models import get_adapter
    from trainer.train.checkpoint import save_lora

    cfg = _cfg(tiny_models, path.parent, family)
    t = get_adapter(cfg.model).load(cfg.model, parts={"transformer"}, dtype=torch.float32).transformer
    t.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k"], init_lora_weights=False))
    save_lora(path, t, {})
    return path


@pytest.mark.parametrize(
    ("model", "lora_family"),
    [("flux", "sd3"), ("sd3", "flux"), ("qwen-image", "flux"), ("flux", "qwen-image")],
)
def test_lora_for_another_model(tiny_models, tmp_path, model, lora_family):
    lora = _lora_for(tiny_models, lora_family, tmp_path / f"{lora_family}.safetensors")
    cfg = _cfg(tiny_models, tmp_path, model, prompts=["x"])
    _fails(cfg, SampleRequest(loras=[str(lora)]), f"{lora}: LoRA", "another model", canonical_family(model))


def test_lora_file_with_foreign_keys(tiny_models, tmp_path):
    cfg = _cfg(tiny_models, tmp_path, prompts=["x"])
    junk = tmp_path / "junk.safetensors"
    save_file({"model.diffusion_model.foo.weight": torch.zeros(2)}, str(junk))
    _fails(cfg, SampleRequest(loras=[str(junk)]), "junk.safetensors: LoRA does not fit this model")
    nomod = tmp_path / "nomod.safetensors"
    save_file(
        {
            "transformer.nowhere.lora_A.weight": torch.zeros(2, 8),
            "transformer.nowhere.lora_B.weight": torch.zeros(8, 2),
        },
        str(nomod),
    )
    _fails(cfg, SampleRequest(loras=[str(nomod)]), "nomod.safetensors: LoRA", "nowhere")


def test_bad_sizes(tiny_models, tmp_path):
    cfg = _cfg(tiny_models, tmp_path, prompts=["x"])
    _fails(cfg, SampleRequest(width=40), "--width 40 is not a multiple of 16", "use 32 or 48")
    _fails(cfg, SampleRequest(height=8), "--height 8 is too small for flux")


def test_cli_prints_one_line(tiny_models, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"model:\n  family: flux\n  path: {tiny_models / 'flux'}\n  dtype: fp32\n"
        f"train:\n  device: cpu\noutput:\n  dir: {tmp_path / 'out'}\n"
    )
    r = CliRunner().invoke(app, ["sample", str(cfg), "--prompts", str(tmp_path / "missing.txt")])
    assert r.exit_code == 1
    assert r.output.strip().splitlines() == [
        f"error: {tmp_path / 'missing.txt'}: prompt file not found "
        "(--prompts expects a text file with one prompt per line)"
    ]
    r = CliRunner().invoke(
        app,
        [
            "sample",
            str(cfg),
            "-p",
            "a cat",
            "--steps",
            "1",
            "--width",
            "32",
            "--height",
            "32",
            "--out",
            str(tmp_path / "cli"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert (tmp_path / "cli" / "0000-seed0-a-cat.png").is_file()


def test_out_must_be_a_folder(tiny_models, tmp_path):
    cfg = _cfg(tiny_models, tmp_path, prompts=["x"])
    out_file = tmp_path / "taken"
    out_file.write_text("")
    _fails(cfg, SampleRequest(offload=0.5, out=out_file), "taken: --out must be a folder")


def test_out_of_memory_says_which_knob(tiny_models, tmp_path, monkeypatch):
    import trainer.sample as sample

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")

    cfg = _cfg(tiny_models, tmp_path, prompts=["x"])
    monkeypatch.setattr(sample, "generate", oom)
    _fails(cfg, SampleRequest(offload=0.5), "out of GPU memory sampling 32x32 at --offload 0.5: raise --offload")
    monkeypatch.setattr(sample, "encode_prompts", oom)
    _fails(cfg, SampleRequest(), "text encoders do not fit", "offload.text_encoders=1.0")
