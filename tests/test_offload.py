"""The conductor on the CPU: the same packing, ring views, plan replay, release points and activation
hooks as on the GPU (copies are synchronous there, so a wrong release point corrupts results at once)."""

import pytest
import torch
from _offload_util import (
    add_lora,
    all_state,
    batch,
    blocks_of,
    fused_adamw,
    tiny_flux,
    train_steps,
    trainable_state,
)

from trainer.offload import attach_offload
from trainer.offload.allocators import ALIGN, BlockPacking, BumpArena, HostArena, Ring, align
from trainer.offload.block import StreamedBlock

STEPS = 3


@pytest.fixture(scope="module")
def lora_reference():
    m = add_lora(tiny_flux(0))
    losses = train_steps(m, STEPS)
    return losses, trainable_state(m)


def _step(m, opt, kw: dict, target: torch.Tensor) -> torch.Tensor:
    """One optimizer step of `m` on (kw, target); the loss, detached."""
    loss = torch.nn.functional.mse_loss(m(**kw)[0], target)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 1.0])
def test_lora_offloaded_training_is_bitwise_resident(lora_reference, fraction):
    m = add_lora(tiny_flux(0))
    h = attach_offload(blocks_of(m), "cpu", fraction)
    losses = train_steps(m, STEPS)
    assert torch.equal(losses, lora_reference[0])
    assert _same(trainable_state(m), lora_reference[1])
    st = h.stats()
    if fraction > 0:
        assert st["ring_bytes"] < st["block_bytes"]
        assert h.plan.streamed  # something really moved
    h.close()
    # close restores plain CPU modules that still compute the same thing
    assert all(p.device.type == "cpu" and p.numel() > 0 for p in m.parameters())


@pytest.mark.parametrize("ring", [3])  # (4 of the tiny model's largest block hold all six)
def test_a_deeper_ring_streams_less_and_trains_the_same(lora_reference, ring):
    """`min_ring_blocks` (issue 29's deeper prefetch): at fraction 1.0 the ring holds that many of the largest
    block, keeps more of them across the turn (fewer bytes a step) and the training is still bitwise."""
    runs = {}
    for n in (2, ring):
        m = add_lora(tiny_flux(0))
        h = attach_offload(blocks_of(m), "cpu", 1.0, min_ring_blocks=n)
        losses = train_steps(m, STEPS)
        assert torch.equal(losses, lora_reference[0]) and _same(trainable_state(m), lora_reference[1])
        runs[n] = h.stats()
        h.close()
    assert runs[ring]["ring_bytes"] > runs[2]["ring_bytes"]
    assert 0 < runs[ring]["h2d_bytes_per_step"] < runs[2]["h2d_bytes_per_step"]


def test_race_detector_leaves_results_unchanged(lora_reference):
    m = add_lora(tiny_flux(0))
    attach_offload(blocks_of(m), "cpu", 0.5, race_detector=True)
    assert torch.equal(train_steps(m, STEPS), lora_reference[0])


def test_release_after_recompute_is_caught():
    """Negative control: releasing after the recompute (OneTrainer #1306) must poison the run."""
    m = add_lora(tiny_flux(0))
    attach_offload(blocks_of(m), "cpu", 0.5, race_detector=True, _release_at_recompute=True)
    losses = train_steps(m, STEPS)
    assert not torch.isfinite(losses).all()


def test_activation_offloading_gives_equal_gradients():
    def grads(activations):
        m = add_lora(tiny_flux(0))
        h = attach_offload(blocks_of(m), "cpu", 0.5, activations=activations, activation_min_bytes=0)
        kw, target = batch(3)
        torch.nn.functional.mse_loss(m(**kw)[0], target).backward()
        g = {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}
        return g, h._c

    g0, _ = grads(False)
    g1, c = grads(True)
    assert _same(g0, g1)
    # the checkpoint inputs of every block after the first (the first block's input needs no grad) went out
    assert c.activations.offloaded_bytes > 0 and len(c.activations._by_block) == len(c.blocks) - 1


