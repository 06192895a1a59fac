"""HunyuanVideo 1.5's VAE in causal time chunks: a clip's encode and decode hold one chunk's activations, not the
clip's.

Why. diffusers' `AutoencoderKLHunyuanVideo15` (0.42.1) runs its encoder and decoder over every frame of a clip at
once: its first encoder level holds 128 channels x every full-size frame per tensor (3.4 GB at 832x480 x 33 in bf16,
twice that where its RMS norms compute in fp32); the planner counted 23.7 GB for that encode (44.5 GB predicted for
the latent-caching phase), and 121 frames scale it by 3.7. Its `enable_tiling` cuts space only (256 px tiles, every
tile over the whole clip, their overlaps blended: other latents than the untiled encode), and it has no temporal
tiling or frame batching.

Why chunks in time are exact. The VAE is causal in time: every `HunyuanVideo15CausalConv3d` pads time on the left
only (its first frame replicated, kernel - 1 frames), its RMS norms normalise each pixel over the channels (no
statistic across frames), its down- and upsamplers treat the first frame alone and then pairs of frames, and the
middle block's attention masks each frame to itself and the frames before it. So frame t's output depends on
frames <= t only, and the clip can run as Wan's VAE runs itself: the first frame alone, then 4 pixel frames (one
latent frame) at a time for the encoder, one latent frame at a time for the decoder, with what each layer needs of
the past carried over (`_State`):

- a causal conv keeps the last kernel - 1 frames of its time-padded input and puts them before the next chunk
  instead of the replicated first frame (the spatial padding is per frame, so it is the same either way);
- a down- or upsampler treats the first chunk as diffusers does (the first frame alone) and every later chunk as
  pairs only (diffusers' rearrangement for frames 1...: `_down_rest` / `_up_rest`, its own static methods);
- the middle block's attention keeps the keys and values of the whole clip's length (zeros until their frame has
  run) and runs a chunk's queries (one latent frame) against them with that frame's rows of diffusers' causal mask:
  the same SDPA call, row for row, as the whole clip's, without its (S, S) mask (4.7 GB at 480p x 121 frames in
  bf16, filled by a Python loop over S).

While `time_chunks(vae)` is open, the encoder, the decoder and the layers above run the chunked functions through a
swapped class (`_time_chunked`: a subclass whose forward calls the instance's `_time_chunk_fn`; no instance gets a
`forward` of its own), their own classes back on exit (the VAE's own code otherwise: `encode`, `latent_dist.mode()`,
its spatial tiling, which then runs each tile in chunks: the latent cache turns it on where a clip's chunked encode
does not fit the GPU, trainer/sampling/placement.py `encode_tiles`, and the sampler's decode above 512x512 pixels), so the
adapter's `encode_videos`, the pipelines' decode and the planner's meta count all run the same code.

Exactness (tests/test_hunyuan_video15_vae.py, the tiny VAE on the CPU): the same convolutions, per-pixel ops and
attention rows on the same numbers; only the down- and upsamplers' shortcut `mean` over a group of channels runs
over a chunk's frames instead of the clip's, and the CPU reduction groups its sums by the tensor's size: fp32
latents bitwise for short clips, within 7.3e-7 (a few ulps) otherwise; bf16 bitwise in every case tried.

Frame by frame inside a chunk. The encoder's layers before its first temporal downsampler (`conv_in`, the blocks
that halve space only) and the decoder's after its last temporal upsampler run at every pixel frame and the largest
sizes (128 channels at full size), and mix frames only through their causal convs: they run one frame at a time
(`_full_rate`), their carried frames passing from frame to frame as from chunk to chunk.

Memory: one frame's working set at the largest levels, one chunk's below, plus the carried frames (two frames per
causal conv at its level's size: the largest part, 1.5 GB at 832x480 in bf16) and the clip's keys and values at the
latent grid (1024 channels: 0.46 GB at 720p x 121 in bf16) with one frame's mask rows (0.8 GB there; 0.15 GB at
480p x 121). Counted at the full size in bf16: 3.57 GB for an 832x480 encode of 33 frames, 3.82 GB of 121; 8.36 and
10.03 GB at 1280x720 (the decode: 4.56, 5.02, 10.66, 12.45 GB; diffusers' whole-clip encode at 832x480 x 33: 23.7).
The planner runs `time_chunks` on the meta device (trainer/planner/vae.py, the family's `vae_time_chunks`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import (
    HunyuanVideo15AttnBlock,
    HunyuanVideo15CausalConv3d,
    HunyuanVideo15Downsample,
    HunyuanVideo15Upsample,
)
from torch import nn


class _State:
    """What one chunked pass carries from chunk to chunk: per causal conv its last input frames, per attention
    block the clip's keys and values and the mask rows (`_attend`); `done` chunks have run."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0  # the pass's chunks (latent frames), the ones done
        self.frames: dict[nn.Module, torch.Tensor] = {}
        self.kv: dict[nn.Module, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _conv(m: HunyuanVideo15CausalConv3d, x: torch.Tensor, state: _State) -> torch.Tensor:
    """The causal conv over a chunk: its time padding is the previous chunk's last frames (the first chunk's is
    diffusers' replicated first frame); then diffusers' spatial padding and the conv."""
    wl, wr, hl, hr, past, _ = m.time_causal_padding
    if m in state.frames:
        x = torch.cat([state.frames[m], x], dim=2)  # allocation: the chunk with the carried frames
    else:
        x = F.pad(x, (0, 0, 0, 0, past, 0), mode=m.pad_mode)
    state.frames[m] = x[:, :, x.shape[2] - past:].clone()  # allocation: a copy, so the chunk's storage can go
    return m.conv(F.pad(x, (wl, wr, hl, hr, 0, 0), mode=m.pad_mode))


def _down_rest(m: HunyuanVideo15Downsample, x: torch.Tensor) -> torch.Tensor:
    """diffusers' `HunyuanVideo15Downsample.forward` for the frames after the first (its `h_next` / `x_next`)."""
    r1 = 2 if m.add_temporal_downsample else 1
    h = m._dcae_downsample_rearrange(m.conv(x), r1=r1, r2=2, r3=2)
    s = m._dcae_downsample_rearrange(x, r1=r1, r2=2, r3=2)
    b, _, t, hh, ww = s.shape
    return h + s.view(b, h.shape[1], m.group_size, t, hh, ww).mean(dim=2)


def _up_rest(m: HunyuanVideo15Upsample, x: torch.Tensor) -> torch.Tensor:
    """diffusers' `HunyuanVideo15Upsample.forward` for the frames after the first (its `h_next` / `x_next`)."""
    r1 = 2 if m.add_temporal_upsample else 1
    h = m._dcae_upsample_rearrange(m.conv(x), r1=r1, r2=2, r3=2)
    s = m._dcae_upsample_rearrange(x, r1=r1, r2=2, r3=2)
    return h + s.repeat_interleave(repeats=m.repeats, dim=1)


def _attend(m: HunyuanVideo15AttnBlock, x: torch.Tensor, state: _State) -> torch.Tensor:
    """diffusers' `HunyuanVideo15AttnBlock.forward` for latent frame n (one a chunk): its queries against the keys
    and values of the whole clip's length, frames 0..n written so far, the rest zeros behind the causal mask's rows
    for frame n (-inf), so SDPA sums what the whole-clip call sums for these rows (module essay)."""
    b, c, f, hh, ww = x.shape
    assert f == 1, "a chunk is one latent frame"
    hw, n = hh * ww, state.done
    h = m.norm(x)

    def tokens(t: torch.Tensor) -> torch.Tensor:  # (B, C, 1, H, W) -> (B, 1, H*W, C), as diffusers lays them out
        return t.reshape(b, c, hw).permute(0, 2, 1).unsqueeze(1).contiguous()

    q = tokens(m.to_q(h))
    if m not in state.kv:  # allocation: keys and values of the whole clip, and this frame's mask rows, once
        k = q.new_zeros(b, 1, state.total * hw, c)
        state.kv[m] = (k, torch.zeros_like(k), q.new_full((hw, state.total * hw), float("-inf")))
    k, v, mask = state.kv[m]
    k[:, :, n * hw:(n + 1) * hw] = tokens(m.to_k(h))
    v[:, :, n * hw:(n + 1) * hw] = tokens(m.to_v(h))
    mask[:, n * hw:(n + 1) * hw] = 0  # frame n's row of diffusers' causal mask: frames <= n visible
    # (B, rows, keys) as diffusers passes it: SDPA's CPU kernel takes another path for a 2-D or 4-D mask
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(b, -1, -1))
    out = out.squeeze(1).reshape(b, f, hh, ww, c).permute(0, 4, 1, 2, 3)
    return m.proj_out(out) + x


