"""HiDream-I1 (`hidream`, issue 42) against diffusers' HiDreamImagePipeline on its tiny model: captions (the pipeline's
encode_prompt: both CLIPs pooled, T5, every Llama hidden state), predict bitwise the pipeline's transformer call (and
the same in training mode, whose output diffusers lays out otherwise), the MoE feed-forwards on the meta device, a
tiny LoRA `dittrain fit` from YAML whose file the pipeline's `load_lora_weights` loads (the experts' LoRA in, the
router untouched) and that predicts exactly as in the trainer, streamed training bitwise resident (LoRA at 1.0 and
0.5, full at 0.5), a LoKr on an fp8 base, `dittrain sample` pixel-identical to the pipeline (resident and streamed,
the fitted LoRA at 0.7), the comfy / kohya layouts, make-tiny, and the planner on the shipped presets."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import _family_checks as checks
import numpy as np
import pytest
import torch
from test_sample import PROMPT
from test_train_support import losses, make_config, pixels, write_images

from trainer.config import Config, ModelConfig
from trainer.models import adapter_class, get_adapter
from trainer.sample import SampleRequest, run_sample

FAMILY = "hidream"


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("hidream-images"))


@pytest.fixture(scope="module")
def parts(tiny_models):
    """(adapter, components, pipeline) of the tiny folder, fp32; read-only for the tests."""
    return checks.tiny_pipeline(FAMILY, tiny_models / FAMILY)


def _reference_pipeline(folder: Path, lora: tuple[Path, float] | None = None):
    """diffusers' own HiDreamImagePipeline from the folder, as a diffusers user loads it (its own transformer class,
    memory aligned as our loader aligns it, so the CPU rounds alike), with diffusers' LoRA loading."""
    from diffusers import DiffusionPipeline, HiDreamImagePipeline

    from trainer.models._diffusers import own_aligned_memory

    pipe = DiffusionPipeline.from_pretrained(str(folder), torch_dtype=torch.float32, local_files_only=True)
    assert type(pipe) is HiDreamImagePipeline
    own_aligned_memory(pipe.transformer)
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora[0]), adapter_name="x")
        pipe.set_adapters(["x"], adapter_weights=[lora[1]])
    return pipe


def test_text_is_the_pipelines_encode_prompt(parts):
    adapter, comps, pipe = parts
    prompts = [PROMPT, "a cat"]
    text = adapter.encode_prompts(comps, prompts)
    t5, _, llama, _, pooled, _ = pipe.encode_prompt(prompt=prompts, device="cpu", do_classifier_free_guidance=False)
    assert torch.equal(text["t5"], t5) and torch.equal(text["pooled"], pooled)
    assert torch.equal(text["llama"], llama.transpose(0, 1)) and text["llama"].shape[:3] == (2, 4, 128)
    assert type(comps.text_encoders[3].lm_head) is torch.nn.Identity  # slimmed: its logits are never read
    batch = adapter.collate_text([{k: v[i] for k, v in text.items()} for i in range(2)])
    assert all(torch.equal(batch[k], text[k]) for k in text)


def test_predict_is_the_pipelines_transformer_call_in_eval_and_in_training_mode(parts):
    """predict on the pipeline's first call's inputs: the negated output, bitwise (eval mode, as the pipeline runs
    it); in training mode (diffusers' other MoE path and output layout) the same image, non-square too."""
    adapter, comps, pipe = parts
    seen = {}

    def hook(_m, _args, kwargs, out):
        seen.setdefault("c", (kwargs, out[0]))

    h = comps.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        pipe(prompt=PROMPT, height=48, width=32, area=48 * 32, num_inference_steps=1, guidance_scale=3.0,
             generator=torch.Generator().manual_seed(0), output_type="latent")
    finally:
        h.remove()
    kw, out = seen["c"]
    assert kw["hidden_states"].shape == (2, 4, 6, 4)  # guidance: negative and positive
    t = kw["timesteps"].float() / 1000
    assert torch.equal(t * 1000, kw["timesteps"].float())
    text = {"t5": kw["encoder_hidden_states_t5"], "llama": kw["encoder_hidden_states_llama3"].transpose(0, 1),
            "pooled": kw["pooled_embeds"]}
    tr = comps.transformer
    with torch.no_grad():
        assert not tr.training
        got = adapter.predict(tr, kw["hidden_states"], t, text)
        assert torch.equal(got, -out)
        tr.train()
        try:
            trained = adapter.predict(tr, kw["hidden_states"], t, text)
        finally:
            tr.eval()
    torch.testing.assert_close(trained, got, rtol=1e-5, atol=1e-6)


