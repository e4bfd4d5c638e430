"""Markdown pipe tables: the one way trainvitals writes them (the callbacks' diagnoses, core's advice tables,
``trainvitals report``). Pure Python; :mod:`trainvitals.text.terminal` and :mod:`~trainvitals.report.html`
read them back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def markdown_cell(value: object) -> str:
    """``value`` as the text of one cell: a bar escaped (``\\|``), a line break as ``<br>`` (a space as
    plain text, a break in TensorBoard and HTML)."""
    return str(value).replace("|", "\\|").replace("\n", "<br>")


def markdown_table(headers: Sequence[object], rows: Iterable[Sequence[object]], align: str = "") -> list[str]:
    """A pipe table as lines: the header, the separator, one line per row, every cell through
    :func:`markdown_cell` (an empty one as ``| |``).

    ``align`` has a letter per column: ``"r"`` right-aligned (``---:``, for numbers), anything else left;
    columns past its end are left-aligned.
    """
    separator = "|" + "|".join("---:" if a == "r" else "---" for a in align.ljust(len(headers), "l")) + "|"
    return [_line(headers), separator, *map(_line, rows)]


def _line(cells: Sequence[object]) -> str:
    return "|" + "|".join(f" {text} " if text else " " for text in map(markdown_cell, cells)) + "|"