def _chunked_forward(coder: nn.Module, forward, step: int, state_box: list):
    """`coder`'s forward in time chunks: the first frame, then `step` frames at a time, each through diffusers'
    forward with the patched layers reading `state_box[0]` (a fresh `_State` per call)."""

    def run(x: torch.Tensor) -> torch.Tensor:
        starts = _starts(x.shape[2], step)
        state_box[0] = state = _State(len(starts))
        outs = []
        for i, start in enumerate(starts):
            outs.append(forward(x[:, :, start:start + (1 if i == 0 else step)]))
            state.done += 1
        state_box[0] = None
        return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]

    return run


def _starts(frames: int, step: int) -> list[int]:
    """First frame of each chunk: 0, then 1, 1 + step, ..."""
    return [0, *range(1, frames, step)]


def _frame_by_frame(forward):
    """`forward` over a chunk one frame at a time (a layer at the full frame rate, its causal convs carrying their
    frames from call to call), the frames' outputs concatenated."""
    return lambda x: torch.cat([forward(x[:, :, t:t + 1]) for t in range(x.shape[2])], dim=2)


def _full_rate(coder: nn.Module) -> list[nn.Module]:
    """The encoder's layers before its first temporal downsampler (`conv_in` and the blocks that downsample in space
    only) and the decoder's after its last temporal upsampler (the blocks that upsample in space only or not at all,
    `norm_out`, `conv_act`, `conv_out`): they run every pixel frame of a chunk at the largest sizes and mix no
    frames but through their causal convs, so they run frame by frame."""
    if hasattr(coder, "down_blocks"):
        out = [coder.conv_in]
        for block in coder.down_blocks:
            if block.downsamplers is not None and block.downsamplers[0].add_temporal_downsample:
                break
            out.append(block)
        return out
    out = []
    for block in reversed(coder.up_blocks):
        if block.upsamplers is not None and block.upsamplers[0].add_temporal_upsample:
            break
        out.append(block)
    return [*out[::-1], coder.norm_out, coder.conv_act, coder.conv_out]


