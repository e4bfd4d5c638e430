"""What GraphIntegrityCallback finds: the kinds of finding (one row each, read by the callback and the report)
and the findings themselves.

A :class:`FindingKind` is declared in the file of the check that files it and registered with that check
(:func:`~trainvitals.integrity.checks.base.register_check`); :func:`critical_counters`,
:func:`warning_counters` and :func:`last_window_counters` turn the registered kinds into the tables
``trainvitals report`` judges a run by. No torch or Lightning import: the report reads this.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

INTEGRITY = "integrity"
"""The report's section for the integrity findings."""

NOTHING_CHECKED = (
    "**Graph integrity: nothing checked.** No graph walk and no gradient check ran, so no verdict: "
    "nothing logged (the run may have ended before its first step)."
)
"""GraphIntegrityCallback's end-of-fit markdown when it checked nothing: not a clean bill of health."""

_NAME = re.compile(r"[a-z][a-z0-9_]*")


class GraphIntegrityError(RuntimeError):
    """Raised by :class:`~trainvitals.integrity.callback.GraphIntegrityCallback` with ``strict=True`` at the
    first finding."""


@dataclass(frozen=True, eq=False)
class FindingKind:
    """A kind of finding: what it logs, and what the report makes of it.

    Its counter is ``graph/findings_<value>`` (how many times it was found so far). A run with a
    critical kind is broken: the report prints ``critical``; any other kind found is listed under its
    ``warning``. Exactly one of the two is given.

    Attributes:
        value: the kind's name (lower case, digits, ``_``); names its counter and its findings.
        metric: ``graph/<metric>``, the kind's count per check window (logged when a window closes), if any.
        label: the report's words for that metric's row; default: the metric's name as words.
        critical: the report's message for a run in which :attr:`report_tag` was above zero (``{n}``: its
            value); ``None``: not critical.
        warning: what the report's findings say of a kind that is not critical when its counter is above
            zero: the problem in a few words (the integrity panel has each finding, where and the fix).
        last_window: the report reads :attr:`report_tag`'s last value, not its largest (needs a metric).
        strict: ``strict=True`` raises on it. Not :attr:`critical` (the report's verdict on a finished run):
            a kind that is also a deliberate choice (lr 0 to keep a group fixed) is only reported.
        section: the report's section.

    Raises:
        ValueError: on a malformed ``value``, both or neither of ``critical`` and ``warning``, ``label`` or
            ``last_window`` without a ``metric``.
    """

    value: str
    metric: str | None = None
    label: str | None = None
    critical: str | None = None
    warning: str | None = None
    last_window: bool = False
    strict: bool = True
    section: str = INTEGRITY

    def __post_init__(self) -> None:
        if not isinstance(self.value, str) or not _NAME.fullmatch(self.value):
            raise ValueError(f"`value` must be a lower-case name ([a-z][a-z0-9_]*), got {self.value!r}")
        if (self.critical is None) == (self.warning is None):
            raise ValueError(f"{self.value}: give exactly one of `critical` and `warning`")
        if self.metric is None and (self.label is not None or self.last_window):
            raise ValueError(f"{self.value}: `label` and `last_window` need a `metric`")

    def __repr__(self) -> str:
        return f"FindingKind({self.value!r})"

    @property
    def counter(self) -> str:
        """``graph/findings_<value>``: how many times the kind was found so far."""
        return f"graph/findings_{self.value}"

    @property
    def window_tag(self) -> str | None:
        """``graph/<metric>``: the kind's count per check window, if it has one."""
        return f"graph/{self.metric}" if self.metric else None

    @property
    def report_tag(self) -> str:
        """The tag the report judges the kind by: its window count if it has one, else its counter."""
        return self.window_tag or self.counter


@dataclass(frozen=True)
class Finding:
    """One problem found.

    Attributes:
        kind: what it is about.
        names: the parameters, module attributes, modules or operations it names.
        message: plain words: what is wrong, where, and the fix.
        step: ``trainer.global_step`` (optimizer steps) at the start of the batch it was first found in.
    """

    kind: FindingKind
    names: tuple[str, ...]
    message: str
    step: int


def critical_counters(kinds: Iterable[FindingKind]) -> tuple[tuple[str, str, str], ...]:
    """``(section, tag regex, message)`` for each critical message of ``kinds``, in their order.

    Kinds that share a message share a row: their tags are joined in one regex (``re.match``; the
    report sums the series it matches).
    """
    rows: dict[tuple[str, str], list[str]] = {}
    for kind in kinds:
        if kind.critical is not None:
            rows.setdefault((kind.section, kind.critical), []).append(re.escape(kind.report_tag))
    return tuple(
        (section, (tags[0] if len(tags) == 1 else f"(?:{'|'.join(tags)})") + "$", message)
        for (section, message), tags in rows.items()
    )


def warning_counters(kinds: Iterable[FindingKind]) -> tuple[tuple[str, str, str], ...]:
    """``(section, counter regex, warning)`` for each kind that is not critical: the report lists a kind found."""
    return tuple(
        (kind.section, re.escape(kind.counter) + "$", kind.warning) for kind in kinds if kind.warning is not None
    )


def last_window_counters(kinds: Iterable[FindingKind]) -> frozenset[str]:
    """The regexes of :func:`critical_counters` that the report reads in the last check window only."""
    kinds = tuple(kinds)
    last = {kind.critical for kind in kinds if kind.last_window}
    return frozenset(pattern for _, pattern, message in critical_counters(kinds) if message in last)