def test_a_non_square_bucket_over_the_padding_runs_unpadded(parts):
    """A non-square bucket of more tokens than the transformer pads to (its max_resolution; 1024 px buckets of aspect
    1.5 and more at full size) runs on its own tokens, as a square image does: the same in eval and training mode,
    and a square image through the same unpadded arguments is diffusers' own call, bitwise."""
    from trainer.models.hidream import unpadded_tokens

    adapter, comps, _ = parts
    tr = comps.transformer
    text = adapter.encode_prompts(comps, [PROMPT])
    lat = torch.randn(1, 4, 20, 16, generator=torch.Generator().manual_seed(2))
    assert 10 * 8 > tr.max_seq
    with torch.no_grad():
        got = adapter.predict(tr, lat, torch.tensor([0.5]), text)
        tr.train()
        try:
            trained = adapter.predict(tr, lat, torch.tensor([0.5]), text)
        finally:
            tr.eval()
        square = torch.randn(1, 4, 8, 8)
        kw = dict(timesteps=torch.tensor([500.0]), encoder_hidden_states_t5=text["t5"],
                  encoder_hidden_states_llama3=text["llama"].transpose(0, 1), pooled_embeds=text["pooled"],
                  return_dict=False)
        assert torch.equal(tr(hidden_states=square, **kw)[0], tr(**unpadded_tokens(square, 2), **kw)[0])
    assert got.shape == lat.shape and torch.isfinite(got).all()
    torch.testing.assert_close(trained, got, rtol=1e-5, atol=1e-6)


def test_the_moe_runs_on_meta_and_real_tensors_take_diffusers_path(parts):
    """The full-size transformer's forward runs on the meta device (the planner's trace) through the balanced stand-in;
    on real tensors the family's class is diffusers' forward (it is the class the pipeline compares with above)."""
    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

    from trainer.planner.trace import forward_inputs, trace_forward

    cls = adapter_class(FAMILY)
    with torch.device("meta"):
        model = cls.transformer_cls.from_config(cls.full_config).to(torch.bfloat16)
    blocks = cls().blocks(model)
    assert len(blocks) == 48
    moe = [m for m in model.modules() if isinstance(m, MOEFeedForwardSwiGLU)]
    assert len(moe) == 48 and all(type(m) is not MOEFeedForwardSwiGLU for m in moe)
    tr = trace_forward(model, blocks, forward_inputs(FAMILY, model, 1, 1024, 1024, cls.text_tokens, torch.bfloat16),
                       mlps=[cls.token_wise_of(b) for b in blocks])
    assert all(s > 0 for s in tr.block_saved) and tr.linear_flops > 0
    # the routed experts' matmuls on 2 of 4 experts' worth of each token, beside the shared expert's: a single block's
    # tokens are the image's 4096, T5's 128 and two Llama layers' 128 each
    d, routed, shared = 2560, moe[0].experts[0].w1.out_features, moe[0].shared_experts.w1.out_features
    s = 4096 + 3 * 128
    assert tr.block_mlp_linear_flops[20] == 2 * 3 * d * (2 * s * routed + s * shared)


def test_full_size_is_the_released_17b_and_the_shift_is_the_schedulers(parts):
    cls = adapter_class(FAMILY)
    with torch.device("meta"):
        model = cls.transformer_cls.from_config(cls.full_config)
    assert sum(p.numel() for p in model.parameters()) == 17_105_733_184
    assert len(cls.full_config["llama_layers"]) == 48 and model.max_seq == 4096
    defaults = {k: v.default for k, v in inspect.signature(cls.transformer_cls.__init__).parameters.items()}
    assert defaults["num_routed_experts"] == 4 and defaults["num_activated_experts"] == 2
    assert defaults["num_layers"] == 16 and defaults["num_single_layers"] == 32
    assert parts[0].timestep_shift(1024, 1024) == cls.default_scheduler["flow_shift"] == 3.0 and cls.runs_cfg(5.0)


# ---------------------------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def fitted(tiny_models, images, tmp_path_factory):
    """`dittrain fit` of a LoRA YAML config: (config path, output folder)."""
    return checks.fit_from_yaml(FAMILY, tiny_models, images, tmp_path_factory.mktemp("fit-hidream"), steps=2)


