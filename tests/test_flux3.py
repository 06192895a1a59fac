"""Flux.3 (trainer/models/flux3.py) on its tiny models, base and step-distilled: text embeddings equal to the
modular pipeline's text step (and a batch's padding equal to a longer window), ids and tokens as the modular blocks
make them, LoRA / full fits that lower the loss, streamed training identical to resident, the LoRA file (diffusers
and comfy layouts) in `Flux3ModularPipeline.load_lora_weights` exactly as in the trainer, and `dittrain sample`
pixel for pixel equal to the modular pipeline run directly with the same seed and LoRA."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_train_support import fit_scored, losses, make_config, pixels, write_images

from trainer.config import Config, ModelConfig
from trainer.models import get_adapter
from trainer.sample import SampleRequest, run_sample
from trainer.train.trainer import Trainer

FOLDERS = ["flux3", "flux3-distilled"]
PROMPTS = ["a red square on a blue background", "a cat", ""]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("flux3-images"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("flux3-cache")


def _components(tiny_models: Path, folder: str = "flux3"):
    mc = ModelConfig(family="flux3", path=tiny_models / folder, dtype="fp32")
    adapter = get_adapter(mc)
    return adapter, adapter.load(mc, parts={"transformer", "vae", "text", "scheduler"}, dtype=torch.float32)


def modular_pipeline(comps, distilled: bool = False):
    """diffusers' own Flux.3 modular pipeline around the folder's parts, prompts encoded as given."""
    from diffusers import Flux3AutoBlocks, Flux3DistilledAutoBlocks

    blocks = (Flux3DistilledAutoBlocks if distilled else Flux3AutoBlocks)()
    blocks.sub_blocks.pop("prompt_upsampler")
    mp = blocks.init_pipeline()
    mp.update_components(transformer=comps.transformer, vae=comps.vae, scheduler=comps.scheduler,
                         text_encoder=comps.text_encoders[0], tokenizer=comps.tokenizers[0])
    mp.set_progress_bar_config(disable=True)
    return mp


def _window_of(comps, n_real: int) -> str:
    """A prompt whose chat-formatted tokens number exactly `n_real`."""
    proc = comps.tokenizers[0]
    for k in range(200):
        p = "cat " * k
        chat = proc.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        if len(proc.tokenizer(chat)["input_ids"]) == n_real:
            return p
    pytest.skip(f"no prompt of exactly {n_real} tokens with this tokenizer")


def test_text_embeddings_equal_the_modular_text_step(tiny_models):
    """Each caption's entry is the text step's output at its own window (multiple of 80); the batch's longer window
    is filled with the caption's own padding row, which is what the text step gives at that window (fp32 rounding
    of the longer masked attention), also for a caption that fills its window exactly."""
    from trainer.models.flux3 import text_embeds

    adapter, comps = _components(tiny_models)
    enc, proc = comps.text_encoders[0], comps.tokenizers[0]
    full = _window_of(comps, 80)
    prompts = [*PROMPTS, full, "dog " * 90]
    text = adapter.encode_prompts(comps, prompts)
    windows = text["prompt_window"].tolist()
    assert windows[:4] == [80, 80, 80, 80] and windows[4] == 160
    longest = text["prompt_embeds"].shape[1]
    for i, p in enumerate(prompts):
        theirs = text_embeds(enc, proc, p, "cpu")[0]
        assert torch.equal(text["prompt_embeds"][i, : windows[i]], theirs)
        longer = text_embeds(enc, proc, p, "cpu", pad_multiple=longest)[0]
        torch.testing.assert_close(text["prompt_embeds"][i], longer, rtol=1e-5, atol=1e-5)
    # collation cuts each entry to its window and pads to the batch's longest with its own row
    items = [{k: v[i] for k, v in text.items()} for i in (0, 3)]
    batch = adapter.collate_text(items)["prompt_embeds"]
    assert batch.shape[1] == 80 and torch.equal(batch[1], text["prompt_embeds"][3, :80])
    items = [{k: v[i] for k, v in text.items()} for i in (3, 4)]
    torch.testing.assert_close(adapter.collate_text(items)["prompt_embeds"][0], text["prompt_embeds"][3])


def test_tokens_and_ids_are_the_modular_blocks(tiny_models):
    """The packed latents are the VAE encoder step's normalised, patchified latents as the blocks tokenise them;
    the image ids carry the 0.5 RoPE scale, the text ids count along l."""
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep, _prepare_image_ids
    from diffusers.modular_pipelines.flux3.encoders import Flux3VaeEncoderStep

    from trainer.models._diffusers import pack_2x2
    from trainer.models.flux3 import image_ids, text_ids

    adapter, comps = _components(tiny_models)
    assert adapter.resolution_divisor == 16 and adapter.timestep_shift(64, 64) == adapter.timestep_shift(1024, 512)
    assert adapter.timestep_shift(64, 64) == pytest.approx(6.93)
    pixels = torch.rand(2, 3, 32, 64) * 2 - 1
    vae = comps.vae
    lat = Flux3VaeEncoderStep._patchify_latents(vae.encode(pixels).latent_dist.mode())
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    theirs = ((lat - mean) / std).flatten(2).transpose(1, 2)
    torch.testing.assert_close(pack_2x2(adapter.encode_images(vae, pixels)), theirs)
    assert torch.equal(image_ids(3, 5, "cpu"), _prepare_image_ids(3, 5, 0.5))
    assert torch.equal(text_ids(7, "cpu"), Flux3TextRoPEInputsStep._prepare_text_ids(torch.zeros(1, 7, 2)))


def _fit(tiny_models, images, cache, out, folder, method="lora", **sections):
    return fit_scored(make_config(tiny_models, images, out, cache / folder, "flux3", method,
                                  model={"path": str(tiny_models / folder)}, **sections))


@pytest.fixture(scope="module")
def lora_run(tiny_models, images, cache, tmp_path_factory):
    runs = {}

    def get(folder):
        if folder not in runs:
            out = tmp_path_factory.mktemp(f"lora-{folder}")
            runs[folder] = _fit(tiny_models, images, cache, out, folder, train={"steps": 4},
                                optimizer={"lr": 1e-2}, lora={"rank": 4, "alpha": 2},
                                sample={"prompts": [PROMPTS[1]], "every": 2, "steps": 2, "width": 32, "height": 32,
                                        "guidance": 1.0 if "distilled" in folder else 2.0})
        return runs[folder]

    return get


@pytest.mark.parametrize("folder", FOLDERS)
def test_lora_fit_lowers_the_loss_samples_and_loads_in_the_modular_pipeline(lora_run, tiny_models, folder):
    """Sampling during training ran (images written); the LoRA file through `Flux3ModularPipeline.load_lora_weights`
    predicts exactly what the trainer's model does."""
    t, path, before, after = lora_run(folder)
    assert path.name == "lora.safetensors" and after < before, (before, after)
    assert list((Path(t.cfg.output.dir) / "samples").rglob("*.png"))
    assert not any(".image_cond." in n for n, _ in t.transformer.named_parameters() if "lora" in n)
    _, comps = _components(tiny_models, folder)
    base = type(comps.transformer).from_pretrained(tiny_models / folder, subfolder="transformer").eval()
    mp = modular_pipeline(comps, "distilled" in folder)
    mp.load_lora_weights(str(path))
    ours, theirs, untrained = _predictions(t, [t.transformer, mp.transformer.eval(), base])
    assert torch.equal(ours, theirs)
    assert (theirs - untrained).abs().max() > 1e-4


