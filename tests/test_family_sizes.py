"""The planner's size facts of the families against the full-size models themselves, built on the meta device:
the VAE parameter counts (latent caching and sampling phases) and the text encoder as the loader builds it (text
caching RAM, issue 26: Flux.2 never loads the decoder layers after the deepest hidden state it reads)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trainer.models import ADAPTERS, adapter_class
from trainer.models._diffusers import DiffusersAdapter
from trainer.planner.phases import _text_ram

#: families whose VAE is the 16-channel AutoencoderKL of Flux.1 (and SD3.5: the same shapes)
FLUX_KL = ("flux", "flux-kontext", "chroma", "z-image", "sd3")


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _full_vae(name: str):
    import diffusers

    with torch.device("meta"):
        if name == "AutoencoderKL":  # FLUX.1-dev's vae/config.json
            return diffusers.AutoencoderKL(
                in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                layers_per_block=2, norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False)
        return getattr(diffusers, name)()  # AutoencoderKLQwenImage / AutoencoderKLFlux2: the defaults are the real ones


@pytest.mark.parametrize("family", [f for f in ADAPTERS if f in FLUX_KL or adapter_class(f).vae_cls_name in (
    "AutoencoderKLQwenImage", "AutoencoderKLFlux2")])
def test_vae_params_are_the_full_size_vae(family):
    cls = adapter_class(family)
    assert cls.vae_params == _params(_full_vae(cls.vae_cls_name))


def test_edit_families_have_their_base_familys_vae():
    assert adapter_class("flux-kontext").vae_params == adapter_class("flux").vae_params == 83_819_683
    for f in ("qwen-image-edit", "qwen-image-edit-plus"):
        assert adapter_class(f).vae_params == adapter_class("qwen-image").vae_params == 126_892_531


@pytest.mark.parametrize("family", list(ADAPTERS))
def test_unloaded_text_encoder_parts_are_declared_where_the_config_is_cut(family):
    """A family that builds its text encoder smaller than the folder's (`text_encoder_config`) says by how much,
    and that part is among the parts it never uses."""
    cls = adapter_class(family)
    cuts = getattr(cls, "text_encoder_config", None) is not getattr(DiffusersAdapter, "text_encoder_config", None)
    assert bool(cls.text_encoder_unloaded_params) == cuts
    for i, n in enumerate(cls.text_encoder_unloaded_params):
        assert 0 < n <= cls.text_encoder_unused_params[i] < cls.text_encoder_params[i][1]


def _full_text_encoder(family: str):
    """(class, full-size config) of the family's text encoder (as bench/program/bench_program.py builds them)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM

    if family == "flux2-klein":  # Qwen3-4B
        return Qwen3ForCausalLM, Qwen3Config(
            vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
    cfg = Mistral3Config()  # Mistral-Small-3.1-24B
    cfg.tie_word_embeddings = cfg.text_config.tie_word_embeddings = False  # it has its own head
    return Mistral3ForConditionalGeneration, cfg


@pytest.mark.parametrize("family", ["flux2", "flux2-klein"])
def test_text_caching_ram_is_the_encoder_as_the_loader_builds_it(family):
    import copy

    cls = adapter_class(family)
    enc_cls, cfg = _full_text_encoder(family)
    with torch.device("meta"):
        whole = _params(enc_cls(copy.deepcopy(cfg)))
        built = _params(enc_cls(cls().text_encoder_config(cfg)))
    assert whole == cls.text_encoder_params[0][1]
    assert whole - built == cls.text_encoder_unloaded_params[0] > 0
    # the planner's RAM for the full-size encoder (no folder: the declared size, bf16) is what is built
    facts = SimpleNamespace(family=family, text_encoders=[(cls.text_encoder_params[0][0], 2 * whole)],
                            text_sizes=None)
    assert _text_ram(facts) == pytest.approx(2 * built, rel=1e-9)


def _folder_with(tmp_path, config):
    """A model folder holding only `text_encoder/config.json` (the planner builds the encoder from it)."""
    config.save_pretrained(tmp_path / "text_encoder")
    return tmp_path


@pytest.mark.parametrize(("family", "layers"), [("flux2", None), ("flux2", 31), ("flux2-klein", None)],
                         ids=["flux2-full", "flux2-bench-31-layers", "flux2-klein-full"])
def test_text_caching_of_a_folder_is_the_presets_prediction(tmp_path, family, layers):
    """The presets' headers plan the full-size encoder from the family's shares (no folder); a run plans the
    encoder its folder's config builds. Both must be the same numbers for the published model, and for the bench's
    folder that stores only the layers the loader reads. Before the planner built the folder's encoder, it applied
    the full-size shares to the folder's bytes: 17.4 GB in the run against 21.5 GB in the 24 GB preset's header
    for the bench's 31-layer Mistral-3, measured 20.6-21.2 GB (bench/history/2026-11-25.md, 2026-11-25 21:40)."""
    from trainer.planner.meta import text_encoder_sizes
    from trainer.planner.phases import _text_vram

    cls = adapter_class(family)
    _, config = _full_text_encoder(family)
    if layers is not None:
        config.get_text_config().num_hidden_layers = layers
    root = _folder_with(tmp_path, config)
    run = SimpleNamespace(model=SimpleNamespace(family=family, path=str(root), dtype="bf16"))
    sizes = text_encoder_sizes(run)
    assert sizes is not None
    name, params = cls.text_encoder_params[0]
    facts = {"family": family, "adapter": cls, "dtype": torch.bfloat16, "text_tokens": cls.text_tokens}
    header = SimpleNamespace(**facts, text_encoders=[(name, 2 * params)], text_sizes=None)
    in_run = SimpleNamespace(**facts, text_encoders=[], text_sizes=sizes)
    for f in (0.0, 0.25, 0.45, 0.65, 1.0):
        for batch in (1, 4):
            assert _text_vram(in_run, f, batch) == pytest.approx(_text_vram(header, f, batch), rel=1e-5), (f, batch)
    assert _text_ram(in_run) == pytest.approx(_text_ram(header), rel=1e-6)


TINY = [(f, folder) for f in ADAPTERS for folder in adapter_class(f).own_tiny_builders()]


@pytest.mark.parametrize(("family", "folder"), TINY, ids=[c[1] for c in TINY])
def test_the_planners_text_encoders_are_the_loaders(tiny_models, family, folder):
    """The encoder the planner builds on the meta device from a folder holds what the loader places: the same
    streamed blocks (`text_encoder_blocks`) and the same bytes outside them."""
    from trainer.config import ModelConfig
    from trainer.models import get_adapter
    from trainer.models.base import text_encoder_blocks
    from trainer.planner.meta import text_encoder_sizes

    mc = ModelConfig(family=family, path=tiny_models / folder, dtype="fp32")
    sizes = text_encoder_sizes(SimpleNamespace(model=mc))
    encoders = get_adapter(mc).load(mc, parts={"text"}, dtype=torch.float32, device="cpu").text_encoders
    assert sizes is not None and len(sizes) == len(encoders) > 0
    for s, enc in zip(sizes, encoders, strict=True):
        blocks = [4 * _params(b) for b in text_encoder_blocks(enc)]
        assert list(s.blocks) == blocks and s.gpu == 4 * _params(enc)