def test_fit_writes_a_lora_the_pipeline_loads_experts_included_router_frozen(tiny_models, fitted):
    _, out = fitted
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(np.isfinite(x["loss"]) for x in lines)
    pipe = _reference_pipeline(tiny_models / FAMILY)
    pipe.load_lora_weights(str(out / "lora.safetensors"))
    names = {k.split(".lora_A.")[0] for k in pipe.transformer.state_dict() if ".lora_A." in k}
    assert "double_stream_blocks.0.block.ff_i.experts.3.w2" in names
    assert "single_stream_blocks.1.block.ff_i.shared_experts.w1" in names
    assert "double_stream_blocks.1.block.attn1.to_k_t" in names and "double_stream_blocks.0.block.ff_t.w3" in names
    assert not any("gate" in n or "adaLN" in n for n in names)


def test_streamed_training_equals_resident_and_the_lora_predicts_as_in_the_trainer(fitted, monkeypatch):
    checks.streamed_fit_equals_the_fit(*fitted, monkeypatch)


@pytest.mark.parametrize(("method", "fraction"), [("lora", 0.5), ("full", 0.5)])
def test_streamed_at_half_equals_resident(tiny_models, images, tmp_path, monkeypatch, method, fraction):
    checks.streamed_training_equals_resident(FAMILY, tiny_models, images, tmp_path, monkeypatch, method, fraction)


def test_nano_batches_chunk_the_moe_feed_forward(tiny_models, images, tmp_path):
    """offload.nano_batches: 2 runs each block's MoE feed-forward (`token_wise`) on token chunks, which are not
    contiguous: the losses of the unchunked run."""
    from trainer.train.trainer import Trainer

    runs = {}
    for n in (1, 2):
        cfg = make_config(tiny_models, images, tmp_path / f"n{n}", tmp_path / "cache", FAMILY,
                          train={"steps": 2, "device": "cpu"}, offload={"nano_batches": n})
        Trainer(cfg).fit()
        runs[n] = losses(tmp_path / f"n{n}")
    torch.testing.assert_close(torch.tensor(runs[2]), torch.tensor(runs[1]), rtol=1e-5, atol=1e-6)


def test_full_fine_tune_trains_the_router(tiny_models, images, tmp_path):
    from trainer.train.trainer import Trainer

    cfg = make_config(tiny_models, images, tmp_path / "full", tmp_path / "cache", FAMILY, "full",
                      train={"steps": 2, "device": "cpu"}, optimizer={"lr": 1e-2})
    t = Trainer(cfg)
    t.setup()
    gate = t.transformer.double_stream_blocks[0].block.ff_i.gate.weight
    before = gate.detach().clone()
    t.fit()
    assert gate.requires_grad and not torch.equal(gate.detach(), before)


def test_a_lokr_on_an_fp8_base_streams(tiny_models, images, tmp_path, monkeypatch):
    """lora.type lokr on model.quantize fp8, streamed at 0.5: finite losses; every block Linear 8-bit, the experts
    included, but the modulation (kept in the model dtype); the router's weight (no Linear) stays fp32."""
    from trainer import quant
    from trainer.train.trainer import Trainer

    monkeypatch.setattr(Trainer, "_can_stream", lambda self: True)
    cfg = make_config(tiny_models, images, tmp_path / "lokr", tmp_path / "cache", FAMILY,
                      train={"steps": 2, "device": "cpu"}, offload={"transformer": 0.5}, model={"quantize": "fp8"},
                      lora={"rank": 4, "alpha": 8, "type": "lokr"})
    t = Trainer(cfg)
    t.fit()
    got = losses(tmp_path / "lokr")
    assert len(got) == 2 and all(np.isfinite(got))
    lin = {n.removesuffix(".base_layer"): m for b in t.adapter.blocks(t.transformer) for n, m in b.named_modules()
           if isinstance(m, torch.nn.Linear) and "lokr_" not in n}
    kept = {n for n, m in lin.items() if not isinstance(m, quant.QuantizedLinear)}
    assert kept == {"block.adaLN_modulation.1"}
    assert isinstance(lin["block.ff_i.experts.2.w1"], quant.QuantizedLinear)
    assert t.transformer.single_stream_blocks[0].block.ff_i.gate.weight.dtype == torch.float32


@pytest.mark.slow
def test_compiled_training_with_ema_and_validation_matches_eager(tiny_models, images, tmp_path, monkeypatch):
    """train.compile (aot_eager on the CPU: the block classes compiled, the experts' masks breaking the graph), with
    EMA and a held-out validation set (eval mode: diffusers' `moe_infer`): the eager run's losses; the EMA weights and
    the validation losses are written."""
    from _family_checks import compiled_fit_with_ema_and_validation_equals_eager

    compiled_fit_with_ema_and_validation_equals_eager(FAMILY, tiny_models, images, tmp_path, monkeypatch)


