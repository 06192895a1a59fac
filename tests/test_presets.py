"""Every YAML shipped in configs/ loads and validates; presets carry the header `dittrain presets` prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import load_config
from trainer.models import ADAPTERS, adapter_class
from trainer.preset_files import find_presets, print_presets

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))


def test_there_are_configs():
    assert CONFIGS, "configs/ holds no YAML"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    assert cfg.model.family in ADAPTERS


def test_sized_presets_have_a_header_with_expectations():
    for p in find_presets(ROOT / "configs"):
        if p.vram_gb is None:
            continue
        assert p.title and p.trains and p.expects, f"{p.path}: header needs a title, 'trains:' and 'expects:' lines"
        cfg = load_config(p.path)
        assert cfg.train.method == p.method, f"{p.path}: file name says {p.method}, config says {cfg.train.method}"


def test_print_presets_lists_each_file(capsys):
    print_presets(ROOT / "configs")
    out = capsys.readouterr().out
    for p in find_presets(ROOT / "configs"):
        assert f"\n{p.path.parent}/\n" in out and f"\n  {p.path.name} " in out


def test_print_presets_fits_the_width_and_never_cuts_a_description(capsys):
    """Lines of 300 characters with descriptions cut mid-sentence before (issue 30 item 19)."""
    import re

    print_presets(ROOT / "configs", width=100)
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    flat = re.sub(r"\s+", " ", out)
    for p in find_presets(ROOT / "configs"):
        text = p.expects or p.title
        assert text and re.sub(r"\s+", " ", text) in flat, p.path
        assert p.expects or text.endswith("."), p.title  # a title is a whole sentence


SIZED = [p for p in CONFIGS if p.parent.name != "tiny" and p.stem.split("-")[-1].endswith("gb")]


def _header(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    return " ".join(lines)


def _setting(cfg, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("path", SIZED, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_preset_header_agrees_with_its_body(path):
    """What the header claims (written by `python -m trainer.planner.presets`) is what the body sets: every
    `section.key: value` it quotes, the transformer fraction and resolution of the title, sampling on or off,
    and a predicted VRAM peak (the largest phase) within the card minus the headroom."""
    import re

    from trainer.planner.presets import HEADROOM_GB

    cfg = load_config(path)
    head = _header(path)
    assert "  " not in head, f"{path}: a word of the header is empty (LTX-2's one token-wise sub-layer once)"
    card = int(re.search(r"-(\d+)gb$", path.stem).group(1))
    quoted = re.findall(r"\b(model|train|data|offload|sample|optimizer|lora)\.(\w+): ([\w.]+)", head)
    assert any(s == "sample" and k == "every" for s, k, _ in quoted), f"{path}: header must say sample.every"
    for section, key, value in quoted:
        have = _setting(cfg, f"{section}.{key}")
        want = type(have)(float(value)) if isinstance(have, int | float) and not isinstance(have, bool) else value
        assert have == want, f"{path}: header says {section}.{key}: {value}, body has {have}"
    f = float(re.search(r"transformer fraction (\d+\.\d+)", head).group(1))
    assert f == pytest.approx(float(cfg.offload.transformer)), path
    cls = adapter_class(cfg.model.family)
    if cls.video:  # a clip of the presets' ladder: `<N>p` x frames, sampled at that frame and length
        frames = cfg.data.clip_frames
        assert re.search(rf", (\d+)p x {frames} frames\)", head) and f"clips of {frames} frames" in head, path
        w, h = map(int, re.search(r"; (\d+)x(\d+) and the other", head).groups())  # the clip's frame
        assert (w * h) ** 0.5 == pytest.approx(cfg.data.resolutions[0], rel=0.03), path
        # sampled at that frame, or at the size the family's pipeline makes of it (HunyuanVideo 1.5 I2V's bucket)
        assert cfg.sample.frames == frames and (cfg.sample.width, cfg.sample.height) == cls.sample_frame(w, h), path
    else:
        assert f"{cfg.data.resolutions[0]} px" in head and f"{cfg.data.resolutions[0]}x{cfg.data.resolutions[0]} buckets" in head
    assert (cfg.model.expert is not None) == bool(cls.experts), f"{path}: a family of experts' preset names one"
    if cfg.sample.every:
        assert f"every {cfg.sample.every} steps" in head and f"{cfg.sample.width}x{cfg.sample.height}" in head
    else:
        assert "Sampling during training is off" in head
    assert "activation offloading" in head if cfg.offload.activations else "activation offloading" not in head
    _auto_agrees(path, cfg, head)
    vram = float(re.search(r"expects: ([\d.]+) GB VRAM \(largest phase: ([a-z ]+)\)", head).group(1))
    assert vram <= card - HEADROOM_GB + 0.05, f"{path}: predicts {vram} GB on a {card} GB card"
    seg = head.split("phases (predicted peak VRAM):")[1].split(". Text caching")[0]
    phases = {m.group(1): float(m.group(2)) for m in (re.match(r"(.+) ([\d.]+) GB$", item.strip())
                                                       for item in seg.split(", "))}
    assert set(phases) >= {"text caching", "latent caching", "load", "training step", "checkpoint save"}, path
    assert max(phases.values()) == pytest.approx(vram, abs=0.051), f"{path}: {phases} vs {vram}"
    assert ("sampling" in phases) == bool(cfg.sample.every), path


def _auto_agrees(path: Path, cfg, head: str) -> None:
    """A preset with train.gradient_checkpointing: auto (planner/presets_auto.py) is a LoRA without activation
    offloading whose header says how many blocks keep their activations within the offload.vram_budget_gb it sets,
    and a predicted step faster than recomputing every block by AUTO_MIN_GAIN; no other preset mentions auto."""
    import re

    from trainer.planner.presets_auto import AUTO_MIN_GAIN

    kept = re.search(r"keeps the activations of (\d+) of (\d+) blocks.*?recomputes (\d+), within "
                     r"offload\.vram_budget_gb: ([\d.]+) .*?predicted step ([\d.]+) s at ([\d.]+) GB, against ([\d.]+) s "
                     r"at ([\d.]+) GB recomputing every block", head)
    if cfg.train.gradient_checkpointing != "auto":
        assert not kept and "checkpointing auto" not in head, path
        return
    assert kept and cfg.train.method == "lora" and not cfg.offload.activations and cfg.offload.nano_batches == 1, path
    k, n, rec, budget, step, vram, rec_step, rec_vram = (float(g) for g in kept.groups())
    assert 0 < k <= n and k + rec == n and budget == cfg.offload.vram_budget_gb, path
    assert step == float(re.search(r"Predicted step ([\d.]+) s", head).group(1)), path
    assert vram == float(re.search(r"expects: ([\d.]+) GB VRAM", head).group(1)), path
    assert step <= (1 - AUTO_MIN_GAIN) * rec_step + 0.005, f"{path}: {step} s is not faster than {rec_step} s"


def test_a_measured_note_is_in_the_header_of_the_preset_it_measured_and_in_no_other():
    """A family's `measured_presets` entry (models/base.py `MeasuredPreset`) names the settings of the preset as
    measured: its shipped file still sets them and its header quotes the note; no other header claims a measurement
    (Flux.1's 24 GB header once kept its note after its preset changed)."""
    import re

    noted = {}
    # every family's folder and its other sizes' (configs/wan-1.3b/: models/base.py `PresetVariant`)
    folders = [(f, adapter_class(f)) for f in ADAPTERS] + [
        (f"{f}-{k}", adapter_class(f).sized(k)) for f in ADAPTERS for k in adapter_class(f).sizes()]
    for family, cls in folders:
        for (method, card), m in cls.__dict__.get("measured_presets", {}).items():
            path = ROOT / "configs" / family / f"{method}-{card}gb.yaml"
            cfg = load_config(path)
            assert m.describes(float(cfg.offload.transformer), cfg.train.gradient_checkpointing), (
                f"{path}: measured at offload.transformer {m.transformer}, gradient_checkpointing {m.checkpointing}; "
                "the preset changed: drop its measured_presets entry")
            noted[path] = m.note
    for path in SIZED:
        head = _header(path)
        assert (path in noted) == bool(re.search(r"measured on an? ", head)), path
        assert path not in noted or noted[path] in head, path


def test_full_fine_tunes_never_keep_the_activations_of_streamed_blocks():
    """A streamed trainable block is stepped and written back in its backward: it must be recomputed, so no full
    fine-tune preset streams with gradient checkpointing auto or off."""
    for path in SIZED:
        cfg = load_config(path)
        if cfg.train.method == "full" and cfg.offload.transformer > 0:
            assert cfg.train.gradient_checkpointing is True, path


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.mark.parametrize("path", SIZED, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_the_commented_optional_features_validate_when_uncommented(path, tmp_path):
    """Each sized preset ends with a commented block of optional features (EMA, validation, LoKr, masks, caption
    handling, per-step LoRAs); uncommented and merged into the preset, it must be a valid config."""
    import yaml

    from trainer.planner.presets import OPTIONAL_MARK

    text = path.read_text()
    assert OPTIONAL_MARK in text, f"{path}: no optional-features block"
    block = text[text.index(OPTIONAL_MARK):].splitlines()[2:]
    extra = yaml.safe_load("\n".join(line[2:] for line in block))
    merged = _merge(yaml.safe_load(text), extra)
    both = merged["model"].get("expert") == "both"  # both experts in one run: no EMA yet (trainer/train/experts.py)
    assert (both or merged["train"]["ema"]) and merged["data"]["sources"][0]["shuffle_tags"]
    cls = adapter_class(yaml.safe_load(text)["model"]["family"])
    no_val = cls.text_uses_reference or cls.video  # not supported there (qwen-image-edit, video families)
    assert ("validation" in merged["data"]) != no_val
    out = tmp_path / "c.yaml"
    out.write_text(yaml.safe_dump(merged))
    cfg = load_config(out)
    assert (both or cfg.train.ema is not None) and cfg.data.masked_loss and cfg.data.sources[0].keep_tokens == 1
    assert (cfg.lora.type == "lokr" and cfg.output.save_every == 500) if cfg.train.method == "lora" else True


def test_fp8_base_only_where_the_header_says_why_and_then_within_the_small_ram():
    """LoRA presets for 8-16 GB cards switch to model.quantize: fp8 where bf16 needs more host RAM than a 32 GB
    machine (planner/presets.py); the header says so, and the fp8 preset's predicted RAM peak fits."""
    import re

    from trainer.planner.presets import SMALL_RAM_GB

    seen = []
    for path in SIZED:
        cfg = load_config(path)
        head = _header(path)
        assert (cfg.model.quantize == "fp8") == ("fp8 base:" in head), path
        if cfg.model.quantize == "fp8":
            seen.append(path.parent.name)
            assert cfg.train.method == "lora" and "more than the 32 GB" in head
            # within the small RAM, or (Flux.2-dev: 32 B) the header says it is over it too
            over = f"over {SMALL_RAM_GB} GB too" in head
            assert (float(re.search(r"\((\d+) GB peak\)", head).group(1)) <= SMALL_RAM_GB) != over
    assert "qwen-image" in seen and "flux" not in seen  # Qwen-Image's 20 B do not fit 32 GB in bf16; Flux's do


def test_presets_filter_by_family_and_card_and_the_whole_list_stays(capsys):
    """`dittrain presets FAMILY` lists one family's, `--vram GB` one preset per family and method (the largest card
    at or below it); without either, every preset and a line saying how to narrow it."""
    from typer.testing import CliRunner

    from trainer.cli import app
    from trainer.preset_files import find_presets, pick

    root = Path(__file__).resolve().parents[1] / "configs"
    every = find_presets(root)
    family = every[0].family
    mine = pick(every, family.replace("-", "_"))
    assert mine and {p.family for p in mine} == {family} and len(mine) < len(every)
    card = pick(every, vram_gb=12.5)
    assert {(p.family, p.method) for p in card} == {(p.family, p.method) for p in every if p.vram_gb and
                                                    p.vram_gb <= 12.5}
    assert len(card) == len({(p.family, p.method) for p in card})  # one each
    assert all(p.vram_gb == max(q.vram_gb for q in every if q.vram_gb and q.vram_gb <= 12.5 and
                                (q.family, q.method) == (p.family, p.method)) for p in card)
    r = CliRunner().invoke(app, ["presets", family, "--vram", "12", "--dir", str(root)])
    assert r.exit_code == 0, r.output
    names = [line.split()[0] for line in r.output.splitlines() if line.startswith("  ") and ".yaml" in line]
    assert names == [p.path.name for p in pick(every, family, 12)]
    whole = CliRunner().invoke(app, ["presets", "--dir", str(root)]).output
    assert all(p.path.name in whole for p in every) and "dittrain presets FAMILY" in whole
    r = CliRunner().invoke(app, ["presets", "--vram", "4", "--dir", str(root)])
    assert r.exit_code == 1 and r.output.startswith("error: no preset for a 4 GB card (the smallest is ")


def test_fp8_base_only_where_it_trains_a_larger_clip_than_bf16_within_the_small_ram(monkeypatch):
    """Where bf16's largest fit needs more than the small RAM, fp8 is chosen only if bf16 within that RAM trains a
    smaller clip: HunyuanVideo 1.5's 16 GB LoRA fits 720p x 121 only with 43 GB of RAM in bf16, 480p x 121 in 29 GB,
    and fp8 within 32 GB gives 480p x 121 too, so bf16 480p x 121 it is (fp8 was chosen before: a weaker base for
    nothing)."""
    from trainer.planner import presets as P

    class Pred:
        def __init__(self, ram):
            self.ram_peak, self.pinned, self.step_s = ram * 1e9, ram * 1e9, 1.0

    def fit(res, ram, q):
        return ({"model": {"quantize": q}, "data": {"resolutions": [res], "clip_frames": 121}}, Pred(ram), 1.0, [],
                None)

    def first_fit(family, method, card, opt, cache, quantize="none", ram_gb=None):
        if quantize == "fp8":
            return fit("480p", 20, "fp8") if fp8_clip[0] == "480p" else fit("720p", 30, "fp8")
        return fit("720p", 43, "none") if ram_gb is None else fit("480p", 29, "none")

    monkeypatch.setattr(P, "_first_fit", first_fit)
    fp8_clip = [""]  # what fp8 fits within the small RAM, per case
    for fp8_clip[0], want in (("480p", ("none", "480p", "")), ("720p", ("fp8", "720p", "with fp8 Linear weights"))):
        d, _, _, _, _, why = P.plan_preset("hunyuan-video-1.5", "lora", 16, {})
        assert (d["model"]["quantize"], d["data"]["resolutions"][0]) == want[:2] and want[2] in why


def test_a_lora_preset_takes_auto_at_its_own_size_only_where_it_is_faster(monkeypatch):
    """`_first_fit` (planner/presets.py): where a LoRA's first fitting setting recomputes every block without
    activation offloading, gradient checkpointing auto at the same size replaces it where it fits and its predicted
    step is AUTO_MIN_GAIN faster; auto is never tried at another size, beside activation offloading, for a full
    fine-tune, or on an 8-16 GB card (AUTO_CARDS)."""
    from trainer.planner import presets as P
    from trainer.planner.presets_auto import AUTO_MIN_GAIN

    class Pred:
        def __init__(self, step):
            self.step_s = step

    calls, case = [], {}

    def fit(family, method, card, opt, cache, quantize, ram_gb, name, frames, act, ckpt, nano, rec=None):
        calls.append((method, name, act, ckpt, ram_gb))
        if ckpt == "auto":
            assert rec is not None and rec[1].step_s == 1.0
            got = case["auto"]
            return got if isinstance(got, str) else ({"train": {"gradient_checkpointing": "auto"}}, Pred(got), 1.0,
                                                     [], "kept")
        if (name, act, ckpt) in case["fits"]:
            return {"train": {"gradient_checkpointing": ckpt}}, Pred(1.0), 1.0, [], None
        return "does not fit"

    monkeypatch.setattr(P, "_fit", fit)

    def first_fit(fits, auto, method="lora", card=48):
        calls.clear()
        case.update(fits=fits, auto=auto)
        r = P._first_fit("flux", method, card, "adamw", {})
        return r[0]["train"]["gradient_checkpointing"], [c for c in calls if c[3] == "auto"]

    fast, slow = 1.0 - 2 * AUTO_MIN_GAIN, 1.0 - AUTO_MIN_GAIN / 2
    ck1024 = {(1024, False, True)}
    assert first_fit(ck1024, fast) == ("auto", [("lora", 1024, False, "auto", None)])
    assert first_fit(ck1024, slow)[0] is True  # not faster enough: every block recomputed, as before
    assert first_fit(ck1024, "a phase does not fit")[0] is True
    assert first_fit(ck1024, fast, method="full") == (True, [])  # a full fine-tune never tries it
    assert first_fit({(1024, False, False)}, fast) == (False, [])  # nothing recomputed already
    assert first_fit({(1024, True, True)}, fast) == (True, [])  # with activation offloading: left as it is
    # 1024 px does not fit: auto at 512 px only, never a size traded for it
    assert first_fit({(512, False, True)}, fast) == ("auto", [("lora", 512, False, "auto", None)])
    # 8-16 GB cards: as before (a margin under one kept block: presets.py AUTO_CARDS)
    assert [first_fit(ck1024, fast, card=c) for c in (8, 12, 16)] == [(True, [])] * 3
    assert [first_fit(ck1024, fast, card=c)[0] for c in (24, 48, 80)] == ["auto"] * 3



def test_flux_48gb_lora_takes_auto_and_the_trainer_keeps_the_blocks_its_header_names():
    """The generator with the planner's real functions (full-size Flux.1-dev on the meta device, 48 GB card): the
    LoRA preset recomputing every block at offload 0 gives way to gradient checkpointing auto at a fraction where
    every block keeps its activations, streamed ones included; every phase fits the card, the step beats the
    recomputed one by AUTO_MIN_GAIN, and the trainer's auto for the written config (streaming.checkpoint_policy
    with its offload.vram_budget_gb) keeps the blocks the header counts."""
    import torch

    from trainer.config import Config
    from trainer.planner.presets import HEADROOM_GB, _first_fit
    from trainer.planner.presets_auto import AUTO_MIN_GAIN
    from trainer.train import streaming

    d, p, _, phases, kept = _first_fit("flux", "lora", 48, "adamw", {})
    assert d["train"]["gradient_checkpointing"] == "auto" and kept is not None
    assert kept.kept == kept.blocks and kept.streamed > 0 and d["offload"]["transformer"] > kept.fraction
    assert max(ph.vram for ph in phases) <= (48 - HEADROOM_GB) * 1e9
    assert p.step_s <= (1 - AUTO_MIN_GAIN) * kept.step_s
    cfg = Config.model_validate(d)
    assert cfg.offload.vram_budget_gb == kept.budget_gb
    policy = streaming.checkpoint_policy(cfg, torch.device("cpu"), cfg.offload.transformer)
    assert policy.count(False) == kept.kept
