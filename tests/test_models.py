"""Model adapters on the tiny models: loading (folder and single file), path errors, forward + backward, block
lists, LoRA targets, timestep shift, and agreement with each family's own diffusers pipeline."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from trainer.config import ModelConfig
from trainer.errors import UserError
from trainer.models import get_adapter
from trainer.models._diffusers import pack_2x2, unpack_2x2

VARIANTS = {"flux": "flux", "flux-schnell": "flux", "sd3": "sd3", "qwen-image": "qwen-image", "flux2": "flux2",
            "flux2-klein": "flux2-klein", "z-image": "z-image", "chroma": "chroma"}
ALL = {"transformer", "vae", "text", "scheduler"}
PROMPTS = ["a red square on a blue background", "a cat"]


def _mc(root: Path, name: str, **kw) -> ModelConfig:
    return ModelConfig(family=VARIANTS[name], path=root / name, dtype="fp32", **kw)


@pytest.fixture(scope="module")
def loaded(tiny_models):
    cache = {}

    def get(name):
        if name not in cache:
            mc = _mc(tiny_models, name)
            adapter = get_adapter(mc)
            cache[name] = (adapter, adapter.load(mc, parts=ALL, dtype=torch.float32))
        return cache[name]

    return get


def _batch(adapter, comps, b=2, side=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    text = adapter.encode_prompts(comps, PROMPTS[:b])
    text = adapter.collate_text([{k: v[i] for k, v in text.items()} for i in range(b)])
    f = adapter.vae_scale_factor
    lat = torch.randn(b, adapter.latent_channels, side // f, side // f, generator=g)
    return lat, torch.rand(b, generator=g), text


def _block_lists(tr, blocks) -> set[str]:
    """The transformer's top-level ModuleLists that hold the blocks (transformer_blocks, ...; Z-Image's
    noise_refiner, context_refiner, layers)."""
    ids = {id(b) for b in blocks}
    return {n for n, m in tr.named_children() if isinstance(m, torch.nn.ModuleList) and any(id(b) in ids for b in m)}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_forward_backward_finite_grads(loaded, name):
    adapter, comps = loaded(name)
    tr = comps.transformer
    tr.requires_grad_(True)
    tr.zero_grad()
    lat, t, text = _batch(adapter, comps)
    out = adapter.predict(tr, lat, t, text, guidance=3.5)
    assert out.shape == lat.shape
    out.float().square().mean().backward()
    missing = [n for n, p in tr.named_parameters() if p.grad is None]
    # Qwen-Image drops the text stream after the last block: that block's text output projection and text MLP
    # get no gradient (a LoRA there stays at its init).
    last = f"transformer_blocks.{len(adapter.blocks(tr)) - 1}."
    unused = (last + "attn.to_add_out.", last + "txt_mlp.")
    expected = [n for n in missing if name == "qwen-image" and n.startswith(unused)]
    assert (len(expected) == 6) == (name == "qwen-image")
    assert missing == expected
    bad = [n for n, p in tr.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not bad
    assert any(p.grad.abs().sum() > 0 for p in tr.parameters() if p.grad is not None)
    tr.zero_grad(set_to_none=True)
    tr.requires_grad_(False)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_blocks_in_execution_order_cover_block_params(loaded, name):
    adapter, comps = loaded(name)
    tr = comps.transformer
    blocks = adapter.blocks(tr)
    order = []
    hooks = [b.register_forward_hook(lambda m, a, o, i=i: order.append(i)) for i, b in enumerate(blocks)]
    try:
        with torch.no_grad():
            adapter.predict(tr, *_batch(adapter, comps, b=1))
    finally:
        for h in hooks:
            h.remove()
    assert order == list(range(len(blocks)))
    in_blocks = [id(p) for b in blocks for p in b.parameters()]
    assert len(in_blocks) == len(set(in_blocks))
    lists = _block_lists(tr, blocks)
    under = {id(p) for n, p in tr.named_parameters() if n.split(".")[0] in lists}
    assert set(in_blocks) == under
    assert len(under) < len(list(tr.parameters()))  # embedders and final norm are not blocks


@pytest.mark.parametrize("name", list(VARIANTS))
def test_default_lora_targets_match_inside_blocks(loaded, name):
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    adapter, comps = loaded(name)
    tr = comps.transformer.__class__.from_config(comps.transformer.config)
    inject_adapter_in_model(LoraConfig(r=2, target_modules=list(adapter.default_lora_targets)), tr)
    keys = list(get_peft_model_state_dict(tr))
    assert keys and all(k.split(".")[0] in _block_lists(tr, adapter.blocks(tr)) for k in keys)
    for target in adapter.default_lora_targets:
        assert any(f".{target}.lora_A" in k for k in keys), target


def test_interfaces_and_shift(loaded):
    expected = {  # name: (divisor, latent channels, text keys, shift at 1024^2, shift at 256^2)
        "flux": (16, 4, {"prompt_embeds", "pooled_prompt_embeds"}, 1.15, 0.5),
        "flux-schnell": (16, 4, {"prompt_embeds", "pooled_prompt_embeds"}, 0.0, 0.0),
        "sd3": (16, 4, {"prompt_embeds", "pooled_prompt_embeds"}, 1.0986, 1.0986),
        "qwen-image": (16, 4, {"prompt_embeds", "prompt_embeds_mask"}, 0.6935, 0.5),
        "flux2": (16, 4, {"prompt_embeds"}, 1.15, 0.5),
        "flux2-klein": (16, 4, {"prompt_embeds"}, 1.15, 0.5),
    }
    for name, (div, ch, keys, log_s1024, log_s256) in expected.items():
        adapter, comps = loaded(name)
        assert (adapter.resolution_divisor, adapter.latent_channels) == (div, ch)
        assert set(adapter.encode_prompts(comps, ["x"])) == keys
        assert adapter.timestep_shift(1024, 1024) == pytest.approx(torch.tensor(log_s1024).exp().item(), rel=1e-3)
        assert adapter.timestep_shift(256, 256) == pytest.approx(torch.tensor(log_s256).exp().item(), rel=1e-3)
        # The scheduler itself shifts a sigma the same way when given the pipelines' mu.
        sched = comps.scheduler.__class__.from_config({**comps.scheduler.config, "shift_terminal": None})
        s = adapter.timestep_shift(512, 512)
        mu = torch.tensor(s).log().item() if sched.config.use_dynamic_shifting else None
        sched.set_timesteps(sigmas=[0.3], mu=mu)
        assert sched.sigmas[0].item() == pytest.approx(s * 0.3 / (1 + (s - 1) * 0.3), rel=1e-5)


def test_qwen_collate_pads_and_masks(loaded):
    adapter, comps = loaded("qwen-image")
    enc = adapter.encode_prompts(comps, PROMPTS)
    items = [{k: v[i] for k, v in enc.items()} for i in range(2)]
    n0, n1 = (int(it["prompt_embeds_mask"].sum()) for it in items)
    assert n0 > n1
    both = adapter.collate_text(items)
    assert both["prompt_embeds"].shape[1] == n0 and both["prompt_embeds_mask"].sum(1).tolist() == [n0, n1]
    one = adapter.collate_text(items[1:])  # no padding needed: no mask, as the pipeline does
    assert set(one) == {"prompt_embeds"} and one["prompt_embeds"].shape[1] == n1


def _capture(pipe):
    seen = {}

    def hook(_m, _args, kwargs, out):
        if "kw" not in seen:
            seen["kw"], seen["out"] = kwargs, out[0]

    return seen, pipe.transformer.register_forward_hook(hook, with_kwargs=True)


# z-image's pipeline calls its transformer with lists, positionally: tests/test_more_families.py checks it
@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "z-image"])
def test_predict_matches_pipeline_transformer_call(loaded, name):
    adapter, comps = loaded(name)
    pipe = adapter.pipeline(comps)
    pipe.set_progress_bar_config(disable=True)
    seen, h = _capture(pipe)
    try:
        extra = {"guidance_scale": 1.0} if name == "sd3" else {"guidance_scale": 3.5} if name in ("flux", "flux2") else {}
        pipe(prompt=PROMPTS, num_inference_steps=2, height=64, width=64, output_type="latent",
             generator=torch.Generator().manual_seed(0), **extra)
    finally:
        h.remove()
    kw, ref = seen["kw"], seen["out"]
    sigma = pipe.scheduler.sigmas[0].item()
    packed = adapter.patch_size == 2 and kw["hidden_states"].ndim == 3
    lat = unpack_2x2(kw["hidden_states"], 8, 8) if packed else kw["hidden_states"]
    if packed:
        assert torch.equal(pack_2x2(lat), kw["hidden_states"])
    text = adapter.encode_prompts(comps, PROMPTS)
    text = adapter.collate_text([{k: v[i] for k, v in text.items()} for i in range(2)])
    assert torch.allclose(text["prompt_embeds"], kw["encoder_hidden_states"], atol=1e-6)
    if "pooled_prompt_embeds" in text:
        assert torch.allclose(text["pooled_prompt_embeds"], kw["pooled_projections"], atol=1e-6)
    if name == "qwen-image":
        assert torch.equal(text["prompt_embeds_mask"], kw["encoder_hidden_states_mask"])
    with torch.no_grad():
        out = adapter.predict(comps.transformer, lat, torch.full((2,), sigma), text, guidance=3.5)
    ref = unpack_2x2(ref, 8, 8) if packed else ref
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4), (out - ref).abs().max()


@pytest.mark.parametrize("name", ["flux", "sd3", "qwen-image"])  # flux-schnell's pipeline runs above
def test_pipeline_from_folder_makes_image(tiny_models, name):
    adapter = get_adapter(_mc(tiny_models, name))
    pipe = adapter.pipeline_cls.from_pretrained(str(tiny_models / name), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    img = pipe("a red square", num_inference_steps=2, height=64, width=64, output_type="pt",
               generator=torch.Generator().manual_seed(0)).images
    assert img.shape == (1, 3, 64, 64) and torch.isfinite(img).all()


@pytest.mark.parametrize("name", ["flux", "qwen-image"])
def test_encode_images_inverts_pipeline_decode_scaling(loaded, name):
    adapter, comps = loaded(name)
    px = torch.rand(1, 3, 64, 64) * 2 - 1
    lat = adapter.encode_images(comps.vae, px)
    assert lat.shape == (1, adapter.latent_channels, 8, 8)
    c = comps.vae.config
    if name == "qwen-image":  # QwenImagePipeline: latents / (1 / std) + mean, on (B, C, 1, h, w)
        raw = comps.vae.encode(px.unsqueeze(2)).latent_dist.mode()[:, :, 0]
        back = lat / (1.0 / torch.tensor(c.latents_std).view(1, -1, 1, 1)) + torch.tensor(c.latents_mean).view(1, -1, 1, 1)
    else:  # FluxPipeline: latents / scaling_factor + shift_factor
        raw = comps.vae.encode(px).latent_dist.mode()
        back = lat / c.scaling_factor + c.shift_factor
    assert torch.allclose(back, raw, atol=1e-5)


@pytest.mark.parametrize("name", ["flux", "sd3", "qwen-image", "flux2"])
def test_single_file_transformer_matches_folder(tiny_models, loaded, tmp_path, name):
    from safetensors.torch import save_file

    adapter, comps = loaded(name)
    f = tmp_path / "transformer.safetensors"
    # Perturbed weights, so a loader that silently read the folder's own weights would fail.
    sd = {k: (v * 1.01).contiguous() for k, v in comps.transformer.state_dict().items()}
    save_file(sd, str(f))
    mc = _mc(tiny_models, name, transformer_file=f)
    tr = get_adapter(mc).load(mc, parts={"transformer"}, dtype=torch.float32).transformer
    got = tr.state_dict()
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
    with torch.no_grad():
        assert torch.isfinite(adapter.predict(tr, *_batch(adapter, comps, b=1))).all()


@pytest.mark.parametrize("single_file", [False, True])
def test_loaded_transformer_tensors_are_64_byte_aligned(tiny_models, loaded, tmp_path, single_file):
    """safetensors' mmap offsets are only 8-byte aligned; CPU kernels round differently there, so resident blocks
    would not match streamed ones (ring views) bit for bit. The loader gives every tensor aligned memory."""
    mc = _mc(tiny_models, "flux")
    if single_file:
        from safetensors.torch import save_file

        f = tmp_path / "transformer.safetensors"
        save_file({k: v.contiguous() for k, v in loaded("flux")[1].transformer.state_dict().items()}, str(f))
        mc = _mc(tiny_models, "flux", transformer_file=f)
    tr = get_adapter(mc).load(mc, parts={"transformer"}, dtype=torch.float32).transformer
    tensors = list(tr.parameters()) + list(tr.buffers())
    assert tensors and all(t.data_ptr() % 64 == 0 for t in tensors if t.numel())


def test_own_aligned_memory_moves_only_misaligned_tensors_and_keeps_ties():
    from trainer.models._diffusers import own_aligned_memory

    buf = torch.arange(70, dtype=torch.float32)
    odd = buf[2:66].view(8, 8)  # 8 bytes past an aligned start
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    m[0].weight.data = odd
    m[1].weight = m[0].weight  # tied
    aligned_bias = m[0].bias.data_ptr()
    m[0].register_buffer("b", odd.clone()[1:])  # a misaligned buffer view
    own_aligned_memory(m)
    assert m[0].weight.data_ptr() % 64 == 0 and torch.equal(m[0].weight, buf[2:66].view(8, 8))
    assert m[1].weight is m[0].weight and m[0].bias.data_ptr() == aligned_bias
    assert m[0].b.data_ptr() % 64 == 0 and torch.equal(m[0].b, buf[2:66].view(8, 8)[1:])


def test_parts_load_only_what_is_asked(tiny_models):
    mc = _mc(tiny_models, "sd3")
    c = get_adapter(mc).load(mc, parts={"vae", "text"}, dtype=torch.float32)
    assert c.transformer is None and c.scheduler is None and c.vae is not None
    assert len(c.text_encoders) == 3 and len(c.tokenizers) == 3


def test_bad_paths_are_user_errors_naming_the_path(tiny_models, tmp_path):
    def fails(mc, parts, *needles):
        with pytest.raises(UserError) as e:
            get_adapter(mc).load(mc, parts=parts, dtype=torch.float32)
        for n in needles:
            assert str(n) in str(e.value), str(e.value)

    missing = tmp_path / "nope"
    fails(ModelConfig(family="flux", path=missing), ALL, missing, "diffusers-format")
    fails(ModelConfig(family="flux", path=tmp_path), {"transformer"}, tmp_path / "transformer/config.json", "transformer/")
    fails(_mc(tiny_models, "flux", transformer_file=tmp_path / "t.safetensors"), {"transformer"}, tmp_path / "t.safetensors")
    fails(ModelConfig(family="flux", path=tiny_models / "sd3"), {"transformer"}, "SD3Transformer2DModel", "flux")
    # a folder of another family is named as such before anything loads (trainer/models/folder.py) ...
    fails(ModelConfig(family="sd3", path=tiny_models / "flux"), {"text"}, tiny_models / "flux", "model.family: flux")
    # ... and a folder of the right family that lacks a part names the part's path
    import shutil

    partial = tmp_path / "sd3-without-te3"
    shutil.copytree(tiny_models / "sd3", partial, ignore=shutil.ignore_patterns("text_encoder_3"))
    fails(ModelConfig(family="sd3", path=partial), {"text"}, partial / "text_encoder_3")
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"x")
    fails(_mc(tiny_models, "flux", transformer_file=bad), {"transformer"}, bad, ".safetensors")


def test_make_tiny_is_deterministic_and_qwen_template_is_34_tokens(tiny_models, tmp_path):
    from trainer.models.qwen_image import TEMPLATE, TEMPLATE_DROP
    from trainer.models.tiny import make_tiny_models

    written = make_tiny_models(tmp_path)  # the same corpus and seeds give byte-identical files
    from trainer.models import adapter_classes

    # every family's own tiny folders, in registry order (the family modules declare them: tiny_builders)
    assert [p.name for p in written] == [name for cls in adapter_classes() for name in cls.tiny_builders()]
    assert [p.name for p in written][:7] == ["flux", "flux-schnell", "sd3", "qwen-image", "flux-kontext",
                                             "qwen-image-edit", "qwen-image-edit-plus"]

    def digest(folder: Path) -> dict[str, str]:
        return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(folder.rglob("*")) if p.is_file()}

    for folder in written:
        assert digest(folder) == digest(tiny_models / folder.name), folder.name
    again = tmp_path / "qwen-image"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(again / "tokenizer"), local_files_only=True)
    prefix = TEMPLATE.split("{}")[0]
    assert len(tok(prefix).input_ids) == TEMPLATE_DROP
    with pytest.raises(UserError, match="unknown family"):
        make_tiny_models(tmp_path, families=["sdxl"])


def test_make_tiny_command(tmp_path):
    from typer.testing import CliRunner

    from trainer.cli import app

    res = CliRunner().invoke(app, ["make-tiny", "--out", str(tmp_path), "--family", "sd3"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "sd3" / "model_index.json").is_file() and "wrote" in res.output
    res = CliRunner().invoke(app, ["make-tiny", "--out", str(tmp_path), "--family", "sdxl"])
    assert res.exit_code == 1 and "unknown family 'sdxl'" in res.output


def test_qwen_text_encoder_drops_its_head_and_vision_tower_and_keeps_the_embeddings(loaded, tiny_models):
    """Captions are hidden states: the slimmed Qwen2.5-VL (no logits head, no vision tower for text-to-image)
    gives bitwise the embeddings of the encoder as transformers loads it, and holds fewer parameters."""
    import transformers

    from trainer.models.qwen_image import NoLogits

    adapter, comps = loaded("qwen-image")
    (enc,) = comps.text_encoders
    assert isinstance(enc.lm_head, NoLogits) and enc.model.visual is None
    full = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tiny_models / "qwen-image", subfolder="text_encoder", dtype=torch.float32, local_files_only=True
    ).eval()
    assert sum(p.numel() for p in enc.parameters()) < sum(p.numel() for p in full.parameters())
    want = adapter.encode_prompts(type(comps)(text_encoders=[full], tokenizers=comps.tokenizers), PROMPTS)
    got = adapter.encode_prompts(comps, PROMPTS)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_qwen_edit_text_encoder_keeps_its_vision_tower(tiny_models):
    from trainer.models import adapter_class
    from trainer.models.qwen_image import NoLogits

    adapter = adapter_class("qwen-image-edit")()
    enc = torch.nn.Module()
    enc.lm_head, enc.model = torch.nn.Linear(2, 3), torch.nn.Module()
    enc.model.visual = torch.nn.Linear(2, 2)
    adapter.slim_text_encoder(enc)
    assert isinstance(enc.lm_head, NoLogits) and enc.model.visual is not None
