"""The verdicts of ``trainvitals report``: a run's sections, findings and exit status, from what it logged.

Each run that holds trainvitals metrics gets five sections — convergence, noise scale and batch size
(:mod:`.convergence`), integrity, memory, spikes and non-finite steps — and those of the callbacks it ran
(:mod:`.schedule`, :mod:`.guard`, :mod:`.updates`) and of the Trainer's gradient clipping (:mod:`.clipping`), and
a list of findings (a damaged event file is one of them). Never a verdict on what was not measured: a section without a valid estimate
says so, and why. The report's record types are in :mod:`.report_model`.
"""

from __future__ import annotations

import re

from trainvitals.integrity.checks import finding_kinds, window_labels
from trainvitals.integrity.findings import INTEGRITY, NOTHING_CHECKED, warning_counters
from trainvitals.memory import MEMORY_CATEGORIES, format_bytes
from trainvitals.report.clipping import clipping_section
from trainvitals.report.convergence import convergence_section, noise_scale_section, stopper_stop, uncounted_since
from trainvitals.report.events import Run
from trainvitals.report.guard import ANSWERED_NONFINITE, answered_nonfinite_steps, guard_section
from trainvitals.report.model import (
    CRASHED,
    CRITICAL_COUNTERS,
    ENDED,
    EVENT_FILES,
    EXIT_CRASHED,
    EXIT_UNFINISHED,
    FIT,
    LAST_WINDOW,
    NONFINITE_STEPS,
    SPIKES,
    UNFINISHED,
    Finding,
    Row,
    RunReport,
    as_of,
    counter,
    fit_end,
    last_logged_step,
    panel,
    series_row,
    value_at,
)
from trainvitals.report.schedule import schedule_section
from trainvitals.report.updates import activation_section, update_section
from trainvitals.tags import FIT_RAISED, MEMORY_BYTES, TRAINVITALS_PREFIXES, TRAINVITALS_ROOTS, grad_norm


def assess(run: Run) -> RunReport:
    """The health report of ``run``: one section per vital sign, and the findings that follow."""
    end, line = fit_end(run)
    report = RunReport(
        run=run.name,
        last_step=last_logged_step(run),
        read_in_part=bool(run.damage),
        measured=any(tag.startswith(TRAINVITALS_PREFIXES) for tag in run.scalars),
        fit_end=end,
    )
    report.findings += [Finding("warning", EVENT_FILES, d.describe()) for d in run.damage]
    if end == CRASHED:
        report.findings.append(
            Finding(
                "warning",
                FIT,
                f"the fit crashed: {line.removeprefix(FIT_RAISED).strip().rstrip('.')}, as TrainvitalsDashboard "
                f"recorded it; what it would have logged after is not in this report (exit status {EXIT_CRASHED}).",
            )
        )
    elif end == UNFINISHED:
        report.findings.append(
            Finding(
                "warning",
                FIT,
                "the fit did not end: TrainvitalsDashboard wrote its layout at fit start but neither the end of fit "
                "nor an exception, so the fit was killed (SIGKILL, out of memory, preempted) or is still running, or "
                "an event file was cut at a record's end (which its format cannot tell); whatever came after is not "
                f"in this report (exit status {EXIT_UNFINISHED}).",
            )
        )
    stop = stopper_stop(run)
    if not report.measured and stop and end == ENDED:
        report.stopped_again = True
        report.sections["convergence"] = [Row("stop", stop)]
        report.findings.append(
            Finding(
                "note",
                "convergence",
                "this fit took no step: it resumed from a checkpoint written after GradNormEarlyStopping stopped "
                "the run, and stopped again at its start, as the stopper's end-of-fit table says — the run was "
                "over before this fit. Its measurements are in the log folder of the fit that stopped.",
            )
        )
        return report
    if not report.measured:
        report.findings.append(
            Finding(
                "warning",
                EVENT_FILES,
                "nothing measured: no trainvitals scalar"
                + (" in the part read" if run.damage else "")
                + ", so no optimizer step was logged — "
                + ("" if end == ENDED else "the run may have ended before its first step (it crashed or was killed), ")
                + "an empty train dataloader (limit_train_batches=0), max_steps=0, or step logging off "
                "(log_every_n_steps=0). Nothing here says whether the run trained or is healthy."
                + _separator_hint(run),
            )
        )
    for section in (
        (
            convergence_section,
            noise_scale_section,
            schedule_section,
            _integrity,
            _memory,
            _spikes,
            clipping_section,
            guard_section,
            update_section,
            activation_section,
        )
        if report.measured
        else (_integrity,)
    ):
        section(run, report)
    answered = answered_nonfinite_steps(run) if report.measured else 0
    for title, pattern, message in CRITICAL_COUNTERS:
        n = counter(run, pattern, last=pattern in LAST_WINDOW)
        if n > 0 and pattern == NONFINITE_STEPS and n <= answered:
            report.findings.append(Finding("warning", title, ANSWERED_NONFINITE.format(n=f"{n:g}")))
        elif n > 0:
            report.findings.append(Finding("critical", title, message.format(n=f"{n:g}")))
    for title, pattern, message in warning_counters(finding_kinds()):
        n = counter(run, pattern)
        if n > 0:
            report.findings.append(
                Finding(
                    "warning",
                    title,
                    f"{message} (found {n:g} time(s)): the integrity findings say where, and what to do",
                )
            )
    if (since := uncounted_since(run)) is not None:
        report.findings.append(
            Finding(
                "critical",
                SPIKES,
                f"GradNormEarlyStopping counted none of the optimizer steps after step {since}: "
                "each had non-finite (inf/NaN) gradients (or a GradScaler skipped it), the run diverged",
            )
        )
    return report


