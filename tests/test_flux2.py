"""Flux.2 (dev and klein) on their tiny models: the latents, the slimmed text encoders and the reference tokens are
the pipelines', and streamed training equals resident training at several fractions, LoRA and full fine-tuning.
(Sampling, fitting, planning and LoRA loading run through the families' entries in the shared tests.)"""

from __future__ import annotations

import pytest
import torch

from trainer.config import ModelConfig
from trainer.models import get_adapter
from trainer.models._diffusers import pack_2x2, unpack_2x2
from trainer.offload import attach_offload

PROMPTS = ["a red square on a blue background", "a cat"]


def _loaded(tiny_models, family, parts=("transformer", "vae", "text", "scheduler")):
    adapter = get_adapter(ModelConfig(family=family, path=tiny_models / family, dtype="fp32"))
    return adapter, adapter.load(adapter.cfg, parts=set(parts), dtype=torch.float32)


def test_latents_are_the_pipelines_normalised_patchified_tokens(tiny_models):
    from diffusers import Flux2Pipeline

    adapter, comps = _loaded(tiny_models, "flux2", ("vae",))
    px = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    lat = adapter.encode_images(comps.vae, px)
    assert lat.shape == (2, adapter.latent_channels, 8, 8)
    pipe = Flux2Pipeline(scheduler=None, vae=comps.vae, text_encoder=None, tokenizer=None, transformer=None)
    want = pipe._pack_latents(pipe._encode_vae_image(px, generator=None))
    assert torch.equal(pack_2x2(lat), want)
    # the VAE's batch-norm statistics are applied (the tiny VAE's are far from 0 / 1)
    raw = pipe._pack_latents(Flux2Pipeline._patchify_latents(comps.vae.encode(px).latent_dist.mode()))
    assert (raw - want).abs().max() > 0.1


@pytest.mark.parametrize("family", ["flux2", "flux2-klein"])
def test_slimmed_text_encoder_gives_the_full_encoders_embeddings(tiny_models, family):
    """Only hidden states up to the deepest one read are kept (and, for Mistral-3, no vision tower): the
    embeddings are bitwise those of the encoder as transformers loads it, through the pipeline's encode_prompt."""
    import transformers

    adapter, comps = _loaded(tiny_models, family, ("text",))
    (enc,) = comps.text_encoders
    full = getattr(transformers, adapter.text_encoder_classes[0]).from_pretrained(
        tiny_models / family, subfolder="text_encoder", dtype=torch.float32, local_files_only=True
    ).eval()
    inner = getattr(enc.model, "language_model", enc.model)
    assert len(inner.layers) == max(adapter.text_layers) + 1 < full.config.get_text_config().num_hidden_layers
    if family == "flux2":
        assert enc.model.vision_tower is None and enc.model.multi_modal_projector is None
    pipe = adapter.pipeline_cls(scheduler=None, vae=None, text_encoder=full, tokenizer=comps.tokenizers[0],
                                transformer=None)
    want, _ = pipe.encode_prompt(prompt=PROMPTS, device="cpu")
    got = adapter.encode_prompts(comps, PROMPTS)["prompt_embeds"]
    assert got.shape == (2, adapter.max_sequence_length, 3 * full.config.get_text_config().hidden_size)
    assert torch.equal(got, want)


def test_reference_latents_join_as_the_pipelines_image_tokens(tiny_models):
    """`control_latents`: the reference's tokens follow the target's with time id 10, as Flux2Pipeline's `image=`."""
    from diffusers import Flux2Pipeline

    adapter, comps = _loaded(tiny_models, "flux2", ("transformer",))
    g = torch.Generator().manual_seed(1)
    x, ref = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 4, 6, 8, generator=g)
    embeds = torch.randn(1, 7, comps.transformer.config.joint_attention_dim, generator=g)
    t = torch.tensor([0.4])
    with torch.no_grad():
        got = adapter.predict(comps.transformer, x, t, {"prompt_embeds": embeds, "control_latents": ref}, 2.0)
        plain = adapter.predict(comps.transformer, x, t, {"prompt_embeds": embeds}, 2.0)
        p = Flux2Pipeline
        ids = torch.cat([p._prepare_latent_ids(torch.zeros(1, 1, 4, 4)), p._prepare_image_ids([ref[:, :, ::2, ::2]])],
                        dim=1)
        out = comps.transformer(
            hidden_states=torch.cat([pack_2x2(x), pack_2x2(ref)], dim=1), encoder_hidden_states=embeds, timestep=t,
            img_ids=ids, txt_ids=p._prepare_text_ids(embeds), guidance=torch.tensor([2.0]), return_dict=False,
        )[0]
    assert torch.equal(got, unpack_2x2(out[:, :16], 8, 8))
    assert not torch.equal(got, plain)


