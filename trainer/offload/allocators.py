"""Memory for streaming: one exact pinned host arena, one GPU ring, and a host bump allocator for activations.

How. Every streamed block's tensors (parameters and buffers) are *packed*: laid out back to back, each start
aligned to `ALIGN` bytes, so one block is one contiguous byte range that crosses PCIe in one copy. The host
side of all streamed blocks is a single allocation (`HostArena`): an ordinary CPU tensor page-locked with
`cudaHostRegister`, so it is exactly as large as the packed bytes (`tensor.pin_memory()` would go through the
caching host allocator, which rounds each request up to a power of two). The GPU side is one `uint8` tensor
(`Ring`) allocated once; a block resident at byte offset `o` is a set of views `ring[o + off_i : ...]` that
replace its parameters' `.data`. Nothing is allocated on the device after setup.

Version counters. Copies into the ring go through a second tensor that aliases the ring's storage
(`Tensor.set_`) and so has its own autograd version counter: refilling a region never bumps the version of
weight views that autograd saved (the "modified by an inplace operation" failure other trainers work around).
The events in the conductor, not version counters, are what keep a region from being overwritten too early.

Activations (`BumpArena`): checkpoint inputs are appended to pinned host chunks during forward and reset every
step (a large input gets a chunk of exactly its size); after a step that needed more than one chunk the chunks are
replaced by one exact buffer.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

ALIGN = 256  # bytes; keeps every dtype view aligned and GPU loads vectorised


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass
class Entry:
    """One tensor of a block: where it lives in the block's packed bytes and how to view it."""

    module: nn.Module
    name: str
    is_param: bool
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size

    def tensor(self) -> torch.Tensor:
        return self.module._parameters[self.name] if self.is_param else self.module._buffers[self.name]


