"""The README and the guides in docs/ against the code: every `dittrain ...` command they show parses with the real
CLI, and every relative link points at a file that exists.

Commands come from two places. A line of a fenced code block that runs `dittrain` (alone, or after `torchrun ...
--no-python`) is a whole command line: click parses it as `dittrain` would (the subcommand, its options and their
values, its arguments), without running it. An inline code span that starts with `dittrain ` is a fragment of one
(`dittrain sample --image` in a sentence), so only its subcommand and option names are checked. Placeholders
(`my.yaml`, `IN OUT`, `[--out DIR]`, `--model ...`) parse as values; square brackets are dropped first."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest
import typer.main

from trainer.cli import app

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_SPAN = re.compile(r"`([^`]+)`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CLI = typer.main.get_command(app)


def _commands(path: Path) -> list[tuple[str, bool]]:
    """(command after `dittrain`, whole line?) for every command the file shows."""
    text = path.read_text(encoding="utf-8")
    found = []
    for block in _FENCE.findall(text):
        for line in block.splitlines():
            m = re.search(r"(?:^|\s)dittrain\s+(\S.*)$", line)
            if m and not line.lstrip().startswith("#"):
                found.append((re.split(r"\s+#\s", m.group(1))[0], True))
    for span in _SPAN.findall(_FENCE.sub("", text)):
        span = " ".join(span.split())
        if span.startswith("dittrain ") and re.match(r"dittrain -{0,2}[a-z]", span):
            found.append((span[len("dittrain ") :], False))
    return found


def _option_names(cmd: click.Command) -> set[str]:
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")} | {"--help"}


CASES = [(p.relative_to(ROOT).as_posix(), c, whole) for p in DOCS for c, whole in _commands(p)]


def test_docs_show_commands():
    """The collection above finds the README's first run (a broken regex would pass every case vacuously)."""
    shown = [c for f, c, _ in CASES if f == "README.md"]
    assert any(c.startswith("fit my.yaml") for c in shown) and any(c.startswith("sample ") for c in shown)
    assert len({f for f, _, _ in CASES}) >= 5


@pytest.mark.parametrize(("doc", "command", "whole"), CASES, ids=[f"{f}: {c[:60]}" for f, c, _ in CASES])
def test_shown_command_parses(doc, command, whole):
    args = [a.strip("[]") for a in shlex.split(command)]
    args = [a for a in args if a]
    if args[0].startswith("-"):  # `dittrain --help`, `dittrain --version`
        assert args[0] in _option_names(_CLI) | {"--version"}, (
            f"{doc}: `dittrain {command}`: no option {args[0]}"
        )
        return
    name, rest = args[0], args[1:]
    assert name in _CLI.commands, (
        f"{doc}: `dittrain {command}`: no command {name!r} (have {sorted(_CLI.commands)})"
    )
    sub = _CLI.commands[name]
    known = _option_names(sub)
    for a in rest:
        if a.startswith("-") and not re.fullmatch(r"-[\d.]+", a):
            assert a.split("=")[0] in known, (
                f"{doc}: `dittrain {command}`: {name} has no option {a} ({sorted(known)})"
            )
    if whole:  # parse it as the shell would hand it over, without running the command
        try:
            sub.make_context(name, rest)
        except click.exceptions.Exit:
            pass
        except click.UsageError as e:
            pytest.fail(f"{doc}: `dittrain {command}` does not parse: {e.format_message()}")


def _links() -> list[tuple[str, str]]:
    out = []
    for p in DOCS:
        text = _FENCE.sub("", p.read_text(encoding="utf-8"))
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            out.append((p.relative_to(ROOT).as_posix(), target))
    return out


def test_docs_have_links():
    assert any(target == "docs/memory.md" for _, target in _links())


@pytest.mark.parametrize(("doc", "target"), _links())
def test_relative_link_points_at_a_file(doc, target):
    path = (ROOT / doc).parent / target.split("#")[0]
    assert path.exists(), f"{doc} links to {target}, which does not exist"


def test_the_site_holds_every_guide_in_the_index_order():
    """mkdocs.yml (`make docs`) builds docs/ with docs/README.md as the front page: its nav is that page and then
    the guides in the order of its table, and the table names every guide of docs/, so a new guide is not left
    out of the site or the index."""
    import yaml

    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert site["docs_dir"] == "docs" and site["strict"] is True
    index = (ROOT / "docs" / "README.md").read_text()
    table = re.findall(r"^\| \[([\w.-]+\.md)\]\(\1\) \|", index, re.M)
    assert site["nav"] == ["README.md", *table]
    assert sorted(table) == sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