# ---------------------------------------------------------------------------------------------- streaming


def _tiny(seed: int, guidance: bool = True):
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    return Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=guidance,
    )


def _blocks(m):
    return [*m.transformer_blocks, *m.single_transformer_blocks]


def _inputs(s: int):
    from trainer.models.flux2 import position_ids, text_ids

    g = torch.Generator().manual_seed(s)
    return dict(
        hidden_states=torch.randn(1, 16, 16, generator=g), encoder_hidden_states=torch.randn(1, 5, 24, generator=g),
        timestep=torch.rand(1, generator=g), guidance=torch.tensor([3.5]), img_ids=position_ids(4, 4, 0.0, "cpu"),
        txt_ids=text_ids(5, "cpu"), return_dict=False,
    ), torch.randn(1, 16, 16, generator=g)


def _lora_run(fraction: float):
    from peft import LoraConfig

    from trainer.models.flux2 import Flux2Adapter

    m = _tiny(0)
    m.requires_grad_(False)
    m.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=list(Flux2Adapter.default_lora_targets),
                             init_lora_weights=False))
    h = attach_offload(_blocks(m), "cpu", fraction, race_detector=fraction > 0)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for s in range(3):
        kw, target = _inputs(s)
        loss = torch.nn.functional.mse_loss(m(**kw)[0], target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    if fraction > 0:
        assert h.plan.streamed  # something really moved
    h.close()
    return torch.stack(losses), {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def lora_resident():
    return _lora_run(0.0)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_lora_streamed_training_is_bitwise_resident(lora_resident, fraction):
    losses, state = _lora_run(fraction)
    assert torch.equal(losses, lora_resident[0])
    assert state.keys() == lora_resident[1].keys() and all(torch.equal(state[k], lora_resident[1][k]) for k in state)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_full_finetune_streamed_with_the_fused_back_pass_is_bitwise_resident(fraction):
    from trainer.config import OptimizerConfig
    from trainer.offload.fused_state import bind_fused
    from trainer.optim import FusedBackPass, build_optimizer

    cfg = OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.1, max_grad_norm=None)

    def run(f):
        m = _tiny(1, guidance=False)
        fb = FusedBackPass(build_optimizer(list(m.parameters()), cfg))
        h = attach_offload(_blocks(m), "cpu", f, trainable=True, optimizer_state=fb.state_layout)
        bind_fused(h, fb)
        losses = []
        for s in range(3):
            kw, target = _inputs(s)
            kw["guidance"] = None
            loss = torch.nn.functional.mse_loss(m(**kw)[0], target)
            loss.backward()
            fb.finish_step()
            losses.append(loss.detach())
        h.close()
        return torch.stack(losses), {n: p.detach().clone() for n, p in m.named_parameters()}

    l0, s0 = run(0.0)
    l1, s1 = run(fraction)
    assert torch.equal(l0, l1)
    assert all(torch.equal(s0[k], s1[k]) for k in s0)


# ---------------------------------------------------------------------------------------------- a fit with extras


@pytest.mark.parametrize(("family", "quantize"), [("flux2", "fp8"), ("flux2-klein", "int8")])
def test_streamed_fit_with_8bit_base_ema_validation_and_samples(tiny_models, tmp_path, family, quantize):
    """The generic features on Flux.2: an 8-bit frozen base streamed at 0.5, EMA, the validation loss and sampling
    during training all run and write what they promise."""
    import json

    from test_train_support import make_config, write_images

    from trainer.config import Config
    from trainer.train.trainer import Trainer

    imgs = write_images(tmp_path / "imgs", n=6)
    raw = make_config(
        tiny_models, imgs, tmp_path / "out", tmp_path / "cache", family,
        model={"quantize": quantize}, train={"steps": 2, "ema": {"decay": 0.9, "every": 1}},
        offload={"transformer": 0.5},
        sample={"prompts": ["a red square"], "every": 2, "steps": 1, "width": 32, "height": 32},
    ).model_dump(mode="json", exclude_unset=True)
    raw["data"]["validation"], raw["train"]["validate_every"] = {"fraction": 0.34}, 2
    cfg = Config.model_validate(raw)
    path = Trainer(cfg).fit()
    out = tmp_path / "out"
    assert path.is_file() and (out / "lora-ema.safetensors").is_file()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("val_loss" in r for r in rows)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if "loss" in r)
    assert list((out / "samples").rglob("*.png"))
