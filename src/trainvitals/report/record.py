"""A fit's report made from what it logged, at fit end, and the record its JSON carries for the other readers.

TrainvitalsDashboard keeps every trainvitals scalar and text panel of the fit (the shared writer's
``RunRecord``) and, at fit end, makes of them the :class:`~trainvitals.report.events.Run` that ``trainvitals
report`` would read back from the run's event files: the same sections, findings and page, whatever the loggers.
The JSON is ``trainvitals report --format json``'s, plus ``"record"``: the run's text panels (the callbacks'
diagnoses, the fit's end) and whether the dashboard ran, which a CSVLogger's ``metrics.csv`` and an MLflow
metric file cannot hold; the CSV and MLflow readers take them from there (:func:`read_record`).
"""

from __future__ import annotations

import json
from pathlib import Path

from trainvitals.report.assess import assess
from trainvitals.report.events import Run
from trainvitals.report.model import RunReport
from trainvitals.report.render import render


def fit_end_report(
    name: str, scalars: dict[str, list[tuple[int, float]]], texts: dict[str, list[tuple[int, str]]]
) -> tuple[RunReport, str | None, str]:
    """The report of the run ``name`` from its logged ``scalars`` and ``texts`` (``{tag: [(step, value)]}``, tags
    without a logger prefix); returns it, its HTML page (``None`` without matplotlib, which the page's plots
    need) and its JSON with the ``"record"`` (module docstring)."""
    run = Run(name=name, scalars=scalars, texts=texts, layout=True)
    report = assess(run)
    try:
        from trainvitals.report.html import render_html

        page: str | None = render_html([(run, report)])
    except ImportError:  # matplotlib is the examples' and dev extras', not a dependency
        page = None
    document = json.loads(render([report], "json"))
    document["record"] = {"texts": texts, "layout": run.layout}
    return report, page, json.dumps(document, indent=2) + "\n"


def read_record(path: Path) -> tuple[dict[str, list[tuple[int, str]]], bool] | None:
    """The text panels and the layout flag of a fit-end JSON at ``path``; ``None`` when it is missing, unreadable
    or holds no record (a JSON that ``trainvitals report --format json -o`` wrote)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8")).get("record")
        texts = {tag: [(int(step), str(text)) for step, text in entries] for tag, entries in record["texts"].items()}
        return texts, bool(record.get("layout"))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
