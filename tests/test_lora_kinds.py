"""Every LoRA-kind spec (trainer/lora_format/kinds.py), DoRA too where a kind has it: built by the trainer on the tiny
Flux, counted by the planner as built, saved as a checkpoint and read back with peft's update, written and read in
every layout that holds it (a layout that cannot is refused before training, by name), resumed bitwise, and loaded
where `dittrain sample` loads it with the trained layer's outputs. The config's kind list comes from the registry.
(tests/test_lora_format.py and tests/test_lora_types.py check each kind more deeply per family.)"""

from __future__ import annotations

import pytest
import torch
from test_lora_format import adapted, bare_pipeline, base_model, outputs, peft_deltas, save_checkpoint_file

from trainer import lora_format as lfm
from trainer import planner
from trainer.config import Config, LoraConfig
from trainer.errors import UserError
from trainer.lora_format.kinds import LORA_KINDS
from trainer.optim.specs import state_bytes
from trainer.sampling.lora import load_loras
from trainer.sampling.request import LoraSpec
from trainer.train import checkpoint as ck

#: every kind, and "dora" for the DoRA variant of each kind that has one (the helpers' spelling)
CASES = [*LORA_KINDS, *(["dora"] if any(k.dora for k in LORA_KINDS.values()) else [])]
FAMILY = "flux"  # fused q/k/v in the original layout: a kind that cannot be stacked is refused there


def _spec(case: str):
    return LORA_KINDS["lora" if case == "dora" else case]


def test_the_config_reads_the_registry():
    assert LoraConfig.model_fields["type"].annotation.__args__ == tuple(LORA_KINDS)
    assert all(k.doc in LoraConfig.model_fields["type"].description for k in LORA_KINDS.values())
    base = {"model": {"family": FAMILY, "path": "m"}, "output": {"dir": "o"}}
    for name, kind in LORA_KINDS.items():
        if not kind.dora:
            with pytest.raises(ValueError, match="lora.dora: true is a variant of lora.type"):
                Config.model_validate({**base, "lora": {"type": name, "dora": True}})


@pytest.mark.parametrize("case", CASES)
def test_the_planner_counts_the_adapter_the_trainer_builds(tiny_models, case):
    t, _, cfg = adapted(tiny_models, FAMILY, case)
    trainable = [p for p in t.parameters() if p.requires_grad]
    plan_cfg = cfg.model_copy(update={
        "data": Config.model_validate({**cfg.model_dump(mode="json"),
                                       "data": {"sources": [{"path": "unused"}], "resolutions": [64]}}).data,
    })  # fmt: skip
    facts = planner.analyze(plan_cfg)
    assert facts.trainable_params == sum(p.numel() for p in trainable) > 0
    assert facts.state_gpu == state_bytes(cfg.optimizer.name, trainable)
    assert planner.expected(plan_cfg, 0.5, facts=facts).peak_reserved > 0  # its forward traces on the meta device


@pytest.mark.parametrize("case", CASES)
def test_build_save_read_and_resume(tiny_models, tmp_path, case):
    spec = _spec(case)
    t, _, cfg = adapted(tiny_models, FAMILY, case)
    src = save_checkpoint_file(t, cfg, tmp_path / "ck.safetensors")
    assert lfm.lora_kind(lfm.lora_metadata(src)) == spec.name
    lf = lfm.read_lora_file(src)
    assert lf.kind == spec.name and lf.dora == (case == "dora")
    want = peft_deltas(t)
    assert set(lf.modules) == set(want)
    for name, m in lf.modules.items():  # the spec's update is peft's (DoRA's rescaling aside)
        if case != "dora":
            torch.testing.assert_close(m.delta(), want[name], rtol=1e-5, atol=1e-6)
    # resume: a fresh adapter of the same config takes the checkpoint's weights bitwise
    other, _, _ = adapted(tiny_models, FAMILY, case, seed=1)
    ck.load_lora(src, other)
    a, b = ck.lora_state_dict(t), ck.lora_state_dict(other)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("fmt", lfm.FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_every_layout_holds_it_or_refuses_it_by_name(tiny_models, tmp_path, case, fmt):
    spec = _spec(case)
    t, adapter, cfg = adapted(tiny_models, FAMILY, case)
    lf = lfm.read_lora_file(save_checkpoint_file(t, cfg, tmp_path / "ck.safetensors"))
    misfit = lfm.check_targets(list(adapter.default_lora_targets), spec.name, fmt, FAMILY)
    if misfit is not None:  # a kind that cannot be stacked, on Flux's fused q/k/v: said before anything loads
        assert spec.pairs is None and spec.label in misfit and fmt != "diffusers"
        return
    base = ck.base_weights(cfg.model) if lf.dora and fmt != "diffusers" else None
    lfm.write_lora_file(tmp_path / f"{fmt}.safetensors", lf, fmt, FAMILY, base)
    if base is not None:  # ComfyUI's dora_scale is written for ComfyUI, not read back (the base weights are in it)
        with pytest.raises(UserError, match="dora_scale"):
            lfm.read_lora_file(tmp_path / f"{fmt}.safetensors", FAMILY)
        return
    back = lfm.read_lora_file(tmp_path / f"{fmt}.safetensors", FAMILY)
    assert back.kind == spec.name and set(back.modules) == set(lf.modules)
    for name, m in lf.modules.items():
        torch.testing.assert_close(back.modules[name].delta(), m.delta(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_sampling_loads_it_with_the_trained_outputs(tiny_models, tmp_path, case):
    """`dittrain sample --lora`: diffusers' load_lora_weights for a kind it takes, peft for the others."""
    t, adapter, cfg = adapted(tiny_models, FAMILY, case)
    path = tmp_path / "lora.safetensors"
    ck.export_lora(path, lfm.read_lora_file(save_checkpoint_file(t, cfg, tmp_path / "ck.safetensors")),
                   "diffusers", FAMILY)
    pipe = bare_pipeline(adapter, base_model(adapter, cfg))
    load_loras(pipe, [LoraSpec(path=path)], FAMILY)
    mods = sorted(peft_deltas(t))[:4]
    want, got = outputs(t, mods), outputs(pipe.transformer, mods)
    for m in mods:
        torch.testing.assert_close(got[m], want[m], rtol=1e-4, atol=1e-5)
