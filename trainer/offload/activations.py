"""Activation offloading: checkpoint inputs go to pinned host memory in forward and come back one block
ahead in backward.

How. With per-block non-reentrant checkpointing, the only activations a block keeps for backward are its
inputs, which `torch.utils.checkpoint` saves as saved tensors *outside* its own hooks. The conductor wraps
each checkpoint call in `saved_tensors_hooks(pack, unpack)` from this module: `pack` copies a large,
grad-carrying input into a bump-allocated pinned host region on a side stream (after that stream waits for
the compute stream, so the tensor is complete) and keeps the device tensor alive only until the copy's event
has passed; `unpack` (the recompute of block j in backward) waits for block j's tensors and starts the copies
of block j-1's, so the transfer hides behind block j's backward. The fetched tensors live in the side stream's
pool of the caching allocator, so a fetch waits for nothing on the compute stream (`_fetch`).

Why those tensors. Inputs that do not require grad (the first block's, the rotary tables and `temb` shared
by every block) are small or shared; copying them once per block would cost more than it saves.
The inputs of the blocks in `on_device` (the conductor's: plan.py `inputs_on_device`, the last two recomputed
blocks, whose backward comes first) stay on the GPU too: backward would fetch them back at once, and holds two
blocks' inputs there anyway, so keeping them costs no GPU memory at backward's peak and saves their pinned bytes.
Any layout goes (`memory_order`): a tensor dense in another dimension order (a patch embedding's transposed tokens)
goes out byte for byte and comes back with its own strides; one with gaps (a slice of a batch's joint sequence)
goes out as a dense copy and comes back dense in the same dimension order. Until 2026-11-28 only contiguous ones
went: HunyuanVideo 1.5's residual stream is transposed, so none of its 54 blocks' inputs left the GPU (at 480p x 121
frames 53 x 198 MB held at the 54th block's forward: out of memory under a 15 GB cap, bench/logs/2026-11-28d-hv/),
and Flux's single blocks at batch 2 kept their text tokens (tests/test_families.py checks every family).

Throttle. A CPU that runs ahead would enqueue many D2H copies whose source tensors stay allocated until the
copies run, erasing the saving (OneTrainer PR #1649). `max_inflight` bounds the copies in flight; beyond it
`pack` waits on the oldest event (a host-device sync, marked below).

Between steps. Nothing waits in the buffers once a step's backward has unpacked everything, so before sampling
and a checkpoint save the trainer gives them back (`release`, before the phase starts): that phase's host-RAM
peak is then the rest of the run's, not the rest plus every offloaded activation (Wan 14B at 720p x 81: 28.6 GB).
The next training step takes them again, once, at its first offloaded input (allocators.BumpArena `alloc`): a
forward that offloads nothing (no grad: sampling's denoising, validation) starts a step (`new_step`) but takes no
buffer, where it used to take the whole high-water buffer back at once and hold it through the sampling pass.

Left out: offloading activations of non-checkpointed code, a device-side bump allocator for the prefetched
tensors (they come from the caching allocator, whose blocks are reused step after step), and fetching two blocks
ahead (measured: 1.015 s against 1.054 with compute's pool, 0.980 against 0.968 with the side pool).
"""

from __future__ import annotations

import contextlib
from collections import deque

import torch

from .allocators import BumpArena


class _Saved:
    """One offloaded tensor: its bytes on the host in memory order, the shape in that order (`shape`), and the
    permutation that gives the tensor back its own dimension order and strides (`back`; None: contiguous)."""

    __slots__ = ("host", "shape", "dtype", "block", "back", "gpu", "event")

    def __init__(self, host, shape, dtype, block, back):
        self.host, self.shape, self.dtype, self.block, self.back = host, shape, dtype, block, back
        self.gpu = None
        self.event = None


def memory_order(t: torch.Tensor) -> list[int]:
    """The order of `t`'s dimensions from the largest stride to the smallest: `t.permute(order)` is contiguous
    where `t` fills one dense block of memory in any dimension order. A patch embedding's
    `conv(x).flatten(2).transpose(1, 2)` gives (B, S, D) tokens with strides (S D, 1, S), and elementwise ops keep
    that layout (HunyuanVideo 1.5's residual stream through every block); a slice `x[:, n:]` of a batch of more than
    one sample (Flux's single blocks split their joint sequence so) leaves gaps, and `permute(order)` needs a copy."""
    if t.is_contiguous():
        return list(range(t.dim()))
    return sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.size(d)))


