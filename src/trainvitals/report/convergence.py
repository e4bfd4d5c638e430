"""The report's convergence and noise-scale sections: the band verdict, read from the stopper's own end-of-fit
table where it wrote one (GradNormEarlyStopping's, or BandSchedule's with its cuts), and B_simple against the
batch — each of one step, and only from a valid estimate."""

from __future__ import annotations

import math
import re

from trainvitals.noise.estimate import (
    DEFAULT_MAX_REL_ERR,
    DEFAULT_MIN_COVERAGE,
    MAX_UNMEASURED_TRACE,
    MIN_MEASUREMENTS,
    RESHUFFLE_EXCESS,
    SOURCES_CHECK,
    epoch_order_cause,
)
from trainvitals.plumbing.loss_progress import plateau_advice
from trainvitals.report.events import Run
from trainvitals.report.model import (
    BAND_STOP,
    BAND_WINDOW,
    Finding,
    Row,
    RunReport,
    as_of,
    counter,
    ended_early,
    first_series,
    logged_steps,
    panel,
    ratio_row_at,
    row_at,
    series_row,
    value_at,
)
from trainvitals.report.schedule import acts_said, cut_record
from trainvitals.tags import DIAGNOSIS_PREFIXES, SUGGESTED_LR, grad_norm
from trainvitals.text.prose import percent
from trainvitals.text.terminal import inline, table_cells

_LR_LABELS = {
    "b_noise": "noise scale B̂ (given)",
    "steps_over_min": "steps over the fewest, S/S_min = 1 + B̂/B",
    "examples_over_min": "examples over the fewest, E/E_min = 1 + B/B̂",
}
_FROM_B_HAT = ("steps_over_min", "examples_over_min")
"""LRScalingAdvisor's ratios computed from its B̂: shown only beside the B_simple of their own step."""


LR_AT = "lr"
"""The noise section's label of the lr a logged step ran at; its row is always dated (:func:`dated`): the advisor's
fit-end "now" is of a later step."""


def dated(row: Row, step: int | None) -> Row:
    """``row`` with the section's ``step`` said beside its value where it has none of its own: a "last" or lr value
    that a callback's fit-end line quotes at a later step (GradNormMonitor's last ‖g‖, the advisor's lr now)."""
    if row.step is None and row.value is not None:
        row.step = step
    return row


def _lr_label(key: str, batch: float | None) -> str:
    """The label of ``lr_scaling/<key>`` (LRScalingAdvisor's tags): ``lr/SGD`` is "lr, SGD" (the step's, dated),
    ``base_lr/SGD`` "base lr, SGD" (the one set, which the advice scales), ``suggested_lr_x2/SGD`` "suggested base lr
    at ×2 (B = 128), SGD" at an effective batch of 64."""
    if key in _LR_LABELS:
        return _LR_LABELS[key]
    for prefix, said in (("lr/", LR_AT), ("base_lr/", "base lr")):
        if key.startswith(prefix):
            return f"{said}, {key.removeprefix(prefix)}"
    if match := SUGGESTED_LR.match(key):
        factor, size, group = match["factor"], match["size"], match["group"]
        if size is not None:
            return f"suggested base lr at B = {size}, {group}"
        at = f" (B = {float(factor) * batch:g})" if batch else ""
        return f"suggested base lr at ×{factor}{at}, {group}"
    return key.replace("_", " ")


def _diverged(run: Run) -> bool:
    """Whether the run ended diverged. With GradNormMonitor's series: (nearly) every step after its last
    finite norm was non-finite — counted as non-finite, or under a GradScaler as skipped (at least two:
    one skip is calibration). A NaN the run trained on from is not the end. A non-finite loss makes the
    gradient non-finite too, so the loss counter decides only without the monitor: GraphIntegrityCallback
    logs it when a check window closes, which says nothing of when the loss was non-finite. Without both,
    GradNormEarlyStopping's streak standing still at the end (:func:`uncounted_since`): its band flag is then
    the last one of before, and says nothing either."""
    finite = [step for series in run.matching(grad_norm("total")).values() for step, v in series if math.isfinite(v)]
    counters = {1: run.matching(grad_norm("nonfinite_steps")), 2: run.matching(grad_norm("amp_skipped_steps"))}
    if not (finite or counters[1] or counters[2]):
        return counter(run, r"graph/nonfinite_losses$") > 0 or uncounted_since(run) is not None
    since = max(finite, default=-1)
    return any(
        _rose_every_step(series, since, least) for least, matching in counters.items() for series in matching.values()
    )


def uncounted_since(run: Run) -> int | None:
    """The logged step after which GradNormEarlyStopping counted no step, when that holds for (at least
    two) steps at the end and neither GradNormMonitor nor GraphIntegrityCallback tells non-finite steps.

    A step it counts adds one to its streak or resets it to 0: a streak ``n > 0`` logged again as ``n``
    at most ``n`` steps later means no step in between was counted — each had a non-finite gradient (or
    was skipped by a GradScaler), and the band flag and noise estimates logged meanwhile are from before.
    """
    if (
        run.matching(grad_norm("total"))
        or run.matching(grad_norm("nonfinite_steps"))
        or counter(run, r"graph/nonfinite_losses$") > 0
    ):
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


