"""Names, counts and shares in a message's words: the first few names spelled out, names grouped under the reason
they share, a noun with its plural, a fraction as a percent a reader reads at a glance."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

Reason = TypeVar("Reason", bound=Hashable)

SHOWN = 5  # names spelled out in a message; a finding keeps them all


def listed(names: Sequence[str]) -> str:
    """``"`a`, `b`, `c`, `d`, `e` and 2 more"``: the first :data:`SHOWN` names, quoted, and a count of the rest."""
    shown = ", ".join(f"`{n}`" for n in names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def by_reason(reasons: Mapping[str, Reason]) -> dict[Reason, list[str]]:
    """The names of ``reasons`` (``{name: why}``) under each reason, in first-seen order: a message says each
    reason once, for all the names it holds, not once per name."""
    groups: dict[Reason, list[str]] = {}
    for name, why in reasons.items():
        groups.setdefault(why, []).append(name)
    return groups


def grouped(names: Sequence[str], noun: str) -> str:
    """``"`a`"`` for one name; ``"`a`, `b`, `c`, `d`, `e` and 3 more (8 modules)"`` for several (:func:`listed`,
    and how many: ``noun`` counted)."""
    return listed(names) + (f" ({counted(len(names), noun)})" if len(names) > 1 else "")


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
