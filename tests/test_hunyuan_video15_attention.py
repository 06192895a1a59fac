"""HunyuanVideo 1.5's attention without the (B, 1, S, S) mask (trainer/models/hunyuan_video15_attention.py):
`PrefixAttnProcessor` gives diffusers' masked attention's numbers (fp32 within a few ulps: the CPU kernel's key
blocking; bf16 within its rounding) for batch 1 and for a batch of different text lengths, padded rows included,
hands SDPA no mask, reads the lengths once per forward, compiles without a recompile per caption length, and is
what every adapter path builds (loader, planner's meta model) while diffusers' own class keeps the masked one."""

from __future__ import annotations

import copy

import diffusers
import pytest
import torch
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

from trainer.models import adapter_class
from trainer.models.hunyuan_video15_attention import PrefixAttnProcessor, use_prefix_attention
from trainer.models.hunyuan_video15_block import HunyuanVideo15Transformer3DModel
from trainer.offload import CompileOptions, attach_offload, compiled

QWEN, BYT5, IMAGE = 20, 6, 5  # text tokens of each kind (the real model: 1000, 256, 729)
#: of the largest value. fp32: SDPA's CPU kernel groups its sum over the keys by their count, so leaving the padded
#: keys out reorders additions (module essay): a few ulps (measured up to 2.5e-7). bf16: its rounding steps (2^-8),
#: which the tiny transformer's two blocks compound (measured up to 7.6e-3 on the output, 6.8e-3 on LoRA gradients)
TOL = {torch.float32: 2e-6, torch.bfloat16: 2 ** -6}


@pytest.fixture(autouse=True)
def _fresh_compile_cache():
    compiled.reset()
    yield
    compiled.reset()


def _pair(dtype=torch.float32, lora=True):
    """diffusers' tiny transformer with real numbers in every weight (and a LoRA), and the same as this family's."""
    torch.manual_seed(0)
    ref = diffusers.HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_refiner_layers=1, mlp_ratio=2.0, text_embed_dim=32, text_embed_2_dim=32, image_embed_dim=16,
        rope_axes_dim=(4, 6, 6), target_size=64, task_type="t2v")
    for p in ref.parameters():  # diffusers zero-initialises some projections
        p.data.normal_(0, 0.2)
    if lora:
        from peft import LoraConfig

        ref.requires_grad_(False)
        ref.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, target_modules=[
            "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]))
    torch.nn.Module.to(ref, dtype)  # torch's: diffusers' warns about fp32 modules this model has none of
    ours = copy.deepcopy(ref)
    use_prefix_attention(ours)
    return ref, ours


def _inputs(qwen: list[int], byt5: list[int], image: bool = False, dtype=torch.float32, seed=1) -> dict:
    """A batch whose sample b keeps qwen[b] Qwen and byt5[b] ByT5 tokens (the rest padding), and the image tokens
    where `image` (I2V: nonzero embeddings)."""
    g = torch.Generator().manual_seed(seed)
    b = len(qwen)
    m1, m2 = torch.zeros(b, QWEN), torch.zeros(b, BYT5)
    for i, (n1, n2) in enumerate(zip(qwen, byt5, strict=True)):
        m1[i, :n1], m2[i, :n2] = 1, 1
    img = torch.randn(b, IMAGE, 16, generator=g) if image else torch.zeros(b, IMAGE, 16)
    return dict(hidden_states=torch.randn(b, 9, 2, 4, 3, generator=g).to(dtype),
                timestep=torch.linspace(300, 700, b).to(dtype),
                encoder_hidden_states=torch.randn(b, QWEN, 32, generator=g).to(dtype), encoder_attention_mask=m1,
                encoder_hidden_states_2=torch.randn(b, BYT5, 32, generator=g).to(dtype),
                encoder_attention_mask_2=m2, image_embeds=img.to(dtype), return_dict=False)


def _close(got, want, dtype):
    assert want.abs().max() > 0
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=TOL[dtype] * want.abs().max().item())


