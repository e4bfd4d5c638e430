"""What ``trainvitals report`` makes of a run — its rows, findings, sections' steps and exit status — and the
helpers every section reads its series with (a value at the section's step, else the last with its own)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainvitals.integrity.checks import finding_kinds
from trainvitals.integrity.findings import critical_counters, last_window_counters
from trainvitals.report.events import Run
from trainvitals.tags import DIAGNOSIS_PREFIXES, FIT_END_TAG, FIT_RAISED, TRAINVITALS_PREFIXES, grad_norm

EXIT_OK, EXIT_CRITICAL, EXIT_NO_DATA, EXIT_DAMAGED, EXIT_UNWRITTEN, EXIT_CRASHED, EXIT_UNFINISHED = range(7)
SEVERITY = (EXIT_OK, EXIT_NO_DATA, EXIT_UNFINISHED, EXIT_CRASHED, EXIT_DAMAGED, EXIT_CRITICAL)
"""Exit statuses from the least to the most severe: the command exits with its runs' most severe."""

ENDED, CRASHED, UNFINISHED, UNKNOWN = "ended", "crashed", "did not end", "unknown"
"""How a fit ended (:func:`fit_end`): normally, by an exception, not at all (killed, or still running), or unknown
(no TrainvitalsDashboard: nothing marks either end)."""

BAND_WINDOW = 10
"""Logged steps over which the fraction in the noise band is taken: one step is in it about half the
time from noise alone at a stationary point (docs/science.md §3), so a single flag says little."""

BAND_STOP = "gradient norm in its noise band"
"""How GradNormEarlyStopping's stop panel names a stop on the noise band (its ``StopReason.NOISE_BAND``)."""

SPIKES, EVENT_FILES, FIT = "spikes and non-finite steps", "event files", "fit"

NONFINITE_STEPS = grad_norm("nonfinite_steps")
"""GradNormMonitor's count of optimizer steps with inf/NaN gradients outside a GradScaler."""
CRITICAL_COUNTERS = (
    (
        SPIKES,
        NONFINITE_STEPS,
        "non-finite (inf/NaN) gradients on {n} optimizer step(s), outside any GradScaler",
    ),
    *critical_counters(finding_kinds()),
)
"""(section, tag regex, message): a counter is critical when its largest value (summed over optimizers) is > 0.

The integrity rows come from the registered checks' finding kinds (:func:`~trainvitals.integrity.checks.finding_kinds`).
The largest, not the last: GraphIntegrityCallback's counts are per check window, and a problem seen in
any window is a problem — except those read in the last window only (:data:`LAST_WINDOW`)."""

LAST_WINDOW = last_window_counters(finding_kinds())
"""Counters read in the last check window only (unused parameters: a branch taken only on some batches goes
unused in one window and trains in the next)."""


@dataclass
class Row:
    """One line of a section: a label, a value and its unit (``bytes``, ``examples``, ``steps``, ``share``: a
    fraction shown as a percent, or empty).

    A section's rows are of one step, its own (:attr:`RunReport.steps`); ``step`` is the step of a value not
    logged at it (a callback with another cadence, a value logged only while it was valid), shown with it, or of a
    "last" value or lr that a callback's fit-end line quotes at a later step
    (:func:`~trainvitals.report.convergence.dated`).
    """

    label: str
    value: float | str | None
    unit: str = ""
    step: int | None = None


@dataclass
class Finding:
    """A conclusion: ``critical`` fails CI, ``warning`` deserves a look, ``note`` is information."""

    severity: str
    section: str
    message: str


