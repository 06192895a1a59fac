"""Single files in the original checkpoint layout stream block by block (trainer/models/original_layout.py,
stream_load): the row map that diffusers' own converter gives on row ids, bitwise the tensors of the whole-file
path (from_single_file + quant.prepare_transformer), bf16 and scaled fp8, with and without ComfyUI's prefix."""

from __future__ import annotations

import pytest
import torch
from _offload_util import add_lora
from test_stream_load import _same_state

from trainer import quant
from trainer.config import ModelConfig
from trainer.models import adapter_class, get_adapter, original_layout, stream_load
from trainer.offload import attach_offload

# ------------------------------------------------------------------------- Flux.1-dev at full size, headers only


def _bfl_flux_header(c: dict) -> dict[str, dict]:
    """The key names and shapes of BFL's flux1-dev.safetensors (bench_program writes such files on the GPU box)."""
    from bench.program import bench_program as bp

    return {k: {"dtype": "BF16", "shape": v} for k, v in bp.bfl_flux_header(c).items()}


@pytest.fixture(scope="module")
def flux_dev_shapes() -> dict[str, torch.Size]:
    from accelerate import init_empty_weights

    cls = adapter_class("flux")
    with init_empty_weights():
        return {k: v.shape for k, v in cls.transformer_cls.from_config(dict(cls.full_config)).state_dict().items()}


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_flux1_dev_original_layout_maps_row_by_row(prefix, flux_dev_shapes):
    """diffusers' Flux converter (inner width 3072 fixed in it) on the full-size BFL layout, shapes only: every
    diffusers tensor is covered, and the fused projections are split and the final modulation's halves swapped."""
    cls = adapter_class("flux")
    config, want = dict(cls.full_config), flux_dev_shapes
    header = {prefix + k: v for k, v in _bfl_flux_header(config).items()}
    if prefix:  # ComfyUI's scaled fp8 files: a marker and one scale per weight, which are no model tensor
        header[prefix + "scaled_fp8"] = {"dtype": "F8_E4M3", "shape": [0]}
        header[prefix + "double_blocks.0.img_attn.qkv.scale_weight"] = {"dtype": "F32", "shape": [1]}
    m = original_layout.row_map(cls.transformer_cls, config, header, want, quant._is_scale_key)
    assert m is not None and m.prefix == prefix and set(m.runs) == set(want)
    r = m.runs
    assert r["transformer_blocks.3.attn.to_k.weight"] == [("double_blocks.3.img_attn.qkv.weight", 3072, 6144)]
    assert r["transformer_blocks.3.attn.add_v_proj.bias"] == [("double_blocks.3.txt_attn.qkv.bias", 6144, 9216)]
    assert r["single_transformer_blocks.7.proj_mlp.weight"] == [("single_blocks.7.linear1.weight", 9216, 21504)]
    assert r["single_transformer_blocks.7.proj_out.weight"] == [("single_blocks.7.linear2.weight", 0, 3072)]
    assert r["norm_out.linear.weight"] == [("final_layer.adaLN_modulation.1.weight", 3072, 6144),
                                           ("final_layer.adaLN_modulation.1.weight", 0, 3072)]
    # a layout the converter cannot read maps to nothing (the whole path decides)
    del header[prefix + "single_blocks.0.linear2.weight"]
    assert original_layout.row_map(cls.transformer_cls, config, header, want, quant._is_scale_key) is None


# ------------------------------------------------------------------------- tiny SD3, values, bitwise


