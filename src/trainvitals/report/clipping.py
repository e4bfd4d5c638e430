"""The report's section on gradient clipping: how many logged steps the Trainer's clipping shrank, to what, and
whether the threshold lies below the noise level sqrt(tr Σ/B) — then what it shrinks is mostly noise.

Read from GradNormMonitor's ``grad_norm/total`` (before clipping) and ``grad_norm/clipped_total`` (after), logged
together at each logging step. A step is clipped where the second is below the first by more than
:data:`SHRINK_TOL`; clipping by norm sets every clipped step's norm to the threshold (``max_norm · ‖g‖ / (‖g‖ +
1e-6)``), so the clipped norms agree to :data:`NORM_SPREAD` and their median is the threshold; clipped norms that
differ more come from clipping by value (or a ``configure_gradient_clipping`` of the module's own), whose
threshold no norm says. The lr cut under SGD is GradNormMonitor's ``grad_norm/clip_lr_cut`` where it was logged:
the clip factor over every step, not the logged ones only, in mean weighted by the lr each ran at (under a schedule
the base-lr cut that moves the weights as far); else the mean factor over the logged steps.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass

from trainvitals.lr_scaling.rules import optimizer_family
from trainvitals.norms.clipping import NOISE_MARGIN, SetLR, clips_most, lower_lr
from trainvitals.report.events import Run
from trainvitals.report.model import Finding, Row, RunReport, as_of, first_series
from trainvitals.tags import grad_norm

CLIPPING = "gradient clipping"
SHRINK_TOL = 1e-3
"""A logged step is clipped where its clipped norm is below its pre-clip norm by more than this share: both are one
sum of squares apart only by rounding when nothing was clipped, and a shrink of 0.1 % is no lr cut."""
NORM_SPREAD = 1e-2
"""Clipping by norm: the clipped steps' norms within this share of their median (float32 and bf16 rounding)."""
_OPTIMIZER = re.compile(r"lr_scaling/lr/(?P<name>[^/-]+)")
"""LRScalingAdvisor's lr tags name the optimizer's class (``lr_scaling/lr/AdamW``, ``.../SGD-1/pg2``)."""


@dataclass(frozen=True)
class Clipped:
    """What clipping did to the logged steps: their number, how many it shrank, the threshold (None where the
    clipped norms disagree: not by norm), the median pre-clip norm, and the mean factor ``clipped / total`` over
    the clipped steps and over every logged step (an unclipped one counts as 1); the lr cut (``cut``: the logged
    ``grad_norm/clip_lr_cut``, else ``scale``)."""

    steps: int
    clipped: int
    threshold: float | None
    median_norm: float
    shrink: float
    scale: float
    cut: float

    @classmethod
    def of(cls, pairs: list[tuple[float, float]], cut: float | None = None) -> Clipped | None:
        """From (pre-clip, clipped) norms of the logged steps, finite, pre-clip > 0, and the logged lr cut (``None``
        where none was: the mean factor over the logged steps stands for it); None without any pair."""
        if not pairs:
            return None
        factors = [min(1.0, after / before) for before, after in pairs]
        shrunk = [(after, f) for (_, after), f in zip(pairs, factors) if f < 1.0 - SHRINK_TOL]
        norms = [after for after, _ in shrunk]
        middle = statistics.median(norms) if norms else math.nan
        by_norm = bool(norms) and max(norms) - min(norms) <= NORM_SPREAD * middle
        return cls(
            steps=len(pairs),
            clipped=len(shrunk),
            threshold=middle if by_norm else None,
            median_norm=statistics.median(before for before, _ in pairs),
            shrink=statistics.fmean(f for _, f in shrunk) if shrunk else 1.0,
            scale=statistics.fmean(factors),
            cut=statistics.fmean(factors) if cut is None else cut,
        )


def clipping_section(run: Run, report: RunReport) -> None:
    """The share of logged steps clipped, the threshold, the median pre-clip norm, the mean shrink, the noise
    level; a finding where clipping shrank most logged steps (:func:`~trainvitals.norms.clipping.clips_most`)."""
    after = first_series(run, grad_norm("clipped_total"))
    if not after:
        return
    as_of(run, report, CLIPPING, grad_norm("clipped_total"))
    before = dict(first_series(run, grad_norm("total")) or [])
    pairs = [
        (before[s], v) for s, v in after if s in before and math.isfinite(v) and math.isfinite(before[s]) and before[s]
    ]
    cuts = [v for _, v in first_series(run, grad_norm("clip_lr_cut")) or [] if math.isfinite(v)]
    clipped = Clipped.of(pairs, cuts[-1] if cuts else None)
    if clipped is None:
        return
    floors = [v for _, v in first_series(run, grad_norm("noise_floor")) or [] if math.isfinite(v)]
    noise = statistics.median(floors) if floors else None
    report.sections[CLIPPING] = [
        Row(f"logged steps clipped, of {clipped.steps}", clipped.clipped / clipped.steps, "share"),
        Row("threshold (clipping by norm)", clipped.threshold if clipped.threshold is not None else "not by norm"),
        Row("pre-clip norm, median", clipped.median_norm),
        Row("factor on a clipped step, mean", clipped.shrink if clipped.clipped else None),
        Row("factor on a logged step, mean", clipped.scale),
        Row("lr cut over every step (factor's lr-weighted mean)", clipped.cut if cuts else None),
        Row("noise level sqrt(tr Σ/B), median", noise),
    ]
    if clips_most(clipped.clipped, clipped.steps):
        family, name = _optimizer(run)
        severity = "note" if family == "adam" else "warning"
        message = clipping_message(clipped, noise, family, name, _set_lrs(run, name))
        report.findings.append(Finding(severity, CLIPPING, message))


