"""The verdicts of ``trainvitals report``: a run's sections, findings and exit status, from what it logged.

Each run that holds trainvitals metrics gets five sections — convergence, noise scale and batch size,
integrity, memory, spikes and non-finite steps — and a list of findings (a damaged event file is one of
them). Never a verdict on what was not measured: a section without a valid estimate says so, and why.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from trainvitals.core.estimate import (
    DEFAULT_MAX_REL_ERR,
    DEFAULT_MIN_COVERAGE,
    MAX_UNMEASURED_TRACE,
    MIN_MEASUREMENTS,
    SOURCES_CHECK,
)
from trainvitals.core.findings import (
    INTEGRITY,
    NOTHING_CHECKED,
    critical_counters,
    last_window_counters,
    warning_counters,
)
from trainvitals.core.memory import MEMORY_CATEGORIES, format_bytes
from trainvitals.dashboard.events import Run
from trainvitals.dashboard.tags import (
    DIAGNOSIS_PREFIXES,
    MEMORY_BYTES,
    TRAINVITALS_PREFIXES,
    TRAINVITALS_ROOTS,
    grad_norm,
)
from trainvitals.dashboard.terminal import inline, table_cells

EXIT_OK, EXIT_CRITICAL, EXIT_NO_DATA, EXIT_DAMAGED, EXIT_UNWRITTEN = 0, 1, 2, 3, 4
SEVERITY = (EXIT_OK, EXIT_NO_DATA, EXIT_DAMAGED, EXIT_CRITICAL)
"""Exit statuses from the least to the most severe: the command exits with its runs' most severe."""

BAND_WINDOW = 10
"""Logged steps over which the fraction in the noise band is taken: one step is in it about half the
time from noise alone at a stationary point (docs/science.md §3), so a single flag says little."""

BAND_STOP = "gradient norm in its noise band"
"""How GradNormEarlyStopping's stop panel names a stop on the noise band (its ``StopReason.NOISE_BAND``)."""

SPIKES, EVENT_FILES = "spikes and non-finite steps", "event files"

CRITICAL_COUNTERS = (
    (SPIKES, grad_norm("nonfinite_steps"), "non-finite (inf/NaN) gradients on {n} optimizer step(s), outside any GradScaler"),
    *critical_counters(),
)
"""(section, tag regex, message): a counter is critical when its largest value (summed over optimizers) is > 0.

The integrity rows come from the finding kinds' table (:class:`~trainvitals.core.findings.FindingKind`).
The largest, not the last: GraphIntegrityCallback's counts are per check window, and a problem seen in
any window is a problem — except those read in the last window only (:data:`LAST_WINDOW`)."""

LAST_WINDOW = last_window_counters()
"""Counters read in the last check window only (unused parameters: a branch taken only on some batches goes
unused in one window and trains in the next)."""


@dataclass
class Row:
    """One line of a section: a label, a value and its unit (``bytes``, ``examples``, ``steps``, ``share``: a
    fraction shown as a percent, or empty).

    A section's rows are of one step, its own (:attr:`RunReport.steps`); ``step`` is the step of a value not
    logged at it (a callback with another cadence, a value logged only while it was valid), shown with it.
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

    @property
    def critical(self) -> bool:
        """Whether any finding is critical: the report's exit status is then 1."""
        return any(f.severity == "critical" for f in self.findings)

    @property
    def status(self) -> str:
        """``CRITICAL``, ``read in part``, ``nothing measured`` or ``ok``: the first that holds."""
        if self.critical:
            return "CRITICAL"
        return "read in part" if self.read_in_part else "ok" if self.measured else "nothing measured"

    @property
    def exit_status(self) -> int:
        """This run's exit status (module docstring); the command exits with the most severe of its runs, those
        that measured nothing left out when another did."""
        return {"CRITICAL": EXIT_CRITICAL, "read in part": EXIT_DAMAGED, "nothing measured": EXIT_NO_DATA}.get(
            self.status, EXIT_OK)