@pytest.mark.slow
def test_compiled_blocks_trace_every_routing_in_one_graph_as_eager(parts):
    """Regional compilation (aot_eager) over steps that route differently: dynamo traces the MoE's data-dependent
    sizes (`_HiDreamBlock.dynamo_config`) instead of breaking the graph at each expert's token mask and compiling the
    expert again for every new token count (up to the recompile limit, then eager): one graph per block variant
    (the double block's first call takes inputs without gradients, the single block's other shapes), none more for a
    new routing, and eager's losses and gradients; eval mode (`moe_infer`, sampling) too, with eager's output."""
    from peft import LoraConfig
    from torch._dynamo.utils import counters

    from trainer.offload import CompileOptions, attach_offload, compiled

    adapter, comps, _ = parts
    cls = adapter_class(FAMILY).transformer_cls
    conf = {**comps.transformer.config, "num_layers": 1, "num_single_layers": 1, "llama_layers": [0, 3]}
    torch.manual_seed(0)
    base = cls.from_config(conf).state_dict()
    opts = CompileOptions(backend="aot_eager", shapes=8)  # the trainer's limit for 8 buckets

    def model():
        m = cls.from_config(conf)
        m.load_state_dict(base)
        m.requires_grad_(False)
        torch.manual_seed(1)
        m.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=list(adapter.default_lora_targets),
                                 init_lora_weights="gaussian"))
        return m

    def inputs(m, seed):
        torch.manual_seed(seed)
        kw = adapter.dummy_inputs(m, 1, 32, 32, 8, torch.float32, device="cpu")
        return {**kw, "timesteps": torch.rand(1) * 1000, "return_dict": False}

    def run(compile, train, seeds):
        m = model().train(train)
        blocks = adapter.blocks(m)
        h = attach_offload(blocks, "cpu", 0.0, mode="train" if train else "sample", compile=compile)
        routed, outs, graphs = [], [], []
        hook = None if compile else blocks[0].block.ff_i.gate.register_forward_hook(
            lambda _m, _a, out: routed.append(out[0].flatten().bincount(minlength=4).tolist()))
        for s in seeds:
            with torch.set_grad_enabled(train):
                out = m(**inputs(m, s))[0]
            if train:
                out.pow(2).mean().backward()
                outs.append((out.pow(2).mean().detach(), {n: p.grad.clone() for n, p in m.named_parameters()
                                                          if p.grad is not None}))
                m.zero_grad()
            else:
                outs.append(out)
            graphs.append(compiled.stats()["graphs"])
        if hook is not None:
            hook.remove()
        h.close()
        return outs, routed, graphs

    compiled.reset()
    breaks = sum(counters["graph_break"].values())
    try:
        seeds = range(4)
        eager, routed, _ = run(False, True, seeds)
        assert len({tuple(r) for r in routed}) > 1  # the routings differ
        got, _, graphs = run(opts, True, seeds)
        assert graphs == [2] * len(seeds)  # the double block's (inputs without gradients) and the single block's
        for (loss, grads), (want_loss, want_grads) in zip(got, eager, strict=True):
            torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
            assert grads.keys() == want_grads.keys() and any(".experts.3." in k for k in grads)
            for k in grads:
                torch.testing.assert_close(grads[k], want_grads[k], rtol=1e-4, atol=1e-6)
        compiled.reset()
        eager, routed, _ = run(False, False, seeds)
        assert len({tuple(r) for r in routed}) > 1
        got, _, graphs = run(opts, False, seeds)
        assert graphs == [2] * len(seeds)
        for a, b in zip(got, eager, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert sum(counters["graph_break"].values()) == breaks  # none at the experts' masks or counts
    finally:
        compiled.reset()


# ---------------------------------------------------------------------------------------------- sampling


def _sample_cfg(tiny_models: Path, out: Path, guidance: float, width: int, height: int) -> Config:
    return Config.model_validate({
        "model": {"family": FAMILY, "path": str(tiny_models / FAMILY), "dtype": "fp32"},
        "sample": {"steps": 2, "width": width, "height": height, "guidance": guidance},
        "train": {"device": "cpu"},
        "output": {"dir": str(out)},
    })


def test_sample_with_the_fitted_lora_equals_the_pipeline_resident_and_streamed(tiny_models, fitted, tmp_path):
    """Guidance 4 (the negative pass), the fitted LoRA at 0.7, 48 x 48: the plain HiDreamImagePipeline's image at its
    default area set to the image's (an exact square: the pipeline keeps the size), pixel for pixel; streamed too."""
    lora = fitted[1] / "lora.safetensors"
    cfg = _sample_cfg(tiny_models, tmp_path, 4.0, 48, 48)
    (plain,) = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=1, out=tmp_path / "plain"))
    (ours,) = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=1, loras=[f"{lora}:0.7"], out=tmp_path / "l"))
    pipe = _reference_pipeline(tiny_models / FAMILY, (lora, 0.7))
    pipe.default_sample_size = 48 // pipe.vae_scale_factor
    image = pipe(prompt=PROMPT, height=48, width=48, num_inference_steps=2, guidance_scale=4.0,
                 generator=torch.Generator().manual_seed(1)).images[0]
    img = pixels(ours)
    assert img.shape == (48, 48, 3) and (img != pixels(plain)).mean() > 0.1, "the LoRA must change the image"
    np.testing.assert_array_equal(img, np.asarray(image.convert("RGB")))
    (streamed,) = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=1, loras=[f"{lora}:0.7"], offload=1.0,
                                                out=tmp_path / "s"))
    np.testing.assert_array_equal(img, pixels(streamed))