@dataclass
class BlockPacking:
    """The packed layout of one block (see module docstring)."""

    entries: list[Entry] = field(default_factory=list)
    nbytes: int = 0
    resident: list[torch.Tensor] = field(default_factory=list)  # trainable params kept on the device
    # optimizer state packed beside trainable weights: (param, state name, offset, nbytes, shape, dtype)
    states: list[tuple[torch.Tensor, str, int, int, torch.Size, torch.dtype]] = field(default_factory=list)

    @classmethod
    def of(cls, block: nn.Module, include_trainable: bool, state_layout=()) -> BlockPacking:
        """`state_layout`: names of fp32 tensors shaped like each trainable weight, or a callable
        p -> {name: (shape, dtype)} (trainer/optim FusedBackPass.state_layout)."""
        pk = cls()
        seen: set[int] = set()
        for mod in block.modules():
            for name, p in mod._parameters.items():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                if p.requires_grad and not include_trainable:
                    pk.resident.append(p)
                    continue
                pk._add(mod, name, True, p)
            for name, b in mod._buffers.items():
                if b is None or id(b) in seen:
                    continue
                seen.add(id(b))
                pk._add(mod, name, False, b)
        if include_trainable and state_layout:
            for e in list(pk.entries):
                p = e.tensor()
                if not (e.is_param and p.requires_grad):
                    continue
                if callable(state_layout):
                    layout = state_layout(p)
                else:
                    layout = {sn: (p.shape, torch.float32) for sn in state_layout}
                for sn, (shape, dtype) in layout.items():
                    n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
                    pk.states.append((p, sn, pk.nbytes, n, torch.Size(shape), dtype))
                    pk.nbytes += align(n)
        pk.nbytes = align(pk.nbytes)
        return pk

    def _add(self, mod: nn.Module, name: str, is_param: bool, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        self.entries.append(Entry(mod, name, is_param, self.nbytes, n, t.dtype, t.shape))
        self.nbytes += align(n)

    def write_into(self, dst: torch.Tensor, fill=None, block: int = -1) -> None:
        """Write the block into `dst` (a uint8 region of `nbytes`): its current tensors, or, with `fill`, what
        `fill(block, entries, views)` writes into the views (trainer/models/stream_load.py reads them from the
        model's files: the block's own tensors are placeholders then)."""
        if fill is not None:
            fill(block, self.entries, self.views(dst))
        else:
            for e in self.entries:
                src = e.tensor().detach().contiguous().reshape(-1).view(torch.uint8)
                dst[e.offset : e.offset + e.nbytes].copy_(src)
        for _, _, off, n, _, _ in self.states:  # optimizer state starts at zero
            dst[off : off + n].zero_()

    def views(self, region: torch.Tensor) -> list[torch.Tensor]:
        return [region[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in self.entries]

    def state_views(self, region: torch.Tensor) -> dict[int, dict[str, torch.Tensor]]:
        out: dict[int, dict[str, torch.Tensor]] = {}
        for p, sn, off, n, shape, dtype in self.states:
            out.setdefault(id(p), {})[sn] = region[off : off + n].view(dtype).view(shape)
        return out

    def point_at(self, views: list[torch.Tensor]) -> None:
        """Make the block's tensors views into a region (the Parameter objects stay the same)."""
        for e, v in zip(self.entries, views, strict=True):
            if e.is_param:
                e.module._parameters[e.name].data = v
            else:
                e.module._buffers[e.name] = v


def _aliasing(t: torch.Tensor) -> torch.Tensor:
    """A tensor on the same storage with its own version counter (see module docstring)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), 0, t.shape, t.stride())


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a refused cudaHostRegister, so that the next kernel launch's
    error check does not report it. torch binds no cudaGetLastError: call the loaded libcudart (best effort)."""
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so", "cudart64_12.dll"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


def pinned_exact(shape, dtype: torch.dtype) -> torch.Tensor:
    """A page-locked CPU tensor of exactly its size, for buffers made one at a time (trainer/optim StateOffload):
    allocated pageable and registered with cudaHostRegister, unregistered when the tensor object dies. torch's
    `pin_memory=True` goes through the caching host allocator, which rounds every request up to a power of two
    (measured: 52 GB of an owned AdamW state's 171.7 GB, bench/history/2026-11-27.md 2026-11-27 13:40); it is the fallback
    where registration is refused. Keep this very tensor object alive as long as its memory is used."""
    import weakref

    buf = torch.empty(shape, dtype=dtype)
    nbytes = buf.numel() * buf.element_size()
    if nbytes == 0 or not torch.cuda.is_available():
        return buf
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(buf.data_ptr(), nbytes, 0)) != 0:
        _clear_cuda_error()
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    weakref.finalize(buf, cudart.cudaHostUnregister, buf.data_ptr())
    return buf


class HostArena:
    """One exactly sized host buffer, page-locked with cudaHostRegister when `pin` (and CUDA) allow.

    `budget` (bytes, None: no limit): an arena larger than it is not pinned. When registration is refused or over
    budget, `pageable=True` keeps the buffer pageable (`refused` says why; the conductor then stages its copies,
    see `Staging`); otherwise the caching host allocator's pinned memory is used (rounded, but page-locked).

    `defer=True` leaves the buffer unpinned until `pin()`: a fresh pageable buffer costs RAM only as it is written,
    so a caller that fills it while freeing what it copies from (the conductor packing a model loaded in RAM, issue
    14) never holds both whole; registering page-locks what is already there, without a copy."""

    def __init__(self, nbytes: int, pin: bool, budget: int | None = None, pageable: bool = False,
                 buf: torch.Tensor | None = None, defer: bool = False):
        self.nbytes = int(nbytes)
        # allocation: the whole arena (pageable), unless `buf` is given (a shared mapping: SharedArena)
        self.buf = torch.empty(max(1, self.nbytes), dtype=torch.uint8) if buf is None else buf
        self._own_buf = buf is None
        self.pinned_bytes = 0
        self._registered = False
        self.refused: str | None = None  # why the arena stayed pageable
        self._pin, self._budget, self._pageable, self._defer = pin, budget, pageable, defer
        self._pin_tried = False
        if not defer:
            self.pin()

    def pin(self) -> None:
        """Page-lock the buffer (once; see the class text for what happens when that is refused)."""
        if self._pin_tried:
            return
        self._pin_tried = True
        pin, budget = self._pin, self._budget
        if budget is not None and self.nbytes > budget:  # checked on the CPU too, so tests can run the staging
            self.refused = (f"offload.pinned_budget_gb {budget / 2**30:.1f} GB is below the arena's "
                            f"{self.nbytes / 2**30:.1f} GB")
        elif pin and torch.cuda.is_available() and self.nbytes > 0:
            err = torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), self.buf.numel(), 0)
            if int(err) == 0:
                self._registered = True
                self.pinned_bytes = self.buf.numel()
            else:
                _clear_cuda_error()
                self.refused = f"cudaHostRegister refused {self.nbytes / 2**30:.1f} GB (error {int(err)})"
        if self.refused is not None and not self._pageable and pin and torch.cuda.is_available() and self._own_buf:
            self.refused = None  # the caching host allocator instead (rounded up, but page-locked)
            old, self.buf = self.buf, torch.empty(max(1, self.nbytes), dtype=torch.uint8, pin_memory=True)
            if self._defer:  # filled before pinning: keep what was written (a fresh arena has nothing to copy)
                self.buf.copy_(old)
            self.pinned_bytes = self.buf.numel()

    @property
    def pinned(self) -> bool:
        return self.pinned_bytes > 0

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buf[offset : offset + nbytes]

    def close(self) -> None:
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())
            self._registered = False
        self.pinned_bytes = 0
        self.buf = torch.empty(0, dtype=torch.uint8)


