"""An in-memory snapshot of a module's parameters and buffers and its optimizers' state. Torch-only.

Taken every N optimizer steps by TrainingGuard and restored by a rollback. The copies live on the CPU
or on the parameters' device (``where``); after the first, a snapshot copies into the tensors of the
previous one (one ``torch._foreach_copy_`` for the module, a copy per optimizer-state tensor), so it
allocates once and holds one model-plus-optimizer state's worth of memory (:attr:`Snapshot.nbytes`).

:class:`BufferCopy` is the skip's target: the module's persistent buffers (BatchNorm's running statistics
and ``num_batches_tracked``), which a step's forward changes before any decision, copied at each step's start.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

WHERE = ("cpu", "device")


class Snapshot:
    """The state of ``module`` and ``optimizers`` at one optimizer step.

    Args:
        where: ``"cpu"`` (host memory, a device-to-host copy per snapshot) or ``"device"`` (the
            parameters' own device: faster, at the cost of device memory).

    Attributes:
        step: the optimizer step whose starting state this is (``None``: none taken yet).
    """

    def __init__(self, where: str = "cpu") -> None:
        self.where = where
        self.step: int | None = None
        self._module: list[Tensor] = []
        self._optimizers: list[dict[str, Any]] = []

    @property
    def nbytes(self) -> int:
        """Bytes held by the copies."""
        tensors = self._module + [t for s in self._optimizers for t in _tensors(s)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def take(self, step: int, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        """Copy ``module``'s parameters and buffers and each optimizer's ``state_dict()`` as of ``step``."""
        sources = [t.detach() for t in _module_tensors(module)]
        with torch.no_grad():
            if _same_layout(self._module, sources):
                torch._foreach_copy_(self._module, sources)
            else:
                self._module = [self._copy(t) for t in sources]
            saved = [opt.state_dict() for opt in optimizers]
            if len(saved) == len(self._optimizers):
                self._optimizers = [self._into(s, old) for s, old in zip(saved, self._optimizers)]
            else:
                self._optimizers = [self._into(s, None) for s in saved]
        self.step = step

    def restore(self, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        """Put the snapshot back: parameters and buffers in place, each optimizer's state loaded from a copy
        (``load_state_dict`` keeps tensors already on the right device: the snapshot must stay apart); the
        optimizers' current hyperparameters (lr, ...) are kept, so a schedule goes on where it is.

        Raises:
            RuntimeError: no snapshot was taken, or the module's tensors or the optimizers' parameter groups
                changed since (checked before anything is copied).
        """
        targets = _module_tensors(module)
        if self.step is None or not _same_layout(self._module, [t.detach() for t in targets]):
            raise RuntimeError("no snapshot of this module's current parameters to restore")
        if not _same_groups(optimizers, self._optimizers):  # checked first: nothing is half restored
            raise RuntimeError("the optimizers' parameter groups changed since the snapshot")
        with torch.no_grad():
            torch._foreach_copy_([t.detach() for t in targets], self._module)
        for opt, saved in zip(optimizers, self._optimizers):
            hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            opt.load_state_dict(_clone(saved))
            for group, kept in zip(opt.param_groups, hyper):
                group.update(kept)

    def state_dict(self) -> dict[str, Any]:
        """The snapshot on the CPU (for a checkpoint, when asked)."""
        return {
            "step": self.step,
            "module": [t.cpu() for t in self._module],
            "optimizers": [_clone(s, torch.device("cpu")) for s in self._optimizers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state.get("step")
        self._module = list(state.get("module", []))
        self._optimizers = list(state.get("optimizers", []))

    def _copy(self, t: Tensor) -> Tensor:
        return t.to("cpu", copy=True) if self.where == "cpu" else t.clone()

    def _into(self, new: Any, old: Any) -> Any:
        """``new`` (an optimizer state tree) copied, into ``old``'s tensors where the layout matches."""
        if isinstance(new, Tensor):
            if isinstance(old, Tensor) and old.shape == new.shape and old.dtype == new.dtype:
                return old.copy_(new)
            return self._copy(new)
        if isinstance(new, dict):
            old = old if isinstance(old, dict) else {}
            return {k: self._into(v, old.get(k)) for k, v in new.items()}
        if isinstance(new, (list, tuple)):
            old = old if isinstance(old, (list, tuple)) and len(old) == len(new) else [None] * len(new)
            return type(new)(self._into(v, o) for v, o in zip(new, old))
        return copy.deepcopy(new)


class BufferCopy:
    """The persistent buffers of a module (those in its ``state_dict``) as of an optimizer step's start, on
    their own devices, for a skipped step to put back what its forward changed (BatchNorm's running mean and
    variance, ``num_batches_tracked``): the weights alone do not undo a forward.

    One ``torch._foreach_copy_`` into tensors allocated at the first :meth:`take` (again only when the
    buffers' shapes or dtypes change): no host sync, and :attr:`nbytes` of memory, the buffers' own size.
    """

    def __init__(self) -> None:
        self._copies: list[Tensor] = []
        self.taken = False

    @property
    def nbytes(self) -> int:
        """Bytes held by the copies."""
        return sum(t.numel() * t.element_size() for t in self._copies)

    def take(self, module: nn.Module) -> None:
        """Copy ``module``'s persistent buffers now (before the step's first forward)."""
        buffers = _persistent_buffers(module)
        with torch.no_grad():
            if not _same_layout(self._copies, buffers):
                self._copies = [b.detach().clone() for b in buffers]
            elif buffers:
                torch._foreach_copy_(self._copies, buffers)
        self.taken = True

    def restore(self, module: nn.Module) -> None:
        """Put the copies back into ``module``'s buffers, in place.

        Raises:
            RuntimeError: nothing taken, or the module's persistent buffers changed since (nothing copied then).
        """
        buffers = _persistent_buffers(module)
        if not self.taken or not _same_layout(self._copies, buffers):
            raise RuntimeError("no copy of this module's current buffers to restore")
        if buffers:
            with torch.no_grad():
                torch._foreach_copy_(buffers, self._copies)


def _persistent_buffers(module: nn.Module) -> list[Tensor]:
    """The buffers in ``module.state_dict()``, each once (a shared module's are not repeated), but a lazy
    module's not yet materialized (its first forward gives them a shape: the layout then changes)."""
    found: dict[int, Tensor] = {}
    for m in module.modules():
        for name, b in m._buffers.items():
            lazy = isinstance(b, nn.parameter.UninitializedBuffer)
            if b is not None and not lazy and name not in m._non_persistent_buffers_set:
                found.setdefault(id(b), b.detach())
    return list(found.values())


def _module_tensors(module: nn.Module) -> list[Tensor]:
    return [*module.parameters(), *module.buffers()]


def _same_layout(saved: list[Tensor], tensors: list[Tensor]) -> bool:
    return len(saved) == len(tensors) and all(s.shape == t.shape and s.dtype == t.dtype for s, t in zip(saved, tensors))


def _same_groups(optimizers: list[torch.optim.Optimizer], saved: list[dict[str, Any]]) -> bool:
    """Whether each optimizer has the snapshot's parameter groups, of the same sizes."""
    return len(optimizers) == len(saved) and all(
        [len(g["params"]) for g in opt.param_groups] == [len(g["params"]) for g in s["param_groups"]]
        for opt, s in zip(optimizers, saved)
    )


def _tensors(tree: Any) -> list[Tensor]:
    if isinstance(tree, Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def _clone(tree: Any, device: torch.device | None = None) -> Any:
    if isinstance(tree, Tensor):
        return tree.to(device, copy=True) if device is not None else tree.clone()
    if isinstance(tree, dict):
        return {k: _clone(v, device) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone(v, device) for v in tree)
    return copy.deepcopy(tree)
