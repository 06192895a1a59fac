"""Progress bars: tqdm on stderr, drawn only when stderr is a terminal.

Redirected to a log file (`dittrain fit cfg.yaml 2> run.log`, a cluster job, a notebook's captured output), a bar
would add a carriage-return update every 0.1 s; there each long phase prints its one summary line instead (the
cache's counts, the training log's per-step lines, "wrote N image(s)").

    for x in bar(items, desc="encoding captions", unit="cap"): ...
    b = bar(total=n, desc="merging", unit="tensor", enabled=progress); b.update(1); b.close()
"""

from __future__ import annotations

import sys

from tqdm.auto import tqdm


def shown(enabled: bool = True) -> bool:
    """Whether a bar would be drawn: asked for, and stderr a terminal."""
    return enabled and sys.stderr.isatty()


def bar(iterable=None, *, enabled: bool = True, **kwargs) -> tqdm:
    """A tqdm bar on stderr, disabled unless `enabled` and stderr is a terminal."""
    return tqdm(iterable, file=sys.stderr, disable=not shown(enabled), **kwargs)
