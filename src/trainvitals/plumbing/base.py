"""What every trainvitals callback shares: its state key, its declared state, its messages.

- The ``state_key`` is built once from the distinguishing arguments (:meth:`TrainvitalsCallback.key_state_by`):
  Lightning reads it in every hook call (profiler names), and two instances with other arguments keep
  their states apart in one checkpoint.
- State is declared once, in the manner of torchmetrics' ``Metric.add_state``
  (:meth:`DeclaredState.add_state`): its default (a value, copied, or a factory), whether it goes into the
  checkpoint (under which key), and how ranks combine it. It is the one way a callback holds per-fit
  state: ``setup(stage="fit")`` resets every declared state — Lightning loads a checkpoint's callback
  states after ``setup``, so a new fold starts afresh, a resumed fit gets its state back (and keeps it
  through a fit that runs no step), and a state loaded for validate stays out of a later fit —;
  ``state_dict``/``load_state_dict`` round-trip the persistent ones; :meth:`DeclaredState.reduce_states`
  combines those declared with a ``dist_reduce_fx`` over ranks, in one collective per operation. A state
  whose value is itself a :class:`DeclaredState` (an integrity check, an optimizer's track) is nested: saved
  by its own declarations, reduced with its owner's.
- Messages carry the prefix ``trainvitals <Callback>:``; :meth:`TrainvitalsCallback.cannot_measure` warns
  once and carries on, or raises under ``strict=True``.
"""

from __future__ import annotations

import copy
import functools
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


@dataclass(frozen=True)
class _State:
    default: Any  # a value (deep-copied at each reset) or a zero-argument factory
    dist_reduce_fx: str | None
    persistent: bool
    key: str


class DeclaredState:
    """Holds its state as declarations (:meth:`add_state`), in the manner of torchmetrics' ``Metric``.

    ``state_dict`` saves the persistent states (a 0-d tensor as a number, an enum by name, an object with
    ``state_dict`` — a nested :class:`DeclaredState` among them — by its state); ``load_state_dict`` reads
    them back in the form of their current values, a key missing from the checkpoint leaving its default.
    """

    def _declared(self) -> dict[str, _State]:
        return self.__dict__.setdefault("_states", {})

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
            dist_reduce_fx: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``: how :meth:`reduce_states` combines
                a numeric tensor over ranks; ``None``: no reduction (the state is the same on every rank, or
                its rank's own).
            persistent: saved by ``state_dict``.
            key: its key in the saved state; default ``name``.

        Raises:
            ValueError: an unknown ``dist_reduce_fx``, or one declared for a state that is not a tensor.
        """
        if dist_reduce_fx not in (None, *REDUCTIONS):
            raise ValueError(f"`dist_reduce_fx` must be one of {REDUCTIONS} or None, got {dist_reduce_fx!r}")
        value = _fresh(default)
        if dist_reduce_fx is not None and not isinstance(value, Tensor):
            raise ValueError(f"`dist_reduce_fx` needs a tensor state, got {type(value).__name__} for `{name}`")
        self._declared()[name] = _State(default, dist_reduce_fx, persistent, name if key is None else key)
        setattr(self, name, value)

    def reset(self) -> None:
        """Every declared state back to its default: a fit that has not started."""
        for name, state in self._declared().items():
            setattr(self, name, _fresh(state.default))

    def state_dict(self) -> dict[str, Any]:
        return {s.key: _saved(getattr(self, name)) for name, s in self._declared().items() if s.persistent}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, s in self._declared().items():
            if s.persistent and s.key in state_dict:
                setattr(self, name, _loaded(getattr(self, name), state_dict[s.key]))

    def reduce_states(self, trainer: "pl.Trainer") -> None:
        """Combine the states declared with a ``dist_reduce_fx`` over ranks, in place, those of the nested
        :class:`DeclaredState` values with them: one collective per operation, every rank calling (the
        strategy's, which on one process gives the state back)."""
        reducible = list(self._reducible())
        for op in REDUCTIONS:
            owned = [(owner, name) for owner, name, fx in reducible if fx == op]
            if owned:
                values = reduce_packed(trainer, [getattr(owner, name) for owner, name in owned], op)
                for (owner, name), value in zip(owned, values):
                    setattr(owner, name, value)

    def _reducible(self) -> Any:
        """(owner, attribute, operation) of every state with a reduction, nested ones included, in order."""
        for name, s in self._declared().items():
            value = getattr(self, name)
            if s.dist_reduce_fx is not None:
                yield self, name, s.dist_reduce_fx
            elif isinstance(value, DeclaredState):
                yield from value._reducible()


class TrainvitalsCallback(DeclaredState, Callback):
    """A Lightning callback with a state key built once, declared state and prefixed messages.

    Subclasses call ``super().__init__()`` first, then :meth:`key_state_by` and :meth:`add_state`;
    ``strict`` (a class attribute here) makes :meth:`cannot_measure` raise. Per-fit setup beyond the
    reset goes in :meth:`setup_fit`.
    """

    strict: bool = False

    def __init__(self) -> None:
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
    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            note_unrecorded(trainer, self)
            self.reset()
            self.setup_fit(trainer, pl_module)

    def setup_fit(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """After the reset in ``setup(stage="fit")``, before a checkpoint's state is loaded."""

    # ------------------------------------------------------------------ messages
    def message(self, text: str, tag: str | None = None) -> str:
        """``text`` with this callback's prefix: ``trainvitals <Callback>: text``, the trainvitals class
        named (also in a user's subclass of it); with ``tag`` (a finding's kind),
        ``trainvitals <Callback> [tag]: text``."""
        name = next(c.__name__ for c in type(self).__mro__ if c.__module__.startswith("trainvitals."))
        return f"trainvitals {name}{f' [{tag}]' if tag else ''}: {text}"

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
    return copy.deepcopy(value)  # a container: the checkpoint's, not the live one


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