def assess(run: Run) -> RunReport:
    """The health report of ``run``: one section per vital sign, and the findings that follow."""
    steps = [s for series in run.scalars.values() for s, _ in series]
    report = RunReport(run=run.name, last_step=max(steps) if steps else None, read_in_part=bool(run.damage),
                       measured=any(tag.startswith(TRAINVITALS_PREFIXES) for tag in run.scalars))
    report.findings += [Finding("warning", EVENT_FILES, d.describe()) for d in run.damage]
    if not report.measured:
        report.findings.append(Finding(
            "warning", EVENT_FILES, "nothing measured: no trainvitals scalar" + (" in the part read" if run.damage else "")
            + ", so no optimizer step was logged — nothing logged (the run may have ended before its first step: it "
            "crashed or was killed), an empty train dataloader (limit_train_batches=0), max_steps=0, or step logging "
            "off (log_every_n_steps=0). Nothing here says whether the run trained or is healthy."
            + _separator_hint(run)))
    if report.measured and _ended_early(run):
        report.findings.append(Finding(
            "warning", EVENT_FILES, "no end-of-fit diagnosis: TrainvitalsDashboard wrote its layout at fit start but "
            "no diagnosis panel at fit end, so the fit is still running, was killed or crashed, or an event file "
            "was cut at a record's end (which its format cannot tell); whatever came after is not in this report."))
    for section in (_convergence, _noise_scale, _integrity, _memory, _spikes) if report.measured else (_integrity,):
        section(run, report)
    for title, pattern, message in CRITICAL_COUNTERS:
        n = _counter(run, pattern, last=pattern in LAST_WINDOW)
        if n > 0:
            report.findings.append(Finding("critical", title, message.format(n=f"{n:g}")))
    for title, pattern, message in warning_counters():
        n = _counter(run, pattern)
        if n > 0:
            report.findings.append(Finding("warning", title, f"{message} (found {n:g} time(s)): the integrity findings "
                                           "say where, and what to do"))
    if (since := _uncounted_since(run)) is not None:
        report.findings.append(Finding(
            "critical", SPIKES, f"GradNormEarlyStopping counted none of the optimizer steps after step {since}: "
            "each had non-finite (inf/NaN) gradients (or a GradScaler skipped it), the run diverged"))
    return report


def _ended_early(run: Run) -> bool:
    """Whether TrainvitalsDashboard wrote its layout at fit start but no diagnosis at fit end: the fit crashed,
    was killed or is still running."""
    return run.layout and not any(tag.startswith(DIAGNOSIS_PREFIXES) for tag in run.texts)


def _logged_steps(run: Run) -> str:
    """"after optimizer step N (the last logged)": how far the run's trainvitals scalars go."""
    steps = [s for series in run.scalars.values() for s, _ in series]  # as RunReport.last_step
    return f"after optimizer step {max(steps)} (the last logged)" if steps else "before its first logged step"


_OTHER_SEPARATOR = re.compile(rf"^.*?\w(\W+)(?:{'|'.join(TRAINVITALS_ROOTS)})/")


def _separator_hint(run: Run) -> str:
    """When scalars look like a prefixed logger's trainvitals tags under another separator, which one."""
    for tag in sorted(run.scalars):
        if match := _OTHER_SEPARATOR.match(tag):
            return (f" But scalars such as `{tag}` look like a logger's prefixed ones: give its separator with "
                    f"--separator {match.group(1)!r}.")
    return ""


def _panel(run: Run, report: RunReport, title: str, tag: str, dated: bool = False) -> None:
    """Pass a callback's end-of-run markdown (the text panel ``tag``) through to the report, if logged;
    ``dated``: its numbers are those of the step it was written at, kept in ``report.steps``."""
    text = run.text(tag)
    if text:
        report.panels[title] = text
        if dated:
            report.steps[title] = run.texts[tag][-1][0]


def _as_of(run: Run, report: RunReport, title: str, *patterns: str) -> int | None:
    """The section ``title``'s step, kept in ``report.steps[title]``: the last step of the first of ``patterns``
    (its anchor) that was logged; None when none was."""
    for pattern in patterns:
        series = [s for s in run.matching(pattern).values() if s]
        if series:
            report.steps[title] = step = max(s[-1][0] for s in series)
            return step
    return None


def _at(series: list[tuple[int, float]] | None, step: int | None) -> tuple[float | None, int | None]:
    """``series``' value at the section's ``step``, and None; else its last value and that value's own step."""
    if not series:
        return None, None
    value = next((v for s, v in reversed(series) if s == step), None)
    if value is not None or step is None:
        return (value, None) if value is not None else (series[-1][1], None)
    return series[-1][1], series[-1][0]


def _first_series(run: Run, *patterns: str) -> list[tuple[int, float]] | None:
    """The first series (tags sorted) of the first of ``patterns`` that matches one, as :meth:`Run.last` picks."""
    for pattern in patterns:
        matching = run.matching(pattern)
        if matching:
            return matching[min(matching)]
    return None