def test_the_inputs_kept_on_the_device_are_the_last_recomputed_blocks_and_stay_there_bitwise():
    """offload/plan.py `inputs_on_device`: the last n blocks recomputed in backward (not the ones that keep their
    activations); with `inputs_on_device` the offloader leaves their checkpoint inputs on the device (their storages
    live on after the forward, as without offloading), the others go to the host, and the gradients are bitwise
    those of offloading every block."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from trainer.offload.plan import inputs_on_device

    assert inputs_on_device([True] * 5, 2) == {3, 4} and inputs_on_device([True] * 5, 0) == set()
    assert inputs_on_device([True, True, True, False, True, False], 2) == {2, 4}
    assert inputs_on_device([False, True], 2) == {1}

    def grads(keep):
        m = add_lora(tiny_flux(0))
        blocks = blocks_of(m)
        h = attach_offload(blocks, "cpu", 0.5, activations=True, activation_min_bytes=0, inputs_on_device=keep)
        storages = []
        for b in blocks:
            b.register_forward_pre_hook(
                lambda mod, args, kwargs: storages.append(StorageWeakRef(kwargs["hidden_states"].untyped_storage())),
                with_kwargs=True)
        kw, target = batch(3)
        loss = torch.nn.functional.mse_loss(m(**kw)[0], target)
        alive = [not s.expired() for s in storages]
        went = sorted(h._c.activations._by_block)
        loss.backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}, alive, went, len(blocks)

    g0, alive0, went0, n = grads(0)
    g2, alive2, went2, _ = grads(2)
    assert _same(g0, g2)
    assert went0 == list(range(1, n)) and went2 == list(range(1, n - 2))
    assert alive0 == [True] + [False] * (n - 1) and alive2 == [True] + [False] * (n - 3) + [True, True]


def test_released_activation_buffers_hold_no_host_bytes_and_the_next_steps_train_bitwise():
    """`release_activations` between steps (the trainer's, before sampling and a checkpoint save) gives every
    activation buffer back (0 host bytes); the next step takes one buffer of the most bytes a pass has used, and
    the losses and LoRA are bitwise those of a run that never released."""

    def run(release):
        m = add_lora(tiny_flux(0))
        h = attach_offload(blocks_of(m), "cpu", 0.5, activations=True, activation_min_bytes=0)
        arena = h._c.activations.arena
        params = [p for p in m.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2)
        losses, held = [], []
        for s in range(4):
            losses.append(_step(m, opt, *batch(100 + s)))
            held.append((len(arena.chunks), sum(c.nbytes for c in arena.chunks)))
            if release and s % 2 == 0:
                h.release_activations()
                assert arena.chunks == [] and h._c.activations.pinned_bytes == 0
        return torch.stack(losses), trainable_state(m), held, arena.high_water, arena.chunk

    l0, w0, held0, high, chunk = run(False)
    l1, w1, held1, _, _ = run(True)
    assert torch.equal(l0, l1) and _same(w0, w1)
    # the first step grew one chunk (this tiny model's inputs fit it); after a release, one buffer of exactly them
    assert 0 < high < chunk and held0 == [(1, chunk)] * 4 and held1 == [(1, chunk)] + [(1, high)] * 3


def test_a_no_grad_forward_after_release_takes_no_activation_buffer_and_the_next_step_trains_bitwise():
    """Sampling during training: the trainer gives the activation buffers back, then denoises with no-grad forwards
    through the same handle. Each such forward starts a step of the offloader (`new_step`) but offloads nothing, so
    it takes no buffer (it took back the whole high-water buffer, and held it through the sampling pass: 28.6 GB of
    Wan 2.2 A14B's at 720p x 81, bench/history/2026-11-28.md 04:24); the next training step takes one buffer of the
    high water at its first offloaded input, and the losses and LoRA are bitwise a run that never sampled."""

    def run(sample):
        m = add_lora(tiny_flux(0))
        h = attach_offload(blocks_of(m), "cpu", 0.5, activations=True, activation_min_bytes=0)
        arena = h._c.activations.arena
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        losses, took, held = [], [], []
        for s in range(4):
            losses.append(_step(m, opt, *batch(100 + s)))
            took.append([c.nbytes for c in arena.chunks])
            if sample:
                h.release_activations()
                with torch.no_grad():
                    for k in range(3):  # a few denoising steps
                        m(**batch(200 + k)[0])
                        held.append(sum(c.nbytes for c in arena.chunks))
        return torch.stack(losses), trainable_state(m), took, held, arena.high_water, arena.chunk

    l0, w0, took0, _, high, chunk = run(False)
    l1, w1, took1, held, _, _ = run(True)
    assert torch.equal(l0, l1) and _same(w0, w1)
    assert held == [0] * 12  # no activation buffer through any sampling pass
    # the first step grew one chunk; after each sampling pass, the step took one buffer of exactly the high water
    assert 0 < high < chunk and took0 == [[chunk]] * 4 and took1 == [[chunk]] + [[high]] * 3


@pytest.mark.parametrize("activations", [False, True])
def test_activation_offloading_frees_the_block_inputs_after_forward(activations):
    """After the forward, a block's input storage lives on only while its checkpoint needs it: every one without
    activation offloading, only the first block's (it needs no grad, so it is not offloaded) with it. Diffusers
    passes the inputs as keyword arguments; a recompute closure holding them would keep them all on the GPU
    whatever the offloader copied out (it did, before 2026-11-22 02:49 UTC)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    m = add_lora(tiny_flux(0))
    attach_offload(blocks_of(m), "cpu", 0.5, activations=activations, activation_min_bytes=0)
    storages = []

    def remember(mod, args, kwargs):
        storages.append(StorageWeakRef(kwargs["hidden_states"].untyped_storage()))

    for b in blocks_of(m):
        b.register_forward_pre_hook(remember, with_kwargs=True)
    kw, target = batch(3)
    loss = torch.nn.functional.mse_loss(m(**kw)[0], target)
    alive = [not s.expired() for s in storages]
    assert alive == ([True] * len(alive) if not activations else [True] + [False] * (len(alive) - 1))
    loss.backward()


def test_full_finetune_streams_weights_and_state_back():
    ref = tiny_flux(0)  # resident = the same code path with nothing streamed
    attach_offload(blocks_of(ref), "cpu", 0.0, trainable=True)
    fused_adamw(ref)
    l0 = train_steps(ref, STEPS, fused=True)
    s0 = all_state(ref)

    m = tiny_flux(0)
    h = attach_offload(blocks_of(m), "cpu", 0.5, trainable=True, optimizer_state=("exp_avg", "exp_avg_sq"))
    fused_adamw(m, handle=h)
    l1 = train_steps(m, STEPS, fused=True)
    assert torch.equal(l0, l1)
    h.close()
    assert _same(all_state(m), s0)


def test_sampling_mode_matches_resident():
    ref = tiny_flux(1)
    with torch.no_grad():
        o0 = [ref(**batch(5 + i)[0])[0] for i in range(3)]
    m = tiny_flux(1)
    h = attach_offload(blocks_of(m), "cpu", 0.5, mode="sample")
    with torch.no_grad():
        o1 = [m(**batch(5 + i)[0])[0] for i in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(o0, o1, strict=True))
    assert h.plan.mode == "sample"


def test_no_grad_forward_inside_training_is_absorbed(lora_reference):
    """A validation forward between steps skips the backward positions; the ring must recover."""
    m = add_lora(tiny_flux(0))
    attach_offload(blocks_of(m), "cpu", 0.5)
    with torch.no_grad():
        m(**batch(9)[0])
    assert torch.equal(train_steps(m, STEPS), lora_reference[0])


def test_nano_batching_is_exact(lora_reference):
    m = add_lora(tiny_flux(0))
    attach_offload(blocks_of(m), "cpu", 0.0, nano_batches=2)
    losses = train_steps(m, STEPS)
    torch.testing.assert_close(losses, lora_reference[0], rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------- allocators


def test_packing_is_aligned_and_round_trips():
    m = tiny_flux(2)
    blk = m.transformer_blocks[0]
    pk = BlockPacking.of(blk, include_trainable=True)
    assert all(e.offset % ALIGN == 0 for e in pk.entries)
    assert pk.nbytes % ALIGN == 0
    raw = sum(p.numel() * p.element_size() for p in blk.parameters())
    assert raw <= pk.nbytes <= raw + ALIGN * (len(pk.entries) + 1)
    before = {n: p.detach().clone() for n, p in blk.named_parameters()}
    buf = torch.empty(pk.nbytes, dtype=torch.uint8)
    pk.write_into(buf)
    pk.point_at(pk.views(buf))
    assert all(torch.equal(before[n], p) for n, p in blk.named_parameters())
    assert all(p.data_ptr() >= buf.data_ptr() for p in blk.parameters())


def test_ring_copies_do_not_bump_saved_versions():
    ring = Ring(1024, torch.device("cpu"))
    v = ring.views(0, 0, BlockPacking())  # empty packing: just the cache
    assert v == []
    w = ring.buf[0:16].view(torch.float32)
    before = w._version
    ring.region(0, 16).copy_(torch.ones(16, dtype=torch.uint8))
    assert w._version == before  # autograd would not see a refill as an in-place edit
    assert ring.buf[0].item() == 1


def test_host_arena_is_exact():
    a = HostArena(12345, pin=False)
    assert a.buf.numel() == 12345 and a.region(100, 5).numel() == 5


def test_bump_arena_grows_then_coalesces():
    b = BumpArena(pin=False, chunk=1024)
    x = b.alloc(1000)
    y = b.alloc(1000)  # needs a second chunk
    assert len(b.chunks) == 2 and x.numel() == 1000 and y.numel() == 1000
    b.reset()
    assert b.chunks == []  # the chunks given back; the one buffer is taken by the pass's first alloc (a no-grad
    b.alloc(1000)  # pass, which allocates nothing, takes none: test_a_no_grad_forward_after_release_...)
    assert len(b.chunks) == 1 and b.chunks[0].nbytes == 2 * align(1000)  # what was used, not the chunks' 2048
    b.alloc(1000)
    assert len(b.chunks) == 1  # steady state: no growth
    b.reset()
    assert len(b.chunks) == 1  # one buffer is kept from pass to pass
    b.alloc(1000)
    b.alloc(1000)
    b.alloc(1000)  # a larger pass grows it again, then coalesces to its size
    b.reset()
    b.alloc(1)
    assert len(b.chunks) == 1 and b.chunks[0].nbytes == 3 * align(1000)


@pytest.mark.parametrize(("block_input", "text"), [(457_113_600, 8_130_560), (198_082_560, 8_130_560)],
                         ids=["720p", "480p"])
def test_the_first_pass_holds_the_bytes_of_the_later_ones(block_input, text):
    """HunyuanVideo 1.5's offloaded checkpoint inputs at 121 frames, 1/1024 of their size (and of the chunks'): the
    text tokens of block 0, then each block's video tokens and text tokens, 51 blocks (the last two stay on the
    GPU). The pass that grows the arena holds at most one chunk more than the one exact buffer of every later pass.
    Each input that did not fit took a chunk of at least `chunk` bytes before, and a text input's chunk went unused
    past it: 37.3 GB held in the first pass at 720p against 23.7 after (55.9 against 42.3 GB of RSS on an H200,
    bench/logs/2026-11-28e/), 13.7 against 10.5 at 480p."""
    b = BumpArena(pin=False, chunk=(256 << 20) >> 10, own=(32 << 20) >> 10)
    sizes = [text >> 10] + [n >> 10 for _ in range(1, 52) for n in (block_input, text)]
    held = []
    for _ in range(3):
        b.reset()
        views = [b.alloc(n) for n in sizes]
        held.append(sum(c.nbytes for c in b.chunks))
    assert [v.numel() for v in views] == sizes
    assert b.high_water == sum(map(align, sizes)) and held[1:] == [b.high_water] * 2
    assert held[0] - b.high_water < b.chunk


def test_hunyuan_video15s_first_step_holds_the_activation_bytes_of_the_later_ones():
    """The same through the offloader's own pack path, on a tiny HunyuanVideo 1.5 transformer (6 blocks, 576
    transposed video tokens and 993 text tokens a block; its full fine-tune, so each block's `temb` goes too) with
    the arena's sizes below its inputs (64 and 8 KB): the first training step holds at most a chunk more host bytes
    for activations than the next (it held a chunk more a block: 1.60 MB against 1.21)."""
    import diffusers

    from trainer.models import adapter_class

    torch.manual_seed(0)
    m = diffusers.HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=6,
        num_refiner_layers=1, mlp_ratio=2.0, text_embed_dim=32, text_embed_2_dim=32, image_embed_dim=16,
        rope_axes_dim=(4, 6, 6), target_size=64, task_type="t2v")
    h = attach_offload(list(m.transformer_blocks), "cpu", 0.0, activations=True, activation_min_bytes=0)
    arena = h._c.activations.arena
    arena.chunk, arena.own = 64 << 10, 8 << 10
    held, went = [], []
    for s in range(2):
        torch.manual_seed(s)
        kw = adapter_class("hunyuan-video-1.5").dummy_inputs(m, 1, 128, 128, 8, torch.float32, "cpu", frames=33)
        out = m(**kw, return_dict=False)[0]
        held.append(sum(c.nbytes for c in arena.chunks))
        went.append(sorted(h._c.activations._by_block))
        out.square().mean().backward()
    h.close()
    assert went == [list(range(6))] * 2 and held[1] == arena.high_water
    assert held[0] - arena.high_water < arena.chunk


def test_blocks_are_checkpointed_once(lora_reference):
    """The handle is the blocks' only checkpoint (the trainer's own wrapper is gone); a second attach on the same
    blocks is refused rather than checkpointing twice."""
    m = add_lora(tiny_flux(0))
    blocks = blocks_of(m)
    calls = []
    for b in blocks:  # a submodule runs in forward and in every recompute
        b.attn.register_forward_pre_hook(lambda mod, args: calls.append(mod))
    h = attach_offload(blocks, "cpu", 0.5, training=True)
    with pytest.raises(ValueError, match="already attached"):
        attach_offload(blocks, "cpu", 0.0)
    losses = train_steps(m, STEPS)
    assert torch.equal(losses, lora_reference[0])
    # forward + one recompute per block per step (a double wrap would recompute twice)
    assert len(calls) == 2 * len(blocks) * STEPS
    assert all(isinstance(b, StreamedBlock) for b in blocks)
    h.close()
    assert not any(isinstance(b, StreamedBlock) for b in blocks)


@pytest.mark.parametrize("masters", [False, True])
def test_full_finetune_with_trainer_optim_fused_back_pass_equals_unfused_adamw(masters):
    """trainer/optim's FusedBackPass with its state packed in the streamed blocks (bind_fused) against a
    plain optimizer.step() after backward on a resident model: bitwise in fp32 on the CPU, and in bf16 with fp32
    master weights (optimizer.master_weights), whose masters are packed and written back with the rest."""
    from trainer.config import OptimizerConfig
    from trainer.offload.fused_state import bind_fused
    from trainer.optim import FusedBackPass, build_optimizer

    cfg = OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.1, max_grad_norm=None, master_weights=masters)
    dtype = torch.bfloat16 if masters else torch.float32

    ref = tiny_flux(0, dtype=dtype)
    attach_offload(blocks_of(ref), "cpu", 0.0, trainable=True)  # same graph, nothing streamed
    opt = build_optimizer(list(ref.parameters()), cfg)
    losses0 = []
    for s in range(STEPS):
        kw, target = batch(100 + s, dtype=dtype)
        loss = torch.nn.functional.mse_loss(ref(**kw)[0], target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses0.append(loss.detach())

    m = tiny_flux(0, dtype=dtype)
    fb = FusedBackPass(build_optimizer(list(m.parameters()), cfg))
    h = attach_offload(blocks_of(m), "cpu", 0.5, trainable=True, optimizer_state=fb.state_layout)
    bind_fused(h, fb)
    losses1 = []
    for s in range(STEPS):
        kw, target = batch(100 + s, dtype=dtype)
        loss = torch.nn.functional.mse_loss(m(**kw)[0], target)
        loss.backward()
        fb.finish_step()
        losses1.append(loss.detach())
    assert torch.equal(torch.stack(losses0), torch.stack(losses1))
    h.sync()  # state dicts now read the host arena, current after the write-back
    streamed = [p for b in h.plan.streamed for p in blocks_of(m)[b].parameters()]
    names = ["exp_avg", "master"] if masters else ["exp_avg"]
    assert streamed and all(fb.state_of(p)[k] is h.host_state_of(p)[k] for p in streamed for k in names)
    if masters:  # the streamed masters (read from the host arena) are the resident run's
        by_name = dict(zip(m.parameters(), ref.parameters(), strict=True))
        assert all(torch.equal(fb.state_of(p)["master"], opt.state_of(by_name[p])["master"]) for p in streamed)
    h.close()
    assert _same(all_state(m), all_state(ref))


def _sd3(seed):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    m = SD3Transformer2DModel(
        sample_size=32, patch_size=1, in_channels=4, num_layers=4, attention_head_dim=8, num_attention_heads=4,
        caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64, out_channels=4,
    )  # fmt: skip

    def inputs(s):
        g = torch.Generator().manual_seed(s)
        return dict(
            hidden_states=torch.randn(1, 4, 8, 8, generator=g),
            encoder_hidden_states=torch.randn(1, 6, 32, generator=g),
            pooled_projections=torch.randn(1, 64, generator=g),
            timestep=torch.tensor([500.0]),
            return_dict=False,
        ), torch.randn(1, 4, 8, 8, generator=g)

    return m, list(m.transformer_blocks), inputs


def _qwen(seed):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    m = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=4, attention_head_dim=16, num_attention_heads=4,
        joint_attention_dim=16, axes_dims_rope=(8, 4, 4),
    )  # fmt: skip

    def inputs(s):
        g = torch.Generator().manual_seed(s)
        return dict(
            hidden_states=torch.randn(1, 16, 16, generator=g),
            encoder_hidden_states=torch.randn(1, 5, 16, generator=g),
            encoder_hidden_states_mask=torch.ones(1, 5, dtype=torch.long),
            timestep=torch.tensor([0.5]),
            img_shapes=[[(1, 4, 4)]],
            return_dict=False,
        ), torch.randn(1, 16, 16, generator=g)

    return m, list(m.transformer_blocks), inputs


@pytest.mark.parametrize("family", [_sd3, _qwen])
def test_other_families_lora_offloaded_equals_resident(family):
    from peft import LoraConfig

    def run(fraction):
        m, blocks, inputs = family(0)
        m.requires_grad_(False)
        m.add_adapter(
            LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False)
        )
        h = attach_offload(blocks, "cpu", fraction, race_detector=fraction > 0)
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for s in range(3):
            losses.append(_step(m, opt, *inputs(s)))
        if fraction:
            assert h.plan.streamed
        h.close()
        return torch.stack(losses), trainable_state(m)

    l0, s0 = run(0.0)
    l1, s1 = run(0.5)
    assert torch.equal(l0, l1)
    assert _same(s0, s1)


