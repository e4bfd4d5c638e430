"""The kinds of finding GraphIntegrityCallback reports: one row each, read by the callback and the report.

Each :class:`FindingKind` member carries its row (:class:`KindSpec`): its name, which is also its
counter ``graph/findings_<name>`` (how many times it was found so far); the count per check window
the callback logs for it, ``graph/<metric>``, if it has one; and, where a run with it is broken, the
message ``trainvitals report`` prints (:func:`critical_counters`), else the warning it lists the kind
under when found (:func:`warning_counters`). A new kind is one member here.
:class:`Finding` is one problem found.
No torch or Lightning import: the report command reads this table.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

INTEGRITY = "integrity"
"""The report's section for the integrity findings."""

NOTHING_CHECKED = (
    "**Graph integrity: nothing checked.** No graph walk and no gradient check ran, so no verdict: "
    "nothing logged (the run may have ended before its first step)."
)
"""GraphIntegrityCallback's end-of-fit markdown when it checked nothing: not a clean bill of health."""


@dataclass(frozen=True)
class KindSpec:
    """What a finding kind logs, and what the report makes of it.

    Attributes:
        value: the kind's name.
        metric: ``graph/<metric>``, the kind's count per check window (logged when a window closes), if any.
        critical: the report's message for a run in which the kind's :attr:`FindingKind.report_tag` was
            above zero (``{n}``: its value); ``None``: not critical.
        warning: what the report's findings say of a kind that is not critical when its counter is above
            zero: the problem in a few words (the integrity panel has each finding, where and the fix).
        last_window: the report reads that tag's last value, not its largest.
        strict: ``strict=True`` raises on it. Not :attr:`critical` (the report's verdict on a finished run):
            a kind that is also a deliberate choice (lr 0 to keep a group fixed) is only reported.
        section: the report's section.
    """

    value: str
    metric: str | None = None
    critical: str | None = None
    warning: str | None = None
    last_window: bool = False
    strict: bool = True
    section: str = INTEGRITY


_AUTOGRAD_ERROR = (
    "the run failed in backward with one of autograd's classic errors ({n}); the integrity panel has the diagnosis"
)