CUTS_ROW = "cuts made by the fit's end (band entries acted on)"
"""The convergence section's row of BandSchedule's cuts, each said with the optimizer step it was made at."""

NORM_OVER_FLOOR = "norm / noise level"
"""The convergence section's row of the last gradient norm over its noise level sqrt(tr Σ/B), the RMS norm of
pure noise (single steps fall below it often)."""


def convergence_section(run: Run, report: RunReport) -> None:
    title = "convergence"
    # Like with like: a partly measured model's floor is set against the norm of the measured parameters.
    norm = grad_norm("measured_total") if run.matching(grad_norm("measured_total")) else grad_norm("total")
    step = as_of(run, report, title, norm, grad_norm("noise_floor"), grad_norm("in_noise_band"))
    rows = [
        dated(row_at(run, step, "gradient norm, last", norm), step),
        dated(row_at(run, step, "noise level sqrt(tr Σ/B), last", grad_norm("noise_floor")), step),  # the one floor
        row_at(run, step, "noise level standard error", grad_norm("noise_floor_se")),
    ]
    total = rows[0].value
    ratio_row = ratio_row_at(
        NORM_OVER_FLOOR, first_series(run, norm), first_series(run, grad_norm("noise_floor")), step
    )
    ratio = ratio_row.value if isinstance(ratio_row.value, float) else None
    said_at = f" at optimizer step {ratio_row.step}" if ratio_row.step is not None else ""
    error_row = ratio_row_at(
        "", first_series(run, grad_norm("noise_floor_se")), first_series(run, grad_norm("noise_floor")), step
    )
    partial = _partial(run)
    flags = [v for _, v in first_series(run, grad_norm("in_noise_band")) or []]
    recent = flags[-BAND_WINDOW:]
    in_band = sum(recent) / len(recent) if recent else None
    end = _stopper_end(run)
    name = stopper_name(run)
    caveat = _STOPPERS_SAY.sub("", run.text("grad_noise/caveat") or "")
    stop = stopper_stop(run)
    held = _held_said(run)
    report.sections[title] = [
        *rows,
        ratio_row,
        _band_row(recent),
        Row("stop", stop)
        if stop
        else Row("stop", f"not stopped: {_end_reason(end, caveat)}", step=_stopper_end_step(run, step))
        if end
        else Row("stop", _not_stopped(run, partial, caveat)),
    ]
    if end.get("cuts"):  # BandSchedule's: a cut's step, the band ratio and its 90 % interval, the lr scale after
        # Every cut by the fit's end, each with its own step; undated: the table's step would read as a cut's.
        report.sections[title].append(Row(CUTS_ROW, end["cuts"]))
    if stop:
        report.findings.append(Finding("note", title, stop))
    if caveat:
        report.findings.append(Finding("note", title, caveat))
    floor_error = (
        f"noise level ± {percent(error_row.value)}"
        if isinstance(error_row.value, float) and math.isfinite(error_row.value)
        else ""
    )
    error = f" ({floor_error})" if floor_error else ""
    if _diverged(run):
        report.findings.append(
            Finding(
                "note",
                title,
                "the run diverged (non-finite gradients or losses): the last finite gradient norm and "
                "the noise estimates come from before, so they say nothing of convergence.",
            )
        )
    elif partial:
        report.findings.append(Finding("note", title, f"{partial}: no noise-band verdict on the whole model."))
    elif end and not stop and end.get("rule", "").startswith("noise band"):
        # A run that ended on a plateau its loss never left wants a change; one the loss rule released, a note.
        severity = "warning" if ON_PLATEAU in _end_reason(end, caveat) else "note"
        report.findings.append(Finding(severity, title, _end_verdict(end, flags, error, caveat, name)))
    elif held:  # in the band, but noise from the start: not the convergence the band says otherwise
        share = "; ".join(filter(None, [_share_in_band(recent, verb=False) if recent else "", floor_error]))
        never_out = (
            f"in its noise band{f' ({share})' if share else ''}, and never shown out of it since the estimate could "
            "first judge it (grad_norm/held_from_start)"
        )
        message = (
            f"held from the start: {never_out}, and its training loss not shown to have fallen: either the steps are "
            "mostly noise at this batch and lr, not convergence — a larger batch (B_simple's, below) or a smaller lr "
            "makes them count — or the run started at its minimum (fine-tuning a converged model), where "
            f"hold_from_start=False lets {name} stop it; {name} does not stop on either."
            if STARTED_AT_MINIMUM in held
            else f"noise-dominated from the start: {never_out}: the steps are mostly noise at this batch and lr, "
            f"which is not convergence, and {name} does not stop on it; a larger batch (B_simple's, below) or a "
            "smaller lr makes the steps count."
        )
        report.findings.append(Finding("note", title, message))
    elif in_band is None:
        if ratio is not None:
            if ended_early(run):
                why = f"no noise-band flag was logged: the fit ended {logged_steps(run)}, without its end-of-fit diagnosis"
            elif run.matching(grad_norm("band_streak")):  # the stopper was there
                why = (
                    f"{name} logged no noise-band flag: its estimate had fewer than {MIN_MEASUREMENTS} "
                    "measurements, or its rule is a threshold or relative one"
                )
            else:
                why = "GradNormEarlyStopping would log whether the run is in its noise band"
            report.findings.append(
                Finding(
                    "note", title, f"the last gradient norm is {ratio:.2f}× its noise level{said_at}{error}; {why}."
                )
            )
        elif total is not None:
            report.findings.append(
                Finding(
                    "note",
                    title,
                    "no noise estimate, so no noise band: it needs accumulate_grad_batches >= 2, "
                    ">= 2 devices, or a BatchVarianceProbe; a fixed norm threshold is no substitute.",
                )
            )
    elif stop and BAND_STOP in stop:  # every step of its patience was in the band; the logged flags sample a few
        report.findings.append(
            Finding(
                "note", title, f"in its noise band: {name} stopped the run on it{error}{_stop_streak_said(run, stop)}."
            )
        )
    elif in_band >= 0.5:
        report.findings.append(
            Finding(
                "note",
                title,
                f"in its noise band ({'; '.join(filter(None, [_share_in_band(recent, verb=False), floor_error]))}): "
                "the gradient norm sits at its noise level, further steps mostly move within noise."
                + _few_flags(recent, name),
            )
        )
    else:
        said = f"; the last norm is {ratio:.2f}× the noise level{said_at}" if ratio is not None else ""
        why = (
            "the band is decided on the smoothed estimates, not on one norm"
            if ratio is not None and ratio <= 1
            else "the true gradient still stands out of the noise"
        )
        report.findings.append(
            Finding(
                "note",
                title,
                f"not in its noise band yet: {_share_in_band(recent)} in it{said}{error}; {why}."
                + _few_flags(recent, name),
            )
        )