@dataclass
class RunReport:
    """The health report of one run."""

    run: str
    last_step: int | None
    sections: dict[str, list[Row]] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    panels: dict[str, str] = field(default_factory=dict)
    """The callbacks' own end-of-run markdown (lr advice, integrity findings, memory table), by title."""
    steps: dict[str, int] = field(default_factory=dict)
    """The optimizer step each section's values and the lr advice are of, by title: a section's is the last
    step of its anchor series (a row not logged then carries its own, :attr:`Row.step`), the advice's the step
    it was written at (fit end). A title whose step is not :attr:`last_step` is shown with it."""
    read_in_part: bool = False
    """An event file of the run is damaged: what was logged in the part not read is not in the report."""
    measured: bool = True
    """Whether the run holds any trainvitals scalar, i.e. whether any optimizer step was measured."""
    fit_end: str = UNKNOWN
    """How the fit ended, as TrainvitalsDashboard recorded it (:func:`fit_end`)."""
    stopped_again: bool = False
    """The fit took no step: it resumed from a checkpoint written after GradNormEarlyStopping's stop, and stopped
    again at its start (a requeued job that was over)."""
    same_logs: list[str] = field(default_factory=list)
    """The other runs whose logs are this one's, each written by another kind of logger
    (:func:`~trainvitals.report.events.same_logs`: one fit written by a TensorBoardLogger and a CSVLogger), reported
    once, here. Two folders of one kind with the same logs (an exact rerun) are two runs, each reported."""
    loggers: list[str] = field(default_factory=list)
    """Where the entry names several runs: the kind of logger that wrote the run and each of :attr:`same_logs`, in
    that order (``"TensorBoard"``, ``"CSV"``, ``"MLflow"``); empty where it names one (the fit-end report, written
    the same into every logger's folder, is the report of its TensorBoard folder)."""

    @property
    def names(self) -> str:
        """The run's name, and those of the runs with the same logs: ``stop/version_0 = stop_csv/version_0``."""
        return " = ".join([self.run, *self.same_logs])

    @property
    def same_logs_said(self) -> str:
        """The line under the run's heading that says why it names several runs; "" when it names one."""
        if not self.same_logs:
            return ""
        kinds = self.loggers
        return (
            f"the same logs as {', '.join(self.same_logs)}: every trainvitals tag at the same steps with the same "
            f"values, written by its {', '.join(kinds[:-1])} and {kinds[-1]} loggers: one fit, reported once"
        )

    @property
    def critical(self) -> bool:
        """Whether any finding is critical: the report's exit status is then 1."""
        return any(f.severity == "critical" for f in self.findings)

    @property
    def status(self) -> str:
        """``CRITICAL``, ``read in part``, ``crashed``, ``did not end``, ``stopped again``, ``ok`` or ``nothing
        measured``: the first that holds."""
        if self.critical:
            return "CRITICAL"
        if self.read_in_part:
            return "read in part"
        if self.fit_end in (CRASHED, UNFINISHED):
            return self.fit_end
        if self.stopped_again:
            return "stopped again"
        return "ok" if self.measured else "nothing measured"

    @property
    def exit_status(self) -> int:
        """This run's exit status (:mod:`trainvitals.report.command`'s docstring)."""
        return {
            "CRITICAL": EXIT_CRITICAL,
            "read in part": EXIT_DAMAGED,
            CRASHED: EXIT_CRASHED,
            UNFINISHED: EXIT_UNFINISHED,
            "nothing measured": EXIT_NO_DATA,
        }.get(self.status, EXIT_OK)


def exit_status(reports: list[RunReport]) -> int:
    """The command's exit status: the most severe of its runs', those that measured nothing left out when
    another did (such a run is then one of the report's findings)."""
    statuses = [r.exit_status for r in reports if r.exit_status != EXIT_NO_DATA] or [EXIT_NO_DATA]
    return max(statuses, key=SEVERITY.index)


def panel(run: Run, report: RunReport, title: str, tag: str, dated: bool = False) -> None:
    """Pass a callback's end-of-run markdown (the text panel ``tag``) through to the report, if logged;
    ``dated``: its numbers are those of the step it was written at, kept in ``report.steps``."""
    text = run.text(tag)
    if text:
        report.panels[title] = text
        if dated:
            report.steps[title] = run.texts[tag][-1][0]


def as_of(run: Run, report: RunReport, title: str, *patterns: str) -> int | None:
    """The section ``title``'s step, kept in ``report.steps[title]``: the last step of the first of ``patterns``
    (its anchor) that was logged; None when none was."""
    for pattern in patterns:
        series = [s for s in run.matching(pattern).values() if s]
        if series:
            report.steps[title] = step = max(s[-1][0] for s in series)
            return step
    return None