class FindingKind(str, enum.Enum):
    """What a finding is about; the value names its counter, ``graph/findings_<value>``."""

    spec: KindSpec

    def __new__(cls, spec: KindSpec) -> FindingKind:
        member = str.__new__(cls, spec.value)
        member._value_ = spec.value
        member.spec = spec
        return member

    @property
    def counter(self) -> str:
        """``graph/findings_<value>``: how many times the kind was found so far."""
        return f"graph/findings_{self.value}"

    @property
    def window_tag(self) -> str | None:
        """``graph/<metric>``: the kind's count per check window, if it has one."""
        return f"graph/{self.spec.metric}" if self.spec.metric else None

    @property
    def report_tag(self) -> str:
        """The tag the report judges the kind by: its window count if it has one, else its counter."""
        return self.window_tag or self.counter

    LOSS_NO_GRAD = KindSpec(
        "loss_no_grad",
        critical="the loss had no grad_fn or reached no parameter on {n} step(s): it was detached (.item(), "
        ".detach(), torch.no_grad()), nothing trains",
    )
    LOSS_NOT_FINITE = KindSpec(
        "loss_not_finite", metric="nonfinite_losses", critical="{n} non-finite loss value(s) in one check window"
    )
    LOSS_NOT_SCALAR = KindSpec("loss_not_scalar", warning="a loss that is not a scalar (left unreduced?)")
    UNREACHABLE_PARAMS = KindSpec("unreachable_params", warning="parameters the loss cannot reach")
    UNOPTIMIZED_LEAVES = KindSpec(
        "unoptimized_leaves",
        metric="unoptimized_params",
        critical="{n} tensor(s) get gradients but belong to no optimizer: unregistered on the module (layers in a "
        "plain Python list?) or left out of configure_optimizers; they never train",
    )
    FROZEN_IN_OPTIMIZER = KindSpec(
        "frozen_in_optimizer", warning="frozen parameters (requires_grad=False) in an optimizer"
    )
    # Not critical, never raised: a module shared by two optimizers on purpose (an encoder trained by two losses).
    SHARED_BY_OPTIMIZERS = KindSpec(
        "shared_by_optimizers", warning="parameters stepped by more than one optimizer", strict=False
    )
    STALE_GRAPH = KindSpec(
        "stale_graph",
        metric="leaked_graphs",
        critical="the loss reached autograd nodes of an earlier step ({n} walk(s)): a graph kept alive across steps "
        "(total += loss, a hidden state not detached)",
    )
    # A branch taken only on some batches (an expert without tokens for a while) is unused in one window and
    # trains in the next: a parameter that never trains is still unused in the last one.
    UNUSED_PARAMS = KindSpec(
        "unused_params",
        metric="unused_params",
        critical="{n} parameter(s) got no gradient in the last check window: not in the loss's graph (an unused "
        "head, a detached branch)",
        last_window=True,
    )
    DEAD_PARAMS = KindSpec(
        "dead_params", metric="dead_params", warning="parameters with an exactly zero gradient all check window long"
    )
    DDP_UNUSED = KindSpec("ddp_unused", warning="parameters DDP finds unused (find_unused_parameters)")
    FROZEN_CHANGED = KindSpec("frozen_changed", warning="frozen parameters that the optimizer still changes")
    GRAD_LEAK = KindSpec("grad_leak", warning="gradients left over from an earlier step (manual optimization)")
    STEP_BEFORE_BACKWARD = KindSpec(
        "step_before_backward",
        critical="an optimizer stepped before the backward that gives its parameters their gradients ({n}): they "
        "never train",
    )
    BATCH_MIXING = KindSpec(
        "batch_mixing", warning="examples mixed across the batch: an output depends on other examples"
    )
    NO_GRAD_ERROR = KindSpec("no_grad_error", critical=_AUTOGRAD_ERROR)
    SECOND_BACKWARD = KindSpec("second_backward", critical=_AUTOGRAD_ERROR)
    INPLACE_MODIFIED = KindSpec("inplace_modified", critical=_AUTOGRAD_ERROR)
    # Not critical: lr=0 is also a way to freeze a part of the model on purpose.
    ZERO_LR = KindSpec(
        "zero_lr",
        warning="a param group at lr exactly 0 whose parameters require grad: they do not train",
        strict=False,
    )


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


def critical_counters() -> tuple[tuple[str, str, str], ...]:
    """``(section, tag regex, message)`` for each critical message, in the order of the kinds.

    Kinds that share a message share a row: their tags are joined in one regex (``re.match``; the
    report sums the series it matches).
    """
    rows: dict[tuple[str, str], list[str]] = {}
    for kind in FindingKind:
        if kind.spec.critical is not None:
            rows.setdefault((kind.spec.section, kind.spec.critical), []).append(re.escape(kind.report_tag))
    return tuple(
        (section, (tags[0] if len(tags) == 1 else f"(?:{'|'.join(tags)})") + "$", message)
        for (section, message), tags in rows.items()
    )


def warning_counters() -> tuple[tuple[str, str, str], ...]:
    """``(section, counter regex, warning)`` for each kind that is not critical: the report lists a kind found."""
    return tuple(
        (kind.spec.section, re.escape(kind.counter) + "$", kind.spec.warning)
        for kind in FindingKind
        if kind.spec.critical is None and kind.spec.warning is not None
    )


def last_window_counters() -> frozenset[str]:
    """The regexes of :func:`critical_counters` that the report reads in the last check window only."""
    last = {kind.spec.critical for kind in FindingKind if kind.spec.last_window}
    return frozenset(pattern for _, pattern, message in critical_counters() if message in last)