def _stop_streak_said(run: Run, said: str) -> str:
    """The streak a band stop (its sentence ``said``) came on, beside the logged band flags: ``grad_norm/band_streak``
    logged at the stop counts the optimizer steps in a row in the band up to it, and the flags logged within those
    steps were set; the last :data:`BAND_WINDOW` flags (the convergence row's share) may reach back before the
    streak, and say so. "" where the streak was not logged at the stop."""
    streaks = first_series(run, grad_norm("band_streak"))
    if not streaks or not streaks[-1][1] >= 1 or f"stopped at optimizer step {streaks[-1][0]} " not in said:
        return ""
    stop, streak = streaks[-1]
    start = stop - int(streak) + 1
    flags = first_series(run, grad_norm("in_noise_band")) or []
    within = [v for s, v in flags if start <= s <= stop]
    said = f", on grad_norm/band_streak {streak:g} at its stop (optimizer steps {start}–{stop} in a row in the band)"
    if within:
        said += f": {sum(within):g} of the {len(within)} band flag(s) logged in them set"
    recent = flags[-BAND_WINDOW:]
    if len(recent) > len(within) and recent[0][0] < start:
        said += (
            f"; {_share_in_band([v for _, v in recent])} in the band, back to step {recent[0][0]}, before the "
            "streak began"
        )
    return said


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


def _few_flags(flags: list[float], name: str = "GradNormEarlyStopping") -> str:
    """A caveat when fewer than :data:`BAND_WINDOW` band flags were logged: each samples one step."""
    if len(flags) >= BAND_WINDOW:
        return ""
    return (
        f" Only {len(flags)} band flag(s) were logged, each of one step, and no end-of-fit table of "
        f"{name}, which counts every step: too few to say for how long."
    )


STOPPERS = ("GradNormEarlyStopping", "BandSchedule")
"""The callbacks that act on the noise band (BandSchedule is a GradNormEarlyStopping that cuts the lr first)."""
STOPPER_PANELS = tuple(f"{prefix}{name}" for name in STOPPERS for prefix in DIAGNOSIS_PREFIXES)
NOT_STOPPED = re.compile(rf"(?:{'|'.join(STOPPERS)})\b(?P<cuts>.*?)did not stop the run")
"""The stop row of a stopper's end-of-fit table when it did not stop: "GradNormEarlyStopping did not stop the run:
why", "BandSchedule cut the lr 2 time(s) (…); did not stop the run: why"."""
_STOPPERS_SAY = re.compile(rf"^trainvitals ({'|'.join(STOPPERS)}): ")
FROM_START = "in its noise band from the start"
"""How the stopper's panel begins where a full streak came before the run was ever out of its band: no stop."""
STARTED_AT_MINIMUM = "or the run started at its minimum"
"""How the stopper's from-start sentence names its second reading, where the loss has not fallen either."""
ON_PLATEAU = "in its noise band for a full streak at optimizer step"
"""How the stopper's panel begins where its ``min_loss_drop`` held a full streak, the training loss not fallen from
its start (a plateau the run has not left): no stop."""