def clipping_message(clipped: Clipped, noise: float | None, family: str, name: str, lrs: list[SetLR]) -> str:
    """The finding: the share clipped, the threshold against the median norm and the noise level, what the shrink
    does under the optimizer's ``family`` (``"sgd"``, ``"adam"``, ``"unsure"``: :func:`~trainvitals.lr_scaling.rules.
    optimizer_family`), and the threshold to use instead, or the lr cut (:attr:`Clipped.cut`) on the lr set (``lrs``,
    :func:`_set_lrs`)."""
    share = f"{clipped.clipped / clipped.steps:.0%} of the {clipped.steps} logged steps"
    if clipped.threshold is None:
        return (
            f"gradient clipping shrank {share}, not by norm (the clipped norms differ: clipping by value, or the "
            f"module's own): the steps' norm is ×{clipped.scale:.2g} in mean over the logged steps, which under SGD "
            f"cuts the lr as much; clip by norm above the usual norms, or {lower_lr(clipped.scale, lrs)} instead."
        )
    threshold, median = clipped.threshold, clipped.median_norm
    said = [f"gradient clipping at {threshold:.3g} clipped {share} (pre-clip norm {median:.3g} in median)"]
    if noise is None:
        said.append(
            "no noise level was logged (GradNormEarlyStopping or BatchVarianceProbe logs it), so not whether what "
            "it shrinks is noise"
        )
    elif noise >= threshold:
        said.append(
            f"the noise level sqrt(tr Σ/B) is {noise:.3g} (median), above the threshold: a pure-noise gradient is "
            f"clipped too, so clipping shrinks mostly noise (≈ {min(1.0, (noise / median) ** 2):.0%} of ‖ḡ‖² at the "
            "median norm, from E‖ḡ‖² = ‖G‖² + tr Σ/B)"
        )
    else:
        said.append(
            f"the noise level sqrt(tr Σ/B) is {noise:.3g} (median), below the threshold: the steps it clips carry "
            "signal, so it caps the true gradient"
        )
    cut = (
        f"each clipped step is scaled ×{clipped.shrink:.2g} in mean (threshold / norm), ×{clipped.scale:.2g} over all "
        "logged steps"
    )
    if family == "adam":
        said.append(
            f"{cut}; under {name}, which divides by the RMS of recent gradients, a factor common to the steps cancels: "
            "it is no lr cut, it sets each step's norm to the threshold"
        )
    else:
        said.append(
            f"{cut}: for SGD, whose step is lr × gradient, an lr cut of ~×{clipped.cut:.2g}"
            + (
                " over every step (the factor's mean weighted by the lr each step ran at: the base-lr cut that moves "
                "the weights as far under the schedule)"
                if f"{clipped.cut:.2g}" != f"{clipped.scale:.2g}"
                else ""
            )
            + ("" if family == "sgd" else " (the logs do not say the optimizer; Adam-like ones cancel most of it)")
        )
    # Above 2× the noise level a norm is mostly signal (NOISE_MARGIN); where the median norm is above that too, the
    # typical step is clipped still: 2× the median norm.
    if noise is not None and NOISE_MARGIN * noise > median:
        aim = f"~{NOISE_MARGIN:g}× the noise level ({NOISE_MARGIN * noise:.2g})"
    else:
        aim = f"~{NOISE_MARGIN:g}× the median norm ({NOISE_MARGIN * median:.2g})"
    lower = f", or {lower_lr(clipped.cut, lrs)} instead" if family != "adam" else ""
    return "; ".join(said) + f"; raise gradient_clip_val above {aim} so that it catches outliers only{lower}."


def _optimizer(run: Run) -> tuple[str, str]:
    """The optimizer's family and class name, from LRScalingAdvisor's lr tags; ``("unsure", "")`` without them."""
    for tag in sorted(run.scalars):
        if match := _OPTIMIZER.match(tag):
            return optimizer_family(match["name"]), match["name"]
    return "unsure", ""


def _set_lrs(run: Run, optimizer: str) -> list[SetLR]:
    """The lrs set on ``optimizer``'s param groups, from LRScalingAdvisor's ``lr_scaling/base_lr/<group>`` (the lr a
    user sets: under a scheduler its base lr) at its last logged step, and whether the lr its steps ran at
    (``lr_scaling/lr/<group>``) moved from it; none without them."""
    lrs = []
    for tag, series in sorted(run.matching(rf"lr_scaling/base_lr/{re.escape(optimizer)}(/[^/]+)?$").items()):
        group = tag.removeprefix("lr_scaling/base_lr/")
        base = series[-1][1]
        if not base > 0:
            continue  # a frozen group: no lr to lower
        now = run.scalars.get(f"lr_scaling/lr/{group}") or []
        moves = any(not math.isclose(v, base, rel_tol=1e-6) for _, v in now)
        said = f"{base:.3g} (the lr set, which a schedule or cut scales; now {now[-1][1]:.3g} at the last logged step)"
        lrs.append(SetLR(group, base, said, "base lr") if moves else SetLR(group, base, f"{base:.3g}", "lr"))
    return lrs
