"""Starting a multi-process test's ranks from a fork server that imported the trainer once.

A spawned rank imports torch, diffusers, peft and the trainer afresh: ~6 s of one core each, and the suite starts
some twenty ranks (test_distributed, test_fsdp, test_sharded_stream, test_owners). multiprocessing's "forkserver"
start method starts one clean server process per pytest process, the first time it is asked, which imports
`PRELOAD` once and forks every rank from there: a rank begins with those modules imported, as a spawned rank has
them after its own imports, and with nothing else of the test's process (no threads, no monkeypatches, no CUDA
context; the server never runs torch). The server's environment is the one it started with, so each rank first
takes the launching process's `os.environ` as it is at launch, as a spawned rank inherits it (only a variable a
preloaded module reads at import, and that a test changed after the server started, differs)."""

from __future__ import annotations

import os

PRELOAD = ["trainer.train.trainer"]  # torch, torch.distributed, diffusers, transformers, peft and the trainer


def _main(rank: int, env: dict, fn, *args) -> None:
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)


def start(fn, args: tuple, nprocs: int):
    """torch.multiprocessing.start_processes(fn, args, nprocs, join=False) from the fork server: the context whose
    `join(timeout)` the caller polls."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)  # read when the server starts
    return mp.start_processes(_main, args=(dict(os.environ), fn, *args), nprocs=nprocs, join=False,
                              start_method="forkserver")
