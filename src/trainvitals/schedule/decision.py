r"""What a band-driven schedule does when the noise band is entered: cut the lr, stop, or nothing.

Torch- and Lightning-free: plain numbers in, an :class:`Action` out (docs/science.md, "From stop to schedule").

The band is ‖G‖² ≤ margin·tr(Σ)/B. Near a minimum, SGD at lr η settles where the loss's expected decrease per
step, η‖G‖² − (η²/2)·tr(HΣ)/B, is zero (a noisy quadratic: McCandlish et al. 2018, App. A; Yaida 2019's
fluctuation–dissipation relation is the same balance), so the stationary ‖G‖² ≈ (η/2)·tr(HΣ)/B: ‖G‖² over tr(Σ)/B
is proportional to η there. After the lr is cut by a factor f, the run is still "in the band" at once (its ‖G‖²
has not moved yet) although it has not relaxed to the new lr. The band's edge therefore follows the lr scale s
(the product of the cuts): margin·s·tr(Σ)/B, so that the next cut waits for the ratio to fall by f as well — for
the run to settle at the lower lr — instead of cutting again as soon as the restarted estimate can decide.

Growing the batch B → kB instead lowers the stationary excess loss as a cut of the lr by 1/k does (∝ η/B), but
leaves the band's stationary ratio ‖G‖²·B/tr(Σ) ≈ η·tr(HΣ)/(2 tr Σ) where it was: just after the growth the run
is out of the band (its ‖G‖² is that of the smaller batch, the edge k× lower), and it comes back when it has
settled at the larger batch. The edge is therefore not scaled for a growth.

After a cut, every further act (a cut, a growth, the stop) needs more than the stopper's stop. The streak is a
point estimate held for ``patience`` steps, and the estimate's error is set by tr(Σ)/B, not by the band's edge:
the edge scaled by s = 0.1 is ten times closer to zero in units of that error, so ‖G‖² within its error of zero
dips under it by chance (on benchmarks/schedule_comparison.py's diabetes MLP the second cuts came on intervals
of 0–3.4 to 0–9.6 times the edge; the window restarted at the cut makes the estimate young, its interval wider
still). So after a cut an act waits until the run is shown inside the band (:func:`shown_in`): the band ratio's
90 % upper end ≤ 1 and its point estimate ≥ 0, at :func:`checks_needed` consecutive checks — the first and the
last ``patience`` steps apart, every check between them passing.

Why both, a multiple-testing argument. The upper end alone is a 95 % one-sided bound, tested at every check for
as long as the run trains: with the truth at the edge it is passed by chance with probability 0.05 at each check,
so over m checks the chance of a false act grows toward m·0.05 (Bonferroni) — and at twice the edge it is not
small either when the error is about two edge-units (as just after a cut: the upper end ≤ 1 then needs a draw of
‖G‖² near −2.3 edges, which a fresh window makes at ~5 % of its first checks; issue #25 saw 2 in 33 restarted
runs, both at the first check allowed). A negative point estimate is a ‖G‖² within its error of zero: it says the
error is large, not that the run is inside the band. With the point ≥ 0 as well, a pass needs the error below
1/t edge-units, so at a true ratio of 2 it is a draw of at least 1/σ + t ≥ 2t ≈ 3.3 standard errors below the
truth (p ≲ 5·10⁻⁴ per check), and it must hold again ``patience`` steps later, on an estimate that has taken in
``patience`` more measurements; tests/schedule/test_schedule_decision.py counts the false acts over 2,000
simulated windows × 30 checks. A minimum count of measurements since the cut would not do (the diabetes MLP's
second cuts came 100–200 steps after the first).

The first cut stays on the stopper's rule, at the stopper's edge: the point estimate with patience that its
benchmark chose (docs/benchmarks.md; requiring the interval inside the band there too delayed the first cut on the
diabetes MLP from steps 139–179 to 269–299 and lost 0.5–3.7 points of 100·R² on all four runs) — but only on an
estimate that bounds the ratio (``bounded``: the band ratio's 90 % interval has a finite upper end and tr(Σ)'s
lower end is above 0). One whose tr(Σ) is not resolved from 0 has no edge to be inside of, and its ratio is noise
(issue #25: tr(Σ)'s error 40× tr(Σ) at the cut); the cut waits for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

from trainvitals.text.intervals import band_ratio_said


class Action(Enum):
    NONE = "none"
    CUT = "cut"
    GROW = "grow"
    STOP = "stop"


def decide(
    in_band: bool,
    cuts: int,
    lr: float,
    factor: float,
    max_cuts: int | None,
    min_lr: float,
    stop: bool,
    shown: bool,
    bounded: bool = True,
    growth: int = 1,
) -> Action:
    """The schedule's answer to the band, after ``cuts`` cuts (batch growths included), the smallest param
    group's lr now ``lr``, a batch growth of ``growth`` on offer (:func:`batch_growth`; 1: none), ``shown``
    whether the run has been shown inside the band (:func:`shown_in` at :func:`checks_needed` checks in a row) and
    ``bounded`` whether the estimate bounds the band ratio (a finite upper end, tr(Σ) resolved from 0).

    While fewer than ``max_cuts`` (``None``: no limit) were made: grow the batch when a growth ≥ 2 is on offer —
    it leaves the lr alone, so ``min_lr`` does not bound it — else cut while the cut lr ``lr·factor`` stays ≥
    ``min_lr``. Otherwise stop, or with ``stop=False`` do nothing (the run trains on at its last lr). After a cut
    (``cuts`` > 0) each of these waits for ``shown``; the first cut or growth waits for ``bounded``, the first stop
    (no cut allowed) is the stopper's own and does not (module docstring)."""
    if not in_band or (cuts and not shown):
        return Action.NONE
    if max_cuts is None or cuts < max_cuts:
        if growth >= 2:
            return Action.GROW if cuts or bounded else Action.NONE
        if lr * factor >= min_lr:
            return Action.CUT if cuts or bounded else Action.NONE
    return Action.STOP if stop else Action.NONE


