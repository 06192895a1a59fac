"""One live `fit` per output folder: a lock held for the whole run.

Why. Two `dittrain fit` of one config started 20 s apart both wrote into one output.dir: the second took the
folder over (run.py's `claim` refuses a second run only once the first has saved something), and the first
crashed when its TensorBoard files were deleted under it. Now the second stops in one line naming the first.

How. `<output.dir>/.dittrain.lock` is locked with `fcntl.flock` (exclusive, non-blocking) before the folder is
claimed and stays locked until the run ends. The kernel drops the lock when the process dies, however it dies
(SIGKILL, out of memory, a power cut of another NFS client once its lease ends), so a stale lock cannot block a
`--resume latest` or a new run: a left-over file is simply locked again. The file holds a small JSON (pid, host,
start time, command) that the refusal quotes; the holder deletes it when it ends, so the folder a failed fresh run
made can be removed. A lock is taken on the file that is at the path after it was locked (the inode compared),
so a process that locked a file just unlinked by its previous holder tries again.

Under torchrun only rank 0 holds it (the other processes write nothing into output.dir). A process that holds
the lock of a folder may take it again (tests run several Trainers on one folder in one process); it is let go
when the last holder releases it. A file system without locks (some network mounts) leaves the run unlocked, said
in one line.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from ..errors import UserError

LOCK_FILE = ".dittrain.lock"

#: folder (resolved) -> [open lock file, holders in this process]
_HELD: dict[Path, list] = {}


class RunLock:
    """`RunLock(out).acquire()` ... `release()`: see the module essay."""

    def __init__(self, out: Path):
        self.path = Path(out) / LOCK_FILE
        self._key = Path(out).resolve()
        self.held = False

    def acquire(self, say=print) -> RunLock:
        held = _HELD.get(self._key)
        if held is not None:
            held[1] += 1
            self.held = True
            return self
        while True:
            f = open(self.path, "a+")  # noqa: SIM115 - kept open for the run: the lock lives as long as the file
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                f.close()
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise UserError(self._refusal()) from None
                say(f"note: {self.path.parent} cannot be locked ({e.strerror or e}): nothing stops a second fit from "
                    f"writing into it at the same time")
                return self
            try:
                same = os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            f.close()  # its holder unlinked it between our open and our lock: lock the new one
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                            "command": " ".join(sys.argv)}))
        f.flush()
        _HELD[self._key] = [f, 1]
        self.held = True
        return self

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        held = _HELD.get(self._key)
        if held is None:
            return
        held[1] -= 1
        if held[1] > 0:
            return
        del _HELD[self._key]
        f = held[0]
        try:
            self.path.unlink(missing_ok=True)  # while still locked: nobody reads a half-gone holder
        except OSError:
            pass
        f.close()  # closing the last descriptor drops the lock

    def _refusal(self) -> str:
        out = self.path.parent
        try:
            info = json.loads(self.path.read_text())
        except (OSError, ValueError):
            info = {}
        if not isinstance(info, dict) or "pid" not in info:
            who = "another process (it has not written its details yet)"
        else:
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info.get("started", 0))))
            host = info.get("host", "?")
            who = f"pid {info['pid']} on {host}, started {started}"
            if host != socket.gethostname():
                who += (f"; that is another machine: if it is down, its lock ends when the file server lets it go, "
                        f"or delete {self.path} once you are sure no run uses the folder")
            elif not _alive(int(info["pid"])):
                who += "; that pid is gone, but a process it started still holds the lock: stop that one"
        return (f"{out} is in use by another dittrain fit ({who}): wait for it to end or stop it, or train into "
                f"another output.dir (--set output.dir=...)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