# ---------------------------------------------------------------------------------------------- StreamedBlock


def test_nothing_assigns_forward():
    """One owner per block's forward: no code in the repo replaces a module's `forward` on an instance."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pattern = re.compile(r"\.forward\s*=[^=]|setattr\([^)]*['\"]forward['\"]")
    hits = [
        f"{p.relative_to(root)}:{n}"
        for d in ("trainer", "bench", "tests")
        for p in sorted((root / d).rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line) and "pattern = re.compile" not in line
    ]
    assert not hits, hits
    m = add_lora(tiny_flux(0))
    h = attach_offload(blocks_of(m), "cpu", 0.5, nano_batches=2)
    mods = [x for b in blocks_of(m) for x in b.modules()]
    assert not any("forward" in x.__dict__ for x in mods)
    assert any(type(x).__name__ == "NanoBatchedFeedForward" for x in mods)
    h.close()


def test_attach_keeps_names_keys_and_classes():
    """The class swap keeps module names, state-dict keys and isinstance checks; close restores the plain classes
    (nano-split MLPs included) and the values."""
    from diffusers.models.attention import FeedForward
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

    m = add_lora(tiny_flux(0))
    names = [n for n, _ in m.named_modules()]
    classes = [type(x) for x in m.modules()]
    state = {k: v.clone() for k, v in m.state_dict().items()}
    h = attach_offload(blocks_of(m), "cpu", 0.5, nano_batches=2)
    assert [n for n, _ in m.named_modules()] == names
    assert list(m.state_dict()) == list(state)
    assert all(isinstance(b, StreamedBlock) for b in blocks_of(m))
    assert all(isinstance(b, FluxTransformerBlock) for b in m.transformer_blocks)
    assert type(m.transformer_blocks[0]).__name__ == "StreamedFluxTransformerBlock"
    assert type(m.transformer_blocks[0]) is type(m.transformer_blocks[1])  # one subclass per base class
    assert all(isinstance(b.ff, FeedForward) for b in m.transformer_blocks)
    h.close()
    assert [n for n, _ in m.named_modules()] == names
    assert [type(x) for x in m.modules()] == classes
    assert _same(m.state_dict(), state)
    assert not any(hasattr(b, "_offload_conductor") for b in blocks_of(m))


def _one_step_grads(fraction):
    m = add_lora(tiny_flux(0))
    h = attach_offload(blocks_of(m), "cpu", fraction)
    assert all(isinstance(b, StreamedBlock) for b in blocks_of(m))
    kw, target = batch(7)
    loss = torch.nn.functional.mse_loss(m(**kw)[0], target)
    seen, todo, identities = set(), [loss.grad_fn], 0
    while todo:  # the release identities in the graph: one per block whose inputs carry grad
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        identities += type(fn).__name__ == "_CallInBackwardBackward"
        todo.extend(f for f, _ in fn.next_functions)
    loss.backward()
    g = {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}
    return loss.detach(), g, h, identities


def test_fraction_zero_runs_the_same_block_and_bits_as_streaming():
    """Fraction 0 runs StreamedBlock too (checkpoint and the release identity, nothing streams): the loss and
    every gradient equal those of fraction 0.5 bit for bit."""
    l0, g0, h0, n0 = _one_step_grads(0.0)
    l1, g1, h1, n1 = _one_step_grads(0.5)
    assert h0.plan is None and h1.plan.streamed
    assert n0 == n1 == len(h0._c.blocks) - 1  # the first block's inputs carry no grad
    assert torch.equal(l0, l1)
    assert _same(g0, g1)


def test_set_mode_rebinds_the_blocks(lora_reference):
    """set_mode builds a new conductor; the blocks must call the new one (sampling, then training again)."""
    ref = add_lora(tiny_flux(0))
    with torch.no_grad():
        want = ref(**batch(9)[0])[0]
    m = add_lora(tiny_flux(0))
    h = attach_offload(blocks_of(m), "cpu", 0.5)
    h.set_mode("sample")
    assert all(b._offload_conductor is h._c for b in blocks_of(m)) and h.plan.mode == "sample"
    with torch.no_grad():
        assert torch.equal(m(**batch(9)[0])[0], want)
    h.set_mode("train")
    assert all(b._offload_conductor is h._c for b in blocks_of(m)) and h.plan.mode == "train"
    assert torch.equal(train_steps(m, STEPS), lora_reference[0])
    h.close()


def test_close_without_keeping_weights_leaves_meta_tensors_and_frees_the_arena():
    """The CLI's fit drops the model at the end: close(keep_weights=False) must not copy every streamed block out
    of the arena (a second copy of the model in RAM), and nothing may point into the freed arena afterwards."""
    m = add_lora(tiny_flux(0))
    blocks = blocks_of(m)
    h = attach_offload(blocks, "cpu", 1.0)
    train_steps(m, 1)
    streamed = [b for b in range(len(blocks)) if b in h._c.host_off]
    assert streamed
    h.close(keep_weights=False)
    for b in streamed:
        frozen = [p for p in blocks[b].parameters() if not p.requires_grad]
        assert frozen and all(p.device.type == "meta" for p in frozen)
        assert all(p.device.type == "cpu" for p in blocks[b].parameters() if p.requires_grad)  # LoRA kept
    assert not any(isinstance(b, StreamedBlock) for b in blocks)


@pytest.mark.parametrize("mode", ["sample", "train"])
def test_originals_leave_ram_as_the_arena_fills_and_before_it_is_pinned(monkeypatch, mode):
    """Host RAM (issue 14): a model loaded whole into RAM (text encoders, the whole-file path) must not hold its
    whole CPU copy beside a pinned arena. The arena is a fresh pageable buffer (RAM only as written), the blocks
    that never stream leave RAM before it is made, each streamed block's original goes as it is packed, and the
    arena is page-locked only after that. Same outputs as without offloading."""
    import trainer.offload.conductor as conductor

    ref = tiny_flux(1)
    with torch.no_grad():
        want = ref(**batch(5)[0])[0]
    m = tiny_flux(1).requires_grad_(False)  # the conductor packs frozen weights
    blocks = blocks_of(m)
    whole = sum(p.numel() * p.element_size() for b in blocks for p in b.parameters())
    held = lambda: sum(p.numel() * p.element_size() for b in blocks for p in b.parameters())  # noqa: E731
    seen = {}

    class Spy(conductor.HostArena):
        def __init__(self, *a, **kw):
            seen["at_alloc"] = held()
            super().__init__(*a, **kw)

        def pin(self):
            seen.setdefault("at_pin", held())
            super().pin()

    monkeypatch.setattr(conductor, "HostArena", Spy)
    h = attach_offload(blocks, "cpu", 0.5, mode=mode, checkpointing=True)
    c = h._c
    never_streamed = sum(c.packs[b].nbytes for b in range(len(blocks)) if b not in c.host_off)
    assert seen["at_alloc"] <= whole - never_streamed
    assert seen["at_pin"] == 0
    if mode == "sample":
        with torch.no_grad():
            assert torch.equal(m(**batch(5)[0])[0], want)


def test_shared_arena_owner_and_reader_see_one_file_and_train_like_a_private_arena(tmp_path, monkeypatch):
    """One process plays both roles of a host's processes (issue 20): the owner creates and fills the arena file,
    a second conductor maps it without writing; both train like a private arena, and the name is gone after."""
    from trainer.offload.allocators import SharedArena

    calls = []
    ref = add_lora(tiny_flux(0))
    h = attach_offload(blocks_of(ref), "cpu", 0.5)
    want = train_steps(ref, 2)
    h.close()

    path = tmp_path / "dittrain-arena-test"
    m1, m2 = add_lora(tiny_flux(0)), add_lora(tiny_flux(0))
    owner = attach_offload(blocks_of(m1), "cpu", 0.5, share=SharedArena(path, True, lambda: calls.append(1)))
    assert not path.exists() and owner.stats()["arena_shared"] and len(calls) == 3  # unlinked after 3 barriers
    # the reader maps the same name: recreate it from the owner's bytes (in a real job it exists until barrier 3)
    path.write_bytes(owner._c.arena.buf.numpy().tobytes())
    monkeypatch.setattr(SharedArena, "unlink", lambda self: None)
    reader = attach_offload(blocks_of(m2), "cpu", 0.5, share=SharedArena(path, False, lambda: None))
    assert reader.stats()["arena_shared"]
    assert torch.equal(train_steps(m1, 2), want) and torch.equal(train_steps(m2, 2), want)
    owner.close(), reader.close()


def test_shared_arena_parts_are_runs_of_blocks_of_about_equal_bytes():
    from trainer.offload.allocators import SharedArena

    sizes = [10, 10, 40, 10, 10, 10, 10]
    blocks = [0, 1, 2, 3, 4, 5, 6]
    parts = [SharedArena(None, r == 0, lambda: None, part=(r, 3)).mine(blocks, sizes) for r in range(3)]
    assert parts == [{0, 1}, {2, 3}, {4, 5, 6}]  # by where each block's middle byte falls: 0-33, 33-67, 67-100
    assert [SharedArena(None, r == 0, lambda: None, part=(r, 2)).mine([2, 5], sizes) for r in range(2)] == [{2}, {5}]
    assert SharedArena(None, True, lambda: None).mine(blocks, sizes) == set(blocks)  # no parts: the owner fills all
    assert SharedArena(None, False, lambda: None).mine(blocks, sizes) == set()


def _fill_part_worker(rank: int, world: int, store: str, result: str) -> dict:
    import hashlib
    from pathlib import Path

    import torch.distributed as tdist

    from trainer.offload.allocators import SharedArena

    def digest(h):  # every streamed tensor's bytes in the arena (the alignment gaps are never written)
        c, d = h._c, hashlib.sha256()
        for b in c.plan.streamed:
            for v in c.packs[b].views(c.arena.region(c.host_off[b], c.packs[b].nbytes)):
                d.update(v.contiguous().view(torch.uint8).numpy().tobytes())
        return d.hexdigest()

    ref = attach_offload(blocks_of(add_lora(tiny_flux(0))), "cpu", 1.0)  # one process's private arena
    want = digest(ref)
    ref.close()
    filled = []

    def fill(block, entries, views):  # what stream_load's fill does, from the blocks' own tensors
        filled.append(block)
        for e, v in zip(entries, views, strict=True):
            v.copy_(e.tensor())

    path = Path(store).with_name("dittrain-arena-test")
    m = add_lora(tiny_flux(0))
    h = attach_offload(blocks_of(m), "cpu", 1.0, fill=fill,
                       share=SharedArena(path, rank == 0, tdist.barrier, part=(rank, world)))
    tdist.barrier()  # the owner unlinks the name after the last barrier of the fill: look once it has run
    out = {"shared": h.stats()["arena_shared"], "filled": filled, "streamed": list(h._c.plan.streamed),
           "same": digest(h) == want, "unlinked": not path.exists(), "loss": train_steps(m, 1).tolist()}
    h.close()
    return out


def test_each_process_fills_its_part_of_the_shared_arena_and_the_bytes_are_one_processs(tmp_path):
    """Issue 40: the owner filled the whole /dev/shm arena while the host's other processes waited (the 4-GPU
    load). Now each process writes its own run of blocks, at the same time; the arena every process maps holds
    exactly the bytes of one process's private arena, and trains like it."""
    from _offload_util import run_ranks

    rs = run_ranks(_fill_part_worker, 2, tmp_path)
    for r in rs:
        assert r["error"] is None, r["error"]
    for r in rs:
        assert r["shared"] and r["same"] and r["unlinked"] and r["filled"]
    filled = [set(r["filled"]) for r in rs]
    assert not filled[0] & filled[1] and filled[0] | filled[1] == set(rs[0]["streamed"])
    assert sorted(rs[0]["filled"] + rs[1]["filled"]) == sorted(rs[0]["streamed"])  # each block read once
    assert rs[0]["loss"] == rs[1]["loss"]


