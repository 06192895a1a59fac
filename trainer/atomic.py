"""Files written whole or not at all, with the mode a plain open() would give them.

`atomic_write` writes under a temporary name in the same folder, flushes it to disk and renames it over the
target (`os.replace`, atomic on one file system), so a kill mid-write leaves the old file (or none), never half a
file. safetensors' writer creates its files -rw-------; `umask_mode` gives them what the process umask allows
(-rw-r--r-- under the usual 022), so a shared machine's group reads them as it reads the rest. Checkpoints
(trainer/train/checkpoint.py), the run's logs and `dittrain convert-lora` (trainer/lora_format/) write through
here. It imports nothing from the rest of trainer/, so every package may use it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some file systems cannot fsync a directory; the rename is still atomic
        pass


def umask_mode(mode: int = 0o666) -> int:
    """`mode` under the process umask: what a plain open() creates. safetensors' writer creates files -rw-------,
    so saved files are given this mode (a shared machine's group then reads checkpoints as it reads the rest)."""
    mask = os.umask(0)
    os.umask(mask)  # no way to read the umask without setting it; both calls are instant
    return mode & ~mask


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write one file through `write(tmp_path)`, then rename it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        write(tmp)
        os.chmod(tmp, umask_mode())
        _fsync_file(tmp)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()