_OTHER_SEPARATOR = re.compile(rf"^.*?\w(\W+)(?:{'|'.join(TRAINVITALS_ROOTS)})/")


def _separator_hint(run: Run) -> str:
    """When scalars look like a prefixed logger's trainvitals tags under another separator, which one."""
    for tag in sorted(run.scalars):
        if match := _OTHER_SEPARATOR.match(tag):
            return (
                f" But scalars such as `{tag}` look like a logger's prefixed ones: give its separator with "
                f"--separator {match.group(1)!r}."
            )
    return ""


_CHECKED_NOTHING = re.compile(r"clean bill of health\.\*\* No findings in 0 graph walk\(s\) and 0 gradient check\(s\)")


def _integrity(run: Run, report: RunReport) -> None:
    title = INTEGRITY
    # The per-kind finding counts (graph/findings_<kind>) are left to the findings panel. The window metrics
    # are labelled, and ordered, as the registered checks say; another one follows, its name as words.
    labels = window_labels()
    order = list(labels)
    step = as_of(run, report, title, r"graph/(?!findings_).+")
    metrics = sorted(
        ((tag.removeprefix("graph/"), series) for tag, series in run.matching(r"graph/(?!findings_).+").items()),
        key=lambda m: (order.index(m[0]) if m[0] in order else len(order), m[0]),
    )
    report.sections[title] = [
        series_row(labels.get(metric, metric.replace("_", " ")), series, step) for metric, series in metrics
    ]
    panel(run, report, "integrity findings", "graph/findings")
    if _CHECKED_NOTHING.search(
        report.panels.get("integrity findings", "")
    ):  # an older callback's clean bill of nothing
        report.panels["integrity findings"] = NOTHING_CHECKED


def _memory(run: Run, report: RunReport) -> None:
    title = "memory"
    step = as_of(run, report, title, MEMORY_BYTES, r"memory/activations/.+")
    categories = sorted(
        (
            (*value_at(series, step), tag.removeprefix("memory/").removesuffix("_bytes"))
            for tag, series in run.matching(MEMORY_BYTES).items()
        ),
        key=_largest_first,
        reverse=True,
    )
    rows = [Row(memory_label(category), value, "bytes", own) for value, own, category in categories]
    per_module = sorted(
        (
            (*value_at(series, step), tag.removeprefix("memory/activations/"))
            for tag, series in run.matching(r"memory/activations/.+").items()
        ),
        key=_largest_first,
        reverse=True,
    )
    rows += [Row(f"saved by {module}", value, "bytes", own) for value, own, module in per_module[:5]]
    report.sections[title] = rows
    panel(run, report, "memory table", "memory/report")
    held = [v for _, v in run.scalars.get("memory/held_saved_bytes", [])]
    if len(held) >= 2 and held[-1] > held[-2] > 0:
        report.findings.append(
            Finding(
                "critical",
                title,
                f"a computation graph outlives its step: {format_bytes(held[-1])} of saved tensors "
                f"still held after backward, up from {format_bytes(held[-2])} at the previous profiled step "
                "(total += loss, a hidden state not detached, retain_graph=True)",
            )
        )


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
    counters = {name: counter(run, grad_norm(name)) for name in names}
    as_of(run, report, title, *(grad_norm(name) for name in names))
    report.sections[title] = [Row(_SPIKE_LABELS[name], value, "steps") for name, value in counters.items()]
    if counters.get("amp_skipped_steps", 0) > 0:
        report.findings.append(
            Finding(
                "note",
                title,
                f"the GradScaler skipped {counters['amp_skipped_steps']:g} step(s) with inf/NaN "
                "gradients and lowered its scale: loss-scale calibration, not divergence.",
            )
        )
    if counters.get("spike_steps", 0) > 0:
        latest = next((run.text(t) for t in sorted(run.texts) if re.match(grad_norm("spikes"), t)), None)
        report.findings.append(
            Finding(
                "warning",
                title,
                f"{counters['spike_steps']:g} gradient-norm spike(s)" + (f"; latest: {latest}" if latest else ""),
            )
        )
