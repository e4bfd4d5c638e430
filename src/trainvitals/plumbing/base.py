"""What every trainvitals callback shares: its state key, its declared state, its messages.

- The ``state_key`` is built once from the distinguishing arguments (:meth:`TrainvitalsCallback.key_state_by`):
  Lightning reads it in every hook call (profiler names), and two instances with other arguments keep
  their states apart in one checkpoint.
- State is declared once (:class:`~trainvitals.plumbing.state.DeclaredState`, in the manner of torchmetrics'
  ``Metric.add_state``): its default (a value, copied, or a factory), whether it goes into the checkpoint
  (under which key), and how ranks combine it. It is the one way a callback holds per-fit state:
  ``setup(stage="fit")`` resets every declared state — Lightning loads a checkpoint's callback states after
  ``setup``, so a new fold starts afresh, a resumed fit gets its state back (and keeps it through a fit that
  runs no step), and a state loaded for validate stays out of a later fit —; ``state_dict``/``load_state_dict``
  round-trip the persistent ones; ``reduce_states`` combines those declared with a ``dist_reduce_fx`` over
  ranks, in one collective per operation. A state whose value is itself a ``DeclaredState`` (an integrity
  check, an optimizer's track) is nested: saved by its own declarations, reduced with its owner's.
- What a callback shares with the others is declared in ``provides`` and ``reads`` and resolved at
  ``setup(stage="fit")`` into ``self.vitals`` (:mod:`trainvitals.plumbing.sharing`).
- Messages carry the prefix ``trainvitals <Callback>:``; :meth:`TrainvitalsCallback.cannot_measure` warns
  once and carries on, or raises under ``strict=True``. A warning with that prefix prints as its text alone
  (:func:`format_warning`), as Lightning prints its own rank-zero warnings without the source line: it
  reads as a message, not as a traceback.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, ClassVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import WarningCache, rank_zero_info, rank_zero_warn
from typing_extensions import override

from trainvitals.plumbing.sharing import Vitals, connect
from trainvitals.plumbing.state import DeclaredState
from trainvitals.plumbing.writers import note_unrecorded

PREFIX = "trainvitals "
"""How every trainvitals message starts (:meth:`TrainvitalsCallback.message`)."""


class TrainvitalsCallback(DeclaredState, Callback):
    """A Lightning callback with a state key built once, declared state and prefixed messages.

    Subclasses call ``super().__init__()`` first, then :meth:`key_state_by` and :meth:`add_state`;
    ``strict`` (a class attribute here) makes :meth:`cannot_measure` raise. Per-fit setup beyond the
    reset goes in :meth:`setup_fit`, where :attr:`vitals` is this fit's hub. ``provides`` and ``reads``
    name what the subclass shares (the constants of :mod:`trainvitals.plumbing.sharing`).
    """

    strict: bool = False
    provides: ClassVar[tuple[str, ...]] = ()
    reads: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._state_key: str | None = None
        self.vitals = Vitals()  # this one alone until setup connects it

    # ------------------------------------------------------------------ state key
    def key_state_by(self, **arguments: Any) -> None:
        """Build the ``state_key`` from the arguments that make a saved state mean something else."""
        self._state_key = self._generate_state_key(**arguments)

    @property
    @override
    def state_key(self) -> str:
        return self._state_key if self._state_key is not None else super().state_key

    # ------------------------------------------------------------------ declared state
    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            note_unrecorded(trainer, self)
            self.reset()
            connect(trainer, self)
            self.setup_fit(trainer, pl_module)

    def setup_fit(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """After the reset in ``setup(stage="fit")``, before a checkpoint's state is loaded."""

    # ------------------------------------------------------------------ messages
    def message(self, text: str, tag: str | None = None) -> str:
        """``text`` with this callback's prefix: ``trainvitals <Callback>: text``, the trainvitals class
        named (also in a user's subclass of it); with ``tag`` (a finding's kind),
        ``trainvitals <Callback> [tag]: text``."""
        name = next(c.__name__ for c in type(self).__mro__ if c.__module__.startswith("trainvitals."))
        return f"{PREFIX}{name}{f' [{tag}]' if tag else ''}: {text}"

    # The stack levels point a warning at the hook that gave it, past these helpers and Lightning's.
    def info(self, text: str, once: bool = False) -> None:
        """Logged on rank zero; ``once``: the first time this callback says this text only."""
        if once:
            self._warning_cache.info(self.message(text), stacklevel=6)
        else:
            rank_zero_info(self.message(text), stacklevel=5)

    def warn(self, text: str, once: bool = False, stacklevel: int = 5) -> None:
        """A warning on rank zero; ``once``: the first time this callback warns this text only."""
        if once:
            self._warning_cache.warn(self.message(text), stacklevel=stacklevel + 1)
        else:
            rank_zero_warn(self.message(text), stacklevel=stacklevel)

    def cannot_measure(self, text: str) -> None:
        """Something this callback should measure cannot be: raise ``RuntimeError`` under ``strict=True``,
        else warn once and carry on."""
        if self.strict:
            raise RuntimeError(self.message(text))
        self.warn(text, once=True, stacklevel=6)

    @functools.cached_property
    def _warning_cache(self) -> WarningCache:
        return WarningCache()


def format_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    """``warnings.formatwarning`` for trainvitals' messages: the text alone, one line per message.

    Python prints ``file:line: UserWarning: text`` and the source line under it, so a message looks like a
    traceback; Lightning's ``_custom_format_warning`` drops the source line of its own warnings. A message
    with trainvitals' prefix names its callback already: it prints as ``text``; every other warning as the
    formatter installed before (Lightning's, which hands the rest to Python's).
    """
    if str(message).startswith(PREFIX):
        return f"{message}\n"
    return _previous_format_warning(message, category, filename, lineno, line)


_previous_format_warning = warnings.formatwarning
warnings.formatwarning = format_warning
