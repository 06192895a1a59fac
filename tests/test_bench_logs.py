"""bench/logs holds the raw output that the current figures stand on, and nothing else.

The rule (bench/RESULTS.md says it too): a file under bench/logs/ stays when bench/RESULTS.md cites it, or when the
notebook section a current row of RESULTS.md points to cites it. A row points to a section through its "date
(section)" cell: the day's link to bench/history/<day>.md, then the times ("15:30") or quoted titles ("Outcome")
that name the section's heading; the section runs to the next heading of its level or above (a cell with no time or
title points to the whole notebook). A citation is a log name as the notebooks write it, with or without
`bench/logs/`: a file (`2026-11-22-plan.md`, which keeps its `.json` / `.log` beside it: the same name before the
extension), a folder (`2026-11-27-wan/`, everything under it), a glob (`2026-11-25h-*`) or a brace list
(`{md,json}`, `{a..i}`)."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
LOGS = BENCH / "logs"

# a log name: a date, then a letter or a dash and more (a date followed by a space or comma is a date, not a log)
_CITATION = re.compile(r"(?:bench/)?(?:logs/)?(20\d\d-\d\d-\d\d(?=[a-z{]|-[\w{*])(?:\{[^}\s]*\}|[^\s`'\",;()\[\]{}])+)")
_HEADING = re.compile(r"^(#+)\s+(.*)")
_EXTENSIONS = (".md", ".json", ".jsonl", ".log", ".txt")


def _expand(pattern: str) -> list[str]:
    """Shell brace expansion: `{a,b}` lists and `{a..i}` letter or number ranges."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    body = m.group(1)
    if ".." in body:
        lo, hi = body.split("..")
        items = ([str(i) for i in range(int(lo), int(hi) + 1)] if lo.isdigit()
                 else [chr(c) for c in range(ord(lo), ord(hi) + 1)])
    else:
        items = body.split(",")
    return [x for item in items for x in _expand(pattern[: m.start()] + item + pattern[m.end():])]


def citations(text: str) -> list[str]:
    """The log patterns `text` cites, braces expanded, relative to bench/logs/."""
    out = []
    for raw in _CITATION.findall(text):
        for p in _expand(raw.rstrip(".:")):
            out.append(p)
    return out


def _matches(pattern: str, rel: str) -> bool:
    """Whether the log at `rel` (relative to bench/logs/) is cited by `pattern`."""
    if pattern.endswith("/"):
        return rel.startswith(pattern)
    if fnmatch.fnmatchcase(rel, pattern) or rel.startswith(pattern + "/"):
        return True
    stem = next((pattern[: -len(e)] for e in _EXTENSIONS if pattern.endswith(e)), None)
    return stem is not None and fnmatch.fnmatchcase(rel, stem + ".*") and "/" not in rel[len(stem):]


def _table_rows(text: str) -> list[dict[str, str]]:
    """The rows of the tables of `text` that have a "date (section)" column, as {header: cell}."""
    rows, header = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set(line) <= set("|- :") and "date (section)" in header:
            rows.append(dict(zip(header, cells, strict=False)))
    return rows


def _section(notebook: str, key: str | None) -> list[str]:
    """The text of the sections of `notebook` whose heading holds `key` (None: the whole notebook)."""
    lines = notebook.splitlines()
    if key is None:
        return [notebook]
    found = []
    for i, line in enumerate(lines):
        m = _HEADING.match(line)
        if m and key in m.group(2):
            level = len(m.group(1))
            end = next((j for j in range(i + 1, len(lines))
                        if (h := _HEADING.match(lines[j])) and len(h.group(1)) <= level), len(lines))
            found.append("\n".join(lines[i:end]))
    return found


def row_sections(results: str, history: Path) -> list[tuple[str, str, list[str]]]:
    """Per current row of RESULTS.md and per section it names: (notebook file, key, the sections' texts)."""
    out = []
    for row in _table_rows(results):
        cell = row["date (section)"]
        # "[day](history/day.md) 07:45, 18:50; [day2](history/day2.md) 01:05": each day's keys follow its link
        parts = re.split(r"\[[^\]]*\]\(history/([^)]+\.md)\)", cell)
        for day, rest in zip(parts[1::2], parts[2::2], strict=True):
            notebook = (history / day).read_text()
            keys = re.findall(r"\b\d\d:\d\d\b", rest) + re.findall(r"\"([^\"]+)\"", rest)
            for key in keys or [None]:
                out.append((day, key or "", _section(notebook, key)))
    return out


def cited_patterns(bench: Path = BENCH) -> list[str]:
    """Every log pattern RESULTS.md cites, itself or through the notebook sections its rows point to."""
    results = (bench / "RESULTS.md").read_text()
    pats = citations(results)
    for _, _, sections in row_sections(results, bench / "history"):
        for text in sections:
            pats += citations(text)
    return pats


def kept_logs(bench: Path = BENCH) -> tuple[set[str], set[str]]:
    """(the logs the rule keeps, the logs it does not), relative to bench/logs/."""
    logs = bench / "logs"
    every = {p.relative_to(logs).as_posix() for p in logs.rglob("*") if p.is_file()}
    pats = cited_patterns(bench)
    kept = {rel for rel in every if any(_matches(p, rel) for p in pats)}
    return kept, every - kept


def test_every_row_points_to_a_section():
    """Each current row's day and times / titles name a heading of that day's notebook."""
    results = (BENCH / "RESULTS.md").read_text()
    rows = row_sections(results, BENCH / "history")
    assert rows
    for day, key, sections in rows:
        assert sections, f"RESULTS.md points to {day} {key!r}: no heading of that notebook holds it"


def test_every_log_results_cites_exists():
    """A log RESULTS.md cites, itself or in a section a row points to, is under bench/logs/."""
    every = [p.relative_to(LOGS).as_posix() for p in LOGS.rglob("*") if p.is_file()]
    missing = [p for p in cited_patterns() if not any(_matches(p, rel) for rel in every)]
    assert not missing, f"cited by RESULTS.md (or a section its rows point to) but not in bench/logs/: {missing}"


def test_no_log_is_uncited():
    """Every file under bench/logs/ is cited by RESULTS.md or by a section a current row points to: a log no
    current figure stands on is removed (git keeps it; each notebook's note says how to get one back)."""
    _, uncited = kept_logs()
    assert not uncited, f"logs no current row of bench/RESULTS.md cites (remove them or cite them): {sorted(uncited)}"


def test_citations_expand_as_the_shell_does():
    assert citations("Raw: `bench/logs/2026-11-22-fullft.{md,json,log}`.") == [
        "2026-11-22-fullft.md", "2026-11-22-fullft.json", "2026-11-22-fullft.log"]
    assert citations("Logs: `bench/logs/2026-11-26{a..c}-*`; 2026-11-25 15:30 UTC, 2026-11-23, night") == [
        "2026-11-26a-*", "2026-11-26b-*", "2026-11-26c-*"]
    assert citations("Logs: `bench/logs/2026-11-27-wan/`.") == ["2026-11-27-wan/"]
    assert _matches("2026-11-22-plan.md", "2026-11-22-plan.json")
    assert not _matches("2026-11-22-plan.md", "2026-11-22-plan-run2.json")
    assert _matches("2026-11-27-wan/", "2026-11-27-wan/x.log")
    assert _matches("2026-11-27-wan", "2026-11-27-wan/x.log")
    assert not _matches("2026-11-27-wan", "2026-11-27-wan22/x.log")