def _row(run: Run, step: int | None, label: str, *patterns: str, unit: str = "") -> Row:
    """The row ``label`` of a section at ``step``, from the first of ``patterns`` logged (:func:`_at`)."""
    return _series_row(label, _first_series(run, *patterns), step, unit)


def _series_row(label: str, series: list[tuple[int, float]] | None, step: int | None, unit: str = "") -> Row:
    """The row ``label`` of a section at ``step``: ``series``' value there, else its last with its own step."""
    value, own = _at(series, step)
    return Row(label, value, unit, own)


def _ratio_row(label: str, top: list[tuple[int, float]] | None, bottom: list[tuple[int, float]] | None,
               step: int | None) -> Row:
    """``top / bottom`` at the last step both were logged at (its own step when not the section's ``step``)."""
    by_step = dict(bottom or [])
    both = [(s, v / by_step[s]) for s, v in (top or []) if by_step.get(s)]
    if not both:
        return Row(label, None)
    at, value = both[-1]
    return Row(label, value, step=None if at == step else at)


def _counter(run: Run, pattern: str, last: bool = False) -> float:
    """A counter's largest (``last``: last) finite value, summed over the series that match (one per optimizer)."""
    values = [[v for _, v in series if math.isfinite(v)] for series in run.matching(pattern).values()]
    return sum((v[-1] if last else max(v)) for v in values if v)


def _diverged(run: Run) -> bool:
    """Whether the run ended diverged. With GradNormMonitor's series: (nearly) every step after its last
    finite norm was non-finite — counted as non-finite, or under a GradScaler as skipped (at least two:
    one skip is calibration). A NaN the run trained on from is not the end. A non-finite loss makes the
    gradient non-finite too, so the loss counter decides only without the monitor: GraphIntegrityCallback
    logs it when a check window closes, which says nothing of when the loss was non-finite. Without both,
    GradNormEarlyStopping's streak standing still at the end (:func:`_uncounted_since`): its band flag is then
    the last one of before, and says nothing either."""
    finite = [step for series in run.matching(grad_norm("total")).values() for step, v in series if math.isfinite(v)]
    counters = {1: run.matching(grad_norm("nonfinite_steps")), 2: run.matching(grad_norm("amp_skipped_steps"))}
    if not (finite or counters[1] or counters[2]):
        return _counter(run, r"graph/nonfinite_losses$") > 0 or _uncounted_since(run) is not None
    since = max(finite, default=-1)
    return any(_rose_every_step(series, since, least) for least, matching in counters.items()
               for series in matching.values())


def _uncounted_since(run: Run) -> int | None:
    """The logged step after which GradNormEarlyStopping counted no step, when that holds for (at least
    two) steps at the end and neither GradNormMonitor nor GraphIntegrityCallback tells non-finite steps.

    A step it counts adds one to its streak or resets it to 0: a streak ``n > 0`` logged again as ``n``
    at most ``n`` steps later means no step in between was counted — each had a non-finite gradient (or
    was skipped by a GradScaler), and the band flag and noise estimates logged meanwhile are from before.
    """
    if run.matching(grad_norm("total")) or run.matching(grad_norm("nonfinite_steps")) or \
            _counter(run, r"graph/nonfinite_losses$") > 0:
        return None
    for series in run.matching(grad_norm("band_streak")).values():
        last, n = series[-1]
        since = last
        for step, count in reversed(series[:-1]):
            if count != n or since - step > n:
                break
            since = step
        if n > 0 and last - since >= 2:
            return since
    return None


def _rose_every_step(series: list[tuple[int, float]], since: int, least: int) -> bool:
    """A step counter rose by at least ``least`` and by (nearly) every step logged after ``since``, or by
    every step of its last logged interval after ``since``: a NaN that began between two logging steps
    leaves the first interval after the last finite norm only partly non-finite."""
    before = max((count for step, count in series if step <= since), default=0.0)
    step, count = series[-1]
    if step <= since:
        return False
    if count - before >= max(least, step - since - 1):
        return True
    if len(series) < 2:
        return False
    previous, then = series[-2]
    return previous >= since and count - then >= max(least, step - previous)


