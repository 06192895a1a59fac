"""offload.nano_batches (trainer/offload/nano.py): a family's token-wise sub-layers (`token_wise` on the adapter:
Wan's cross-attention and feed-forward; every diffusers FeedForward for the others) run in token chunks, each
recomputed in backward. Same losses and LoRA weights with it on and off for tiny Wan and Flux, resident and
streamed, eager and compiled (aot_eager), fp32 on the CPU: the forward is bitwise the same (each token's rows are
computed alone either way), so the first loss is; a weight inside a split sub-layer gets its gradient as a sum of
per-chunk matmuls instead of one over all tokens (fp32 reassociation, ~1e-7 relative), so after 3 AdamW steps
the weights agree to 1e-5 of their size, not bitwise (measured: up to 6e-6). And the planner's count of what a block saves with
chunks (planner/trace.py `chunk_mlps`) equals the trace of the block with the split installed, on a narrow Wan
block at the real 480p x 81 token count (32,760)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _offload_util import add_lora, blocks_of, tiny_flux, train_steps, trainable_state

from trainer.models import adapter_class
from trainer.offload import CompileOptions, attach_offload, compiled
from trainer.offload.nano import NanoBatched, split_mlps
from trainer.planner import trace as ptrace

AOT = CompileOptions(backend="aot_eager", shapes=4)
WAN = adapter_class("wan")


@pytest.fixture(autouse=True, scope="module")
def _fresh_compile_cache():
    """Compiled graphs kept for the module, not per test: the streamed-compiled cases run the graphs the compiled
    (resident) cases traced for the same block classes and nano-batch splits (~15 s of aot_eager each on 2 cores),
    as a streamed run after a resident one does (dynamo's guards compile anew what the ring's views would need;
    tests/test_compile.py counts that nothing does). A case run alone compiles its own."""
    compiled.reset()
    yield
    compiled.reset()


def _wan(width: int = 16, heads: int = 2, ffn: int = 64, device="cpu"):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(23)
    with torch.device(device):
        return WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=width, in_channels=4,
            out_channels=4, text_dim=32, freq_dim=32, ffn_dim=ffn, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=64,
        )


def _wan_lora():
    from peft import LoraConfig

    m = _wan()
    m.requires_grad_(False)
    m.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=list(WAN.default_lora_targets),
                             init_lora_weights=False))
    return m


def _wan_steps(m, steps: int = 3) -> torch.Tensor:
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for s in range(steps):
        g = torch.Generator().manual_seed(100 + s)
        x = torch.randn(1, 4, 3, 8, 8, generator=g)  # 3 latent frames of 4 x 4 tokens: 48 tokens
        text = torch.randn(1, 8, 32, generator=g)
        out = m(hidden_states=x, timestep=torch.rand(1, generator=g) * 1000, encoder_hidden_states=text,
                return_dict=False)[0]
        loss = F.mse_loss(out, torch.randn(out.shape, generator=g))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses)


def _same_run(base, other) -> None:
    (base_l, base_w, _), (losses, w, _) = base, other
    # the first forward: the same up to the matmul kernel the CPU picks for a chunk's rows (bitwise on AVX2 CPUs,
    # not on this AVX-512 one for Flux's feed-forwards: a test must not depend on the CPU's code generation)
    torch.testing.assert_close(losses[0], base_l[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(losses, base_l, rtol=1e-5, atol=0)
    assert w.keys() == base_w.keys()
    for k in w:  # summation order of the split sub-layers' weight gradients: see the module docstring
        torch.testing.assert_close(w[k], base_w[k], rtol=0, atol=1e-5 * base_w[k].abs().max().item())


def _run(build, steps_fn, family: str, fraction: float, nano: int, compile, blocks):
    m = build()
    h = attach_offload(blocks(m), "cpu", fraction, nano_batches=nano, compile=compile,
                       nano_mlps=adapter_class(family).token_wise_of)
    split = sum(isinstance(x, NanoBatched) for x in m.modules())
    losses = steps_fn(m)
    h.close()
    return losses, trainable_state(m), split


CASES = [(0.0, False), (1.0, False), (0.0, AOT), (1.0, AOT)]


@pytest.mark.parametrize(("fraction", "compile"), CASES, ids=["resident", "streamed", "compiled", "streamed-compiled"])
def test_wan_chunks_give_the_same_losses_and_lora(fraction, compile):
    """Wan: both blocks' attn2 and ffn split in 4 chunks (of 48 tokens); the same bits as without."""
    base = _run(_wan_lora, _wan_steps, "wan", fraction, 1, compile, lambda m: list(m.blocks))
    run = _run(_wan_lora, _wan_steps, "wan", fraction, 4, compile, lambda m: list(m.blocks))
    assert base[2] == 0 and run[2] == 2 * len(WAN.token_wise)
    _same_run(base, run)


