"""The report's section on BandSchedule: the lr scale it left on top of the scheduler's lr, and every cut (a
batch growth said as one). The convergence section reads its end-of-fit table for the band verdict."""

from __future__ import annotations

import re

from trainvitals.report.events import Run
from trainvitals.report.model import Finding, Row, RunReport, as_of, counter, first_series, panel, series_row
from trainvitals.tags import DIAGNOSIS_PREFIXES

SCHEDULE = "band-driven schedule"
LR_SCALE = r"schedule/lr_scale$"
CUTS = r"schedule/cuts$"
ACCUMULATE = r"schedule/accumulate_grad_batches$"
CUT_RECORD = "schedule/cut_record"


def schedule_section(run: Run, report: RunReport) -> None:
    """The lr scale at the section's step, the number of cuts (batch growths included) and a row per cut (its
    step, the band ratio and its 90 % interval, the scale or batch after), as BandSchedule logged them; the
    accumulation its growths set; a note naming the cuts and growths."""
    if not run.matching(LR_SCALE):
        return
    step = as_of(run, report, SCHEDULE, LR_SCALE)
    cuts = int(counter(run, CUTS, last=True))
    rows = [
        series_row("lr scale (× the lr the scheduler set)", first_series(run, LR_SCALE), step),
        Row("lr cuts and batch growths" if run.matching(ACCUMULATE) else "lr cuts", float(cuts)),
    ]
    if run.matching(ACCUMULATE):
        rows.append(series_row("accumulate_grad_batches set", first_series(run, ACCUMULATE), step))
    record = cut_record(run)
    for label, grew in (("cut", False), ("batch growth", True)):  # a growth is recorded as "→ batch N"
        rows += [Row(f"{label} {i}", line) for i, line in enumerate((c for c in record if ("→ batch" in c) is grew), 1)]
    report.sections[SCHEDULE] = rows
    if record:
        report.findings.append(
            Finding("note", SCHEDULE, f"BandSchedule {acts_said(record, at=False)}: {'; '.join(record)}")
        )
    for prefix in DIAGNOSIS_PREFIXES:
        panel(run, report, "band-driven schedule at fit end", f"{prefix}BandSchedule")


def cut_record(run: Run) -> list[str]:
    """BandSchedule's cut record, a line per cut (``step 420: band ratio 0.81 (90 %: 0.42–1.2) → lr × 0.1``, a
    batch growth ``→ batch 640``), as its last ``schedule/cut_record`` panel holds it; ``[]`` without one."""
    return [line.removeprefix("- ") for line in (run.text(CUT_RECORD) or "").splitlines() if line.startswith("- ")]


def acts_said(record: list[str], at: bool = True) -> str:
    """ "cut the lr 2 time(s) (at step(s) 52, 103)" from a :func:`cut_record` (``at=False``: without the steps),
    its batch growths said as "grew the batch …" beside it; "" for no cut."""
    said = []
    for verb, grew in (("cut the lr", False), ("grew the batch", True)):
        steps = [m[1] for line in record if ("→ batch" in line) is grew and (m := re.match(r"step (\d+)", line))]
        if steps:
            said.append(f"{verb} {len(steps)} time(s)" + (f" (at step(s) {', '.join(steps)})" if at else ""))
    return " and ".join(said)