@dataclass
class SharedArena:
    """The streamed frozen weights once per host for the processes on it: the arena is a file under
    /dev/shm that the `owner` (local rank 0) creates; after a `barrier` every process maps it and writes its
    `part` of the streamed blocks into it, all at once; after a second barrier the owner unlinks the name (the
    mappings stay) and every process pins its mapping with cudaHostRegister, as any arena. Never for optimizer
    state; trainable weights only under the sharded stream, where each process writes back its own slice
    (trainer/train/owners.py); otherwise every process reads the same bytes and none writes them. `barrier` is a
    collective of every process of the job.

    `part` (i, n): this process fills the i-th of n runs of consecutive blocks of about equal bytes (`mine`);
    None: the owner fills every block and the others none. Filling by parts splits the reads, the casts and the
    first touch of the file's pages (4 KB tmpfs pages, faulted in by whoever writes them) over the host's
    processes; with the owner filling alone, the others waited through all of it (issue 40)."""

    path: Path
    owner: bool
    barrier: Callable[[], None]
    part: tuple[int, int] | None = None

    def mine(self, blocks: list[int], sizes: list[int]) -> set[int]:
        """Of `blocks` (in arena order; `sizes` by block index), those this process fills: the ones whose middle
        byte falls in its n-th of the arena (every block is in exactly one process's set)."""
        if self.part is None:
            return set(blocks) if self.owner else set()
        i, n = self.part
        total = sum(sizes[b] for b in blocks)
        out, at = set(), 0
        for b in blocks:
            if min(n - 1, (2 * at + sizes[b]) * n // max(1, 2 * total)) == i:
                out.add(b)
            at += sizes[b]
        return out

    def fits(self, nbytes: int) -> str | None:
        """None, or why this host's /dev/shm cannot hold `nbytes` (Docker gives containers 64 MB by default;
        writing past a tmpfs's space kills the process with SIGBUS, so this is checked before)."""
        try:
            st = os.statvfs(self.path.parent)
        except OSError as e:
            return f"{self.path.parent} is not usable ({e.strerror})"
        free = st.f_bavail * st.f_frsize
        if free < nbytes + (256 << 20):
            return (f"{self.path.parent} has {free / 2**30:.1f} GB free, the arena needs {nbytes / 2**30:.1f} GB "
                    "(containers: docker run --shm-size)")
        return None

    def create(self, nbytes: int) -> torch.Tensor:
        """Owner: the file sized `nbytes` and mapped shared (its pages are allocated as they are written)."""
        with open(self.path, "wb") as f:
            f.truncate(max(1, nbytes))
        return self.map(nbytes)

    def map(self, nbytes: int) -> torch.Tensor:
        return torch.from_file(str(self.path), shared=True, size=max(1, nbytes), dtype=torch.uint8)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)


