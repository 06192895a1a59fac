"""The shipped presets: `configs/<family>/<method>-<N>gb.yaml`, each opening with a comment header.

A preset's header is its documentation, and `dittrain presets` prints it as a table:

    # <title: what it trains, for which card; may run over several comment lines>
    # trains: <method, rank, resolution>
    # expects: <VRAM, RAM, speed relative to no offloading>

The table groups the presets by folder (a family, or another size of one: configs/wan-1.3b/), one row per file
with its card size and what it expects, wrapped at word boundaries to the terminal's width (100 columns where there
is no terminal) under its own column, never cut. A preset without `expects:` (the tiny ones) shows its title's first
sentence, whole. `configs/tiny/` holds the CPU-sized configs of the demo and the tests; they are listed last.
`dittrain presets FAMILY` lists one family's (its sizes' too), `--vram GB` the one preset per folder and method for
that card (the largest card size at or below it); without them, every preset.
"""

from __future__ import annotations

import re
import shutil
import textwrap
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

from .errors import UserError

_NAME = re.compile(r"^(?P<method>lora|full)-(?P<gb>\d+)gb$")


@dataclass(frozen=True)
class Preset:
    path: Path
    family: str
    method: str
    vram_gb: int | None
    title: str
    trains: str
    expects: str


def _header(path: Path) -> dict[str, str]:
    fields: dict[str, str] = {}
    title: list[str] = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        key, sep, value = text.partition(":")
        if sep and key in ("trains", "expects"):
            fields[key] = value.strip()
        elif text and "trains" not in fields and "expects" not in fields:
            title.append(text)  # the title's comment lines, up to the first key line
    fields["title"] = _first_sentence(" ".join(title))
    return fields


def _first_sentence(text: str) -> str:
    """Up to the first full stop that ends a sentence (". " or the end), never in the middle of one."""
    m = re.search(r"\.(\s|$)", text)
    return text[: m.start() + 1] if m else text


def find_presets(configs_dir: Path) -> list[Preset]:
    """Every preset YAML under configs_dir, sorted by family, method and card size."""
    if not configs_dir.is_dir():
        raise UserError(f"{configs_dir}: no presets folder here (run from the dittrain checkout, or pass --dir)")
    out = []
    for path in sorted(configs_dir.glob("*/*.yaml")):
        m = _NAME.match(path.stem)
        head = _header(path)
        out.append(
            Preset(
                path=path,
                family=path.parent.name,
                method=m["method"] if m else path.stem,
                vram_gb=int(m["gb"]) if m else None,
                title=head.get("title", ""),
                trains=head.get("trains", ""),
                expects=head.get("expects", ""),
            )
        )
    out.sort(key=lambda p: (p.family == "tiny", p.family, p.method, p.vram_gb or 0, p.path.name))
    return out


def _card(p: Preset) -> str:
    return f"{p.vram_gb} GB" if p.vram_gb else "CPU" if p.family == "tiny" else "-"


def pick(presets: list[Preset], family: str | None = None, vram_gb: float | None = None) -> list[Preset]:
    """The presets of `family` (any accepted spelling; None: every family): its folder and its sizes' (`wan`:
    configs/wan/ and configs/wan-1.3b/), or one size's (`wan-1.3b`); and with `vram_gb` only the one for that card
    per folder and method: the largest card size at or below it (the tiny CPU configs left out)."""
    if family is not None:
        from .models import ADAPTERS, preset_folder

        key, size = preset_folder(family, where="dittrain presets FAMILY")
        # a size's folder is <family>-<size> and no family's own (wan-i2v is a family, not a size of wan)
        sizes = {p.family for p in presets if p.family.startswith(key + "-") and p.family not in ADAPTERS}
        if size and f"{key}-{size}" not in sizes:
            raise UserError(f"dittrain presets FAMILY: no presets folder {key}-{size} ({key}'s sizes with presets: "
                            f"{', '.join(sorted(sizes)) or 'none'})")
        presets = [p for p in presets if p.family == (f"{key}-{size}" if size else key) or not size and p.family in sizes]
    if vram_gb is not None:
        fits = [p for p in presets if p.vram_gb is not None and p.vram_gb <= vram_gb]
        best = {}
        for p in fits:  # sorted by card size within family and method: the last one fitting wins
            best[(p.family, p.method)] = p
        presets = [p for p in fits if best[(p.family, p.method)] is p]
    return presets


def print_presets(configs_dir: Path, width: int | None = None, family: str | None = None,
                  vram_gb: float | None = None) -> None:
    """The table (see the module docstring), no line wider than `width` (default: the terminal's, 60 to 120);
    `family` / `vram_gb` narrow it (`pick`)."""
    every = find_presets(configs_dir)
    if not every:
        raise UserError(f"{configs_dir}: no presets found (expected <family>/<lora|full>-<N>gb.yaml files)")
    presets = pick(every, family, vram_gb)
    if not presets:
        smallest = min((p.vram_gb for p in pick(every, family) if p.vram_gb), default=None)
        raise UserError(f"no preset for a {vram_gb:g} GB card{f' of family {family}' if family else ''} (the "
                        f"smallest is {smallest} GB): `dittrain plan CONFIG --vram {vram_gb:g}` says what fits")
    width = width or max(60, min(120, shutil.get_terminal_size((100, 24)).columns))
    name_w = max(len(p.path.name) for p in presets)
    card_w = max(len("card"), *(len(_card(p)) for p in presets))
    indent = 2 + name_w + 2 + card_w + 2
    print(f"  {'preset':<{name_w}}  {'card':<{card_w}}  expects (planner prediction; measured where noted)")
    for folder, group in groupby(presets, key=lambda p: p.path.parent):
        print(f"{folder}/")
        for p in group:
            text = textwrap.wrap(p.expects or p.title or "-", width=max(20, width - indent), break_long_words=False,
                                 break_on_hyphens=False)
            print(f"  {p.path.name:<{name_w}}  {_card(p):<{card_w}}  {text[0]}")
            for line in text[1:]:
                print(" " * indent + line)
    print("\nCopy the one for your card, set model.path and data.sources, then: dittrain fit my.yaml")
    if family is None and vram_gb is None:
        print("Only one family or card: dittrain presets FAMILY, dittrain presets --vram GB (or both)")
