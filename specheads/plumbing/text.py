"""Numbers in user-facing sentences: counts with their noun in the right number, rates that never round to 0."""

from __future__ import annotations


def count(number: int, noun: str, plural: str | None = None) -> str:
    """`1 test prompt`, `3 test prompts` (`plural` for nouns that do not take an s)."""
    return f"{number:,} {noun if number == 1 else plural or noun + 's'}"


def rate(value: float) -> str:
    """A rate with thousands separators when large and three significant digits when small (never a bare 0)."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