def _convergence(run: Run, report: RunReport) -> None:
    title = "convergence"
    # Like with like: a partly measured model's floor is set against the norm of the measured parameters.
    norm = grad_norm("measured_total") if run.matching(grad_norm("measured_total")) else grad_norm("total")
    step = _as_of(run, report, title, norm, grad_norm("noise_floor"), grad_norm("in_noise_band"))
    rows = [_row(run, step, "gradient norm, last", norm),
            _row(run, step, "noise floor sqrt(tr Σ/B), last", grad_norm("noise_floor")),  # the run's one floor
            _row(run, step, "noise floor standard error", grad_norm("noise_floor_se"))]
    total = rows[0].value
    ratio_row = _ratio_row("norm / noise floor", _first_series(run, norm), _first_series(run, grad_norm("noise_floor")),
                           step)
    ratio = ratio_row.value if isinstance(ratio_row.value, float) else None
    said_at = f" at optimizer step {ratio_row.step}" if ratio_row.step is not None else ""
    error_row = _ratio_row("", _first_series(run, grad_norm("noise_floor_se")), _first_series(run, grad_norm("noise_floor")),
                           step)
    partial = _partial(run)
    band = run.matching(grad_norm("in_noise_band"))
    flags = [v for _, v in band[min(band)]] if band else []
    recent = flags[-BAND_WINDOW:]
    in_band = sum(recent) / len(recent) if recent else None
    end = _stopper_end(run)
    caveat = (run.text("grad_noise/caveat") or "").removeprefix("trainvitals GradNormEarlyStopping: ")
    stop = run.text("grad_norm/stop_reason") or (end.get("stop") if end and not _end_reason(end) else None)
    report.sections[title] = [
        *rows, ratio_row,
        _band_row(recent),
        Row("stop", stop) if stop else Row("stop", f"not stopped: {_end_reason(end, caveat)}", step=_stopper_end_step(
            run, step)) if end else Row("stop", _not_stopped(run, partial)),
    ]
    if stop:
        report.findings.append(Finding("note", title, stop))
    if caveat:
        report.findings.append(Finding("note", title, caveat))
    floor_error = (f"noise floor ± {100 * error_row.value:.2g}%"
                   if isinstance(error_row.value, float) and math.isfinite(error_row.value) else "")
    error = f" ({floor_error})" if floor_error else ""
    if _diverged(run):
        report.findings.append(Finding(
            "note", title, "the run diverged (non-finite gradients or losses): the last finite gradient norm and "
            "the noise estimates come from before, so they say nothing of convergence."))
    elif partial:
        report.findings.append(Finding("note", title, f"{partial}: no noise-band verdict on the whole model."))
    elif end and not stop and end.get("rule", "").startswith("noise band"):
        report.findings.append(Finding("note", title, _end_verdict(end, flags, error, caveat)))
    elif in_band is None:
        if ratio is not None:
            if _ended_early(run):
                why = f"no noise-band flag was logged: the fit ended {_logged_steps(run)}, without its end-of-fit diagnosis"
            elif run.matching(grad_norm("band_streak")):  # the stopper was there
                why = (f"GradNormEarlyStopping logged no noise-band flag: its estimate had fewer than {MIN_MEASUREMENTS} "
                       "measurements, or its rule is a threshold or relative one")
            else:
                why = "GradNormEarlyStopping would log whether the run is in its noise band"
            report.findings.append(Finding(
                "note", title, f"the last gradient norm is {ratio:.2f}× its noise floor{said_at}{error}; {why}."))
        elif total is not None:
            report.findings.append(Finding(
                "note", title, "no noise estimate, so no noise band: it needs accumulate_grad_batches >= 2, "
                ">= 2 devices, or a BatchVarianceProbe; a fixed norm threshold is no substitute."))
    elif stop and BAND_STOP in stop:  # every step of its patience was in the band; the logged flags sample a few
        report.findings.append(Finding(
            "note", title, f"in its noise band: GradNormEarlyStopping stopped the run on it{error}; the band flags "
            f"logged meanwhile ({_share_in_band(recent)} in it) sample single steps."))
    elif in_band >= 0.5:
        report.findings.append(Finding(
            "note", title, f"in its noise band ({'; '.join(filter(None, [_share_in_band(recent, verb=False), floor_error]))}): "
            "the gradient norm sits at its noise floor, further steps mostly move within noise."
            + _few_flags(recent)))
    else:
        said = f"; the last norm is {ratio:.2f}× the noise floor{said_at}" if ratio is not None else ""
        why = ("the band is decided on the smoothed estimates, not on one norm" if ratio is not None and ratio <= 1
               else "the true gradient still stands out of the noise")
        report.findings.append(Finding(
            "note", title, f"not in its noise band yet: {_share_in_band(recent)} in it{said}{error}; {why}."
            + _few_flags(recent)))


