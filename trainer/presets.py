"""The shipped presets: `configs/<family>/<method>-<N>gb.yaml`, each opening with a comment header.

A preset's header is its documentation, and `dittrain presets` prints it as a table:

    # <title: what it trains, for which card>
    # trains: <method, rank, resolution>
    # expects: <VRAM, RAM, speed relative to no offloading>

`configs/tiny/` holds the CPU-sized configs of the demo and the tests; they are listed apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
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
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        key, sep, value = text.partition(":")
        if sep and key in ("trains", "expects"):
            fields[key] = value.strip()
        elif "title" not in fields and text:
            fields["title"] = text
    return fields


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


def print_presets(configs_dir: Path) -> None:
    presets = find_presets(configs_dir)
    if not presets:
        raise UserError(f"{configs_dir}: no presets found (expected <family>/<lora|full>-<N>gb.yaml files)")
    rows = [("preset", "family", "method", "card", "expects")]
    for p in presets:
        card = f"{p.vram_gb} GB" if p.vram_gb else "CPU" if p.family == "tiny" else "-"
        rows.append((str(p.path), p.family, p.method, card, p.expects or p.title))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4])
        if i == 0:
            print("  ".join("-" * w for w in widths) + "  " + "-" * 7)
    print("\nCopy the one for your card, set model.path and data.sources, then: dittrain fit my.yaml")
