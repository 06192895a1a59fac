"""Starting a multi-process test's ranks, or a `python -m trainer` command, from a fork server that imported the
trainer once.

A spawned rank imports torch, diffusers, peft and the trainer afresh: ~6 s of one core each, and the suite starts
some twenty ranks (test_distributed, test_fsdp, test_sharded_stream, test_owners). multiprocessing's "forkserver"
start method starts one clean server process per pytest process, the first time it is asked, which imports
`PRELOAD` once and forks every rank from there: a rank begins with those modules imported, as a spawned rank has
them after its own imports, and with nothing else of the test's process (no threads, no monkeypatches, no CUDA
context; the server never runs torch). The server's environment is the one it started with, so each rank first
takes the launching process's `os.environ` as it is at launch, as a spawned rank inherits it (only a variable a
preloaded module reads at import, and that a test changed after the server started, differs). `Command` runs
`python -m MODULE ARGS` the same way, for a test that starts CLI commands one after another (bench_program's,
bench_caption's rows)."""

from __future__ import annotations

import os
import sys

PRELOAD = ["trainer.train.trainer", "trainer.cli"]  # torch, diffusers, transformers, peft, the trainer, its CLI


def _main(rank: int, env: dict, fn, *args) -> None:
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)


def _server():
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts
    return ctx


def start(fn, args: tuple, nprocs: int):
    """torch.multiprocessing.start_processes(fn, args, nprocs, join=False) from the fork server: the context whose
    `join(timeout)` the caller polls."""
    import torch.multiprocessing as mp

    _server()
    return mp.start_processes(_main, args=(dict(os.environ), fn, *args), nprocs=nprocs, join=False,
                              start_method="forkserver")


def _command(env: dict, cwd: str, log: str, module: str, argv: list[str]) -> None:
    import runpy

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)  # stdout and stderr to the log, as the command's own process would write them
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [module, *argv]  # runpy puts the module's file first, as `python -m` does
    runpy.run_module(module, run_name="__main__", alter_sys=True)


class Command:
    """`python -m MODULE ARGV` (cwd, env, stdout and stderr appended to the file `log`) in a process forked from the
    server: `pid`, `wait()` -> its exit status (SystemExit's code; 1 after an exception, its traceback in the log),
    as subprocess.Popen has them."""

    def __init__(self, module: str, argv: list[str], env: dict, cwd: str, log: str):
        self._p = _server().Process(target=_command, args=(dict(env), str(cwd), str(log), module, list(argv)))
        self._p.start()
        self.pid = self._p.pid

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit status; None if the process still runs after `timeout` seconds."""
        self._p.join(timeout)
        return self._p.exitcode

    def kill(self) -> None:
        self._p.kill()
        self._p.join()