def test_sample_is_the_size_asked_and_the_pipelines_image_at_that_area(tiny_models, tmp_path):
    """32 x 48 without guidance: the plain pipeline would scale it to its default area (128 latent pixels a side: more
    tokens than the tiny transformer pads to); the face asks for the image's own, and the image is the plain
    pipeline's at that area."""
    cfg = _sample_cfg(tiny_models, tmp_path, 1.0, 32, 48)
    assert not adapter_class(FAMILY).runs_cfg(1.0)
    (png,) = run_sample(cfg, SampleRequest(prompts=[PROMPT], seed=7, out=tmp_path / "a"))
    pipe = _reference_pipeline(tiny_models / FAMILY)
    pipe.default_sample_size = (32 * 48) ** 0.5 * (1 + 1e-9) / pipe.vae_scale_factor
    image = pipe(prompt=PROMPT, height=48, width=32, num_inference_steps=2, guidance_scale=1.0,
                 generator=torch.Generator().manual_seed(7)).images[0]
    assert pixels(png).shape == (48, 32, 3)
    np.testing.assert_array_equal(pixels(png), np.asarray(image.convert("RGB")))


# ---------------------------------------------------------------------------------------------- LoRA layouts


@pytest.mark.parametrize("fmt", ["comfy", "kohya"])
def test_original_layout_gives_the_diffusers_update(tiny_models, tmp_path, fmt):
    from test_lora_format import test_original_layout_gives_the_diffusers_update as check

    check(tiny_models, tmp_path, FAMILY, "lora", fmt)


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_round_trips_through_every_layout(tiny_models, tmp_path, kind):
    from test_lora_format import test_round_trips_through_every_layout as check

    check(tiny_models, tmp_path, FAMILY, kind)


# ---------------------------------------------------------------------------------------------- tiny, planner


def test_make_tiny_writes_a_folder_the_pipeline_loads(tmp_path):
    from typer.testing import CliRunner

    from trainer.cli import app

    r = CliRunner().invoke(app, ["make-tiny", "--out", str(tmp_path), "--family", FAMILY])
    assert r.exit_code == 0, r.output
    index = json.loads((tmp_path / FAMILY / "model_index.json").read_text())
    assert index["_class_name"] == "HiDreamImagePipeline" and index["scheduler"][1] == "UniPCMultistepScheduler"
    mc = ModelConfig(family=FAMILY, path=tmp_path / FAMILY, dtype="fp32")
    comps = get_adapter(mc).load(mc, parts={"transformer", "scheduler"}, dtype=torch.float32)
    assert type(comps.scheduler).__name__ == "UniPCMultistepScheduler"
    assert type(comps.transformer).__module__ == "trainer.models.hidream"


def test_planner_on_the_presets():
    """The shipped 8 and 16 GB presets of both methods plan at the full-size config (48 blocks) and fit their card."""
    from trainer.config import load_config
    from trainer.planner import analyze, report

    for method in ("lora", "full"):
        for card in (8, 16):
            path = Path("configs") / FAMILY / f"{method}-{card}gb.yaml"
            if not path.is_file():
                continue
            cfg = load_config(path, [])
            facts = analyze(cfg)
            assert facts.family == FAMILY and len(facts.block_param_bytes) == 48
            lines, fraction = report(cfg, vram_gb=card, facts=facts)
            assert fraction is not None and 0 < fraction <= 1, lines
