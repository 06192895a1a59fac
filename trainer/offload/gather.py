"""The sharded stream: the processes of one host fill their rings together, each copying 1/N of a block.

Why. With N processes on one host, each streaming the whole model from the host's (shared) pinned arena, every
block crosses PCIe N times and the copies share the host's bandwidth: measured on 4 x H200, 55.3 GB/s for one GPU
alone, 43.8 GB/s each with four copying. The GPUs' own links (NVLink) sit idle meanwhile, at 254-325 GB/s of
all-gather bus bandwidth. So each process copies only its slice of a block over PCIe and the processes all-gather
the slices into every ring: a GPU's copy time per block falls to 1/N of it, plus a gather that NVLink runs several
times faster than PCIe.

How. Every process has the same plan (same blocks, same fraction, same ring offsets), so a load of block b into
ring offset o on one process is the same load on every other, issued at the same position of the plan's
sequence. The conductor pads each block's packed bytes to a multiple of N x ALIGN (`padded`), so the ring region
splits into N equal slices of whole ALIGN units. `load` runs on the conductor's transfer stream: it copies slice
`rank` of the block from the host arena into slice `rank` of the ring region (one non_blocking copy from pinned
memory), then all-gathers the region in place (`all_gather_single(region, region[slice])`: NCCL reads each
process's slice from its own output buffer). The collective runs on the group's own NCCL stream, which waits for
the transfer stream (the slice copy) at issue; `Work.wait()` makes the transfer stream wait for the gather in
turn, so the block's load event, recorded after it, covers both. Nothing blocks the host.

Ordering. Collectives of one group must be issued in the same order on every process. The conductor issues loads
only at its release points, in plan order; a pass that one process runs alone (sampling or validation on rank 0
during training) would issue loads the others never pair, so the trainer makes the others join each such
transformer call (train/sharded.py Lockstep), as with FSDP. The gathers use their own process group (`group`,
the processes of this host), so their order is independent of the gradient all-reduces on the default group,
which the autograd hooks issue in their own order.

Where it is used: streamed blocks with several processes on one host of CUDA GPUs (on the CPU the same code runs
over gloo, for the tests): frozen blocks (LoRA), and a full fine-tune's trainable blocks when each process steps
its own parameters and broadcasts them (trainer/train/owners.py), so every ring ends a block's backward with the
same bytes and each process writes back only its slice (conductor `_write_back`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from .allocators import ALIGN, align

# torch 2.13 deprecates all_gather_into_tensor for all_gather_single: the new name where this torch has it
_all_gather = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor


@dataclass
class SliceGather:
    """The processes of one host that fill each ring together; see the module docstring. `group`: their process
    group (every process of the job must call the conductor's loads in the same order); `rank`, `world`: this
    process's place in it."""

    group: object
    rank: int
    world: int

    def padded(self, nbytes: int) -> int:
        """A block's packed bytes rounded up to N equal slices of whole ALIGN units."""
        return align(nbytes, ALIGN * self.world)

    def slice(self, region: torch.Tensor) -> torch.Tensor:
        k = region.numel() // self.world
        return region[self.rank * k:(self.rank + 1) * k]

    def barrier(self) -> None:
        """Every process of the host has got here (e.g. has written its slices of the arena back)."""
        tdist.barrier(group=self.group)

    def load(self, dst: torch.Tensor, src: torch.Tensor, copy: Callable[[torch.Tensor, torch.Tensor], object],
             cuda: bool) -> int:
        """Fill the ring region `dst` with the block whose host bytes are `src` (both `padded` long): this
        process's slice over PCIe with `copy(dst_slice, src_slice)` (the conductor's host-to-device copy), the rest
        gathered from the others. Enqueued on the current stream (the conductor's transfer stream) when `cuda`;
        synchronous on the CPU. Returns the bytes this process copied."""
        mine = self.slice(dst)
        copy(mine, self.slice(src))
        work = _all_gather(dst, mine, group=self.group, async_op=cuda)
        if work is not None:
            work.wait()  # NCCL: the current stream waits for the gather; the host does not
        return mine.numel()
