"""``trainvitals report`` as text, markdown or JSON (``html``: :mod:`trainvitals.report.html`)."""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from trainvitals.memory import format_bytes
from trainvitals.report.convergence import B_SIMPLE, B_SIMPLE_INTERVAL, B_SIMPLE_PARTIAL, NO_POINT, NORM_OVER_FLOOR
from trainvitals.report.model import Row, RunReport, exit_status
from trainvitals.text.markdown import markdown_table
from trainvitals.text.terminal import WIDTH, format_table, inline, markdown_to_text, table_cells

EMPTY_RUNS = "runs whose event files are empty (0 bytes: not flushed yet, or the run died at once), not reported"


def render(reports: Sequence[RunReport], fmt: str, skipped: Sequence[str] = (), empty: Sequence[str] = ()) -> str:
    """The reports as ``text``, ``markdown`` or ``json``; ``skipped`` names runs without trainvitals data, ``empty``
    those whose event files are all empty. Several runs get an overview first (:func:`overview_rows`).

    ``html`` needs the runs' series for its plots: :func:`trainvitals.report.html.render_html`."""
    if fmt == "json":
        return (
            json.dumps(
                _json_safe(
                    {
                        "critical": any(r.critical for r in reports),
                        "exit_status": exit_status(list(reports)),
                        "runs": [{**asdict(r), "critical": r.critical, "status": r.status} for r in reports],
                        "skipped_runs": list(skipped),
                        "empty_runs": list(empty),
                    }
                ),
                indent=2,
                allow_nan=False,
            )
            + "\n"
        )
    render_run = _markdown_run if fmt == "markdown" else _text_run
    out = []
    if len(reports) > 1:
        if fmt == "markdown":
            out += ["## overview", "", *overview_markdown(reports), ""]
        else:
            out += ["overview", *format_table([OVERVIEW, ["---"] * len(OVERVIEW), *overview_rows(reports)], "  "), ""]
    out += [line for r in reports for line in render_run(r)]
    if skipped:
        out.append(f"runs without trainvitals metrics, not reported: {', '.join(skipped)}")
    if empty:
        out.append(f"{EMPTY_RUNS}: {', '.join(empty)}")
    return "\n".join(out).rstrip() + "\n"


OVERVIEW = ("run", "status", "last step", "stop", NORM_OVER_FLOOR, "B_simple", "findings")
"""The overview's columns: a line per run, its sections' headline numbers (as the run's own report shows them)."""


def overview_rows(reports: Sequence[RunReport]) -> list[list[str]]:
    """One row per run under :data:`OVERVIEW` (named with the runs of the same logs): its status, last logged
    step, how it stopped (the stop row's words before their first colon), the last norm over its noise level,
    B_simple (its 90 % bound where the point is unreliable), and its findings by severity."""

    def cell(r: RunReport, section: str, label: str) -> str:
        found = next((row for row in r.sections.get(section, []) if row.label.startswith(label)), None)
        if found is None or found.value is None:
            return "-"
        shown = format_value(found)
        return shown + " (partial)" if found.label == B_SIMPLE_PARTIAL else shown

    def b_simple(r: RunReport) -> str:
        """B_simple's point, or where its interval has no upper end (‖G‖² within its error of 0: the point is
        unreliable, as the run's section says) that interval, "≥ 550 (90 %)"; "none (‖G‖² ≤ 0)" where the
        section's step has neither — each of the section's step, as its rows are."""
        point, bound = (cell(r, "noise scale and batch size", label) for label in (B_SIMPLE, B_SIMPLE_INTERVAL))
        partial = " (partial)" if point.endswith("(partial)") else ""
        if bound.startswith("≥"):
            return bound + partial
        return "none (‖G‖² ≤ 0)" + partial if point.startswith(NO_POINT) else point

    def counts(r: RunReport) -> str:
        n = {s: sum(f.severity == s for f in r.findings) for s in ("critical", "warning", "note")}
        return ", ".join(f"{k} {s}" + ("s" if k > 1 and s != "critical" else "") for s, k in n.items() if k) or "none"

    return [
        [
            r.names,
            r.status,
            "-" if r.last_step is None else str(r.last_step),
            cell(r, "convergence", "stop").split(":", 1)[0],
            cell(r, "convergence", NORM_OVER_FLOOR),
            b_simple(r),
            counts(r),
        ]
        for r in reports
    ]


def overview_markdown(reports: Sequence[RunReport]) -> list[str]:
    """The overview (:func:`overview_rows`) as a markdown table."""
    return markdown_table(OVERVIEW, overview_rows(reports))


