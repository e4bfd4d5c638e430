"""What every trainvitals callback shares: its state key, its declared state, its messages.

- The ``state_key`` is built once from the distinguishing arguments (:meth:`TrainvitalsCallback.key_state_by`):
  Lightning reads it in every hook call (profiler names), and two instances with other arguments keep
  their states apart in one checkpoint.
- State is declared once, in the manner of torchmetrics' ``Metric.add_state``
  (:meth:`TrainvitalsCallback.add_state`): its default (a value, copied, or a factory), whether it goes
  into the checkpoint (under which key), and how ranks combine it. ``setup(stage="fit")`` resets every
  declared state — Lightning loads a checkpoint's callback states after ``setup``, so a new fold starts
  afresh, a resumed fit gets its state back, and a state loaded for validate stays out of a later fit —;
  ``state_dict``/``load_state_dict`` round-trip the persistent ones (read with defaults, so older
  checkpoints load); :meth:`TrainvitalsCallback.reduce_states` combines the reducible ones over ranks in
  one collective per operation.
- Messages carry the prefix ``trainvitals <Callback>:``; :meth:`TrainvitalsCallback.cannot_measure` warns
  once and carries on, or raises under ``strict=True``. A warning with that prefix prints as its text alone
  (:func:`format_warning`), as Lightning prints its own rank-zero warnings without the source line: it
  reads as a message, not as a traceback.
"""

from __future__ import annotations

import copy
import functools
import warnings
from dataclasses import dataclass
from enum import Enum
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import WarningCache, rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from trainvitals.plumbing.writers import note_unrecorded

REDUCTIONS = ("sum", "mean", "max", "min")
PREFIX = "trainvitals "
"""How every trainvitals message starts (:meth:`TrainvitalsCallback.message`)."""


@dataclass(frozen=True)
class _State:
    default: Any  # a value (deep-copied at each reset) or a zero-argument factory
    dist_reduce_fx: str | None
    persistent: bool
    key: str


class TrainvitalsCallback(Callback):
    """A Lightning callback with a state key built once, declared state and prefixed messages.

    Subclasses call ``super().__init__()`` first, then :meth:`key_state_by` and :meth:`add_state`;
    ``strict`` (a class attribute here) makes :meth:`cannot_measure` raise. Per-fit setup beyond the
    reset goes in :meth:`setup_fit`.
    """

    strict: bool = False

    def __init__(self) -> None:
        self._states: dict[str, _State] = {}
        self._state_key: str | None = None

    # ------------------------------------------------------------------ state key
    def key_state_by(self, **arguments: Any) -> None:
        """Build the ``state_key`` from the arguments that make a saved state mean something else."""
        self._state_key = self._generate_state_key(**arguments)

    @property
    @override
    def state_key(self) -> str:
        return self._state_key if self._state_key is not None else super().state_key

    # ------------------------------------------------------------------ declared state
    def add_state(
        self,
        name: str,
        default: Any,
        dist_reduce_fx: str | None = None,
        persistent: bool = True,
        key: str | None = None,
    ) -> None:
        """Declare ``self.<name>`` and set it to ``default``.

        Args:
            name: the attribute.
            default: its value at each reset, deep-copied; a callable is a factory called instead (a class
                or a ``functools.partial``: the callback is pickled under ``ddp_spawn``).
            dist_reduce_fx: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``: how :meth:`reduce_states`
                combines a numeric tensor over ranks; ``None``: per rank.
            persistent: saved by ``state_dict`` (a 0-d tensor as a number, an enum by name, an object
                with ``state_dict`` by its state).
            key: its key in the saved state; default ``name``.
        """
        if dist_reduce_fx not in (None, *REDUCTIONS):
            raise ValueError(f"`dist_reduce_fx` must be one of {REDUCTIONS} or None, got {dist_reduce_fx!r}")
        self._states[name] = _State(default, dist_reduce_fx, persistent, name if key is None else key)
        setattr(self, name, _fresh(default))

    def reset(self) -> None:
        """Every declared state back to its default: a fit that has not started."""
        for name, state in self._states.items():
            setattr(self, name, _fresh(state.default))

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            note_unrecorded(trainer, self)
            self.reset()
            self.setup_fit(trainer, pl_module)

    def setup_fit(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """After the reset in ``setup(stage="fit")``, before a checkpoint's state is loaded."""

    @override
    def state_dict(self) -> dict[str, Any]:
        return {s.key: _saved(getattr(self, name)) for name, s in self._states.items() if s.persistent}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, s in self._states.items():
            if s.persistent and s.key in state_dict:
                setattr(self, name, _loaded(getattr(self, name), state_dict[s.key]))

    def reduce_states(self, trainer: "pl.Trainer") -> None:
        """Combine the states declared with a ``dist_reduce_fx`` over ranks, in place: one collective per
        operation, every rank calling (a no-op on one process)."""
        if trainer.world_size == 1:
            return
        for op in REDUCTIONS:
            names = [n for n, s in self._states.items() if s.dist_reduce_fx == op]
            if names:
                for name, value in zip(names, reduce_packed(trainer, [getattr(self, n) for n in names], op)):
                    setattr(self, name, value)

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


def reduce_packed(trainer: "pl.Trainer", tensors: list[Tensor], op: str = "sum") -> list[Tensor]:
    """``tensors`` combined over ranks by ``op`` (``"sum"``, ``"mean"``, ``"max"``, ``"min"``) in one
    collective, packed as float64 and given back in their shapes and dtypes. Every rank must call it
    with the same shapes."""
    packed = torch.cat([t.detach().to(torch.float64).reshape(-1) for t in tensors])
    if op in ("sum", "mean"):
        packed = trainer.strategy.reduce(packed, reduce_op=op)
    else:
        gathered = trainer.strategy.all_gather(packed).reshape(-1, packed.numel())
        packed = gathered.amax(0) if op == "max" else gathered.amin(0)
    return [part.reshape(t.shape).to(t.dtype) for t, part in zip(tensors, packed.split([t.numel() for t in tensors]))]


def _fresh(default: Any) -> Any:
    return default() if callable(default) else copy.deepcopy(default)


def _saved(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.item() if value.dim() == 0 else value.detach().cpu()
    if isinstance(value, Enum):
        return value.name
    if callable(getattr(value, "state_dict", None)):
        return value.state_dict()
    return value


def _loaded(current: Any, saved: Any) -> Any:
    """``saved`` in the form of the state's ``current`` value."""
    if isinstance(current, Tensor):
        return torch.as_tensor(saved, dtype=current.dtype, device=current.device)
    if isinstance(current, Enum):
        return type(current)[saved]
    if callable(getattr(current, "load_state_dict", None)):
        current.load_state_dict(saved)
        return current
    if isinstance(current, (bool, int, float)) and saved is not None:
        return type(current)(saved)
    return saved
