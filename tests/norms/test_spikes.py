"""core.spikes.SpikeDetector against a direct computation of the winsorized, bias-corrected EMA."""

import pytest

from trainvitals.norms.spikes import SpikeDetector


def _reference(values, factor, beta, warmup):
    """Weighted average of the (clipped) earlier values with weights β^(t-1-j), normalised to sum 1."""
    kept, flags = [], []
    for value in values:
        t = len(kept)
        weights = [beta ** (t - 1 - j) for j in range(t)]
        average = sum(w * x for w, x in zip(weights, kept)) / sum(weights) if t else 0.0
        spike = t >= max(1, warmup) and value > factor * average
        flags.append(value / average if spike else None)
        kept.append(factor * average if spike else value)
    return flags


def test_flags_and_ratios_equal_the_direct_computation():
    values = [1.0, 1.2, 0.9, 9.0, 1.1, 30.0, 30.0, 30.0, 1.0] + [40.0] * 40
    detector = SpikeDetector(factor=3.0, beta=0.9, warmup_steps=3)
    flags = [detector.update(v) for v in values]
    expected = _reference(values, 3.0, 0.9, 3)
    assert [f is None for f in flags] == [e is None for e in expected]
    assert [f for f in flags if f] == pytest.approx([e for e in expected if e], rel=1e-12)
    assert flags[3] == pytest.approx(9.0 / ((1.0 * 0.81 + 1.2 * 0.9 + 0.9) / (0.81 + 0.9 + 1.0)))
    assert flags[-1] is None  # a lasting level shift is followed


def test_no_spike_during_warmup_and_state_round_trips():
    detector = SpikeDetector(factor=2.0, beta=0.5, warmup_steps=2)
    assert detector.update(1.0) is None and detector.update(100.0) is None  # warmup
    restored = SpikeDetector(factor=2.0, beta=0.5, warmup_steps=2)
    restored.load_state_dict(detector.state_dict())
    assert (restored.count, restored.average) == (2, detector.average)
    assert restored.update(1000.0) == detector.update(1000.0)


@pytest.mark.parametrize(
    "kwargs, name", [({"factor": 1.0}, "factor"), ({"beta": 1.0}, "beta"), ({"warmup_steps": -1}, "warmup_steps")]
)
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SpikeDetector(**{"factor": 3.0, "beta": 0.9, "warmup_steps": 0, **kwargs})


def test_an_average_of_zero_flags_nothing_and_is_left_behind():
    detector = SpikeDetector(factor=5.0, beta=0.98, warmup_steps=20)
    assert [detector.update(0.0) for _ in range(30)] == [None] * 30
    assert detector.update(1.0) is None  # no scale to exceed: it enters the average
    flags = [detector.update(1.0) for _ in range(200)]
    assert detector.average > 0.5 and flags[-1] is None