def _band_row(flags: list[float]) -> Row:
    """The last logged band flags' row: a share over :data:`BAND_WINDOW` or more of them, else a count in words."""
    label = "fraction in the noise band"
    if not flags:
        return Row(label, "no band flag logged")
    if len(flags) == 1:
        return Row("in the noise band on its only logged step", "yes" if flags[0] else "no")
    if len(flags) < BAND_WINDOW:
        return Row(f"in the noise band, of only {len(flags)} logged steps", f"{sum(flags):g} (too few for a share)")
    return Row(f"{label}, last {len(flags)} logged steps", sum(flags) / len(flags), "share")


def _share_in_band(flags: list[float], verb: bool = True) -> str:
    """How many of the last logged band flags were set, in words (``verb``: with "was"/"were"): a share only
    over :data:`BAND_WINDOW` of them."""
    if len(flags) == 1:
        return "its only logged step" + ((" was" if flags[0] else " was not") if verb else "")
    were = " were" if verb else ""
    if len(flags) < BAND_WINDOW:
        return f"{sum(flags):g} of only {len(flags)} logged steps{were}"
    return f"{sum(flags) / len(flags):.0%} of the last {len(flags)} logged steps{were}"


def _few_flags(flags: list[float]) -> str:
    """A caveat when fewer than :data:`BAND_WINDOW` band flags were logged: each samples one step."""
    if len(flags) >= BAND_WINDOW:
        return ""
    return (f" Only {len(flags)} band flag(s) were logged, each of one step, and no end-of-fit table of "
            "GradNormEarlyStopping, which counts every step: too few to say for how long.")


STOPPER_PANELS = tuple(f"{prefix}GradNormEarlyStopping" for prefix in DIAGNOSIS_PREFIXES)
NOT_STOPPED = "GradNormEarlyStopping did not stop the run"


def _stopper_end(run: Run) -> dict[str, str]:
    """GradNormEarlyStopping's end-of-fit table (its diagnosis panel), ``quantity -> value``; ``{}`` when it
    was not logged (no stopper, or a fit that did not end). It counts every step, the logged flags sample a few."""
    text = next((run.text(tag) for tag in STOPPER_PANELS if run.text(tag)), None)
    rows = [table_cells(line) for line in (text or "").splitlines()[2:] if line.lstrip().startswith("|")]
    return {inline(row[0]): inline(row[1]) for row in rows if len(row) == 2}


def _stopper_end_step(run: Run, step: int | None) -> int | None:
    """The step the stopper's end-of-fit table was written at (fit end), when it is not the section's ``step``."""
    at = next((run.texts[tag][-1][0] for tag in STOPPER_PANELS if run.texts.get(tag)), None)
    return None if at == step else at


def _end_reason(end: dict[str, str], caveat: str = "") -> str:
    """Why the stopper did not stop the run, in its own end-of-fit words; "" when it stopped it. An older
    table says only that it did not: the reason is then a run shorter than its min_steps, or with no streak its
    ``caveat`` (why its estimate cannot decide), else its streak."""
    stop = end.get("stop", "")
    if not stop.startswith(NOT_STOPPED):
        return ""
    why = stop.removeprefix(NOT_STOPPED).lstrip(":. ").rstrip(".")
    if why:
        return why
    streak, seen = end.get("in-condition streak", "?"), end.get("optimizer steps seen", "")
    least = re.search(r"min_steps (\d+)", end.get("rule", ""))
    if least and seen.isdigit() and int(seen) < int(least[1]):  # the stopper's own words for it
        return f"the run ended after {seen} optimizer steps, before min_steps={least[1]}"
    if caveat and streak.startswith("0 "):
        return caveat.rstrip(".")
    return f"{streak} in a row in its condition at the end" + (f", over {seen} optimizer steps" if seen else "")


_STREAK = re.compile(r"(\d+) of (\d+) steps")


def _end_verdict(end: dict[str, str], flags: list[float], error: str, caveat: str) -> str:
    """The noise-band verdict at the end of a fit the stopper did not stop, from its streak (every step
    counted), with its reason; the logged band flags are named with how many there were; ``error``: the
    floor's, said after the verdict; ``caveat``: why the estimate could not decide, if it said so."""
    why = _end_reason(end, caveat)
    streak = _STREAK.match(end.get("in-condition streak", ""))
    if "before min_steps" in why:
        lead = "no noise-band verdict: the run ended before the stopper's min_steps, so it counted no step"
    elif streak and int(streak[1]) > 0:
        lead = (f"in its noise band at the end, for {streak[1]} step(s) in a row, short of the {streak[2]} it takes "
                "to stop")
    elif caveat or "cannot decide" in why or "no noise estimate" in why:
        lead = "no noise-band verdict: the noise estimate could not decide"
        error = ""
    elif streak:
        lead = "not in its noise band at the end (the last step the stopper counted was outside it)"
    else:
        lead = "no noise-band verdict from the stopper's table"
    seen = end.get("optimizer steps seen")
    sampled = (f"; the band flag was logged on {len(flags)} of its {seen} steps ({sum(flags):g} in the band), single "
               "steps that say little on their own" if flags and seen else "")
    return f"{lead}{error}. GradNormEarlyStopping at fit end: {why}{sampled}."


