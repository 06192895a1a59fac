"""Shared by the offload tests (CPU and GPU): a small Flux transformer, LoRA, and a few training steps."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROPE = {16: [4, 4, 8], 64: [16, 24, 24], 128: [16, 56, 56]}


def tiny_flux(
    seed: int, layers: int = 2, singles: int = 4, dtype=torch.float32, device="cpu", dim_head=16, heads=2
):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    with torch.device(device):
        m = FluxTransformer2DModel(
            patch_size=1,
            in_channels=4,
            num_layers=layers,
            num_single_layers=singles,
            attention_head_dim=dim_head,
            num_attention_heads=heads,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            axes_dims_rope=ROPE[dim_head],
            guidance_embeds=False,
        )
    return m if dtype == torch.float32 else m.to(dtype)


def add_lora(model, rank: int = 4):
    from peft import LoraConfig

    model.requires_grad_(False)
    model.add_adapter(
        LoraConfig(
            r=rank,
            lora_alpha=rank,
            target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_mlp"],
            init_lora_weights=False,
        )
    )
    return model


def blocks_of(model):
    return list(model.transformer_blocks) + list(model.single_transformer_blocks)


def flux_modulation() -> str:
    """The Flux adapter's `modulation_linears`: the pattern trainer.quant keeps in the model dtype in tiny_flux's
    blocks (unless `modulation`)."""
    from trainer.models import adapter_class

    return adapter_class("flux").modulation_linears


def batch(seed: int, device="cpu", dtype=torch.float32, side=8, text=8, channels=4, joint=32, pooled=32):
    g = torch.Generator().manual_seed(seed)
    n = side * side

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    ids = torch.zeros(n, 3)
    ids[:, 1] = torch.arange(n) // side
    ids[:, 2] = torch.arange(n) % side
    return dict(
        hidden_states=r(1, n, channels),
        encoder_hidden_states=r(1, text, joint),
        pooled_projections=r(1, pooled),
        timestep=torch.rand(1, generator=g).to(device=device, dtype=dtype),
        img_ids=ids.to(device),
        txt_ids=torch.zeros(text, 3, device=device),
        return_dict=False,
    ), r(1, n, channels)


def train_steps(
    model, steps: int, lr: float = 1e-2, device="cpu", dtype=torch.float32, fused=None, side=8, text=8
):
    """Plain AdamW over the trainable params (or `fused(model)` for in-backward steps); returns losses."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr) if fused is None else None
    losses = []
    for s in range(steps):
        kw, target = batch(100 + s, device=device, dtype=dtype, side=side, text=text)
        out = model(**kw)[0]
        loss = F.mse_loss(out.float(), target.float())
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float().cpu())
    return torch.stack(losses)


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def all_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def fused_adamw(model, handle=None, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
    """A minimal fused back pass (AdamW in post-accumulate-grad hooks) for the offload tests; state of
    streamed parameters comes from `handle.state_of(p)` (packed with the block), the rest from a dict."""
    import math

    b1, b2 = betas
    state: dict[int, dict] = {}
    steps: dict[int, int] = {}

    def hook(p):
        st = handle.state_of(p) if handle is not None else None
        if st is None:
            st = state.setdefault(
                id(p),
                {
                    "exp_avg": torch.zeros_like(p, dtype=torch.float32),
                    "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32),
                },
            )
        k = steps[id(p)] = steps.get(id(p), 0) + 1
        g = p.grad.float()
        w = p.data.float()
        w.mul_(1 - lr * weight_decay)
        st["exp_avg"].lerp_(g, 1 - b1)
        st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (st["exp_avg_sq"].sqrt() / math.sqrt(1 - b2**k)).add_(eps)
        w.addcdiv_(st["exp_avg"], denom, value=-lr / (1 - b1**k))
        p.data.copy_(w)
        p.grad = None

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(hook)
    return hook


def place_non_blocks(model, blocks, device) -> None:
    """Move every parameter and buffer outside `blocks` to `device` (the caller's job under offloading)."""
    inside = {id(t) for b in blocks for t in list(b.parameters()) + list(b.buffers())}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            if id(p) not in inside:
                p.data = p.data.to(device)
        for n, b in mod.named_buffers(recurse=False):
            if id(b) not in inside:
                mod._buffers[n] = b.to(device)


def _rank_main(rank: int, world: int, store: str, result: str, body, *args) -> None:
    """One rank of `run_ranks`: a gloo group over the file `store`, `body`'s dict (or its traceback as
    "error") written to `result`/rank<r>.json."""
    import datetime
    import json
    import traceback
    from pathlib import Path

    import torch.distributed as tdist

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                             timeout=datetime.timedelta(seconds=120))
    out: dict = {"error": None}
    try:
        out.update(body(rank, world, store, result, *args))
    except Exception:  # noqa: BLE001 - reported to the test
        out["error"] = traceback.format_exc()
    finally:
        Path(result, f"rank{rank}.json").write_text(json.dumps(out))
        tdist.destroy_process_group()


def run_ranks(body, world: int, tmp, *args, timeout: float = 240) -> list[dict]:
    """`body(rank, world, store, result, *args) -> dict` in `world` processes (tests/_ranks.py), each a rank of one gloo group
    (one thread each; `result` a folder they share); returns each rank's dict, its "error" a traceback or None. A run
    past `timeout` seconds fails."""
    import json
    import time
    from pathlib import Path

    import pytest
    from _ranks import start

    result = Path(tmp) / f"results-{world}-{time.monotonic_ns()}"
    result.mkdir()
    ctx = start(_rank_main, (world, str(result / "store"), str(result), body, *args), world)
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {world}-process run hung")
    return [json.loads((result / f"rank{r}.json").read_text()) for r in range(world)]