class Staging:
    """Host-to-device copies from a pageable arena through two pinned buffers of one block each.

    Where pinning is refused or capped (Windows and WSL pin at most about half of RAM, containers less, or
    `offload.pinned_budget_gb`), the arena stays ordinary memory. A copy then goes in two legs: the CPU copies the
    block into staging buffer k (a memcpy on the host thread), and the transfer stream copies buffer k to the ring
    asynchronously and records `done[k]`. Buffer k is written again only after `done[k]` has fired, so a host
    write never races the DMA still reading it; the two buffers alternate, so one block's DMA overlaps the next
    block's host copy. Cost: the host waits (`done[k].synchronize()`, a host-device sync) whenever it gets two
    loads ahead of the transfer stream, which itself waits for compute to release the target regions.
    On the CPU (tests) the legs run synchronously through the same buffers."""

    def __init__(self, block_bytes: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.bufs = [torch.empty(max(1, block_bytes), dtype=torch.uint8, pin_memory=self.cuda) for _ in range(2)]
        self.done: list = [None, None]
        self.k = 0
        self.copies = 0

    @property
    def pinned_bytes(self) -> int:
        return sum(b.numel() for b in self.bufs) if self.cuda else 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream=None) -> object:
        """Enqueue `dst.copy_(src)` (pageable host `src`, device `dst`) on `stream` (the current stream when it
        is called inside `torch.cuda.stream(stream)`); returns the event that marks its end (None on the CPU)."""
        k, n = self.k, src.numel()
        self.k ^= 1
        if self.done[k] is not None:
            self.done[k].synchronize()  # host-device sync: buffer k's previous DMA has finished
        stage = self.bufs[k][:n]
        stage.copy_(src)  # host memcpy, pageable -> pinned
        dst.copy_(stage, non_blocking=self.cuda)
        self.copies += 1
        if self.cuda:
            self.done[k] = torch.cuda.Event(enable_timing=True)
            self.done[k].record(stream)
        return self.done[k]


class Ring:
    """The preallocated device buffer the streamed blocks live in, addressed by byte offsets."""

    def __init__(self, capacity: int, device: torch.device):
        self.capacity = int(capacity)
        self.buf = torch.empty(
            max(1, self.capacity), dtype=torch.uint8, device=device
        )  # the only device alloc
        self._copy_target = _aliasing(self.buf)
        self._views: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._state_views: dict[tuple[int, int], dict[int, dict[str, torch.Tensor]]] = {}

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        """Write target for copies (no autograd version bump)."""
        return self._copy_target[offset : offset + nbytes]

    def views(self, block: int, offset: int, packing: BlockPacking) -> list[torch.Tensor]:
        key = (block, offset)
        v = self._views.get(key)
        if v is None:  # built once per (block, offset); steady state cycles through a fixed set
            v = self._views[key] = packing.views(self.buf[offset : offset + packing.nbytes])
        return v

    def state_views(
        self, block: int, offset: int, packing: BlockPacking
    ) -> dict[int, dict[str, torch.Tensor]]:
        key = (block, offset)
        v = self._state_views.get(key)
        if v is None:
            v = self._state_views[key] = packing.state_views(self.buf[offset : offset + packing.nbytes])
        return v