def _predictions(t, models):
    from trainer.train.objective import FlowMatching

    b = t.data.batch_at(0)
    n = FlowMatching(t.cfg.train.model_copy(update={"timestep_sampling": "uniform"}), seed=5).noise(b.latents)
    t.transformer.eval()
    with torch.no_grad():
        return [t.adapter.predict(m, n.noisy, n.t, b.text) for m in models]


def test_comfy_and_kohya_layouts_load(lora_run, tiny_models, tmp_path):
    """The LoRA converted to the comfy layout (BFL's names) and to kohya's loads with `dittrain sample`'s loader,
    giving the trainer's predictions. diffusers' Flux.3 mixin refuses the comfy file as written (its `.alpha` keys
    hold no "lora", and it reads no `lora_down` / `lora_up`), and reads BFL's names once the alphas are folded into
    the weights under peft's `lora_A` / `lora_B`."""
    from safetensors.torch import load_file, save_file

    from trainer import lora_format as lfm
    from trainer.sampling.lora import load_loras
    from trainer.sampling.request import LoraSpec

    t, path, _, _ = lora_run("flux3")
    want = _predictions(t, [t.transformer])[0]
    for fmt in ("comfy", "kohya"):
        dst = tmp_path / f"{fmt}.safetensors"
        lfm.convert_lora(path, dst, fmt)
        _, comps = _components(tiny_models)
        pipe = t.adapter.pipeline(comps)
        load_loras(pipe, [LoraSpec(dst)], "flux3")
        torch.testing.assert_close(_predictions(t, [pipe.transformer.eval()])[0], want, rtol=1e-5, atol=1e-5)
    sd = load_file(tmp_path / "comfy.safetensors")
    assert all(k.startswith("diffusion_model.") for k in sd)
    folded = {}
    for k, v in sd.items():
        if k.endswith(".lora_up.weight"):
            stem = k[: -len(".lora_up.weight")]
            folded[f"{stem}.lora_B.weight"] = v * (sd[f"{stem}.alpha"] / sd[f"{stem}.lora_down.weight"].shape[0])
        elif k.endswith(".lora_down.weight"):
            folded[k.replace(".lora_down.", ".lora_A.")] = v
    save_file(folded, tmp_path / "folded.safetensors")
    _, comps = _components(tiny_models)
    mp = modular_pipeline(comps)
    with pytest.raises(ValueError, match="lora"):
        mp.load_lora_weights(str(tmp_path / "comfy.safetensors"))
    mp.load_lora_weights(str(tmp_path / "folded.safetensors"))
    torch.testing.assert_close(_predictions(t, [mp.transformer.eval()])[0], want, rtol=1e-5, atol=1e-5)


