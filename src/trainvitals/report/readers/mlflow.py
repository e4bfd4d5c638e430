"""An MLflow file store's run for ``trainvitals report``: ``mlruns/<experiment>/<run>/``.

Each metric is a file under ``metrics/``, its key the file's path there (``metrics/grad_norm/total``), one line
``<timestamp ms> <value> <step>`` per value logged; the fit-end JSON is one of the run's artifacts
(``artifacts/trainvitals_report.json``). MLFlowLogger's keys are the trainvitals tags with the characters MLflow
refuses mapped to ``_`` (``trainvitals.tags.mlflow_key``).
"""

from __future__ import annotations

import os
from pathlib import Path

from trainvitals.report.events import Run
from trainvitals.report.readers.text import last_read, read_lines
from trainvitals.report.record import read_record
from trainvitals.tags import REPORT_JSON


def finds(files: list[str], subfolders: list[str]) -> bool:
    return "meta.yaml" in files and "metrics" in subfolders


def read(folder: Path, name: str) -> Run:
    """The run in ``folder``: every metric file's ``(step, value)`` lines, in the order logged; the text panels
    from the fit-end JSON artifact when present. A metric file whose last line lacks its newline is damage."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    damage = []
    metrics = folder / "metrics"
    for where, _, files in os.walk(metrics):
        for file in sorted(files):
            path = Path(where, file)
            key = path.relative_to(metrics).as_posix()
            text, cut = read_lines(path, f"{name}/metrics/{key}")
            series = scalars[key] = []
            for line in text.splitlines():
                parts = line.split()
                try:
                    series.append((int(parts[2]), float(parts[1])))
                except (IndexError, ValueError):
                    continue
            damage += last_read(cut, series[-1][0] if series else None)
    texts, layout = read_record(folder / "artifacts" / REPORT_JSON) or ({}, False)
    return Run(
        name=name, scalars=dict(sorted(scalars.items())), texts=texts, damage=damage, layout=layout, logger="MLflow"
    )