def _not_stopped(run: Run, partial: str) -> str:
    """Why GradNormEarlyStopping did not stop the run, from what it logged (a stop it writes as text): no
    stopper, a diverged run, never in the band, too short a streak, no valid source, partial coverage."""
    streaks = [v for series in run.matching(grad_norm("band_streak")).values() for _, v in series if math.isfinite(v)]
    if not streaks:
        if _ended_early(run):
            return (f"nothing logged by a stopper yet: the fit ended {_logged_steps(run)}, before GradNormEarlyStopping "
                    "(if it was attached) logged")
        if any(tag.startswith(DIAGNOSIS_PREFIXES) for tag in run.texts):
            return "no stop rule: the fit ended with no GradNormEarlyStopping diagnosis, so none was attached"
        return "no stop rule: no GradNormEarlyStopping logged anything (not attached, or the fit ended before it logged)"
    if _diverged(run):
        return "not stopped: the run diverged, and the stopper counts no step with non-finite gradients"
    streak = f"the logged streak in its condition reached {max(streaks):g} step(s) in a row"
    flags = [v for series in run.matching(grad_norm("in_noise_band")).values() for _, v in series]
    if flags and not any(flags):
        return (f"not stopped: never in the noise band, on any of the {len(flags)} logged steps (the steps in between "
                "were not logged, and the stopper's end-of-fit table, which counts them, was not either)")
    if flags:
        return (f"not stopped: in the noise band on {sum(flags):g} of {len(flags)} logged steps; {streak}, short of "
                "its patience or before min_steps")
    if not flags and _ended_early(run):
        return (f"not stopped: the fit ended {_logged_steps(run)} without its end-of-fit diagnosis, before a "
                f"noise-band flag was logged; {streak}")
    caveat = run.text("grad_noise/caveat")
    if caveat:  # the stopper's own words: no valid source, partial coverage
        return "not stopped: " + caveat.removeprefix("trainvitals GradNormEarlyStopping: ")
    if partial:
        return f"not stopped: {partial}"
    if run.last(grad_norm("noise_floor")) is None:
        return ("not stopped: no noise estimate was logged, so no noise band (it needs accumulate_grad_batches >= 2, "
                f">= 2 devices, or a BatchVarianceProbe); {streak}")
    return (f"not stopped: no noise-band flag was logged (the estimate had fewer than {MIN_MEASUREMENTS} measurements, "
            f"or the rule is a threshold or relative one); {streak}")


def _partial(run: Run) -> str:
    """"partial: …" when the run's noise estimate covered too little of ‖ḡ‖² to decide; else ""."""
    coverage = run.last(r"grad_noise/coverage$")
    unmeasured = run.last(r"grad_noise/unmeasured_trace_share$")
    if coverage is not None and coverage < DEFAULT_MIN_COVERAGE:
        return f"partial: the noise estimate covers {coverage:.0%} of ‖ḡ‖² (a decision needs {DEFAULT_MIN_COVERAGE:.0%})"
    if coverage is not None and unmeasured is not None and not unmeasured <= MAX_UNMEASURED_TRACE:
        return (f"partial: the noise estimate covers {coverage:.0%} of ‖ḡ‖², but the unmeasured parameters may hold up "
                f"to {unmeasured:.2g}× the measured tr Σ (a decision needs ≤ {MAX_UNMEASURED_TRACE:g})")
    return ""


