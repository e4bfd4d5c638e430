"""The report's section on TrainingGuard: what it met (non-finite steps, spikes), what it did (skips, rollbacks, a
stop), and the module that made the first inf/NaN.

The events are read from the run folder's ``skip_batches.json`` (every event), else from the guard's text panel
(its summary line and latest events: the dashboard's ``diagnosis/TrainingGuard`` or ``guard/event_log``), the
totals from its counters ``guard/events``, ``guard/skipped_steps`` and ``guard/rollbacks``. Severity: a stop, or a
non-finite step the guard only warned about (applied as it was), is critical — as non-finite gradients are in the
spikes section; skips, rollbacks and spike warnings are a warning (the run went on without those steps).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainvitals.report.events import Run
from trainvitals.report.model import Finding, Row, RunReport, as_of, counter, panel
from trainvitals.tags import DIAGNOSIS_PREFIXES, GUARD_EVENT_LOG, SKIP_BATCHES_FILE
from trainvitals.text.terminal import inline, table_cells

GUARD = "training guard"
EVENTS, SKIPPED, ROLLBACKS = r"guard/events$", r"guard/skipped_steps$", r"guard/rollbacks$"
SHOWN_EVENTS = 10
"""Events listed as rows of the section, the latest last (every one is in ``skip_batches.json``)."""
_STOPPED, _MADE_BY = "; stopped: ", "; first inf/NaN made by "  # TrainingGuard.summary_line's words
_MADE_IN_DETAIL = "; made by "  # and its event's detail's


def guard_section(run: Run, report: RunReport) -> None:
    """The guard's counts, its stop and the producer at the section's step, its latest events; one finding that
    says what it met and what it did (module docstring for its severity)."""
    text = _panel_text(run)
    if not (run.matching(EVENTS) or text):
        return
    as_of(run, report, GUARD, EVENTS, SKIPPED)
    events, recorded = guard_events(run)
    total = int(counter(run, EVENTS, last=True)) or len(events)
    if not total:
        report.sections[GUARD] = [Row("events", 0.0)]
        return
    summary = text.splitlines()[0] if text else ""
    producer = next((e["producer"] for e in events if e.get("producer")), None) or _after(summary, _MADE_BY)
    stop = next((e for e in events if e["action"] == "stop"), None)
    stopped = _after(summary, _STOPPED, until=_MADE_BY)
    skipped, rollbacks = counter(run, SKIPPED, last=True), counter(run, ROLLBACKS, last=True)
    kinds = {kind: sum(e["kind"] == kind for e in events) for kind in ("nonfinite", "spike")}
    applied = [e for e in events if e["kind"] == "nonfinite" and e["action"] == "warn"]
    among = f" among the latest {len(events)}" if len(events) < total else ""

    rows = [
        Row("events", float(total)),
        Row(f"non-finite steps{among}", float(kinds["nonfinite"]), "steps"),
        Row(f"spikes{among}", float(kinds["spike"]), "steps"),
        Row("steps skipped", skipped, "steps"),
        Row("rollbacks", rollbacks),
    ]
    if stop or stopped:
        rows.append(Row("stopped", stopped or f"at optimizer step {stop['global_step']}: {stop.get('detail', '')}"))
    if producer:
        rows.append(Row("first inf/NaN made by", producer))
    if recorded:
        rows.append(Row("every event's batches", str(recorded)))
    rows += [Row(f"event at optimizer step {e['global_step']}", _event_words(e)) for e in events[-SHOWN_EVENTS:]]
    report.sections[GUARD] = rows

    did = [
        f"skipped {skipped:g} step(s)" if skipped else "",
        f"rolled back {rollbacks:g} time(s)" if rollbacks else "",
        f"warned about {n} without acting" if (n := sum(e["action"] == "warn" for e in events)) else "",
        f"stopped the fit at optimizer step {stop['global_step']}" if stop else ("stopped the fit" if stopped else ""),
    ]
    first = events[0] if events and not among else None
    message = (
        f"TrainingGuard met {total} event(s) ({kinds['nonfinite']} non-finite step(s), {kinds['spike']} spike(s)"
        f"{among}) and {', '.join(d for d in did if d) or 'recorded them'}"
        + (f"; the first at optimizer step {first['global_step']}: {_seen(first)}" if first else "")
        + (f"; the first inf/NaN was made by {producer}" if producer else "")
        + "."
    )
    if stop or stopped:
        message += (
            " A guard stop is no convergence (as GradNormEarlyStopping's is): the fit ended on an event it was told to "
            "stop on, or once its budget of skips and rollbacks was spent"
            + (f"; its checkpoint: {checkpoint}" if (checkpoint := _after(stopped, "; checkpoint: ")) else "")
            + "."
        )
    if applied:
        message += (
            f" {len(applied)} non-finite step(s) were applied as they were (action warn, from optimizer step "
            f"{applied[0]['global_step']}): the weights may hold inf/NaN since."
        )
    if recorded:
        message += f" The steps' batches are listed in {recorded}."
    report.findings.append(Finding("critical" if stop or stopped or applied else "warning", GUARD, message))
    for prefix in DIAGNOSIS_PREFIXES:
        panel(run, report, "training guard at fit end", f"{prefix}TrainingGuard")
    if "training guard at fit end" not in report.panels:
        panel(run, report, "training guard events", GUARD_EVENT_LOG)


ANSWERED_NONFINITE = (
    "non-finite (inf/NaN) gradients on {n} optimizer step(s), each answered by TrainingGuard (skipped or rolled "
    "back): the weights took none of them; the training guard section says which batches and what made them"
)
"""GradNormMonitor's non-finite steps when the guard answered every one: a warning, as the guard's skips are."""


def answered_nonfinite_steps(run: Run) -> int:
    """How many of the guard's recorded non-finite events it answered by not applying the step (a skip or a
    rollback; a stop ends the fit and is the guard section's own critical finding): GradNormMonitor counts those
    steps too. Events read from the text panel (its latest 20) may undercount, which keeps the monitor's count
    critical: never more lenient than the events show."""
    events, _ = guard_events(run)
    return sum(e["kind"] == "nonfinite" and e["action"] in ("skip", "rollback") for e in events)


def guard_events(run: Run) -> tuple[list[dict[str, Any]], Path | None]:
    """The guard's events, oldest first, and the file they were read from: ``skip_batches.json`` in the run's
    folder when it is there and readable (every event), else the rows of its text panel (the latest 20, without
    ``detail``; ``None`` then). Each event a dict with at least ``global_step``, ``kind`` and ``action``. Read once
    per run (kept in ``run.side_files``): the guard section, the monitor's findings and the HTML plot share it."""
    if SKIP_BATCHES_FILE not in run.side_files:
        run.side_files[SKIP_BATCHES_FILE] = _read_events(run)
    return run.side_files[SKIP_BATCHES_FILE]