def stopper_name(run: Run) -> str:
    """The band's callback in ``run``: BandSchedule where its panel or its lr scale was logged, else
    GradNormEarlyStopping."""
    schedule = any(run.texts.get(f"{prefix}BandSchedule") for prefix in DIAGNOSIS_PREFIXES)
    return "BandSchedule" if schedule or run.matching(r"schedule/lr_scale$") else "GradNormEarlyStopping"


def _stopper_panel(run: Run) -> tuple[int, str] | None:
    """The stopper's end-of-fit table (GradNormEarlyStopping's or BandSchedule's diagnosis panel) as (step written
    at, markdown), if logged."""
    tag = next((tag for tag in STOPPER_PANELS if run.texts.get(tag)), None)
    return None if tag is None else run.texts[tag][-1]


def stopper_stop(run: Run) -> str | None:
    """GradNormEarlyStopping's sentence for its stop (its stop panel, else the stop row of its end-of-fit table),
    or None when it did not stop the run (its panel then says at most that the band held from the start)."""
    end = _stopper_end(run)
    panel = run.text("grad_norm/stop_reason")
    if panel and not _from_start(panel) and not _on_plateau(panel):
        return panel
    return end.get("stop") if end and not _end_reason(end) else None


def _from_start(text: str) -> bool:
    """Whether a stopper's panel ``text`` is its sentence for a band held from the start (no stop), not a stop."""
    return _STOPPERS_SAY.sub("", text).startswith(FROM_START)


def _on_plateau(text: str) -> bool:
    """Whether a stopper's panel ``text`` is its sentence for a full streak held on a plateau (no stop)."""
    return _STOPPERS_SAY.sub("", text).startswith(ON_PLATEAU)


def _held_said(run: Run) -> str:
    """Why the stopper did not stop a run in its band, where its last ``grad_norm/held_from_start`` is 1: a full
    streak held, the run never shown out of the band (noise from the start). Its own words (the batch to use) where
    the log kept its text panel, else what the scalars show and where the words are; "" when not held."""
    series = first_series(run, grad_norm("held_from_start"))
    if not series or series[-1][1] != 1.0:
        return ""
    panel = run.text("grad_norm/stop_reason") or ""
    if _from_start(panel):
        return _STOPPERS_SAY.sub("", panel).rstrip(".")
    streaks = [v for _, v in first_series(run, grad_norm("band_streak")) or [] if math.isfinite(v)]
    logged = f" (the logged streak reached {max(streaks):g} step(s) in a row)" if streaks else ""
    kept = "this logger keeps no text" if not run.texts else "it is not in this log"
    return (
        f"held: in its noise band from the start, its streak reached its patience{logged} but the run was never "
        f"shown out of the band (grad_norm/held_from_start): noise from step 0 is not convergence, and the stopper does "
        f"not stop on it; its own words, with the batch to use, are its text panel grad_norm/stop_reason ({kept})"
    )


def _stopper_end(run: Run) -> dict[str, str]:
    """The stopper's end-of-fit table, ``quantity -> value`` (BandSchedule's two tables in one: its schedule, cuts
    and lr scale, then the stopper's rows); ``{}`` when it was not logged (no stopper, or a fit that did not end).
    It counts every step, the logged flags sample a few."""
    return _two_column_table((_stopper_panel(run) or (0, ""))[1])


def _two_column_table(text: str) -> dict[str, str]:
    """A markdown table of two columns, ``first -> second`` cell, its header and rule left out."""
    rows = [table_cells(line) for line in text.splitlines() if line.lstrip().startswith("|")]
    return {
        inline(row[0]): inline(row[1])
        for row in rows
        if len(row) == 2 and row[0] != "quantity" and not set(row[0]) <= set("-: ")  # no header, no rule
    }


def _stopper_end_step(run: Run, step: int | None) -> int | None:
    """The step the stopper's end-of-fit table was written at (fit end), when it is not the section's ``step``."""
    at = (_stopper_panel(run) or (None, ""))[0]
    return None if at == step else at


def _end_reason(end: dict[str, str], caveat: str = "") -> str:
    """Why the stopper did not stop the run, in its own end-of-fit words; "" when it stopped it. An older
    table says only that it did not: the reason is then a run shorter than its min_steps, or with no streak its
    ``caveat`` (why its estimate cannot decide), else its streak."""
    stop = end.get("stop", "")
    said = NOT_STOPPED.match(stop)
    if not said:
        return ""
    cuts = said["cuts"].strip(" ;")  # BandSchedule's, before the stopper's words
    why = stop[said.end() :].lstrip(":. ").rstrip(".")
    if cuts and why:
        return f"{cuts}; {why}"
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
_RATIO = re.compile(r"puts the band ratio .*?\) at (?P<said>.+?)(?P<then>; that interval [^;]*|)(?=; th|$)")
"""The stopper's fit-end band ratio: "… puts the band ratio (‖G‖² over …) at 1.3 (90 %: 0–3.4); that interval reaches
into the band: not shown to be outside it" (``noise.stopper``); an interval wholly outside the band adds nothing."""
_REACHED = re.compile(r"reached (\d+) \((\d+) steps in a row\)")


