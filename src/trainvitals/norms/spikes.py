"""Gradient-norm spikes: a value far above its running average, found on the host.

The detector runs in plain Python floats over the totals of a logging window, read back in one
transfer: a float operation costs nanoseconds, a device operation microseconds (and a kernel launch
on an accelerator), so a recurrence over a few dozen steps is cheapest on the host.

A gradient norm from a batch smaller than the usual one (an epoch's short last batch) is noisier: the rule
allows it √(B / b) (:class:`UsualBatch`, from the step's :func:`noise_weight`; :func:`norm_spike` applies it), the
one spike rule of GradNormMonitor, UpdateMonitor and TrainingGuard; the guard, which acts on a spike, also asks a
value to clear its values' own spread (:data:`SPREAD_Z`).
"""

from __future__ import annotations

import math
from typing import Any

from trainvitals._validation import check_float, check_int


def first_spike_note(counted_in: str) -> str:
    """What a monitor's console line on the fit's first spike adds: that the later ones are counted, not said.

    A noisy run (small batches late in training) spikes every few dozen steps; a line for each would bury
    the console, so a monitor says the first, in Lightning's manner of one warning, and the count
    (``counted_in``: a scalar tag, the fit-end line) tells the rest; each spike still goes to its text panel.
    """
    return f" (this fit's first; later spikes are counted in {counted_in}, not said)"


SPREAD_Z = 8.0
"""TrainingGuard's spread term: a value is a spike only above mean + this many standard deviations of the values
before it as well. A classifier's batch loss near convergence spreads as widely as its mean: on four recorded
digits-MLP runs its loss events fall from 4–31 to 1–4, and 30× spikes injected at random steps are found in 34–46
of 50 instead of 47–49 (docs/callbacks/training-guard.md, which says why no magnitude rule is safe there); a
steady loss (a spread under half its mean) keeps the plain ``factor`` × mean."""