@pytest.mark.parametrize(("fraction", "compile"), CASES, ids=["resident", "streamed", "compiled", "streamed-compiled"])
def test_flux_chunks_give_the_same_losses_and_lora(fraction, compile):
    """An image family without a declaration: every FeedForward (the double blocks' ff and ff_context)."""
    def build():
        return add_lora(tiny_flux(0))

    def steps(m):
        return train_steps(m, 3)

    base = _run(build, steps, "flux", fraction, 1, compile, blocks_of)
    run = _run(build, steps, "flux", fraction, 4, compile, blocks_of)
    assert run[2] == 4  # 2 double blocks x (ff, ff_context); the single blocks' MLP is inline
    _same_run(base, run)


def test_wan_declares_its_token_wise_sub_layers():
    m = _wan()
    b = m.blocks[0]
    assert [type(x).__name__ for x in WAN.token_wise_of(b)] == ["WanAttention", "FeedForward"]
    assert WAN.token_wise_of(b)[0] is b.attn2
    assert [x for x in adapter_class("flux").token_wise_of(tiny_flux(0).transformer_blocks[0])]  # FeedForwards


def test_planner_counts_what_a_chunked_block_saves_at_480p_x_81():
    """Narrow Wan blocks (2 heads of 16, ffn 64: the count is per tensor, the width only scales it) on the meta device at 32,760 tokens (21 latent frames of 30 x 52): what the block's
    recompute saves with the split installed, traced, is the planner's `chunk_mlps` count less the one chunk's
    tensors that backward recomputes at a time (which the planner adds to the working set)."""
    n, tokens = 4, 21 * 30 * 52
    x = dict(hidden_states=torch.randn(1, 4, 21, 60, 104, device="meta"),
             encoder_hidden_states=torch.randn(1, 512, 32, device="meta"), timestep=torch.ones(1, device="meta"))
    plain = _wan(device="meta")
    plain.requires_grad_(True)
    tr = ptrace.trace_forward(plain, list(plain.blocks), x, mlps=[WAN.token_wise_of(b) for b in plain.blocks])
    planned = ptrace.chunk_mlps(tr, n)
    split = _wan(device="meta")
    split.requires_grad_(True)
    for b in split.blocks:
        split_mlps(b, n, WAN.token_wise_of(b))
    real = ptrace.trace_forward(split, list(split.blocks), x)
    assert x["hidden_states"][0, 0].numel() // 4 == tokens
    for i in range(len(plain.blocks)):
        chunk = -(-tr.block_mlp_saved[i] // n)
        assert tr.block_mlp_saved[i] > 0.25 * tr.block_saved[i]  # attn2's q and output, ffn's 64-wide hidden
        # the split block saves neither the hidden nor what the sub-layers make again per chunk (the text's keys
        # and values): the planner keeps one chunk's worth of both in backward's working set
        assert tr.block_mlp_other[i] > 0
        assert real.block_saved[i] == planned.block_saved[i] - chunk - tr.block_mlp_other[i]
    # one chunk's hidden is what the sub-layers save on a quarter of the tokens
    assert planned.block_largest[0] < tr.block_largest[0]


def test_plan_of_the_14b_preset_at_480p_x_81_counts_the_chunks():
    """`dittrain plan` of configs/wan/lora-16gb.yaml at 480p x 81, every block streamed, eager blocks: with 8 chunks the block
    working set is the chunked trace's (saved + 2 x inputs + the larger of 2 x largest and the attention's backward,
    prediction.py), the feed-forward's
    13,824-wide hidden (two 0.91 GB bf16 tensors) no longer the largest; the step costs the sub-layers' matmuls
    once more."""
    import yaml

    from trainer.config import Config
    from trainer.planner.prediction import analyze, predict

    raw = yaml.safe_load(open("configs/wan/lora-16gb.yaml"))
    raw["data"]["clip_frames"] = 81
    raw["offload"]["transformer"] = 1.0
    raw["train"]["compile"] = False  # eager blocks: the compiled count is test_compiled_chunks_* below
    raw["offload"]["nano_batches"] = 1  # without chunks first (the preset may turn them on)
    facts = analyze(Config.model_validate(raw))
    off = predict(facts, 1.0, 632, activation_offload=True)
    tr = facts.trace(632)
    assert tr.block_largest[5] == 32760 * 13824 * 2 and facts.tokens(632) == 32760
    facts.nano_batches = 8
    on = predict(facts, 1.0, 632, activation_offload=True)
    ch = facts.trace(632)
    assert ch.block_largest[5] == 32760 * 5120 * 4  # an fp32 residual / norm input is now the largest
    assert on.act_block == max(s + max(2 * b, a) + 2 * i for s, b, i, a in zip(
        ch.block_saved, ch.block_largest, ch.block_inputs, ch.block_attn_bwd, strict=True))
    saved = off.act_block - on.act_block
    # the self-attention's backward (q, k, v gradients and the float32 dq: 1.68 GB) is now the block's transient, more
    # than twice the largest saved tensor (1.34 GB)
    assert ch.block_attn_bwd[5] == 3 * 32760 * 5120 * 2 + 32760 * 5120 * 4 > 2 * ch.block_largest[5]
    assert 2.55e9 < saved < 2.65e9, saved  # of 10.99 GB
    assert on.peak_reserved < off.peak_reserved - 3.4e9
    assert on.step_s > off.step_s


def _kept(block, args, kwargs, compile=None) -> tuple[int, int, list[tuple[int, ...]]]:
    """(bytes, largest, shapes) of what `block`'s forward keeps for backward on real tensors, weights and its own
    inputs left out: its class's forward compiled as the trainer compiles it, with `compile`'s backend."""
    weights = {ptrace._storage(p)[0] for p in block.parameters()}
    inputs = {ptrace._storage(a)[0] for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
    kept: dict[int, tuple[int, tuple[int, ...]]] = {}
    alive = []

    def pack(t):
        alive.append(t)
        sid, nbytes = ptrace._storage(t)
        if sid not in weights and sid not in inputs:
            kept[sid] = (nbytes, tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compiled.forward_of(type(block), compile)(block, *args, **kwargs)
    return sum(n for n, _ in kept.values()), max(n for n, _ in kept.values()), [s for _, s in kept.values()]


def test_compiled_chunks_keep_nothing_of_the_sub_layers_and_the_planner_counts_it():
    """Compiled, each chunk is an activation-checkpoint region that the partitioner recomputes whole: a Wan block
    with its attn2 and ffn split keeps, for backward, none of the feed-forward's 64-wide hidden, none of attn2's
    per-token tensors and none of their weights, whatever the number of chunks (but for a random generator's state per
    chunk). The planner's count
    (compiled_saves.py `chunk_saving`, on the meta device) is what the real block keeps, run on the CPU with the
    trainer's compiled forward and `split_mlps`, and `chunk_mlps` turns it into the block's recompute: what the split
    compiled block keeps (the recompute runs the compiled forward), plus one chunk's hidden and the sub-layers' other
    tensors (the chunk being recomputed in backward). Until 2026-11-28 it was the eager block's saved bytes less what
    the split stops keeping, which left in what the compiled block never keeps outside the chunks (1.86 GB per
    HunyuanVideo 1.5 block at 720p x 121)."""
    from trainer.planner import compiled_saves as pcompiled

    opts = CompileOptions(backend=pcompiled.BACKEND, shapes=4)
    m = _wan_lora()
    x = dict(hidden_states=torch.randn(1, 4, 3, 8, 8), encoder_hidden_states=torch.randn(1, 8, 32),
             timestep=torch.ones(1))
    blocks = list(m.blocks)
    tr = ptrace.trace_forward(m, blocks, x, kernels="cpu", mlps=[WAN.token_wise_of(b) for b in blocks])
    i, args, kwargs = tr.last_calls[type(blocks[0]).__name__]
    blk = blocks[i]
    whole = _kept(blk, args, kwargs, opts)
    kept = {}
    for n in (2, 4):
        split_mlps(blk, n, WAN.token_wise_of(blk))
        kept[n] = _kept(blk, args, kwargs, opts)
        for mod in WAN.token_wise_of(blk):
            mod.__class__ = mod._plain_class
        compiled.reset()
    # the forward keeps nothing of any chunk but, where a chunk runs a random op (attention), the generator state
    # the partitioner saves to replay it (the CPU's is 5,056 bytes; CUDA's 16)
    assert kept[4][0] - kept[2][0] == 2 * torch.get_rng_state().numel() and kept[2][1] == kept[4][1]
    assert not any(64 in s for s in kept[2][2]) and any(64 in s for s in whole[2])  # the ffn's hidden
    assert whole[0] - kept[2][0] > tr.block_mlp_saved[i]  # more than the eager count's hidden goes
    meta = _wan(device="meta")
    from peft import LoraConfig

    meta.requires_grad_(False)
    meta.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=list(WAN.default_lora_targets)))
    xm = {k: v.to("meta") for k, v in x.items()}
    mblocks = list(meta.blocks)
    mtr = ptrace.trace_forward(meta, mblocks, xm, kernels="cpu", mlps=[WAN.token_wise_of(b) for b in mblocks])
    counted = pcompiled.chunk_saving(meta, mblocks, mtr, WAN.token_wise_of, kernels="cpu")
    assert counted[i] == (kept[2][0], kept[2][1])
    planned = ptrace.chunk_mlps(tr, 4, counted)
    m_, o = tr.block_mlp_saved[i], tr.block_mlp_other[i]
    assert planned.block_saved[i] == kept[2][0] + -(-m_ // 4) + o
    assert planned.block_largest[i] == max(kept[2][1], -(-tr.block_mlp_largest[i] // 4))


def _get_device_of_torch_2_11(args, kwargs):
    """torch 2.11's `torch._prims.rng_prims.get_device` (the GPU hosts' torch, bench/history: 2.11.0+cu130), copied:
    it names cuda, xpu, hpu or cpu tensors' device and None for any other, meta included (2.13's names meta)."""
    if kwargs.get("device"):
        device = kwargs.get("device")
        return torch.device(device).type if isinstance(device, str) else device.type
    devices = {a.device.type for a in args if isinstance(a, torch.Tensor)}
    return next((d for d in ("cuda", "xpu", "hpu", "cpu") if d in devices), None)


def test_the_compiled_chunk_count_holds_where_torch_names_no_device_for_meta(monkeypatch):
    """The planner counts what a compiled block stops saving with its sub-layers in chunks by compiling the split
    block on meta (compiled_saves.py `chunk_saving`); a chunk's attention is a random op, which the partitioner wraps
    in `run_and_save_rng_state`, whose device `_rng_state_on_meta` turns from meta to the CPU's. torch 2.11's
    `get_device` says None for meta tensors, not "meta": the count raised `AssertionError: Backend not supported for
    None` there, `Facts.trace` fell back to the eager count, and the trainer's phase line on the GPU host said
    31.52 GB for Wan 2.2 A14B at 720p x 81 with 16 chunks where the compiled count is 27.34 (bench/history/
    2026-11-28.md 07:43). With 2.11's `get_device` the count is the same as with this torch's, GPU kernels (flash
    attention) as the trainer's planner counts them."""
    from peft import LoraConfig
    from torch._prims import rng_prims

    from trainer.planner import compiled_saves as pcompiled

    meta = _wan(device="meta")
    meta.requires_grad_(False)
    meta.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=list(WAN.default_lora_targets)))
    x = dict(hidden_states=torch.randn(1, 4, 3, 8, 8, device="meta"),
             encoder_hidden_states=torch.randn(1, 8, 32, device="meta"), timestep=torch.ones(1, device="meta"))
    blocks = list(meta.blocks)
    tr = ptrace.trace_forward(meta, blocks, x, kernels="cuda", mlps=[WAN.token_wise_of(b) for b in blocks])
    pcompiled._CACHE.clear()
    here = pcompiled.chunk_saving(meta, blocks, tr, WAN.token_wise_of)
    pcompiled._CACHE.clear()
    monkeypatch.setattr(rng_prims, "get_device", _get_device_of_torch_2_11)
    assert _get_device_of_torch_2_11((x["hidden_states"],), {}) is None
    try:
        on_2_11 = pcompiled.chunk_saving(meta, blocks, tr, WAN.token_wise_of)
    finally:
        pcompiled._CACHE.clear()
    assert rng_prims.get_device is _get_device_of_torch_2_11  # restored after the count
    assert on_2_11 == here and all(saving > 0 for saving, _ in here)
