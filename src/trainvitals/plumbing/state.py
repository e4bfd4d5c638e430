"""Declared state, in the manner of torchmetrics' ``Metric.add_state``: what a callback (or a part of one, such as
an integrity check) holds per fit, how it is reset, saved and combined over ranks.

Torch only: the integrity checks hold their state this way and are imported without Lightning (by the report).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    import lightning.pytorch as pl

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


def optimizer_index(trainer: "pl.Trainer", optimizer: Any) -> int:
    """``optimizer``'s place in ``trainer.optimizers``, the index an :class:`IndexedStates` is keyed by (0 for
    one the Trainer does not hold)."""
    return next((i for i, opt in enumerate(trainer.optimizers) if opt is optimizer), 0)


class IndexedStates:
    """A :class:`DeclaredState` per index (an optimizer's), made by ``make`` on first use: one declared state of
    a callback whose parts are built later (at an optimizer's first step), so that a state loaded from a
    checkpoint is kept, and saved again, by a fit that builds none of them (a requeued job that runs no step)."""

    def __init__(self, make: Callable[[], DeclaredState]) -> None:
        self._make = make
        self.by_index: dict[int, DeclaredState] = {}

    def get(self, index: int) -> DeclaredState:
        """Index ``index``'s state, restored or fresh."""
        if index not in self.by_index:
            self.by_index[index] = self._make()
        return self.by_index[index]

    def state_dict(self) -> dict[str, Any]:
        return {str(i): state.state_dict() for i, state in self.by_index.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for index, state in state_dict.items():
            self.get(int(index)).load_state_dict(state)