def _end_verdict(
    end: dict[str, str], flags: list[float], error: str, caveat: str, name: str = "GradNormEarlyStopping"
) -> str:
    """The noise-band verdict at the end of a fit the stopper (``name``) did not stop, from its streak (every step
    counted), with its reason; the logged band flags are named with how many there were; ``error``: the
    floor's, said after the verdict; ``caveat``: why the estimate could not decide, if it said so."""
    why = _end_reason(end, caveat)
    streak = _STREAK.match(end.get("in-condition streak", ""))
    reached = _REACHED.match(end.get("in-condition streak", ""))
    act = "to stop" if name == "GradNormEarlyStopping" else "to cut the lr (or stop)"
    if ON_PLATEAU in why and reached:  # its words say why, and what to do: the lead says it ended held
        lead = (
            f"ended on a plateau its training loss never left: in its noise band for {reached[2]} step(s) in a row "
            f"(its patience is {reached[1]}), held there by min_loss_drop (the band reads a plateau as a minimum)"
        )
        if "higher learning rate" not in why:  # an older table's words give no advice
            why += f"; {plateau_advice('stop the run' if name == 'GradNormEarlyStopping' else 'cut the lr or stop the run')}"
    elif "before min_steps" in why:
        lead = "no noise-band verdict: the run ended before the stopper's min_steps, so it counted no step"
    elif streak and int(streak[1]) > 0:
        lead = (
            f"in its noise band at the end, for {streak[1]} step(s) in a row, short of the {streak[2]} it takes {act}"
        )
    elif reached:  # a full streak with nothing done: BandSchedule with no cut left and stop=False, or min_steps
        lead = f"in its noise band at the end, for {reached[2]} step(s) in a row (its patience is {reached[1]})"
    elif caveat or "cannot decide" in why or "no noise estimate" in why:
        lead = "no noise-band verdict: the noise estimate could not decide"
        error = ""
    elif streak and (ratio := _RATIO.search(why)):  # the interval decides the words, as in the stopper's line
        said = ratio["said"].replace(" (", ", ", 1).removesuffix(")")
        lead = (
            f"not shown inside or outside its noise band at the end (band ratio {said})"
            if "reaches into the band" in ratio["then"]
            else f"inside its noise band at the end, its streak not yet begun (band ratio {said})"
            if "lies inside the band" in ratio["then"]
            else f"not in its noise band at the end (band ratio {said})"  # the whole interval above the edge
            if "90 %" in said
            else f"no noise-band verdict at the end (band ratio {said})"  # no interval
        )
        if error:  # one parenthesis: "(band ratio 1.3, 90 %: 0–3.4; noise level ± 7%)"
            lead, error = f"{lead[:-1]}; {error.strip().removeprefix('(')}", ""
    elif streak:
        lead = "not in its noise band at the end (the last step the stopper counted was outside it)"
    else:
        lead = "no noise-band verdict from the stopper's table"
    seen = end.get("optimizer steps seen")
    sampled = (
        f"; the band flag was logged on {len(flags)} of its {seen} steps ({sum(flags):g} in the band), single "
        "steps that say little on their own"
        if flags and seen
        else ""
    )
    return f"{lead}{error}. {name} at fit end: {why}{sampled}."


def _not_stopped(run: Run, partial: str, caveat: str) -> str:
    """Why GradNormEarlyStopping did not stop the run, from what it logged (a stop it writes as text): no
    stopper, a diverged run, never in the band, too short a streak, no valid source, partial coverage."""
    streaks = [v for series in run.matching(grad_norm("band_streak")).values() for _, v in series if math.isfinite(v)]
    if not streaks:
        if ended_early(run):
            return (
                f"nothing logged by a stopper yet: the fit ended {logged_steps(run)}, before GradNormEarlyStopping "
                "(if it was attached) logged"
            )
        if any(tag.startswith(DIAGNOSIS_PREFIXES) for tag in run.texts):
            return "no stop rule: the fit ended with no GradNormEarlyStopping diagnosis, so none was attached"
        return (
            "no stop rule: no GradNormEarlyStopping logged anything (not attached, or the fit ended before it logged)"
        )
    if _diverged(run):
        return "not stopped: the run diverged, and the stopper counts no step with non-finite gradients"
    held = _held_said(run)
    if held:
        return f"not stopped: {held}"
    panel = run.text("grad_norm/stop_reason") or ""
    if _on_plateau(panel):  # its own words: the loss's fall against min_loss_drop
        return f"not stopped: {_STOPPERS_SAY.sub('', panel).rstrip('.')}"
    record = cut_record(run)
    if record and stopper_name(run) == "BandSchedule":  # its streaks reached their patience: it cut on them
        last = int(re.match(r"step (\d+)", record[-1])[1])
        after = [v for series in run.matching(grad_norm("band_streak")).values() for s, v in series if s > last]
        since = f"; after the last, the logged streak reached {max(after):g} step(s) in a row" if after else ""
        return (
            f"not stopped: BandSchedule {acts_said(record)}, each where its streak in the noise band reached its "
            f"patience{since} (its end-of-fit table, which says why it did not act again, was not logged)"
        )
    streak = f"the logged streak in its condition reached {max(streaks):g} step(s) in a row"
    flags = [v for series in run.matching(grad_norm("in_noise_band")).values() for _, v in series]
    if flags and not any(flags):
        return (
            f"not stopped: never in the noise band, on any of the {len(flags)} logged steps (the steps in between "
            "were not logged, and the stopper's end-of-fit table, which counts them, was not either)"
        )
    if flags:
        return (
            f"not stopped: in the noise band on {sum(flags):g} of {len(flags)} logged steps; {streak}, short of "
            "its patience or before min_steps"
        )
    if ended_early(run):
        return (
            f"not stopped: the fit ended {logged_steps(run)} without its end-of-fit diagnosis, before a "
            f"noise-band flag was logged; {streak}"
        )
    if caveat:  # the stopper's own words: no valid source, partial coverage
        return "not stopped: " + caveat
    if partial:
        return f"not stopped: {partial}"
    if run.last(grad_norm("noise_floor")) is None:
        return (
            "not stopped: no noise estimate was logged, so no noise band (it needs accumulate_grad_batches >= 2, "
            f">= 2 devices, or a BatchVarianceProbe); {streak}"
        )
    return (
        f"not stopped: no noise-band flag was logged (the estimate had fewer than {MIN_MEASUREMENTS} measurements, "
        f"or the rule is a threshold or relative one); {streak}"
    )