def _sd3_original(sd: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """The tiny SD3.5's diffusers state dict in Stability's original key names (the inverse of diffusers'
    converter: fused qkv, qk norms, dual attention, the last block's context modulation and the final modulation with shift before scale)."""
    def swap(t):
        a, b = t.chunk(2)
        return torch.cat([b, a])

    out = {"pos_embed": sd["pos_embed.pos_embed"], "context_embedder.weight": sd["context_embedder.weight"],
           "context_embedder.bias": sd["context_embedder.bias"]}
    for new, old in (("pos_embed.proj", "x_embedder.proj"), ("time_text_embed.timestep_embedder.linear_1", "t_embedder.mlp.0"),
                     ("time_text_embed.timestep_embedder.linear_2", "t_embedder.mlp.2"),
                     ("time_text_embed.text_embedder.linear_1", "y_embedder.mlp.0"),
                     ("time_text_embed.text_embedder.linear_2", "y_embedder.mlp.2"), ("proj_out", "final_layer.linear")):
        for p in ("weight", "bias"):
            out[f"{old}.{p}"] = sd[f"{new}.{p}"]
    for p in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{p}"] = swap(sd[f"norm_out.linear.{p}"])
    for i in range(layers):
        d, o, last = f"transformer_blocks.{i}.", f"joint_blocks.{i}.", i == layers - 1
        for p in ("weight", "bias"):
            out[f"{o}x_block.attn.qkv.{p}"] = torch.cat([sd[f"{d}attn.to_{x}.{p}"] for x in "qkv"])
            out[f"{o}context_block.attn.qkv.{p}"] = torch.cat([sd[f"{d}attn.add_{x}_proj.{p}"] for x in "qkv"])
            out[f"{o}x_block.attn.proj.{p}"] = sd[f"{d}attn.to_out.0.{p}"]
            out[f"{o}x_block.adaLN_modulation.1.{p}"] = sd[f"{d}norm1.linear.{p}"]
            ctx = sd[f"{d}norm1_context.linear.{p}"]
            out[f"{o}context_block.adaLN_modulation.1.{p}"] = swap(ctx) if last else ctx
            out[f"{o}x_block.mlp.fc1.{p}"] = sd[f"{d}ff.net.0.proj.{p}"]
            out[f"{o}x_block.mlp.fc2.{p}"] = sd[f"{d}ff.net.2.{p}"]
            if f"{d}attn2.to_q.{p}" in sd:  # SD3.5's dual attention layers
                out[f"{o}x_block.attn2.qkv.{p}"] = torch.cat([sd[f"{d}attn2.to_{x}.{p}"] for x in "qkv"])
                out[f"{o}x_block.attn2.proj.{p}"] = sd[f"{d}attn2.to_out.0.{p}"]
            if not last:
                out[f"{o}context_block.attn.proj.{p}"] = sd[f"{d}attn.to_add_out.{p}"]
                out[f"{o}context_block.mlp.fc1.{p}"] = sd[f"{d}ff_context.net.0.proj.{p}"]
                out[f"{o}context_block.mlp.fc2.{p}"] = sd[f"{d}ff_context.net.2.{p}"]
        for new, old in (("attn.norm_q", "x_block.attn.ln_q"), ("attn.norm_k", "x_block.attn.ln_k"),
                         ("attn.norm_added_q", "context_block.attn.ln_q"), ("attn.norm_added_k", "context_block.attn.ln_k"),
                         ("attn2.norm_q", "x_block.attn2.ln_q"), ("attn2.norm_k", "x_block.attn2.ln_k")):
            if f"{d}{new}.weight" in sd:  # SD3.5's RMS qk norms
                out[f"{o}{old}.weight"] = sd[f"{d}{new}.weight"]
    return out


def _write_sd3_original(tiny_models, path, kind: str, prefix: str = "") -> None:
    from safetensors.torch import save_file

    ad = get_adapter(ModelConfig(family="sd3", path=tiny_models / "sd3"))
    tr = ad.transformer_cls.from_pretrained(str(tiny_models / "sd3"), subfolder="transformer")
    sd = _sd3_original(tr.state_dict(), tr.config.num_layers)
    assert sum(v.numel() for v in sd.values()) == sum(p.numel() for p in tr.state_dict().values())
    out = {}
    for k, v in sd.items():
        if kind == "fp8-scaled" and v.ndim == 2 and "blocks" in k:
            s = v.abs().max() / 448.0
            out[prefix + k] = (v / s).to(torch.float8_e4m3fn)
            out[prefix + k[: -len("weight")] + "scale_weight"] = s.reshape(1).float()
        else:
            out[prefix + k] = v.to(torch.bfloat16).contiguous()
    save_file(out, str(path))


@pytest.mark.parametrize(("kind", "quantize", "prefix"), [("bf16", "none", ""), ("bf16", "int8", ""),
                                                          ("fp8-scaled", "fp8", "model.diffusion_model."),
                                                          ("fp8-scaled", "none", "model.diffusion_model.")])
def test_original_layout_file_streams_bitwise_like_from_single_file(kind, quantize, prefix, tiny_models, tmp_path):
    f = tmp_path / "sd3.safetensors"
    _write_sd3_original(tiny_models, f, kind, prefix)
    mc = ModelConfig(family="sd3", path=tiny_models / "sd3", transformer_file=f, quantize=quantize, dtype="bf16")
    assert stream_load.supported(mc) and stream_load.whole_file_note(mc) is None
    assert stream_load.file_prefix(mc) is None and stream_load.file_layout(mc).prefix == prefix
    ad = get_adapter(mc)
    ref = ad.load(mc, parts={"transformer"}, dtype=torch.bfloat16).transformer  # diffusers' converter, whole
    if kind == "bf16":  # the written file is the folder's model, renamed (checks this test's inverse)
        folder = get_adapter(mc).transformer_cls.from_pretrained(str(tiny_models / "sd3"), subfolder="transformer",
                                                                 torch_dtype=torch.bfloat16)
        if quantize == "none":
            _same_state(folder, ref)
    torch.manual_seed(0)
    add_lora(ref)
    tr, loader = stream_load.load(ad, mc, torch.bfloat16, torch.device("cpu"), stream_blocks=True)
    torch.manual_seed(0)
    add_lora(tr)
    h = attach_offload(ad.blocks(tr), "cpu", 1.0, fill=loader.fill)
    assert h.plan.streamed
    h.close()
    _same_state(ref, tr)
