"""`dittrain plan`'s text fitted to the terminal: tables wider than it are split into tables of fewer columns (each
led by the row names; a trailing note column wraps inside its cells), and prose lines are wrapped at spaces, never
inside a word (a path longer than the terminal stays whole on a line of its own)."""

from __future__ import annotations

import shutil
import textwrap

#: `dittrain plan` is laid out for at least this many columns, however narrow the terminal claims to be
MIN_WIDTH = 60


def terminal_width() -> int:
    """The terminal's columns (COLUMNS when set; 80 when the output is not a terminal), at least `MIN_WIDTH`."""
    return max(MIN_WIDTH, shutil.get_terminal_size((80, 24)).columns)


def table(rows: list[tuple], note: bool = False, width: int | None = None, indent: str = "") -> list[str]:
    """Rows (the first the header) as aligned text under a rule: the first column and a trailing `note` column
    left-aligned, the others (numbers) right-aligned. Wider than `width`: the columns are split into several
    tables of at most `width`, each starting with the first column, separated by a blank line; a note column that
    still does not fit wraps inside its cells."""
    rows = [tuple(str(c) for c in r) for r in rows]
    n = len(rows[0])
    if width is None or _width(rows, range(n), indent) <= width:
        return _render(rows, range(n), note, indent)
    groups, cur = [], [0]
    for i in range(1, n):
        if len(cur) > 1 and _width(rows, [*cur, i], indent) > width:
            groups.append(cur)
            cur = [0, i]
        else:
            cur.append(i)
    groups.append(cur)
    out = []
    for g in groups:
        has_note = note and g[-1] == n - 1
        sub = [tuple(r[i] for i in g) for r in rows]
        if has_note and _width(sub, range(len(g)), indent) > width:
            sub = _wrap_last(sub, width - _width(sub, range(len(g) - 1), indent) - 2)
        out += ([""] if out else []) + _render(sub, range(len(g)), has_note, indent)
    return out


def wrap(lines: list[str], width: int | None) -> list[str]:
    """Each line longer than `width` wrapped at spaces, its indent kept ("- " items hang under their text)."""
    if width is None:
        return lines
    out = []
    for line in lines:
        if len(line) <= width:
            out.append(line)
            continue
        lead = line[: len(line) - len(line.lstrip())]
        hang = lead + ("  " if line.lstrip().startswith("- ") else "")
        out += textwrap.wrap(line.strip(), width, initial_indent=lead, subsequent_indent=hang,
                             break_long_words=False, break_on_hyphens=False)
    return out


def _width(rows: list[tuple], cols, indent: str) -> int:
    cols = list(cols)
    return len(indent) + sum(max(len(r[i]) for r in rows) for i in cols) + 2 * (len(cols) - 1)


def _wrap_last(rows: list[tuple], room: int) -> list[tuple]:
    """The last column's cells wrapped to `room` (at least 20), continuation lines as rows of empty cells."""
    out = []
    for k, r in enumerate(rows):
        pieces = [r[-1]] if k == 0 else textwrap.wrap(r[-1], max(20, room), break_long_words=False) or [""]
        out.append((*r[:-1], pieces[0]))
        out += [(*("" for _ in r[:-1]), p) for p in pieces[1:]]
    return out


def _render(rows: list[tuple], cols, note: bool, indent: str) -> list[str]:
    cols = list(cols)
    w = [max(len(r[i]) for r in rows) for i in cols]
    out = []
    for k, r in enumerate(rows):
        cells = [r[i].rjust(w[j]) if 0 < j < len(cols) - (1 if note else 0) else r[i].ljust(w[j])
                 for j, i in enumerate(cols)]
        out.append((indent + "  ".join(cells)).rstrip())
        if k == 0:
            out.append(indent + "  ".join("-" * x for x in w))
    return out