def shown_in(ratio: Any, ratio_high: Any) -> Any:
    """Whether one check shows the run inside the band beyond the estimate's error (module docstring): the band
    ratio's point estimate ``ratio`` ≥ 0 and its 90 % upper end ``ratio_high`` ≤ 1 (``nan``: not measured, no).
    Floats, numpy arrays or tensors alike."""
    return (ratio >= 0.0) & (ratio_high <= 1.0)


def measurements_to_show(ratio: float, ratio_high: float, measurements: float) -> float:
    """At least how many effective measurements of ‖G‖² the band ratio's 90 % interval needs for :func:`shown_in`
    to pass as often as not, whatever the true ratio, at the error per measurement the interval shows
    (docs/callbacks/band-schedule.md, "What a second act needs"). The half-width h = ``ratio_high`` − ``ratio``
    shrinks as 1/√n; a pass needs the point ≥ 0 and the point + h ≤ 1, at best (a true ratio of ½) h ≤ ½, so
    n ≥ ``measurements``·(2h)². After a cut by a factor s the edge is s× nearer 0 in units of that error: 1/s² of
    the unscaled edge's n. ``inf`` where the interval has no upper end."""
    if not math.isfinite(ratio_high):
        return math.inf
    return measurements * max(2.0 * (ratio_high - ratio), 1.0) ** 2


def checks_needed(patience: int, check_every_n_steps: int) -> int:
    """Consecutive checks :func:`shown_in` must pass after a cut: enough that the first and the last lie at least
    ``patience`` steps apart, checks ``check_every_n_steps`` steps apart — at least 2."""
    return -(-patience // check_every_n_steps) + 1


def scaled_margin(margin: float, lr_scale: float) -> float:
    """The band's margin at lr scale ``lr_scale`` (module docstring): ``margin·lr_scale``."""
    return margin * lr_scale


def batch_growth(factor: float, batch: int | None, b_simple: float | None, population: int | None) -> int:
    """By how much a band entry grows the effective batch instead of cutting the lr (1: cut the lr instead).

    round(1/``factor``) — the same stationary loss as an lr cut by ``factor`` (on a noisy quadratic the stationary
    excess loss is ∝ η/B) — but not beyond B_simple (``b_simple``: the run's estimate when it is reliable, else
    ``None``): past the noise scale each step needs more examples for the same progress, E/E_min = 1 + B/B_noise
    (McCandlish et al. 2018, Eq. 2.11), so a batch of B_simple spends at most twice the fewest examples; and not
    beyond half the ``population`` (an epoch would hold less than two steps). Less than 2: no growth."""
    if not batch:
        return 1
    growth = round(1 / factor)
    if b_simple is not None and math.isfinite(b_simple):
        growth = min(growth, int(b_simple // batch))
    if population:
        growth = min(growth, int(population // (2 * batch)))
    return growth if growth >= 2 else 1


@dataclass(frozen=True)
class Cut:
    """One cut: the optimizer step it was made at, the band ratio ‖G‖²/(margin·tr Σ/B) that triggered it and
    the ends of the estimate's 90 % interval of it (Fieller's; ``nan`` when not measured), the lr scale after, and
    the effective batch after when the cut grew the batch instead (``None``: the lr was cut)."""

    step: int
    band_ratio: float
    ratio_low: float
    ratio_high: float
    lr_scale: float
    batch: int | None = None

    def line(self) -> str:
        """``step 420: band ratio 0.81 (90 %: 0.42–1.2) → lr × 0.1`` (or ``→ batch 640``; the ratio in
        :func:`~trainvitals.text.intervals.band_ratio_said`'s words)."""
        then = f"batch {self.batch}" if self.batch is not None else f"lr × {self.lr_scale:g}"
        return (
            f"step {self.step}: band ratio {band_ratio_said(self.band_ratio, self.ratio_low, self.ratio_high)} → {then}"
        )
