"""Names and counts in a message's words: the first few names spelled out, a noun with its plural."""

from __future__ import annotations

from collections.abc import Sequence

SHOWN = 5  # names spelled out in a message; a finding keeps them all


def listed(names: Sequence[str]) -> str:
    """``"`a`, `b`, `c`, `d`, `e` and 2 more"``: the first :data:`SHOWN` names, quoted, and a count of the rest."""
    shown = ", ".join(f"`{n}`" for n in names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def counted(n: int, noun: str) -> str:
    """``"1 optimizer step"``, ``"3 optimizer steps"``."""
    return f"{n} {noun}" + ("" if n == 1 else "s")
