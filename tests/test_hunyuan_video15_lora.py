"""HunyuanVideo 1.5's comfy / kohya key map (trainer/models/hunyuan_video15.py `HV15_LORA_KEYS`) against the names
outside sources give each layer, and musubi-tuner's own LoRA files read through it.

No diffusers release converts HunyuanVideo 1.5 files in the original layout (0.42 has neither a `from_single_file`
mapping nor a LoRA converter for it), so the sources are written out here as data: the Tencent name of each diffusers
layer as diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py (`convert_hyvideo15_transformer_to_diffusers`,
diffusers 6156cf8 / 671149e) takes it, and the renames from Tencent's names to ComfyUI's: musubi-tuner's
networks/convert_hunyuan_video_1_5_lora_to_comfy.py for the dual-stream blocks (q, k, v fused into `qkv` in that
order, `mlp_fc1` -> `mlp_0`, `mlp_fc2` -> `mlp_2`, `mod_linear` -> `mod_lin`) and ComfyUI's HunyuanVideo
`process_unet_state_dict` (comfy/supported_models.py) for the rest. docs/lora-files.md says what else was run."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_lora_format import adapted, base_model, outputs, peft_deltas, save_checkpoint_file

from trainer import lora_format as lfm
from trainer.errors import UserError
from trainer.models import adapter_class

_D, _R = "transformer_blocks.{i}", "context_embedder.token_refiner.refiner_blocks.{i}"
_TD, _TR = "double_blocks.{i}", "txt_in.individual_token_refiner.blocks.{i}"
#: diffusers layer -> (Tencent layer, which third of it: None for all of it), from diffusers' conversion script
TENCENT = {
    "time_embed.timestep_embedder.linear_1": ("time_in.mlp.0", None),
    "time_embed.timestep_embedder.linear_2": ("time_in.mlp.2", None),
    "context_embedder.time_text_embed.timestep_embedder.linear_1": ("txt_in.t_embedder.mlp.0", None),
    "context_embedder.time_text_embed.timestep_embedder.linear_2": ("txt_in.t_embedder.mlp.2", None),
    "context_embedder.time_text_embed.text_embedder.linear_1": ("txt_in.c_embedder.linear_1", None),
    "context_embedder.time_text_embed.text_embedder.linear_2": ("txt_in.c_embedder.linear_2", None),
    "context_embedder.proj_in": ("txt_in.input_embedder", None),
    **{f"{_R}.attn.to_{p}": (f"{_TR}.self_attn_qkv", j) for j, p in enumerate("qkv")},
    f"{_R}.attn.to_out.0": (f"{_TR}.self_attn_proj", None),
    f"{_R}.ff.net.0.proj": (f"{_TR}.mlp.fc1", None),
    f"{_R}.ff.net.2": (f"{_TR}.mlp.fc2", None),
    f"{_R}.norm_out.linear": (f"{_TR}.adaLN_modulation.1", None),
    **{f"context_embedder_2.linear_{n}": (f"byt5_in.fc{n}", None) for n in (1, 2, 3)},
    "image_embedder.linear_1": ("vision_in.proj.1", None),
    "image_embedder.linear_2": ("vision_in.proj.3", None),
    f"{_D}.norm1.linear": (f"{_TD}.img_mod.linear", None),
    f"{_D}.norm1_context.linear": (f"{_TD}.txt_mod.linear", None),
    **{f"{_D}.attn.to_{p}": (f"{_TD}.img_attn_{p}", None) for p in "qkv"},
    f"{_D}.attn.to_out.0": (f"{_TD}.img_attn_proj", None),
    **{f"{_D}.attn.add_{p}_proj": (f"{_TD}.txt_attn_{p}", None) for p in "qkv"},
    f"{_D}.attn.to_add_out": (f"{_TD}.txt_attn_proj", None),
    f"{_D}.ff.net.0.proj": (f"{_TD}.img_mlp.fc1", None),
    f"{_D}.ff.net.2": (f"{_TD}.img_mlp.fc2", None),
    f"{_D}.ff_context.net.0.proj": (f"{_TD}.txt_mlp.fc1", None),
    f"{_D}.ff_context.net.2": (f"{_TD}.txt_mlp.fc2", None),
    "proj_out": ("final_layer.linear", None),
    "norm_out.linear": ("final_layer.adaLN_modulation.1", None),  # its halves swapped (scale, shift): no name here
}
#: Tencent -> ComfyUI, in order, on "<name>.": ComfyUI's HunyuanVideo `process_unet_state_dict` renames
COMFY_RENAMES = (
    ("txt_in.t_embedder.mlp.0.", "txt_in.t_embedder.in_layer."),
    ("txt_in.t_embedder.mlp.2.", "txt_in.t_embedder.out_layer."),
    ("txt_in.c_embedder.linear_1.", "txt_in.c_embedder.in_layer."),
    ("txt_in.c_embedder.linear_2.", "txt_in.c_embedder.out_layer."),
    ("_mod.linear.", "_mod.lin."), ("_attn_qkv.", "_attn.qkv."), ("mlp.fc1.", "mlp.0."), ("mlp.fc2.", "mlp.2."),
    ("_attn_proj.", "_attn.proj."), ("_in.mlp.2.", "_in.out_layer."), ("_in.mlp.0.", "_in.in_layer."),
)


def comfy_name(tencent: str, third: int | None) -> tuple[str, int]:
    """ComfyUI's layer and the part of it that Tencent's layer (or its `third`) is: the dual-stream blocks' separate
    q, k, v are the parts of ComfyUI's fused `qkv` (musubi-tuner's converter)."""
    name, part = tencent, third or 0
    for s in ("img", "txt"):
        for j, p in enumerate("qkv"):
            if name.endswith(f".{s}_attn_{p}"):
                name, part = name[: -len(f"_{p}")] + "_qkv", j
    name += "."
    for old, new in COMFY_RENAMES:
        name = name.replace(old, new)
    return name[:-1], part


def _linears(family: str) -> dict[str, torch.nn.Linear]:
    from accelerate import init_empty_weights

    cls = adapter_class(family)
    with init_empty_weights():
        model = cls.transformer_cls.from_config(dict(cls.full_config))
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _template(name: str) -> tuple[str, str]:
    """(the name with its block index as {i}, the index or "")."""
    m = re.search(r"(?:transformer|refiner)_blocks\.(\d+)\.", name)
    return (name[: m.start(1)] + "{i}" + name[m.end(1):], m.group(1)) if m else (name, "")


@pytest.mark.parametrize("family", ["hunyuan-video-1.5", "hunyuan-video-1.5-i2v"])
def test_every_linear_has_comfyuis_name_for_its_tencent_layer(family):
    """Every Linear of the full-size transformer (meta device) but the final modulation has an original name: the
    ComfyUI layer that its Tencent layer (diffusers' conversion script) becomes, at the same part of a fused q/k/v;
    kohya names map back. The final modulation is refused in one line naming it."""
    kmap = adapter_class(family).lora_key_map
    assert kmap is not None
    linears = _linears(family)
    assert len(linears) == 54 * 14 + 2 * 7 + 14
    for name in linears:
        template, i = _template(name)
        tencent, third = TENCENT[template]
        if template == "norm_out.linear":
            assert kmap.place(name) is None
            continue
        place = kmap.place(name)
        assert place is not None, name
        want, part = comfy_name(tencent.replace("{i}", i), third)
        assert (place.original, place.index) == (want, part), name
        assert kmap.parts(place.original)[1][part] == name
        assert kmap.from_kohya(kmap.kohya(place.original)[len("lora_unet_"):]) == place.original
    with pytest.raises(UserError, match=r"^norm_out\.linear: no name for this module in the hunyuan-video-1.5 "):
        lfm.check_layout(["norm_out.linear"], "lora", "kohya", "hunyuan-video-1.5")


def test_comfy_layout_fuses_qkv_at_comfyuis_width():
    """The fused layers' parts are each as wide as the layer's input (ComfyUI's `qkv` is 3 x hidden)."""
    kmap, linears = adapter_class("hunyuan-video-1.5").lora_key_map, _linears("hunyuan-video-1.5")
    fused = {r.original for r in kmap.rules if r.fused}
    assert fused == {"double_blocks.{i}.img_attn.qkv", "double_blocks.{i}.txt_attn.qkv",
                     "txt_in.individual_token_refiner.blocks.{i}.self_attn.qkv"}
    for name in ("transformer_blocks.3.attn.add_v_proj", "context_embedder.token_refiner.refiner_blocks.1.attn.to_k"):
        assert linears[name].out_features == linears[name].in_features == 2048


def _musubi_file(lf, path) -> dict[str, torch.Tensor]:
    """`lf`'s dual-stream block layers as musubi-tuner writes them: `lora_unet_` + Tencent's name with "_", the
    weights as trained and `.alpha` = scale x rank."""
    out = {}
    for name, m in lf.modules.items():
        template, i = _template(name)
        if not template.startswith("transformer_blocks."):
            continue
        key = "lora_unet_" + TENCENT[template][0].replace("{i}", i).replace(".", "_")
        out[f"{key}.lora_down.weight"], out[f"{key}.lora_up.weight"] = m.t["down"], m.t["up"]
        out[f"{key}.alpha"] = torch.tensor(m.scale * m.rank)
    save_file(out, str(path))
    return out


def test_musubi_tuners_own_files_read_and_convert_to_comfyuis_layout(tiny_models, tmp_path):
    """A musubi-tuner HunyuanVideo 1.5 LoRA (Tencent's names: split q/k/v, `img_mlp_fc1`, `img_mod_linear`) reads to
    the trained updates, and converts to the kohya file dittrain writes for the same layers (ComfyUI's names, q/k/v
    fused), as musubi-tuner's converter to ComfyUI does."""
    t, _, cfg = adapted(tiny_models, "hunyuan-video-1.5", "lora")
    src = save_checkpoint_file(t, cfg, tmp_path / "ck.safetensors")
    lf = lfm.read_lora_file(src)
    musubi = tmp_path / "musubi.safetensors"
    keys = _musubi_file(lf, musubi)
    assert "lora_unet_double_blocks_0_img_attn_q.lora_down.weight" in keys
    assert "lora_unet_double_blocks_1_txt_mlp_fc2.lora_up.weight" in keys
    back = lfm.read_lora_file(musubi, family="hunyuan-video-1.5")
    blocks = {n for n in lf.modules if n.startswith("transformer_blocks.")}
    assert set(back.modules) == blocks
    for n in blocks:
        torch.testing.assert_close(back.modules[n].delta(), lf.modules[n].delta(), rtol=1e-6, atol=1e-7)
    lfm.convert_lora(musubi, tmp_path / "from-musubi.safetensors", "kohya", family="hunyuan-video-1.5")
    got = load_file(str(tmp_path / "from-musubi.safetensors"))
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in got
    assert "lora_unet_double_blocks_0_img_mlp_0.lora_up.weight" in got
    assert not any("_fc1." in k or "_attn_q." in k for k in got)
    ours = tmp_path / "ours.safetensors"
    lfm.write_lora_file(ours, type(lf)({n: lf.modules[n] for n in blocks}, lf.meta), "kohya", "hunyuan-video-1.5")
    assert got.keys() == load_file(str(ours)).keys()


@pytest.mark.parametrize(("family", "fmt"), [("hunyuan-video-1.5", "comfy"), ("hunyuan-video-1.5-i2v", "kohya")])
def test_sample_loads_comfy_and_kohya_files(tiny_models, tmp_path, family, fmt):
    """`dittrain sample --lora` (load_loras) takes a comfy / kohya file into the family's pipeline (its
    `HunyuanVideoLoraLoaderMixin`) and gives the trained layer outputs. The pipeline reads its VAE's config when it is
    built, so it gets the tiny folder's VAE beside the transformer."""
    import inspect

    from diffusers import AutoencoderKLHunyuanVideo15

    from trainer.sampling.lora import load_loras
    from trainer.sampling.request import LoraSpec

    t, adapter, cfg = adapted(tiny_models, family, "lora")
    src = save_checkpoint_file(t, cfg, tmp_path / "ck.safetensors")
    lfm.convert_lora(src, tmp_path / f"{fmt}.safetensors", fmt)
    params = inspect.signature(adapter.pipeline_cls.__init__).parameters
    kw = {n: None for n, p in params.items() if n != "self" and p.default is inspect.Parameter.empty}
    base = base_model(adapter, cfg)
    vae = AutoencoderKLHunyuanVideo15.from_pretrained(str(tiny_models / family), subfolder="vae")
    load_loras(adapter.pipeline_cls(**{**kw, "transformer": base, "vae": vae}),
               [LoraSpec(tmp_path / f"{fmt}.safetensors")], family)
    mods = list(peft_deltas(t))
    assert any(".token_refiner." in m for m in mods) and any(".attn.add_v_proj" in m for m in mods)
    want, got = outputs(t, mods), outputs(base, mods)
    for m in mods:
        torch.testing.assert_close(got[m], want[m], rtol=1e-5, atol=1e-5)


def test_convert_lora_cli_writes_comfyuis_names(tiny_models, tmp_path):
    """`dittrain convert-lora --to comfy / kohya` takes a HunyuanVideo 1.5 LoRA (once refused: no key map) and
    writes ComfyUI's names, q/k/v fused with their ranks in the header."""
    import json

    from safetensors import safe_open
    from typer.testing import CliRunner

    from trainer.cli import app

    t, _, cfg = adapted(tiny_models, "hunyuan-video-1.5", "lora")
    src = save_checkpoint_file(t, cfg, tmp_path / "ck.safetensors")
    for fmt, key in (("comfy", "diffusion_model.double_blocks.1.txt_attn.qkv.lora_down.weight"),
                     ("kohya", "lora_unet_txt_in_individual_token_refiner_blocks_0_self_attn_qkv.alpha")):
        res = CliRunner().invoke(app, ["convert-lora", str(src), str(tmp_path / f"{fmt}.safetensors"), "--to", fmt])
        assert res.exit_code == 0, res.output
        with safe_open(str(tmp_path / f"{fmt}.safetensors"), framework="pt") as f:
            assert key in f.keys()
            assert f.metadata()[lfm.META_FORMAT] == fmt and f.metadata()["dittrain.family"] == "hunyuan-video-1.5"
            assert json.loads(f.metadata()[lfm.META_FUSED])["double_blocks.0.img_attn.qkv"] == [4, 4, 4]
