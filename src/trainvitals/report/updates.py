"""The report's sections on what the steps did to the weights (UpdateMonitor) and what the layers put out
(ActivationMonitor): the last logged values, and findings read from the whole series."""

from __future__ import annotations

import math
import re
import statistics

from trainvitals.activations.stats import DEAD_WHY, INACTIVE_WHY, units_word
from trainvitals.report.events import Run
from trainvitals.report.model import Finding, Row, RunReport, as_of, counter, panel, value_at
from trainvitals.tags import DIAGNOSIS_PREFIXES, activation, update

UPDATES, ACTIVATIONS = "weight updates", "activations"
USUAL_RATIO = (1e-5, 1e-1)
"""UpdateMonitor's default usual range (``usual_ratio`` 1e-3 ÷ × ``ratio_factor`` 100): a group whose median
ratio is outside it gets a finding."""
DEAD_SHARE = 0.5
"""ActivationMonitor's default ``dead_share``: a dead fraction above it at the last measured step is a finding."""
MAX_ROWS = 8


def update_section(run: Run, report: RunReport) -> None:
    """The total and per-group ‖Δθ‖/‖θ‖ at the section's step, the skipped steps; groups that never moved or
    whose median ratio is outside the usual range."""
    ratios = run.matching(update("ratio/.+"))
    if not ratios:
        return
    step = as_of(run, report, UPDATES, update("total_ratio"), update("ratio/.+"))
    rows = [
        Row(f"‖Δθ‖/‖θ‖ {_name(tag, 'total_ratio') or 'of all parameters'}", value, step=own)
        for tag, series in sorted(run.matching(update("total_ratio")).items())
        for value, own in [value_at(series, step)]
    ]
    per_group = sorted(((*value_at(series, step), _name(tag, "ratio/")) for tag, series in ratios.items()))
    rows += [Row(f"‖Δθ‖/‖θ‖ of {name}", value, step=own) for value, own, name in per_group[-MAX_ROWS:][::-1]]
    rows.append(Row("steps begun but not taken (GradScaler)", counter(run, update("skipped_steps")), "steps"))
    report.sections[UPDATES] = rows
    values = {_name(tag, "ratio/"): [v for _, v in series if math.isfinite(v)] for tag, series in ratios.items()}
    still = sorted(name for name, v in values.items() if v and max(v) == 0.0)
    if still:
        report.findings.append(
            Finding(
                "warning",
                UPDATES,
                f"layers that never moved (Δθ = 0 at every logged step): {', '.join(still)} — lr 0 in their param "
                "group, frozen by the optimizer, or no gradient reaches them (dead units before them)",
            )
        )
    low, high = USUAL_RATIO
    outside = sorted(
        f"{name} ({median:.2g})"
        for name, v in values.items()
        if v and max(v) > 0.0 and not low <= (median := statistics.median(v)) <= high
    )
    if outside:
        report.findings.append(
            Finding(
                "warning",
                UPDATES,
                f"update/weight ratio outside [{low:g}, {high:g}] (median over the logged steps): {', '.join(outside)}"
                " — the rule of thumb is ~1e-3 per step",
            )
        )
    for prefix in DIAGNOSIS_PREFIXES:
        panel(run, report, "update findings", f"{prefix}UpdateMonitor")


def activation_section(run: Run, report: RunReport) -> None:
    """Per module, the rms and the share of dead (ReLU) or inactive (GELU, SiLU, ...) units at the section's step
    (largest first); those above :data:`DEAD_SHARE`."""
    rms = run.matching(activation("rms"))
    if not rms:
        return
    step = as_of(run, report, ACTIVATIONS, activation("rms"))
    largest = sorted((*value_at(series, step), tag.split("/", 2)[2]) for tag, series in rms.items())
    rows = [Row(f"rms of {name}", value, step=own) for value, own, name in largest[-MAX_ROWS:][::-1]]
    # The monitor's own word per activation: dead under ReLU (no gradient), inactive under GELU, SiLU, ...
    shares = {
        word: {
            tag.split("/", 2)[2]: value_at(series, step)
            for tag, series in run.matching(activation(f"{word}_fraction")).items()
        }
        for word in (units_word(True), units_word(False))
    }
    for word, found in shares.items():
        rows += [Row(f"{word} units in {name}", value, "share", own) for name, (value, own) in sorted(found.items())]
    report.sections[ACTIVATIONS] = rows
    for (word, found), why in zip(shares.items(), (DEAD_WHY, INACTIVE_WHY)):
        high = sorted(
            f"{name} ({value:.0%})" for name, (value, _) in found.items() if value is not None and value > DEAD_SHARE
        )
        if high:
            report.findings.append(
                Finding("warning", ACTIVATIONS, f"{word} units above {DEAD_SHARE:.0%}: {', '.join(high)} — {why}")
            )
    for prefix in DIAGNOSIS_PREFIXES:
        panel(run, report, "activation findings", f"{prefix}ActivationMonitor")


def _name(tag: str, after: str) -> str:
    """The group (or ``optimizer <i>``) a tag ``update/[optimizer_<i>/]<after><group>`` is of."""
    match = re.match(rf"update/(?:optimizer_(\d+)/)?{re.escape(after)}(.*)$", tag)
    if match is None:
        return tag
    optimizer, rest = match.groups()
    return " ".join(part for part in (rest, optimizer and f"(optimizer {optimizer})") if part)