def _read_events(run: Run) -> tuple[list[dict[str, Any]], Path | None]:
    """:func:`guard_events`, read from the run's folder or its panel."""
    path = run.folder / SKIP_BATCHES_FILE if run.folder is not None else None
    if path is not None and path.is_file():
        try:
            events = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(events, list) and all(
                isinstance(e, dict) and {"global_step", "kind", "action"} <= e.keys() for e in events
            ):
                return events, path
        except (OSError, ValueError):
            pass  # a file cut short or another tool's: the panel's events instead
    text = _panel_text(run) or ""
    lines = [line for line in text.splitlines() if line.lstrip().startswith("|")]
    if len(lines) < 2:
        return [], None
    header = [inline(c) for c in table_cells(lines[0])]
    events = []
    for line in lines[2:]:
        event: dict[str, Any] = dict(zip(header, (inline(c) for c in table_cells(line))))
        if {"global_step", "kind", "action"} <= event.keys() and event["global_step"].isdigit():
            event["global_step"] = int(event["global_step"])
            events.append(event)
    return events, None


def _panel_text(run: Run) -> str | None:
    """The guard's latest panel: the dashboard's fit-end diagnosis, else its event log."""
    for prefix in DIAGNOSIS_PREFIXES:
        if text := run.text(f"{prefix}TrainingGuard"):
            return text
    return run.text(GUARD_EVENT_LOG)


def _after(line: str, start: str, until: str | None = None) -> str:
    """The words of ``line`` after ``start`` (up to ``until``), ``""`` when ``start`` is not in it."""
    if start not in line:
        return ""
    rest = line.split(start, 1)[1]
    return rest.split(until, 1)[0] if until else rest


def _event_words(event: dict[str, Any]) -> str:
    """One event as a row's value: what was seen, what was done, where."""
    where = ", ".join(
        f"{name} {event[key]}"
        for key, name in (("epoch", "epoch"), ("batch_idx", "batch"))
        if event.get(key) not in (None, "")
    )
    return f"{event['action']}: {_seen(event)}" + (f" ({where})" if where else "")


def _seen(event: dict[str, Any]) -> str:
    """What the guard saw at ``event``, without the producer (the section's own row says it)."""
    if event.get("detail"):
        return str(event["detail"]).split(_MADE_IN_DETAIL, 1)[0]
    return f"{event['kind']} (loss {event.get('loss', '?')}, ‖g‖ {event.get('grad_norm', '?')})"