class ActivationOffloader:
    def __init__(self, device: torch.device, min_bytes: int = 1 << 20, max_inflight: int = 4,
                 on_device: frozenset[int] = frozenset()):
        self.device = device
        self.on_device = on_device  # blocks whose checkpoint inputs stay where they are (see the module essay)
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.arena = BumpArena(pin=self.cuda)
        self.min_bytes = min_bytes
        self.max_inflight = max_inflight
        self._block = -1
        self._by_block: dict[int, list[_Saved]] = {}
        self._inflight: deque = deque()  # (event, device tensor kept alive until its D2H copy has run)
        self.offloaded_bytes = 0  # of the last forward

    # ------------------------------------------------------------------------------------------ interface
    def hooks(self, block: int):
        self._block = block
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def new_step(self) -> None:
        """Called at the start of each forward pass."""
        self._by_block.clear()
        self._drain(block=False)
        if len(self.arena.chunks) > 1 and self.cuda:
            self.stream.synchronize()  # host-device sync (growth steps only): chunks are about to be freed
        self.arena.reset()
        self.offloaded_bytes = 0

    def release(self) -> None:
        """Between steps (before sampling or a checkpoint save, which save nothing for backward): the pinned
        buffers given back to the OS; the next training forward's first offloaded input takes one buffer of the most
        bytes a pass has used again (a fresh allocation and page-lock: seconds for tens of GB)."""
        self._drain(block=True)
        if self.cuda:
            self.stream.synchronize()  # host-device sync: no copy reads or writes the buffers any more
        self._by_block.clear()
        self.arena.release()

    def close(self) -> None:
        """The end of training: the same as `release` (the arena's counters reset too, which nothing reads after)."""
        self.release()

    @property
    def pinned_bytes(self) -> int:
        return self.arena.pinned_bytes

    # ------------------------------------------------------------------------------------------ hooks
    def _pack(self, t: torch.Tensor):
        n = t.numel() * t.element_size()
        if not (t.requires_grad and n >= self.min_bytes and t.device == self.device) or self._block in self.on_device:
            return t
        order = memory_order(t)
        back = None if order == sorted(order) else sorted(range(t.dim()), key=order.__getitem__)
        # the same bytes in memory order: a view where t is dense, else a copy (a slice of a larger tensor; the
        # copy lives until its transfer has passed, as t does)
        dense = t.detach().permute(order).contiguous()
        host = self.arena.alloc(n)
        src = dense.reshape(-1).view(torch.uint8)
        if self.cuda:
            self._drain(block=False)
            while len(self._inflight) >= self.max_inflight:
                self._inflight.popleft()[0].synchronize()  # host-device sync: bounds CPU run-ahead
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(src, non_blocking=True)
                ev = self.stream.record_event()
            self._inflight.append((ev, dense))  # the source (t's storage, or its dense copy) lives until the copy ran
        else:
            host.copy_(src)
        s = _Saved(host, dense.shape, t.dtype, self._block, back)
        self._by_block.setdefault(self._block, []).append(s)
        self.offloaded_bytes += n
        return s

    def _unpack(self, s):
        if not isinstance(s, _Saved):
            return s
        if s.gpu is None:
            self._fetch(s)
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(s.event)
            s.gpu.record_stream(compute)  # its memory is not fetched into again before compute is done with it
        t, s.gpu = s.gpu, None
        for prev in self._by_block.get(s.block - 1, ()):  # one block ahead in backward
            if prev.gpu is None:
                self._fetch(prev)
        return t if s.back is None else t.permute(s.back)  # its own dimension order again (without gaps)

    def _fetch(self, s: _Saved) -> None:
        if not self.cuda:
            s.gpu = torch.empty(s.shape, dtype=s.dtype, device=self.device)
            s.gpu.view(-1).view(torch.uint8).copy_(s.host)
            return
        # From the side stream's pool, not compute's: memory compute freed may still be in use by its queued
        # kernels, so a fetch into it would have to wait for all of them (it did: 1.054 vs 0.968 s a Flux step,
        # bench/history/2026-11-26.md 2026-11-26). The side stream's blocks come back to it only once the compute stream,
        # which `record_stream` names in `_unpack`, has passed their last use.
        with torch.cuda.stream(self.stream):
            gpu = torch.empty(s.shape, dtype=s.dtype, device=self.device)
            gpu.view(-1).view(torch.uint8).copy_(s.host, non_blocking=True)
            s.event = self.stream.record_event()
        s.gpu = gpu

    def _drain(self, block: bool) -> None:
        while self._inflight and (block or self._inflight[0][0].query()):
            ev, _ = self._inflight.popleft()
            if block:
                ev.synchronize()


@contextlib.contextmanager
def nothing():
    yield