def _partial(run: Run) -> str:
    """ "partial: …" when the run's noise estimate covered too little of ‖ḡ‖² to decide, with what the probe said it
    does not measure and why (:func:`_unmeasured`); else ""."""
    coverage = run.last(r"grad_noise/coverage$")
    unmeasured = run.last(r"grad_noise/unmeasured_trace_share$")
    which = f"; {said}" if (said := _unmeasured(run)) else ""
    if coverage is not None and coverage < DEFAULT_MIN_COVERAGE:
        return (
            f"partial: the noise estimate covers {coverage:.0%} of ‖ḡ‖² (a decision needs {DEFAULT_MIN_COVERAGE:.0%}"
            f"{which})"
        )
    if coverage is not None and unmeasured is not None and not unmeasured <= MAX_UNMEASURED_TRACE:
        return (
            f"partial: the noise estimate covers {coverage:.0%} of ‖ḡ‖², but the unmeasured parameters may hold up "
            f"to {unmeasured:.2g}× the measured tr Σ (a decision needs ≤ {MAX_UNMEASURED_TRACE:g}{which})"
        )
    return ""


def _unmeasured(run: Run) -> str:
    """The probe's "not measured: …" words, from the sources row of its diagnosis panel: the tensors no source
    measures, and what would measure them; "" where the log has no such panel (a logger without text)."""
    for prefix in DIAGNOSIS_PREFIXES:
        found = re.search(
            r"^\| sources \|.*?(not measured: [^|\n]*?) *\|", run.text(f"{prefix}BatchVarianceProbe") or "", re.M
        )
        if found:
            return found.group(1)
    return ""


B_SIMPLE = "B_simple = tr Σ / ‖G‖²"
"""The noise section's B_simple row; of a partial estimate, :data:`B_SIMPLE_PARTIAL`."""
B_SIMPLE_PARTIAL = f"{B_SIMPLE}, of the measured parameters only (partial estimate)"
B_SIMPLE_INTERVAL = "B_simple, 90 % interval"
"""The noise section's row of B_simple's 90 % interval: "≥ 550 (90 %)" where it has no upper end."""
NO_POINT = "none: "
"""How the B_simple row begins where the section's step logged an interval but no point (:func:`_no_point`)."""
OLDER_POINT = "B_simple's last point estimate (older)"
"""The row of the last point logged before such a step, dated: never read as the interval's."""


def b_simple_interval_at(run: Run, step: int | None) -> str:
    """B_simple's logged 90% interval (``grad_noise/b_simple_low``, ``_high``; :mod:`trainvitals.noise.estimate`,
    rule 8) at ``step`` in words: "B_simple ≥ 180 (90 %)" where its high end was not logged (infinite: ‖G‖²
    within its error of 0), "B_simple 120–340 (90 %)" otherwise; "" when no lower end > 0 was logged there."""
    low, own = value_at(first_series(run, r"grad_noise/b_simple_low$"), step)
    if low is None or own is not None or not low > 0:
        return ""
    high, high_own = value_at(first_series(run, r"grad_noise/b_simple_high$"), step)
    if high is None or high_own is not None:
        return f"B_simple ≥ {low:.3g} (90 %)"
    return f"B_simple {low:.3g}–{high:.3g} (90 %)"


