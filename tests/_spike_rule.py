"""The spike rule replayed by hand, for tests of every callback that applies it (norms, updates, the guard)."""

from __future__ import annotations


def spike_ratios(values, factor, beta, warmup, allowances=None, z=None):
    """Weighted average of the (clipped) earlier values with weights β^(t-1-j), normalised to sum 1; each value's
    threshold factor × that × its allowance (1 by default), or with ``z`` the larger of that and allowance × (average
    + z × the weighted standard deviation). Per value: its ratio to the average where flagged, else ``None``; a
    flagged value enters the averages clipped to its threshold."""
    kept, flags = [], []
    for value, allowance in zip(values, allowances or [1.0] * len(values)):
        t = len(kept)
        weights = [beta ** (t - 1 - j) for j in range(t)]
        average = sum(w * x for w, x in zip(weights, kept)) / sum(weights) if t else 0.0
        threshold = allowance * factor * average
        if z is not None and t:
            variance = sum(w * (x - average) ** 2 for w, x in zip(weights, kept)) / sum(weights)
            threshold = max(threshold, allowance * (average + z * variance**0.5))
        spike = t >= max(1, warmup) and value > threshold
        flags.append(value / average if spike else None)
        kept.append(threshold if spike else value)
    return flags


def flagged_steps(values, allowances, factor, beta, warmup, z=None) -> list[int]:
    """The indices :func:`spike_ratios` flags."""
    flags = spike_ratios(values, factor, beta, warmup, allowances, z)
    return [i for i, ratio in enumerate(flags) if ratio is not None]