#: class -> its subclass whose forward is the instance's `_time_chunk_fn` (`time_chunks`)
_CHUNKED: dict[type, type] = {}


def _time_chunked(cls: type) -> type:
    """`cls` with a forward that calls the instance's `_time_chunk_fn`: what `time_chunks` swaps a layer's class to
    (no instance gets a `forward` of its own: tests/test_offload.py `test_nothing_assigns_forward`)."""
    if cls not in _CHUNKED:
        _CHUNKED[cls] = type(f"TimeChunked{cls.__name__}", (cls,),
                             {"forward": lambda self, *a, **k: self._time_chunk_fn(*a, **k)})
    return _CHUNKED[cls]


def _current(m: nn.Module):
    """What `m` runs now: its time-chunked function where `time_chunks` gave it one, else its class's forward."""
    return vars(m).get("_time_chunk_fn") or m.forward


@contextlib.contextmanager
def time_chunks(vae: nn.Module) -> Iterator[None]:
    """While open, `vae`'s encoder runs the first pixel frame, then `temporal_compression_ratio` frames at a time,
    and its decoder one latent frame at a time, carrying the causal state over, their full-rate layers frame by frame
    (module essay); both restored on exit. A clip's frames must be k x ratio + 1 (the VAE's own requirement)."""
    ratio = int(vae.config.temporal_compression_ratio)
    box: list = [None]
    patched: list[tuple[nn.Module, type]] = []

    def patch(m: nn.Module, fn) -> None:  # a class swap, as the offload conductor's blocks: forward stays the class's
        if "_time_chunk_fn" not in vars(m):
            patched.append((m, type(m)))
            m.__class__ = _time_chunked(type(m))
        m._time_chunk_fn = fn

    for coder, step in ((vae.encoder, ratio), (vae.decoder, 1)):
        for m in coder.modules():
            if isinstance(m, HunyuanVideo15CausalConv3d):
                patch(m, lambda x, m=m: _conv(m, x, box[0]))
            elif isinstance(m, HunyuanVideo15Downsample):
                first = _current(m)
                patch(m, lambda x, m=m, first=first: first(x) if not box[0].done else _down_rest(m, x))
            elif isinstance(m, HunyuanVideo15Upsample):
                first = _current(m)
                patch(m, lambda x, m=m, first=first: first(x) if not box[0].done else _up_rest(m, x))
            elif isinstance(m, HunyuanVideo15AttnBlock):
                patch(m, lambda x, m=m: _attend(m, x, box[0]))
        for m in _full_rate(coder):
            patch(m, _frame_by_frame(_current(m)))
        patch(coder, _chunked_forward(coder, _current(coder), step, box))
    try:
        yield
    finally:
        for m, plain in patched:
            m.__class__ = plain
            del m._time_chunk_fn