def _no_point(run: Run, step: int | None, point: Row) -> str:
    """Why B_simple has no point at ``step`` where its estimate logged its interval there: B_simple = tr Σ/‖G‖² is
    infinite where the smoothed ‖G‖² is ≤ 0, and the writers leave an infinite value out. ``""`` where the point is
    of ``step``, or nothing of the estimate was logged there."""
    if step is None or point.value is not None and point.step is None:
        return ""
    if not any(s == step for s, _ in first_series(run, r"grad_noise/b_simple_low$") or []):
        return ""
    grad, own = value_at(first_series(run, r"grad_noise/grad_sq_norm$"), step)
    return f"the smoothed ‖G‖² is {grad:.3g} ≤ 0" if grad is not None and own is None else "the smoothed ‖G‖² is ≤ 0"


NO_ERROR_BAR = "too few measurements, or ‖G‖² not resolved from zero"
"""Why B_simple has no finite error bar, where the logged tags do not name the epoch order (:func:`no_upper_end`)."""


def no_upper_end(run: Run, step: int | None) -> str:
    """Why B_simple's interval has no upper end at ``step``, from the logged tags: the reshuffled epoch's δ_R where
    that takes it away from a ‖G‖² clear of zero (:func:`~trainvitals.noise.estimate.epoch_order_cause`), else
    :data:`NO_ERROR_BAR`."""
    keys = ("grad_sq_norm", "grad_sq_norm_se", "trace_cov", "trace_cov_high", "effective_measurements")
    values = [value_at(first_series(run, rf"grad_noise/{key}$"), step) for key in keys]
    excess, own = value_at(first_series(run, re.escape(RESHUFFLE_EXCESS) + "$"), step)
    if excess is None or own is not None or any(v is None or at is not None for v, at in values):
        return NO_ERROR_BAR
    return epoch_order_cause(*(v for v, _ in values[:4]), excess, values[4][0]) or NO_ERROR_BAR


def _partial_rows(run: Run, step: int | None) -> list[Row]:
    """What a partial estimate's data show, of the measured parameters: tr Σ and ‖G‖² with their standard errors,
    B_simple's 90% lower end, and the bound on the tr Σ of the parameters it does not see; each row only if logged."""
    values = {
        key: value_at(first_series(run, rf"grad_noise/{key}$"), step)
        for key in ("trace_cov", "trace_cov_se", "grad_sq_norm", "grad_sq_norm_se", "unmeasured_trace_share")
    }
    rows = []
    for key, label in (("trace_cov", "tr Σ"), ("grad_sq_norm", "‖G‖²")):
        (value, own), (se, se_own) = values[key], values[f"{key}_se"]
        if value is not None:
            shown = f"{value:.4g} ± {se:.2g} (standard error)" if se is not None and se_own == own else f"{value:.4g}"
            rows.append(Row(f"{label} of the measured parameters", shown, step=own))
    low, own = value_at(first_series(run, r"grad_noise/b_simple_low$"), step)
    if low is not None and low > 0:
        rows.append(Row("B_simple of the measured parameters, 90% lower end", low, "examples", own))
    share, own = values["unmeasured_trace_share"]
    if share is not None:
        rows.append(Row("tr Σ of the unmeasured parameters, at most", f"{share:.3g}× the measured tr Σ", step=own))
    return rows


ESTIMATE_PANELS = tuple(
    f"{prefix}{name}" for name in (*STOPPERS, "BatchVarianceProbe") for prefix in DIAGNOSIS_PREFIXES
)
"""The end-of-fit tables that quote the noise estimate's rows (``GradientNoise.summary_rows``), its effective batch
among them."""


def _fit_end_batch(run: Run, step: int | None) -> Row:
    """The "effective batch B" row from the first end-of-fit table of :data:`ESTIMATE_PANELS` that says it (only
    LRScalingAdvisor logs the batch as a series), with the table's step when it is not the section's ``step``."""
    for tag in ESTIMATE_PANELS:
        for at, text in reversed(run.texts.get(tag, [])):
            said = re.fullmatch(r"(\d+) examples", _two_column_table(text).get("effective batch B", ""))
            if said:
                return Row("effective batch B", float(said[1]), "examples", None if at == step else at)
    return Row("effective batch B", None, "examples")