class SpikeDetector:
    """Flags a value above ``factor`` × the bias-corrected EMA of the values before it and, with ``spread_z``,
    above that mean + ``spread_z`` × their standard deviation (bias-corrected EMAs of the value and its square).

    A spike enters the EMAs clipped to the threshold (winsorized): one spike barely moves the
    average, while a lasting level shift is followed within ~1/(1 − β) steps instead of being
    flagged forever.

    Args:
        factor: the threshold as a multiple of the average, > 1.
        beta: EMA decay per value, in [0, 1).
        warmup_steps: no spike is flagged before this many values (at least one) entered the EMA.
        spread_z: the spread term's standard deviations (:data:`SPREAD_Z` for TrainingGuard); ``None``: none.

    Raises:
        ValueError: on an invalid argument, naming it.
    """

    def __init__(self, factor: float, beta: float, warmup_steps: int, spread_z: float | None = None) -> None:
        self.factor, self.beta, self.warmup_steps = self.check_arguments(factor, beta, warmup_steps)
        self.spread_z = spread_z
        self._ema = self._sq_ema = 0.0
        self.count = 0
        self.by_spread = False  # whether the last spike's threshold was the spread term's

    @staticmethod
    def check_arguments(
        factor: float, beta: float, warmup_steps: int, names: tuple[str, str, str] = ("factor", "beta", "warmup_steps")
    ) -> tuple[float, float, int]:
        """The arguments as (float, float, int); TypeError/ValueError naming the first invalid one by its
        name in ``names`` (a caller's own)."""
        return (
            check_float(names[0], factor, 1.0, low_open=True),
            check_float(names[1], beta, 0.0, 1.0, high_open=True),
            check_int(names[2], warmup_steps, 0),
        )

    @property
    def average(self) -> float:
        """The bias-corrected EMA (Adam's correction); 0.0 before the first value."""
        return self._ema / (1.0 - self.beta**self.count) if self.count else 0.0

    @property
    def spread(self) -> float:
        """The bias-corrected standard deviation of the values so far, from the EMAs of the value and its square;
        0.0 before the first value."""
        if not self.count:
            return 0.0
        mean_sq = self._sq_ema / (1.0 - self.beta**self.count)
        return math.sqrt(max(mean_sq - self.average**2, 0.0))

    def threshold(self, allowance: float = 1.0) -> float:
        """What the next value must exceed to be a spike: ``allowance`` × the larger of ``factor`` × the average and,
        with ``spread_z``, the average + ``spread_z`` × :attr:`spread`."""
        average = self.average
        spread = average + self.spread_z * self.spread if self.spread_z is not None else 0.0
        return allowance * max(self.factor * average, spread)

    def update(self, value: float, allowance: float = 1.0) -> float | None:
        """Take one finite value; returns its ratio to the average when it is a spike, else None. ``allowance`` (≥ 1)
        raises this value's threshold :meth:`threshold` (and its winsorization with it): what its measurement's own
        noise allows (a gradient norm from a short batch)."""
        average = self.average
        threshold = self.threshold(allowance)
        # An average of 0 (a loss weighted 0 so far) has no scale to exceed: the value enters the EMA.
        spike = self.count >= max(1, self.warmup_steps) and average > 0.0 and value > threshold
        if spike:
            self.by_spread = threshold > allowance * self.factor * average
        kept = threshold if spike else value
        self._ema += (1.0 - self.beta) * (kept - self._ema)
        self._sq_ema += (1.0 - self.beta) * (kept * kept - self._sq_ema)
        self.count += 1
        return value / average if spike else None

    def spread_words(self) -> str:
        """After a spike whose threshold was the spread term's: what it was, in words (else empty)."""
        if not self.by_spread:
            return ""
        return f" (and above its steps' own spread, mean + {self.spread_z:g} s.d.)"

    def state_dict(self) -> dict[str, Any]:
        return {"ema": self._ema, "sq_ema": self._sq_ema, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._ema, self.count = float(state.get("ema", 0.0)), int(state.get("count", 0))
        self._sq_ema = float(state.get("sq_ema", self._ema * self._ema))  # an older state: no spread yet


def noise_weight(sizes: list[int | None], divisor: int) -> float:
    """The noise of one rank's step gradient in units of tr Σ: Σ_k 1 / (divisor² · b_k) over its micro-batches of
    ``sizes`` b_k examples, each loss divided by ``divisor`` (Lightning's ``accumulate_grad_batches``), so that
    E‖g‖² = c²‖G‖² + weight · tr Σ (c ≤ 1: the share of the step's micro-batches that ran). Under DDP the ranks'
    gradients are averaged: the step's weight is the ranks' sum over world_size², its effective batch 1 / that
    (:func:`effective_batch`). NaN when a size is unknown (``None``) or there is none."""
    if not sizes or not all(sizes):
        return math.nan
    return sum(1.0 / (divisor * divisor * b) for b in sizes)


def relative_noise_weight(sizes: list[int | None], divisor: int) -> float:
    """:func:`noise_weight` over c², c = n / ``divisor`` the share of the step's micro-batches that ran (n = len(sizes)):
    the step's noise relative to its signal, what the spike rule compares. A step whose accumulation ran short (an
    epoch's last, n < divisor) has its gradient scaled by c, signal and noise alike, so that its norm against a full
    step's is at most that of the mean of its n micro-batches; weighted as that mean, it is allowed what its noise
    needs and does not count as a larger batch towards the usual one (a lone 5-row micro-batch of 4 is 5 examples,
    not the 80 of its noise weight)."""
    return noise_weight(sizes, min(len(sizes), divisor) if sizes else divisor)


def effective_batch(weight: float, world_size: int = 1) -> float:
    """The examples of one batch whose mean gradient is as noisy as a step of :func:`noise_weight` ``weight`` summed
    over ``world_size`` ranks whose gradients are averaged: world_size² / weight; NaN where a weight is unknown."""
    return world_size**2 / weight if weight > 0 else math.nan  # NaN > 0 is False


class UsualBatch:
    """The usual effective batch of the recent optimizer steps, and the spike rule's allowance to a smaller one.

    A step of b < B examples has E‖ḡ_b‖² = ‖G‖² + tr Σ / b ≤ (B / b) · (‖G‖² + tr Σ / B): its gradient norm may be
    up to √(B / b) times the usual one from noise alone (exactly so when noise dominates), as on an epoch's short
    last batch (``drop_last=False``). B is the largest effective batch (:func:`effective_batch`) of the last
    ``span`` to 2 · ``span`` steps (two spans' maxima kept: bounded memory; a batch size lowered for good stops
    counting as short within 2 · ``span`` steps). The callbacks' span is their spike EMA's horizon, 1 / (1 − β).
    """

    def __init__(self, span: int) -> None:
        self.span = max(int(span), 1)
        self.current = self.previous = 0.0  # the largest batch of this span, of the one before
        self.steps = 0

    def ratio(self, batch: float) -> float:
        """B / b for a step of effective batch ``batch`` = b below the usual B, else 1 (an unknown b: 1); no count."""
        usual = max(self.current, self.previous)
        return usual / batch if math.isfinite(batch) and 0 < batch < usual else 1.0

    def allowance(self, batch: float) -> tuple[float, float]:
        """(√(B / b), B) for a step of effective batch ``batch`` = b below the usual B, else (1, B); then b counts
        towards B. An unknown b (NaN) is allowed nothing and counts for nothing."""
        usual, ratio = max(self.current, self.previous), self.ratio(batch)
        sized = math.isfinite(batch) and batch > 0
        if sized:
            self.current = max(self.current, batch)
        self.steps += 1
        if self.steps % self.span == 0:
            self.previous, self.current = self.current, 0.0
        return math.sqrt(ratio), usual

    def state_dict(self) -> dict[str, Any]:
        return {"current": self.current, "previous": self.previous, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.current, self.previous = float(state.get("current", 0.0)), float(state.get("previous", 0.0))
        self.steps = int(state.get("steps", 0))


SHORT_BATCH_HINT = "the DataLoader's drop_last=True leaves an epoch's short last batch out"
"""Said with a spike on a short batch: such a step takes the full lr on a few examples' gradient."""


def norm_spike(norm: float, batch: float, spikes: SpikeDetector, usual: UsualBatch | None) -> tuple[float, str] | None:
    """One step's finite gradient norm ``norm``, of effective batch ``batch``, through ``spikes`` with the threshold
    raised by ``usual``'s allowance (none without it): (its ratio to the average, what the allowance was in words —
    empty for a usual batch) when it is a spike, else None."""
    allowance, usual_batch = usual.allowance(batch) if usual is not None else (1.0, math.nan)
    limit = spikes.threshold(allowance) / spikes.average if spikes.average > 0.0 else math.inf
    ratio = spikes.update(norm, allowance)
    if ratio is None:
        return None
    short = (
        f" (a batch of {batch:.4g} examples against the usual {usual_batch:.4g}: beyond the "
        f"{limit:.3g}× its noise allows; {SHORT_BATCH_HINT})"
        if allowance > 1.0
        else ""
    )
    return ratio, short
