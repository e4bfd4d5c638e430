"""An estimate with its 90 % interval in words, the point never outside the interval it is quoted with."""

from __future__ import annotations

import math


def band_ratio_said(ratio: float, low: float, high: float) -> str:
    """The band ratio ‖G‖²/(margin·tr Σ/B) with its 90 % interval (``nan``: not measured), as every message and
    record that quotes it says it: ``"0.81 (90 %: 0.42–1.2)"``, ``"2.3 (90 %: ≥ 1.5, no upper end)"``. The ratio
    of a true ‖G‖² is ≥ 0 and so are the ends said. A negative point is a ‖G‖² estimate below 0, and the upper end
    is what is known: ``"≤ 1.2 (90 %; ‖G‖² within its error of 0)"``, ``"≤ 0 (90 %; ‖G‖² below 0 beyond its
    error)"`` (the interval {0}), ``"unbounded (90 %; ‖G‖² within its error of 0)"`` with no upper end; any other
    point outside its interval is left out: ``"in 0.42–1.2 (90 %)"``."""
    if math.isnan(ratio):
        return "not measured"
    if math.isnan(high):
        return f"{ratio:.2g} (no interval)"
    low, high = (low if low > 0 else 0.0), max(high, 0.0)
    if ratio < 0:
        if not math.isfinite(high):
            return "unbounded (90 %; ‖G‖² within its error of 0)"
        why = "within its error of 0" if high > 0 else "below 0 beyond its error"
        return f"≤ {high:.2g} (90 %; ‖G‖² {why})"
    if not math.isfinite(high):
        return f"{ratio:.2g} (90 %: ≥ {low:.2g}, no upper end)" if ratio >= low else f"≥ {low:.2g} (90 %)"
    if not low <= ratio <= high:
        return f"in {low:.2g}–{high:.2g} (90 %)"
    return f"{ratio:.2g} (90 %: {low:.2g}–{high:.2g})"