class BumpArena:
    """Host memory for offloaded activations: bump allocation in pinned chunks, reset each step.

    A pass that outgrows what the arena holds (the first training step, a larger bucket, the step after `release`)
    grows it: a tensor that does not fit what is left of the current chunk gets a buffer of exactly its size if it
    has at least `own` bytes, else a new shared chunk of `chunk` bytes to bump-allocate in. A grown pass so holds
    its bytes, plus the last shared chunk's tail, plus under `own` bytes per earlier shared chunk: every grown byte
    is page-locked, used or not, so an unused tail is host RAM the step holds for nothing. When every tensor that
    did not fit took a chunk of at least `chunk` bytes, HunyuanVideo 1.5 at 720p x 121 frames (a block's 457 MB of
    tokens, then its 8 MB of text tokens, which opened a 256 MB chunk that the next block's tokens did not fit) held
    37.3 GB in its first step and 23.7 GB after (55.9 against 42.3 GB of RSS, bench/logs/2026-11-28e/).
    `own` is glibc's largest mmap threshold: a buffer that large is its own mapping, so giving it back (`reset`)
    returns its pages to the OS, where a smaller one could stay resident in the malloc heap."""

    def __init__(self, pin: bool, chunk: int = 256 << 20, own: int = 32 << 20):
        self.pin = pin and torch.cuda.is_available()
        self.chunk = chunk
        self.own = own
        self.chunks: list[HostArena] = []
        self._cur: HostArena | None = None  # the chunk bump-allocated in: the one buffer, or the last shared chunk
        self._off = 0  # offset inside it
        self.used = 0
        self.high_water = 0
        # (bytes, seconds, after `release`) of the last one-buffer allocation: after growth steps or a `release`
        self.retaken: tuple[int, float, bool] | None = None
        self._released = False

    def reset(self) -> None:
        """Start of a forward pass. Several chunks from last time are given back, to become one buffer of exactly
        the most bytes a pass has used (the chunks' sum would keep each shared chunk's unused tail: 0.27 GB for Flux
        at 1024 px). That buffer is taken by the pass's first `alloc`, not here: a forward that offloads nothing (a
        no-grad one: sampling, validation) takes no buffer after `release` (taken here, it cost Wan 2.2 A14B at
        720p x 81 its 28.6 GB of activation buffers through every sampling pass, bench/history/2026-11-28.md 04:24)."""
        if len(self.chunks) > 1:
            for c in self.chunks:
                c.close()
            self.chunks = []
        self._cur = self.chunks[0] if self.chunks else None
        self._off = self.used = 0

    def release(self) -> None:
        """Give every chunk back (nothing in them is needed any more); the next pass's first `alloc` takes one
        buffer of the most bytes a pass has used."""
        self.close()
        self._off = self.used = 0
        self._released = True

    def alloc(self, nbytes: int) -> torch.Tensor:
        n = align(nbytes)
        if not self.chunks and self.high_water > 0:
            t0 = time.perf_counter()
            self._cur = HostArena(self.high_water, self.pin)  # allocation: after growth steps and `release`
            self.chunks = [self._cur]
            # page-locking tens of GB takes seconds
            self.retaken = (self.high_water, time.perf_counter() - t0, self._released)
            self._released = False
        self.used += n
        self.high_water = max(self.high_water, self.used)
        if self._cur is not None and self._off + n <= self._cur.nbytes:
            self._off += n
            return self._cur.region(self._off - n, nbytes)
        # growth (first steps only); a tensor of its own leaves the shared chunk's cursor where it is
        if n >= self.own:
            self.chunks.append(HostArena(n, self.pin))  # allocation: exactly this tensor
            return self.chunks[-1].region(0, nbytes)
        self._cur, self._off = HostArena(self.chunk, self.pin), n  # allocation: a shared chunk
        self.chunks.append(self._cur)
        return self._cur.region(0, nbytes)

    @property
    def pinned_bytes(self) -> int:
        return sum(c.pinned_bytes for c in self.chunks)

    def close(self) -> None:
        for c in self.chunks:
            c.close()
        self.chunks = []
        self._cur = None
