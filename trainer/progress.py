"""Progress bars: tqdm on stderr, drawn only when stderr is a terminal.

Redirected to a log file (`dittrain fit cfg.yaml 2> run.log`, a cluster job, a notebook's captured output), a bar
would add a carriage-return update every 0.1 s; there each long phase prints its one summary line instead (the
cache's counts, the training log's per-step lines, "wrote N image(s)"). A phase that can run for minutes before its
summary (caching) asks for `lines=True`: without a terminal it then prints a plain line when it starts and one at
least every LINES_EVERY_S seconds ("encoding latents 40/120 img"), as the training log's status lines do.

    for x in bar(items, desc="encoding captions", unit="cap"): ...
    b = bar(total=n, desc="merging", unit="tensor", enabled=progress); b.update(1); b.close()
"""

from __future__ import annotations

import os
import sys
import time

from tqdm.auto import tqdm

LINES_EVERY_S = 20.0  # without a terminal: a progress line of a `lines=True` bar at least this often
_now = time.monotonic  # tests replace it


def shown(enabled: bool = True) -> bool:
    """Whether a bar would be drawn: asked for, and stderr a terminal."""
    return enabled and sys.stderr.isatty()


def line(msg: str) -> None:
    """One line to stderr that does not break a bar being drawn. Several processes (torchrun): rank 0 speaks."""
    if os.environ.get("RANK", "0") == "0":
        tqdm.write(msg, file=sys.stderr)


class _Lines:
    """A bar's stand-in without a terminal: "DESC 0/N UNIT" at the start, then "DESC n/N UNIT" when an update
    comes LINES_EVERY_S or more after the last line. The part of tqdm's interface the callers use."""

    def __init__(self, iterable=None, *, total: int | None = None, desc: str = "", unit: str = "it", **_) -> None:
        self.iterable, self.n, self.desc, self.unit = iterable, 0, desc, unit
        self.total = len(iterable) if total is None and hasattr(iterable, "__len__") else total
        self._say()

    def _say(self) -> None:
        self._said = _now()
        line(f"{self.desc} {self.n}/{'?' if self.total is None else self.total} {self.unit}")

    def update(self, n: int = 1) -> None:
        self.n += n
        if _now() - self._said >= LINES_EVERY_S:
            self._say()

    def __iter__(self):
        for x in self.iterable:
            yield x
            self.update()

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def bar(iterable=None, *, enabled: bool = True, lines: bool = False, **kwargs):
    """A tqdm bar on stderr, disabled unless `enabled` and stderr is a terminal; `lines`: without a terminal (and
    enabled), progress lines instead (`_Lines`)."""
    if lines and enabled and not shown():
        return _Lines(iterable, **kwargs)
    return tqdm(iterable, file=sys.stderr, disable=not shown(enabled), **kwargs)
