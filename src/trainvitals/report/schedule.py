"""The report's section on BandSchedule: the lr scale it left on top of the scheduler's lr, and every cut (a
batch growth said as one). The convergence section reads its end-of-fit table for the band verdict."""

from __future__ import annotations

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
    record = [line.removeprefix("- ") for line in (run.text(CUT_RECORD) or "").splitlines() if line.startswith("- ")]
    rows += [Row(f"cut {i}", line) for i, line in enumerate(record, 1)]
    report.sections[SCHEDULE] = rows
    if record:
        grew = sum("→ batch" in line for line in record)
        done = " and ".join(
            f"{verb} {n} time(s)" for verb, n in (("cut the lr", len(record) - grew), ("grew the batch", grew)) if n
        )
        report.findings.append(Finding("note", SCHEDULE, f"BandSchedule {done}: {'; '.join(record)}"))
    for prefix in DIAGNOSIS_PREFIXES:
        panel(run, report, "band-driven schedule at fit end", f"{prefix}BandSchedule")