def test_shared_arena_falls_back_to_a_private_one_when_dev_shm_is_too_small(tmp_path, monkeypatch):
    from trainer.offload.allocators import SharedArena

    monkeypatch.setattr(SharedArena, "fits", lambda self, n: "/dev/shm has 0.1 GB free (containers: --shm-size)")
    m = add_lora(tiny_flux(0))
    h = attach_offload(blocks_of(m), "cpu", 0.5, share=SharedArena(tmp_path / "a", True, lambda: None))
    assert not h.stats()["arena_shared"] and "keeps its own arena" in h.pinning_note
    assert not (tmp_path / "a").exists()
    h.close()


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_parked_on_disk_holds_no_host_bytes_and_unparks_bitwise(fraction):
    """`park(disk=True)` (trainer/train/experts.py's offload.park: disk): the arena freed and every block tensor
    hollow (NaN over one scalar: no bytes), no parking buffer; `unpark` reads every block again through `fill` (here
    from a copy of the model's tensors, as the loader reads the files) and the training is bitwise one parked in RAM
    (which keeps every block's bytes on the host); a close while parked on disk gives back the weights."""
    import torch.nn.functional as F

    def run(disk: bool):
        m = add_lora(tiny_flux(0))
        blocks = blocks_of(m)
        source = {(id(mod), n): t.detach().clone() for b in blocks for mod in b.modules()
                  for n, t in [*mod._parameters.items(), *mod._buffers.items()] if t is not None}
        frozen = {n: t.detach().clone() for n, t in m.named_parameters() if not t.requires_grad}
        reads = []

        def fill(block, entries, views):  # what TransformerLoader.fill does from the files
            reads.append(block)
            for e, v in zip(entries, views, strict=True):
                v.copy_(source[(id(e.module), e.name)])

        h = attach_offload(blocks, "cpu", fraction, parkable=True, fill=fill)
        params = [p for p in m.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2)
        losses, idle = [], []
        for s in range(STEPS):
            kw, target = batch(100 + s)
            loss = F.mse_loss(m(**kw)[0].float(), target.float())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            reads.clear()
            h.park(disk=disk)  # as at a change of expert
            st = h.stats()
            idle.append(st["host_bytes"])
            assert h.parked and st["parked_on"] == ("disk" if disk else "ram")
            if disk:
                assert all(torch.isnan(p).all() for b in blocks for p in b.parameters() if not p.requires_grad)
            h.unpark()
            assert sorted(set(reads)) == (list(range(len(blocks))) if disk else [])  # every block read back
            assert h.stats()["host_bytes"] == (st["offloaded_bytes"] if disk else st["block_bytes"])
        h.park(disk=disk)
        h.close()
        back = {n: t for n, t in m.named_parameters() if not t.requires_grad}
        assert _same(back, frozen)
        return torch.stack(losses), trainable_state(m), idle

    ram, disk = run(False), run(True)
    assert torch.equal(ram[0], disk[0]) and _same(ram[1], disk[1])
    assert all(n == 0 for n in disk[2]) and all(n > 0 for n in ram[2])