def noise_scale_section(run: Run, report: RunReport) -> None:
    title = "noise scale and batch size"
    # The interval's steps too: where ‖G‖² ≤ 0 no point is logged, but its lower end is the latest news.
    step = as_of(run, report, title, r"grad_noise/b_simple(_low)?$", r"lr_scaling/effective_batch$", r"lr_scaling/")
    partial = _partial(run)
    rows = [
        row_at(run, step, B_SIMPLE_PARTIAL if partial else B_SIMPLE, r"grad_noise/b_simple$", unit="examples"),
        row_at(run, step, "B_simple relative error", r"grad_noise/b_simple_rel_err$"),
        Row(B_SIMPLE_INTERVAL, b_simple_interval_at(run, step).removeprefix("B_simple ") or None),
        row_at(run, step, "share of ‖ḡ‖² measured", r"grad_noise/coverage$", unit="share"),
        row_at(run, step, "effective batch B", r"lr_scaling/effective_batch$", unit="examples"),
    ]
    if rows[4].value is None:  # no LRScalingAdvisor: the batch its estimate's readers wrote at fit end
        rows[4] = _fit_end_batch(run, step)
    b_simple_row, error_row, interval_row, _, batch_row = rows
    interval = b_simple_interval_at(run, step)
    # The verdict's numbers are of the section's step, B_simple's last: an error of another step is not its.
    b_simple = b_simple_row.value if b_simple_row.step is None else None
    rel_err = error_row.value if error_row.step is None else None
    if error_row.value is None and b_simple is not None:  # an infinite one is not logged
        why = no_upper_end(run, step)
        error_row.value = "none finite: " + (
            why if why == NO_ERROR_BAR else "‖G‖² is clear of zero, not of a reshuffled epoch's excess δ_R (see below)"
        )
    no_point = _no_point(run, step, b_simple_row)
    batches = {v for _, v in first_series(run, r"lr_scaling/effective_batch$") or []}
    batch = batch_row.value if batch_row.step is None or len(batches) == 1 else None  # one batch all along: its own
    unreliable = value_at(first_series(run, r"grad_noise/b_simple_unreliable$"), step)
    at = f" at optimizer step {step}"
    if partial:
        rows[4:4] = _partial_rows(run, step)
    if no_point:  # this step's interval beside no point, not beside an older one read as its own
        rows[0:2] = [Row(b_simple_row.label, NO_POINT + no_point)]
        if b_simple_row.value is not None:
            rows.insert(1, Row(OLDER_POINT, b_simple_row.value, "examples", b_simple_row.step))
    rows += [
        series_row(_lr_label(tag.removeprefix("lr_scaling/"), batch_row.value), series, step)
        for tag, series in sorted(run.matching(r"lr_scaling/(?!effective_batch$).+").items())
    ]
    rows = [dated(r, step) if r.label.startswith(f"{LR_AT}, ") else r for r in rows]
    # A B_simple error or a ratio of another step was computed from a B̂ not shown here: left out, not dated.
    stale = {error_row.label} | {_LR_LABELS[k] for k in _FROM_B_HAT}
    report.sections[title] = [
        r for r in rows if (r.step is None or r.label not in stale) and (r is not interval_row or r.value is not None)
    ]
    panel(run, report, "lr scaling advice", "lr_scaling/advice", dated=True)
    advice_step = report.steps.get("lr scaling advice")
    classic = (
        "the lr advice follows the classic rules"
        if advice_step in (None, step)
        else f"the lr advice, written at optimizer step {advice_step}, says which rule it followed then"
    )
    checked = run.text(SOURCES_CHECK)
    if checked:  # said once by the callbacks: a noise source dropped, or two that disagree
        report.findings.append(Finding("warning", title, f"noise sources: {checked}."))
    if b_simple is not None and partial:
        low = next((r for r in rows if r.label.endswith("90% lower end") and r.step is None), None)
        ends = f" (≥ {low.value:.3g} at 90%)" if low is not None else ""
        report.findings.append(
            Finding(
                "note",
                title,
                f"{partial}: B_simple = {b_simple:.3g}{ends}{at} is of the measured parameters only, not of the model; "
                "no batch-size verdict, and no noise-aware lr advice.",
            )
        )
    elif no_point:
        report.findings.append(
            Finding(
                "note",
                title,
                f"B_simple is unreliable (no point estimate: {no_point}, the gradient's signal lost in its noise){at}"
                + (f"; {interval}" if interval else "")
                + f": no batch-size verdict from a point estimate; {classic}.",
            )
        )
    elif b_simple is not None and (
        unreliable == (1, None) or rel_err is not None and not rel_err <= DEFAULT_MAX_REL_ERR
    ):
        # The reason agrees with the interval quoted: "no upper bound" only where that interval has none.
        what = (
            f"relative error {rel_err:.2g}"
            if rel_err is not None and math.isfinite(rel_err)
            else "flagged at this step; its relative error not logged here"
            if "–" in interval
            else f"no finite error bar: {no_upper_end(run, step)}"
        )
        report.findings.append(
            Finding(
                "note",
                title,
                f"B_simple = {b_simple:.3g} is unreliable ({what}){at}"
                + (f"; {interval}" if interval else "")
                + f": no batch-size verdict from the point estimate; {classic}.",
            )
        )
    elif b_simple is not None and batch and math.isfinite(b_simple):
        spread = (f" (± {percent(rel_err)})" if rel_err is not None else " (its error was not logged with it)") + at
        if batch < b_simple:
            message = (
                f"B = {batch:g} < B_simple = {b_simple:.3g}{spread}: each step is noise-dominated; a batch near "
                "B_simple balances steps against examples."
            )
        else:
            message = (
                f"B = {batch:g} >= B_simple = {b_simple:.3g}{spread}: beyond the noise scale a larger batch buys "
                "few steps for its examples."
            )
        report.findings.append(Finding("note", title, message))
    if _diverged(run) and run.matching(r"lr_scaling/"):
        report.findings.append(
            Finding(
                "note",
                title,
                "the run diverged: find the cause (or lower the lr) before following any lr-scaling advice.",
            )
        )
