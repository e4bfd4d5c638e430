"""Names, counts and shares in a message's words: the first few names spelled out, a noun with its plural, a
fraction as a percent a reader reads at a glance."""

from __future__ import annotations

import math
from collections.abc import Sequence

SHOWN = 5  # names spelled out in a message; a finding keeps them all


def listed(names: Sequence[str]) -> str:
    """``"`a`, `b`, `c`, `d`, `e` and 2 more"``: the first :data:`SHOWN` names, quoted, and a count of the rest."""
    shown = ", ".join(f"`{n}`" for n in names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def counted(n: int, noun: str) -> str:
    """``"1 optimizer step"``, ``"3 optimizer steps"``."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def percent(fraction: float) -> str:
    """A fraction (a relative error, a share) as a percent: ``"100 %"``, ``"12 %"``, ``"4.6 %"``, ``"0.41 %"``;
    whole percents from 10 on, two significant digits below, ``"< 0.01 %"`` under that: never ``.2g``'s
    ``"1e+02%"``."""
    p = 100 * fraction
    if p < 0:
        return f"-{percent(-fraction)}"
    if not math.isfinite(p) or p >= 9.95:
        return f"{p:.0f} %"
    return f"{p:.2g} %" if p == 0 or p >= 0.01 else "< 0.01 %"