def test_full_fit_lowers_the_loss(tiny_models, images, cache, tmp_path):
    t, path, before, after = _fit(tiny_models, images, cache, tmp_path / "out", "flux3", "full",
                                  train={"steps": 3}, optimizer={"lr": 1e-3})
    assert (path / "config.json").is_file() and after < before, (before, after)
    assert len(losses(tmp_path / "out")) == 3


@pytest.mark.parametrize(("method", "fractions"), [("lora", (0.0, 0.5, 1.0)), ("full", (0.0, 0.5))])
def test_streamed_training_equals_resident(tiny_models, images, cache, tmp_path, method, fractions):
    """fp32 on the CPU: every fraction gives bitwise the resident run's losses (LoRA: sampling with guidance after
    every step, through the training ring, changes none of them)."""
    runs = {}
    sample = {"prompts": [PROMPTS[1]], "every": 1, "steps": 2, "width": 32, "height": 32, "guidance": 2.0}
    for fraction in fractions:
        out = tmp_path / f"f{fraction}"
        cfg = make_config(tiny_models, images, out, cache / "flux3", "flux3", method, train={"steps": 2},
                          offload={"transformer": fraction}, **({"sample": sample} if method == "lora" else {}))
        Trainer(cfg).fit()
        runs[fraction] = losses(out)
        assert method != "lora" or len(list((out / "samples").rglob("*.png"))) == 2
    assert all(r == runs[0.0] for r in runs.values()), runs


