"""Markdown cells and tables, shared by every module that renders a part of the summary (`report`, `step`)."""

from __future__ import annotations

from .rows import ESTIMATE_UNIT


def human_bytes(n: float | None) -> str:
    """A byte count as people read it: "1.3 GB", "805.3 MB", "12 B"; "-" for None."""
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def number(value: float | None, unit: str) -> str:
    """A figure in its unit's form: bytes as `human_bytes`, ops whole, estimated ms to 2 decimals, else 3 digits."""
    if value is None:
        return "-"
    if unit == ESTIMATE_UNIT:
        return f"{value:.2f}"
    return human_bytes(value) if unit == "bytes" else f"{value:.0f}" if unit == "ops" else f"{value:.3g}"


def table(header: list[str], body: list[list[str]]) -> list[str]:
    """A markdown table: the header, its rule, one line per row."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(cells) + " |" for cells in body),
    ]