def _noise_scale(run: Run, report: RunReport) -> None:
    title = "noise scale and batch size"
    step = _as_of(run, report, title, r"grad_noise/b_simple$", r"lr_scaling/effective_batch$", r"lr_scaling/")
    rows = [_row(run, step, "B_simple = tr Σ / ‖G‖²", r"grad_noise/b_simple$", unit="examples"),  # the run's one
            _row(run, step, "B_simple relative error", r"grad_noise/b_simple_rel_err$"),
            _row(run, step, "share of ‖ḡ‖² measured", r"grad_noise/coverage$", unit="share"),
            _row(run, step, "effective batch B", r"lr_scaling/effective_batch$", unit="examples")]
    b_simple_row, error_row, _, batch_row = rows
    # The verdict's numbers are of the section's step, B_simple's last: an error of another step is not its.
    b_simple = b_simple_row.value if b_simple_row.step is None else None
    rel_err = error_row.value if error_row.step is None else None
    batches = {v for _, v in _first_series(run, r"lr_scaling/effective_batch$") or []}
    batch = batch_row.value if batch_row.step is None or len(batches) == 1 else None  # one batch all along: its own
    unreliable = _at(_first_series(run, r"grad_noise/b_simple_unreliable$"), step)
    at = f" at optimizer step {step}"
    rows += [_series_row(_lr_label(tag.removeprefix("lr_scaling/"), batch_row.value), series, step)
             for tag, series in sorted(run.matching(r"lr_scaling/(?!effective_batch$).+").items())]
    report.sections[title] = rows
    checked = run.text(SOURCES_CHECK)
    if checked:  # said once by the callbacks: a noise source dropped, or two that disagree
        report.findings.append(Finding("warning", title, f"noise sources: {checked}."))
    partial = _partial(run)
    if b_simple is not None and partial:
        report.findings.append(Finding("note", title, f"{partial}: no batch-size verdict, and no noise-aware lr advice."))
    elif b_simple is not None and (unreliable == (1, None) or rel_err is not None and not rel_err <= DEFAULT_MAX_REL_ERR):
        what = f"relative error {rel_err:.2g}" if rel_err is not None and math.isfinite(rel_err) else (
            "no finite error bar: too few measurements, or ‖G‖² not resolved from zero")
        report.findings.append(Finding(
            "note", title, f"B_simple = {b_simple:.3g} is unreliable ({what}){at}: no batch-size verdict; the lr advice "
            "follows the classic rules."))
    elif b_simple is not None and batch and math.isfinite(b_simple):
        spread = (f" (± {100 * rel_err:.2g}%)" if rel_err is not None else " (its error was not logged with it)") + at
        if batch < b_simple:
            message = (f"B = {batch:g} < B_simple = {b_simple:.3g}{spread}: each step is noise-dominated; a batch near "
                       "B_simple balances steps against examples.")
        else:
            message = (f"B = {batch:g} >= B_simple = {b_simple:.3g}{spread}: beyond the noise scale a larger batch buys "
                       "few steps for its examples.")
        report.findings.append(Finding("note", title, message))
    if _diverged(run) and run.matching(r"lr_scaling/"):
        report.findings.append(Finding(
            "note", title, "the run diverged: find the cause (or lower the lr) before following any lr-scaling advice."))
    _panel(run, report, "lr scaling advice", "lr_scaling/advice", dated=True)


_LR_LABELS = {
    "b_noise": "noise scale B̂ (given)",
    "steps_over_min": "steps over the fewest, S/S_min = 1 + B̂/B",
    "examples_over_min": "examples over the fewest, E/E_min = 1 + B/B̂",
}
_SUGGESTED_LR = re.compile(r"suggested_lr_(?:x(?P<factor>[0-9.]+)|b(?P<size>[0-9]+))/(?P<group>.+)$")


def _lr_label(key: str, batch: float | None) -> str:
    """The label of ``lr_scaling/<key>`` (LRScalingAdvisor's tags): ``lr/SGD`` is "lr now, SGD",
    ``suggested_lr_x2/SGD`` "suggested lr at ×2 (B = 128), SGD" at an effective batch of 64."""
    if key in _LR_LABELS:
        return _LR_LABELS[key]
    if key.startswith("lr/"):
        return f"lr now, {key.removeprefix('lr/')}"
    if match := _SUGGESTED_LR.match(key):
        factor, size, group = match["factor"], match["size"], match["group"]
        if size is not None:
            return f"suggested lr at B = {size}, {group}"
        at = f" (B = {float(factor) * batch:g})" if batch else ""
        return f"suggested lr at ×{factor}{at}, {group}"
    return key.replace("_", " ")


_INTEGRITY_LABELS = {
    "unused_params": "parameters without a gradient",
    "dead_params": "parameters with an exactly zero gradient",
    "unoptimized_params": "tensors with a gradient in no optimizer",
    "unregistered_params": "of those, not registered on the module",
    "leaked_graphs": "losses reaching an earlier step's graph",
    "nonfinite_losses": "non-finite losses",
}
"""GraphIntegrityCallback's counts per check window, ``graph/<metric>`` (callbacks/integrity_checks/), as labelled
here and in this order; another metric is shown after them, its name as words."""