@pytest.mark.parametrize(("folder", "guidance"), [("flux3", 3.0), ("flux3-distilled", 1.0)])
def test_sample_equals_the_modular_pipeline_with_the_same_seed_and_lora(tiny_models, lora_run, tmp_path, folder,
                                                                        guidance):
    lora = lora_run(folder)[1]
    cfg = Config.model_validate({
        "model": {"family": "flux3", "path": str(tiny_models / folder), "dtype": "fp32"},
        "sample": {"steps": 2, "width": 64, "height": 32, "guidance": guidance},
        "train": {"device": "cpu"},
        "output": {"dir": str(tmp_path / "s")},
    })
    (png,) = run_sample(cfg, SampleRequest(prompts=[PROMPTS[0]], seed=7, out=tmp_path / "s", loras=[str(lora)],
                                           offload=0.5))

    ours = pixels(png)
    _, comps = _components(tiny_models, folder)
    mp = modular_pipeline(comps, "distilled" in folder)
    mp.load_lora_weights(str(lora), adapter_name="x")
    kw = {} if "distilled" in folder else {"negative_prompt": ""}
    if "distilled" not in folder:
        from diffusers import ClassifierFreeGuidance

        mp.update_components(guider=ClassifierFreeGuidance(guidance_scale=guidance))
    (image,) = mp(prompt=PROMPTS[0], height=32, width=64, num_inference_steps=2,
                  generator=torch.Generator().manual_seed(7), output="images", **kw)
    theirs = np.asarray(image.convert("RGB"))
    assert ours.shape == (32, 64, 3)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("lora", [{"type": "lokr"}, {"type": "loha"}, {"dora": True}], ids=["lokr", "loha", "dora"])
def test_lora_kinds_train_and_load_for_sampling(tiny_models, images, cache, tmp_path, lora):
    """LoKr, LoHa and DoRA (the generic method code) train on Flux.3, and `dittrain sample`'s loader applies the
    file to the pipeline's transformer exactly as trained."""
    from trainer.sampling.lora import load_loras
    from trainer.sampling.request import LoraSpec

    t, path, before, after = _fit(tiny_models, images, cache, tmp_path / "out", "flux3", train={"steps": 2},
                                  optimizer={"lr": 1e-2}, lora={"rank": 4, "alpha": 4, **lora})
    assert np.isfinite(after) and after != before
    _, comps = _components(tiny_models)
    pipe = t.adapter.pipeline(comps)
    load_loras(pipe, [LoraSpec(path)], "flux3")
    ours, theirs = _predictions(t, [t.transformer, pipe.transformer.eval()])
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)


def test_lora_on_an_fp8_base_streams_like_resident(tiny_models, images, cache, tmp_path):
    """An fp8 base (block Linears only; Flux.3's modulation is outside its blocks) trains, streamed as resident."""
    runs = {}
    for fraction in (0.0, 0.5):
        out = tmp_path / f"f{fraction}"
        cfg = make_config(tiny_models, images, out, cache / "flux3", "flux3", train={"steps": 2},
                          model={"quantize": "fp8"}, offload={"transformer": fraction})
        Trainer(cfg).fit()
        runs[fraction] = losses(out)
    assert runs[0.5] == runs[0.0] and all(np.isfinite(runs[0.0]))


def test_streamed_loading_keeps_the_fp32_qk_norms_as_from_pretrained_does(tiny_models):
    """Flux.3 keeps its QK norms in fp32 under a bf16 model (`_keep_in_fp32_modules`): `fit`'s block-by-block loader
    gives every parameter the dtype and value diffusers' `from_pretrained` gives it."""
    from trainer.models.stream_load import TransformerLoader, empty_transformer

    mc = ModelConfig(family="flux3", path=tiny_models / "flux3", dtype="bf16")
    adapter = get_adapter(mc)
    tr = empty_transformer(adapter, mc, torch.bfloat16)
    TransformerLoader(tr, mc, torch.bfloat16).place(tr, "cpu")
    ref = adapter.transformer_cls.from_pretrained(tiny_models / "flux3", subfolder="transformer",
                                                  torch_dtype=torch.bfloat16)
    ours, theirs = dict(tr.named_parameters()), dict(ref.named_parameters())
    assert {p.dtype for p in ours.values()} == {torch.float32, torch.bfloat16}
    assert all(ours[n].dtype == p.dtype and torch.equal(ours[n], p) for n, p in theirs.items())