def value_at(series: list[tuple[int, float]] | None, step: int | None) -> tuple[float | None, int | None]:
    """``series``' value at the section's ``step``, and None; else its last value and that value's own step."""
    if not series:
        return None, None
    value = next((v for s, v in reversed(series) if s == step), None)
    if value is not None or step is None:
        return (value, None) if value is not None else (series[-1][1], None)
    return series[-1][1], series[-1][0]


def first_series(run: Run, *patterns: str) -> list[tuple[int, float]] | None:
    """The first series (tags sorted) of the first of ``patterns`` that matches one, as :meth:`Run.last` picks."""
    for pattern in patterns:
        matching = run.matching(pattern)
        if matching:
            return matching[min(matching)]
    return None


def row_at(run: Run, step: int | None, label: str, *patterns: str, unit: str = "") -> Row:
    """The row ``label`` of a section at ``step``, from the first of ``patterns`` logged (:func:`value_at`)."""
    return series_row(label, first_series(run, *patterns), step, unit)


def series_row(label: str, series: list[tuple[int, float]] | None, step: int | None, unit: str = "") -> Row:
    """The row ``label`` of a section at ``step``: ``series``' value there, else its last with its own step."""
    value, own = value_at(series, step)
    return Row(label, value, unit, own)


def ratio_row_at(
    label: str, top: list[tuple[int, float]] | None, bottom: list[tuple[int, float]] | None, step: int | None
) -> Row:
    """``top / bottom`` at the last step both were logged at (its own step when not the section's ``step``)."""
    by_step = dict(bottom or [])
    both = [(s, v / by_step[s]) for s, v in (top or []) if by_step.get(s)]
    if not both:
        return Row(label, None)
    at, value = both[-1]
    return Row(label, value, step=None if at == step else at)


def counter(run: Run, pattern: str, last: bool = False) -> float:
    """A counter's largest (``last``: last) finite value, summed over the series that match (one per optimizer)."""
    values = [[v for _, v in series if math.isfinite(v)] for series in run.matching(pattern).values()]
    return sum((v[-1] if last else max(v)) for v in values if v)


def fit_end(run: Run) -> tuple[str, str]:
    """How the run's fit ended, and TrainvitalsDashboard's line saying so (``""`` when it wrote none).

    The dashboard's :data:`~trainvitals.tags.FIT_END_TAG` panel, the latest line (a fit resumed into the same
    folder writes after the one before): :data:`ENDED` or :data:`CRASHED`. Without it, its diagnosis panels,
    written at fit end only, mean :data:`ENDED`; its layout alone, written at fit start, :data:`UNFINISHED` (killed,
    still running, or a file cut at a record's end, which the format cannot tell); no layout :data:`UNKNOWN`.
    """
    line = run.text(FIT_END_TAG)
    if line:
        return (CRASHED if line.startswith(FIT_RAISED) else ENDED), line
    if any(tag.startswith(DIAGNOSIS_PREFIXES) for tag in run.texts):
        return ENDED, ""
    return (UNFINISHED if run.layout else UNKNOWN), ""


def ended_early(run: Run) -> bool:
    """Whether the fit is known not to have ended normally: it crashed, was killed or is still running."""
    return fit_end(run)[0] in (CRASHED, UNFINISHED)


def last_logged_step(run: Run) -> int | None:
    """The last optimizer step of a trainvitals scalar: the run's own metrics (Lightning's ``epoch``, a validation
    loss) keep their own count, and say nothing of what the callbacks measured."""
    steps = [s for tag, series in run.scalars.items() if tag.startswith(TRAINVITALS_PREFIXES) for s, _ in series]
    return max(steps) if steps else None


def logged_steps(run: Run) -> str:
    """ "after optimizer step N (the last logged)": how far the run's trainvitals scalars go."""
    step = last_logged_step(run)
    return f"after optimizer step {step} (the last logged)" if step is not None else "before its first logged step"
