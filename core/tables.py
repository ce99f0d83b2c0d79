"""Markdown tables: the one renderer of the tables in evaluate's eval/report.md and the study's
report.md. A table is a header and rows of cells already formatted (each report chooses its
columns and their digits); this module only lays them out as a pipe table."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def row(cells: Sequence[str]) -> str:
    """One row: `| a | b |`, every cell as given (an empty one is `|  |`)."""
    return "| " + " | ".join(cells) + " |"


def header(headings: Sequence[str]) -> list[str]:
    """The header row and its rule, one `---` per column; an empty heading is `| |` (the row
    labels' column)."""
    return [
        "|" + "|".join(f" {h} " if h else " " for h in headings) + "|",
        "|---" * len(headings) + "|",
    ]


def table(headings: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A whole table: the header, its rule and one line per row."""
    return [*header(headings), *(row(cells) for cells in rows)]