_CHECKED_NOTHING = re.compile(r"clean bill of health\.\*\* No findings in 0 graph walk\(s\) and 0 gradient check\(s\)")


def _integrity(run: Run, report: RunReport) -> None:
    title = INTEGRITY
    # The per-kind finding counts (graph/findings_<kind>) are left to the findings panel.
    order = list(_INTEGRITY_LABELS)
    step = _as_of(run, report, title, r"graph/(?!findings_).+")
    metrics = sorted(((tag.removeprefix("graph/"), series) for tag, series in run.matching(
        r"graph/(?!findings_).+").items()), key=lambda m: (order.index(m[0]) if m[0] in order else len(order), m[0]))
    report.sections[title] = [_series_row(_INTEGRITY_LABELS.get(metric, metric.replace("_", " ")), series, step)
                              for metric, series in metrics]
    _panel(run, report, "integrity findings", "graph/findings")
    if _CHECKED_NOTHING.search(report.panels.get("integrity findings", "")):  # an older callback's clean bill of nothing
        report.panels["integrity findings"] = NOTHING_CHECKED


def _memory(run: Run, report: RunReport) -> None:
    title = "memory"
    step = _as_of(run, report, title, MEMORY_BYTES, r"memory/activations/.+")
    categories = sorted(((*_at(series, step), tag.removeprefix("memory/").removesuffix("_bytes"))
                         for tag, series in run.matching(MEMORY_BYTES).items()), key=_largest_first, reverse=True)
    rows = [Row(memory_label(category), value, "bytes", own) for value, own, category in categories]
    per_module = sorted(((*_at(series, step), tag.removeprefix("memory/activations/"))
                         for tag, series in run.matching(r"memory/activations/.+").items()), key=_largest_first, reverse=True)
    rows += [Row(f"saved by {module}", value, "bytes", own) for value, own, module in per_module[:5]]
    report.sections[title] = rows
    _panel(run, report, "memory table", "memory/report")
    held = [v for _, v in run.scalars.get("memory/held_saved_bytes", [])]
    if len(held) >= 2 and held[-1] > held[-2] > 0:
        report.findings.append(Finding(
            "critical", title, f"a computation graph outlives its step: {format_bytes(held[-1])} of saved tensors "
            f"still held after backward, up from {format_bytes(held[-2])} at the previous profiled step "
            "(total += loss, a hidden state not detached, retain_graph=True)"))


def memory_label(key: str) -> str:
    """The words for ``memory/<key>_bytes``: its category's label (the profiler's table), else the key as words."""
    return next((c.label for c in MEMORY_CATEGORIES if c.key == key), key.replace("_", " "))


def _largest_first(row: tuple[float, int | None, str]) -> tuple[bool, float, str]:
    """A sort key (reversed) for memory rows: those of the section's step first, each group the largest first."""
    value, own, name = row
    return own is None, value, name


_SPIKE_LABELS = {
    "nonfinite_steps": "steps with non-finite gradients",
    "amp_skipped_steps": "steps a GradScaler skipped",
    "spike_steps": "gradient-norm spikes",
}
"""GradNormMonitor's counters, ``grad_norm/<name>``, as the spikes section labels them."""


def _spikes(run: Run, report: RunReport) -> None:
    title = SPIKES
    names = [n for n in _SPIKE_LABELS if run.matching(grad_norm(n))]
    counters = {name: _counter(run, grad_norm(name)) for name in names}
    _as_of(run, report, title, *(grad_norm(name) for name in names))
    report.sections[title] = [Row(_SPIKE_LABELS[name], value, "steps") for name, value in counters.items()]
    if counters.get("amp_skipped_steps", 0) > 0:
        report.findings.append(Finding(
            "note", title, f"the GradScaler skipped {counters['amp_skipped_steps']:g} step(s) with inf/NaN "
            "gradients and lowered its scale: loss-scale calibration, not divergence."))
    if counters.get("spike_steps", 0) > 0:
        latest = next((run.text(t) for t in sorted(run.texts) if re.match(grad_norm("spikes"), t)), None)
        report.findings.append(Finding(
            "warning", title, f"{counters['spike_steps']:g} gradient-norm spike(s)" + (f"; latest: {latest}" if latest else "")))