def test_activation_offloading_takes_block_inputs_laid_out_in_another_dimension_order():
    """A residual stream whose tokens are transposed in memory (a patch embedding's `flatten(2).transpose(1, 2)`:
    HunyuanVideo 1.5's) goes to the host like a contiguous one and comes back with its own strides: the inputs' GPU
    storages are freed after forward and the gradients are bitwise those without offloading. Before 2026-11-28 such
    inputs stayed on the device (out of memory on the GPU at 480p x 121 frames)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from trainer.offload.activations import memory_order

    t = torch.zeros(2, 6, 4).transpose(1, 2)
    assert memory_order(t) == [0, 2, 1] and memory_order(torch.zeros(2, 6, 4)[:, 2:]) == [0, 1, 2]

    def run(activations):
        m = add_lora(tiny_flux(0))
        blocks = blocks_of(m)
        h = attach_offload(blocks, "cpu", 0.5, activations=activations, activation_min_bytes=0)
        storages = []

        def transposed(mod, args, kwargs):
            x = kwargs["hidden_states"]
            y = x.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, (B, D, S) in memory
            storages.append(StorageWeakRef(y.untyped_storage()))
            return args, {**kwargs, "hidden_states": y}

        for b in blocks:
            b.register_forward_pre_hook(transposed, with_kwargs=True)
        kw, target = batch(3)
        loss = torch.nn.functional.mse_loss(m(**kw)[0], target)
        alive = [not s.expired() for s in storages]
        went = sorted(h._c.activations._by_block) if activations else []
        loss.backward()
        if activations:  # one such tensor through the offloader's own pack and unpack: the same values and strides
            y = torch.randn(2, 5, 3, requires_grad=True).transpose(1, 2)
            gaps = torch.randn(2, 6, 3, requires_grad=True)[:, 2:]  # a slice of a batch: not one dense block
            with h._c.activations.hooks(1):
                back = h._c.activations._unpack(h._c.activations._pack(y))
                dense = h._c.activations._unpack(h._c.activations._pack(gaps))
            assert back.stride() == y.stride() and torch.equal(back, y)
            assert dense.is_contiguous() and torch.equal(dense, gaps)
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}, alive, went, len(blocks)

    g0, alive0, _, n = run(False)
    g1, alive1, went1, _ = run(True)
    assert _same(g0, g1)
    assert alive0 == [True] * n and alive1 == [True] + [False] * (n - 1)
    assert went1 == list(range(1, n))


def test_hold_keeps_more_blocks_between_passes_and_gives_them_back():
    """`hold(f)` between sampling passes: beyond the ring, the streamed blocks `f` would keep are held on the
    device (copied once), each pass then copies what the held plan's step loads (that many bytes fewer a step)
    and gives the outputs of the resident model; `hold(None)` returns to the constructor's plan, again and again
    (a captioner's prefill and decode, trainer/captioning/vlm.py)."""
    from trainer.offload.conductor import Conductor

    phases = [(None, 2), (0.25, 3), (None, 3), (0.25, 2)]
    ref = tiny_flux(1, singles=6)
    with torch.no_grad():
        want = [ref(**batch(5 + i)[0])[0] for i in range(sum(n for _, n in phases))]
    m = tiny_flux(1, singles=6).requires_grad_(False)  # frozen: packed and streamed
    h = attach_offload(blocks_of(m), "cpu", 0.75, mode="sample")
    base = h.plan
    copied = [0]
    load = Conductor._load

    def spy(self, dst, src):
        copied[0] += dst.numel()
        return load(self, dst, src)

    got = []
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(Conductor, "_load", spy)
        for f, passes in phases:
            copied[0] = 0
            assert h.hold(f)
            held = h.stats()["held_bytes"]
            assert (held > 0) == (f is not None) and copied[0] >= held  # the held blocks are copied once
            plan = h.plan
            assert (plan is base) == (f is None) and plan.bytes_per_step() == base.bytes_per_step() - held
            for k in range(passes):
                copied[0] = 0
                got.append(m(**batch(5 + len(got))[0])[0])
                assert copied[0] == sum(plan.sizes[ld.block] for ld in plan.step_loads(k))
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    h.close()


def test_the_activation_buffer_taken_again_after_release_is_timed_and_the_step_says_so(monkeypatch):
    """The pass after `release` (a sampling pass, a checkpoint save) page-locks one buffer of the high-water bytes
    again: seconds for tens of GB on a GPU host. The arena records (bytes, seconds); the trainer's step line says
    it where it took a second or more, so the slow step after sampling is explained in the log."""
    from types import SimpleNamespace

    from trainer.offload.allocators import BumpArena
    from trainer.train.trainer import Trainer

    a = BumpArena(pin=False, chunk=1 << 20, own=1 << 19)
    a.reset()
    a.alloc(3 << 19)  # growth: a buffer of its own
    assert a.retaken is None
    a.release()
    a.reset()
    a.alloc(100)
    nbytes, seconds, released = a.retaken
    assert nbytes == a.high_water >= 3 << 19 and seconds >= 0 and released
    a.alloc(2 << 20)  # growth again: a second buffer
    a.reset()  # several buffers: the next pass takes one of the high-water bytes, not after a release
    a.alloc(100)
    assert a.retaken[0] == a.high_water and not a.retaken[2]

    said = []
    handle = SimpleNamespace(activations_retaken=lambda: (24.6e9, 9.3, True))
    fake = SimpleNamespace(offload=handle, step=251, dist=SimpleNamespace(is_main=True))
    monkeypatch.setattr("trainer.train.trainer.say", said.append)
    Trainer._say_activations_retaken(fake, 10.1)
    handle.activations_retaken = lambda: (24.6e9, 0.2, True)  # under a second: nothing to explain
    Trainer._say_activations_retaken(fake, 0.9)
    assert said == ["offload: step 251 page-locked its 24.6 GB activation buffer in 9.3 s of its 10.1 s (it is "
                    "given back before sampling and checkpoint saves, so that their host RAM peak is without it)"]
