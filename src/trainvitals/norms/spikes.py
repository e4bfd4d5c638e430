"""Gradient-norm spikes: a value far above its running average, found on the host.

The detector runs in plain Python floats over the totals of a logging window, read back in one
transfer: a float operation costs nanoseconds, a device operation microseconds (and a kernel launch
on an accelerator), so a recurrence over a few dozen steps is cheapest on the host.
"""

from __future__ import annotations

from typing import Any

from trainvitals._validation import check_float, check_int


def first_spike_note(counted_in: str) -> str:
    """What a monitor's console line on the fit's first spike adds: that the later ones are counted, not said.

    A noisy run (small batches late in training) spikes every few dozen steps; a line for each would bury
    the console, so a monitor says the first, in Lightning's manner of one warning, and the count
    (``counted_in``: a scalar tag, the fit-end line) tells the rest; each spike still goes to its text panel.
    """
    return f" (this fit's first; later spikes are counted in {counted_in}, not said)"


class SpikeDetector:
    """Flags a value above ``factor`` × the bias-corrected EMA of the values before it.

    A spike enters the EMA clipped to the threshold (winsorized): one spike barely moves the
    average, while a lasting level shift is followed within ~1/(1 − β) steps instead of being
    flagged forever.

    Args:
        factor: the threshold as a multiple of the average, > 1.
        beta: EMA decay per value, in [0, 1).
        warmup_steps: no spike is flagged before this many values (at least one) entered the EMA.

    Raises:
        ValueError: on an invalid argument, naming it.
    """

    def __init__(self, factor: float, beta: float, warmup_steps: int) -> None:
        self.factor, self.beta, self.warmup_steps = self.check_arguments(factor, beta, warmup_steps)
        self._ema = 0.0
        self.count = 0

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

    def update(self, value: float, allowance: float = 1.0) -> float | None:
        """Take one finite value; returns its ratio to the average when it is a spike, else None. ``allowance`` (≥ 1)
        raises this value's threshold to ``allowance`` × ``factor`` × the average (and its winsorization with it):
        what its measurement's own noise allows (a gradient norm from a short batch)."""
        average = self.average
        threshold = allowance * self.factor * average
        # An average of 0 (a loss weighted 0 so far) has no scale to exceed: the value enters the EMA.
        spike = self.count >= max(1, self.warmup_steps) and average > 0.0 and value > threshold
        self._ema += (1.0 - self.beta) * ((threshold if spike else value) - self._ema)
        self.count += 1
        return value / average if spike else None

    def state_dict(self) -> dict[str, Any]:
        return {"ema": self._ema, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._ema, self.count = float(state.get("ema", 0.0)), int(state.get("count", 0))
