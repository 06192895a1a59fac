"""Counted nouns for messages: `count(1, "image")` is "1 image", `count(5, "image")` "5 images"."""

from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`n noun`, the noun in the plural unless n is 1 (`plural` for nouns that do not just add an s)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