CASES = {"batch 1": ([13], [4], False), "batch 2, different lengths": ([13, 5], [0, 6], False),
         "batch 2, image tokens kept (I2V)": ([20, 2], [3, 0], True), "batch 2, equal lengths": ([9, 9], [2, 2], False)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_one_attention_call_matches_diffusers_masked_one(sdpa_masks, case, dtype):
    """One block's attention module, as the transformer calls it (its reordered text, valid tokens first): both
    outputs (video and text, the padded text rows included: zeros through to_add_out in both) and the input
    gradients; no SDPA call gets a mask."""
    qwen, byt5, image = CASES[case]
    ref, _ = _pair(dtype, lora=False)
    attn = ref.transformer_blocks[0].attn
    calls = {}

    def grab(_m, _args, kw):  # the block's real attention inputs
        calls.setdefault("kw", kw)

    h = attn.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        ref(**_inputs(qwen, byt5, image, dtype))
    h.remove()
    kw = calls["kw"]
    outs = []
    for proc in (HunyuanVideo15AttnProcessor2_0(), PrefixAttnProcessor()):
        attn.set_processor(proc)
        x = {k: v.detach().clone().requires_grad_(v.is_floating_point() and k != "attention_mask")
             if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        sdpa_masks.clear()
        img, txt = attn(**x)
        (img.float().square().sum() + txt.float().sin().sum()).backward()
        outs.append([img.detach(), txt.detach(), x["hidden_states"].grad, x["encoder_hidden_states"].grad])
        masks = list(sdpa_masks)
    # a pair of calls (video queries, valid text queries) per prefix length: one for equal lengths, else per sample
    assert masks == [None] * 2 * (1 if len(set(qwen)) == 1 and len(set(byt5)) == 1 else len(qwen)), masks
    for got, want in zip(outs[1], outs[0], strict=True):
        _close(got, want, dtype)
    kept = IMAGE * image + torch.tensor(qwen) + torch.tensor(byt5)
    pad_rows = [outs[1][1][i, n:] for i, n in enumerate(kept.tolist())]
    bias = attn.to_add_out.bias.detach()
    for rows, ref_rows in zip(pad_rows, [outs[0][1][i, n:] for i, n in enumerate(kept.tolist())], strict=True):
        assert torch.equal(rows, ref_rows) and (rows == bias).all()  # zero attention through to_add_out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["batch 1", "batch 2, different lengths", "batch 2, image tokens kept (I2V)"])
def test_transformer_output_and_lora_gradients_match_diffusers(case, dtype, monkeypatch):
    """The whole transformer, trained (LoRA on the attention): output and LoRA gradients as diffusers' masked
    processor gives them, with the prefix lengths read on the host once per forward (two blocks, one read)."""
    ref, ours = _pair(dtype)
    assert len({id(b.attn.processor) for b in ours.transformer_blocks}) == 1
    res = []
    for m in (ref, ours):
        reads, orig = [], torch.Tensor.tolist

        def count(t, _orig=orig, _reads=reads):
            _reads.append(t.shape)
            return _orig(t)

        monkeypatch.setattr(torch.Tensor, "tolist", count)
        out = m(**_inputs(*CASES[case], dtype=dtype))[0]
        monkeypatch.setattr(torch.Tensor, "tolist", orig)
        out.float().square().mean().backward()
        # the last block's text-only LoRAs (add_q_proj, to_add_out, ...) get none: its text stream is dropped
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in m.parameters() if p.requires_grad]
        res.append([out.detach(), torch.cat([g.flatten() for g in grads])])
        if m is ours:
            assert len(reads) == 1, reads
    for got, want in zip(res[1], res[0], strict=True):
        _close(got, want, dtype)


def test_compiled_blocks_do_not_recompile_per_caption_length():
    """Inside compiled, recomputed blocks (aot_eager, as train.compile on the CPU tests): the eager model's numbers,
    and a batch of other caption lengths makes no new graph (the prefix attention runs eagerly between them)."""
    _, eager = _pair()
    fast = copy.deepcopy(eager)
    h = attach_offload(list(fast.transformer_blocks), "cpu", 0.0, checkpointing=True,
                       compile=CompileOptions(backend="aot_eager"))
    try:
        for i, lengths in enumerate((([13], [4]), ([7], [0]), ([20], [6]))):
            kw = _inputs(*lengths, False)
            got = fast(**kw)[0]
            got.square().mean().backward()
            with torch.no_grad():
                want = eager(**kw)[0]
            torch.testing.assert_close(got.detach(), want, rtol=1e-6, atol=1e-6)
            if i == 0:
                graphs = compiled.stats()["graphs"]
                assert graphs >= 1
        assert compiled.stats()["graphs"] == graphs
    finally:
        h.close()


def test_a_mask_that_is_not_a_prefix_gets_diffusers_masked_call(sdpa_masks):
    """The transformer always moves the kept tokens first; a mask that does not (a caller's own) is attended as diffusers does."""
    ref, _ = _pair(lora=False)
    attn = ref.transformer_blocks[0].attn
    g = torch.Generator().manual_seed(0)
    x, e = torch.randn(1, 6, 32, generator=g), torch.randn(1, 4, 32, generator=g)
    mask = torch.tensor([[True, False, True, False]])
    with torch.no_grad():
        want = attn(x, e, attention_mask=mask)
        attn.set_processor(PrefixAttnProcessor())
        sdpa_masks.clear()
        got = attn(x, e, attention_mask=mask)
    assert sdpa_masks == [(1, 1, 10, 10)]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from trainer.models.tiny import make_tiny_models

    root = tmp_path_factory.mktemp("tiny-hv15-attention")
    make_tiny_models(root, ["hunyuan-video-1.5", "hunyuan-video-1.5-i2v"])
    return root


def test_every_adapter_path_builds_the_prefix_attention(folders):
    """The adapter's transformer class (same name as diffusers', so folders and single files match it) attends
    through the prefix processor however it is built: the loader, `from_config` (stream_load), the planner's meta
    model; diffusers' own class loading the same folder keeps the masked processor. The planner's video facts."""
    from trainer.config import ModelConfig
    from trainer.models import get_adapter
    from trainer.planner.meta import meta_transformer

    for family in ("hunyuan-video-1.5", "hunyuan-video-1.5-i2v"):
        cls = adapter_class(family)
        assert cls.transformer_cls is HunyuanVideo15Transformer3DModel
        assert cls.transformer_cls.__name__ == diffusers.HunyuanVideo15Transformer3DModel.__name__
        assert cls.bucket_step == 16
        meta = meta_transformer(family, cls.full_config, torch.bfloat16)
        assert type(meta) is HunyuanVideo15Transformer3DModel
        assert {type(b.attn.processor) for b in meta.transformer_blocks} == {PrefixAttnProcessor}
        mc = ModelConfig(family=family, path=folders / family, dtype="fp32")
        tr = get_adapter(mc).load(mc, parts={"transformer"}, dtype=torch.float32).transformer
        assert {type(b.attn.processor) for b in tr.transformer_blocks} == {PrefixAttnProcessor}
        plain = diffusers.HunyuanVideo15Transformer3DModel.from_pretrained(str(mc.path), subfolder="transformer")
        assert {type(b.attn.processor) for b in plain.transformer_blocks} == {HunyuanVideo15AttnProcessor2_0}