def status_line(r: RunReport) -> str:
    """The run's status and its last logged optimizer step: the heading of its report in every format."""
    step = f", last logged optimizer step {r.last_step}" if r.last_step is not None else ""
    return r.status + step


_SET_AGAINST = {"lr scaling advice": "noise scale and batch size"}
"""Panels whose numbers are read beside a section's (the advice's B̂ beside B_simple): a step that differs from
that section's is shown too."""


def heading(r: RunReport, title: str) -> str:
    """A section's or panel's title, with the step its numbers are of when that is not the run's last logged
    step (:attr:`RunReport.steps`), or not the step of the section it is read beside (:data:`_SET_AGAINST`)."""
    step = r.steps.get(title)
    beside = r.steps.get(_SET_AGAINST.get(title, ""), step)
    return title if step is None or step == r.last_step == beside else f"{title}, as of optimizer step {step}"


def _markdown_run(r: RunReport) -> list[str]:
    """One run in markdown: the findings first, a table per section, the callbacks' panels as they wrote them."""
    out = [f"## run `{r.names}`: {status_line(r)}"] + (["", f"{r.same_logs_said}."] if r.same_logs else [])
    if r.findings:
        out += ["", "### findings", ""] + [f"- **{f.severity}** ({f.section}): {f.message}" for f in r.findings]
    for title, rows in r.sections.items():
        if rows:
            out += [
                "",
                f"### {heading(r, title)}",
                "",
                *markdown_table(("measure", "value"), [(row.label, format_value(row)) for row in rows]),
            ]
    for title, text in r.panels.items():
        out += ["", f"### {heading(r, title)}", "", text]
    return out + [""]


def _text_run(r: RunReport) -> list[str]:
    """One run for a terminal: the findings first, then aligned sections, then the panels as plain text."""
    out = [f"run {r.names}: {status_line(r)}"] + ([f"  {r.same_logs_said}."] if r.same_logs else [])
    if r.findings:
        out += ["", "  findings"] + [f"    [{f.severity}] {f.section}: {f.message}" for f in r.findings]
    for title, rows in r.sections.items():
        if rows:
            out += ["", f"  {heading(r, title)}"] + format_table(
                [[row.label, format_value(row)] for row in rows], indent="    "
            )
    for title, text in r.panels.items():
        out += ["", f"  {heading(r, title)}"]
        out += _findings_text(text, "    ") or [textwrap.indent(markdown_to_text(text), "    ")]
    return out + [""]


FINDINGS_HEADER = ["step", "kind", "names", "finding"]
"""The columns of GraphIntegrityCallback's findings table (its ``summary_markdown``)."""


def _findings_text(markdown: str, indent: str) -> list[str] | None:
    """GraphIntegrityCallback's findings table for a terminal, one block a finding: "step N, kind: names", then
    the finding wrapped at :data:`~trainvitals.text.terminal.WIDTH` under it — not a table whose last column wraps
    into a narrow strip beside the names. Names the finding's text already lists are not said twice. None when
    ``markdown`` is not that table alone."""
    lines = [line for line in markdown.splitlines() if line.strip()]
    if not all(line.lstrip().startswith("|") for line in lines):
        return None
    rows = [table_cells(line) for line in lines]
    if len(rows) < 3 or [inline(c).lower() for c in rows[0]] != FINDINGS_HEADER or any(len(r) != 4 for r in rows):
        return None
    out: list[str] = []
    wrap = {"width": WIDTH, "break_long_words": False, "break_on_hyphens": False}
    for step, kind, names, finding in ([inline(c) for c in row] for row in rows[2:]):
        head = f"step {step}, {kind}" + (f": {names}" if names and names not in finding else "")
        out += textwrap.wrap(head, initial_indent=indent, subsequent_indent=indent + "    ", **wrap)
        out += textwrap.wrap(finding, initial_indent=indent + "  ", subsequent_indent=indent + "  ", **wrap)
    return out


def _json_safe(obj: Any) -> Any:
    """``inf``/``nan`` (B_simple when ‖G‖² ≤ 0) as the strings ``"inf"``/``"nan"``: JSON has no such numbers."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def format_value(row: Row) -> str:
    """A row's value as shown: ``n/a`` when not logged, bytes in binary units, a share as a percent, a number
    to 4 digits; with its own step when it is not its section's."""
    v = row.value
    if v is None:
        return "n/a"
    if isinstance(v, str):
        text = v
    elif row.unit == "bytes":
        text = format_bytes(v)
    elif row.unit == "share":
        text = f"{v:.1%}"
    else:
        text = f"{v:.4g} {row.unit}" if row.unit else f"{v:.4g}"
    return text if row.step is None else f"{text} (at optimizer step {row.step})"
