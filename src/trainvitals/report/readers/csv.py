"""A CSVLogger's run folder for ``trainvitals report``: its ``metrics.csv`` and the fit-end JSON beside it.

CSVLogger writes one row per logging call, a column per key (empty where that call did not log it) and the
optimizer step in ``step``; the keys are the logger's, its ``prefix`` included (split off as TensorBoard's are).
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from trainvitals.report.events import Run
from trainvitals.report.readers.text import last_read, read_lines
from trainvitals.report.record import read_record
from trainvitals.tags import REPORT_JSON

METRICS = "metrics.csv"


def finds(files: list[str], subfolders: list[str]) -> bool:
    return METRICS in files


def read(folder: Path, name: str) -> Run:
    """The run in ``folder``: every numeric cell of ``metrics.csv`` as ``(step, value)`` under its column, in row
    order; the text panels from :data:`~trainvitals.tags.REPORT_JSON` when present. A last line without its
    newline (a writer killed mid-line) is left out and is the run's damage."""
    text, damage = read_lines(folder / METRICS, f"{name}/{METRICS}")
    scalars: dict[str, list[tuple[int, float]]] = {}
    last = None
    for row in csv.DictReader(io.StringIO(text)):
        step = _number(row.pop("step", None))
        if step is None:
            continue
        for key, cell in row.items():
            value = _number(cell)
            if key and value is not None:
                scalars.setdefault(key, []).append((int(step), value))
                last = int(step)
    texts, layout = read_record(folder / REPORT_JSON) or ({}, False)
    return Run(
        name=name,
        scalars=scalars,
        texts=texts,
        damage=last_read(damage, last),
        layout=layout,
        logger="CSV",
    )


def _number(cell: str | None) -> float | None:
    """A cell's number; ``None`` for an empty cell (not logged by that call) or one that is no number."""
    if not cell:
        return None
    try:
        return float(cell)
    except (TypeError, ValueError):  # TypeError: the extra cells of a row longer than the header, as a list
        return None
