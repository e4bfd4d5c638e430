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
import weakref
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

    def take(
        self,
        step: int,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        before: dict[int, Tensor] | None = None,
    ) -> None:
        """Copy ``module``'s parameters and buffers and each optimizer's ``state_dict()`` as of ``step``.

        ``before``: tensors to copy instead of some buffers, by the buffer's ``id`` (:meth:`BufferCopy.copies`: the
        buffers as they were at the step's first micro-batch). Taken before the update, the parameters are the
        step's starting state, but its forward has already moved BatchNorm's running statistics: those copies are."""
        before = before or {}
        sources = [before.get(id(t), t).detach() for t in _module_tensors(module)]
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
    The list of buffers is found by a walk of the module at the first :meth:`take` and kept: a later one checks
    that each is still its module's (a ``.to()`` or an assignment replaces it) and that no buffer or submodule
    was registered into one of its modules since (torch's global registration hooks, installed from the first
    :meth:`take` to :meth:`close`), else walks again: on a CPU 0.09–0.12 ms a step for a ResNet-50's 53 BatchNorm
    layers, against 0.40–0.52 ms with the walk (``benchmarks/bench_training_guard.py``).
    """

    def __init__(self) -> None:
        self._copies: list[Tensor] = []
        self.taken = False
        self.walks = 0
        """Walks of the module for its buffers (what the tests count)."""
        self._held: _HeldBuffers | None = None
        self._watching: weakref.finalize | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held by the copies."""
        return sum(t.numel() * t.element_size() for t in self._copies)

    def take(self, module: nn.Module) -> None:
        """Copy ``module``'s persistent buffers now (before the step's first forward)."""
        kept = self._held
        buffers = self._buffers_of(module)
        self.taken = True
        if not buffers:  # nothing a forward changes (an MLP): no copy, no grad-mode switch
            self._copies = []
            return
        with torch.no_grad():
            # The copies were made from this very list: the layout is theirs (a restore checks it again).
            if self._held is not kept and not _same_layout(self._copies, buffers):
                self._copies = [b.detach().clone() for b in buffers]
            else:
                torch._foreach_copy_(self._copies, buffers)

    def copies(self) -> dict[int, Tensor]:
        """The copies of the last :meth:`take`, by the ``id`` of the buffer each was copied from."""
        held = self._held.buffers if self._held is not None and self._copies else []
        return {id(b): c for b, c in zip(held, self._copies)}

    def close(self) -> None:
        """Forget the kept list of buffers and stop watching registrations (at the end of a fit); the copies stay."""
        self._held = None
        if self._watching is not None:
            self._watching()  # once: a copy collected without a close stops watching too
            self._watching = None

    def _buffers_of(self, module: nn.Module) -> list[Tensor]:
        """``module``'s persistent buffers: the kept list while it holds (class docstring), else a new walk."""
        held = self._held
        if held is not None and held.holds(module):
            return held.buffers
        if self._watching is None:
            _Registrations.watch()
            self._watching = weakref.finalize(self, _Registrations.unwatch)
        self.walks += 1
        self._held = _HeldBuffers(module)
        return self._held.buffers

    def restore(self, module: nn.Module) -> None:
        """Put the copies back into ``module``'s buffers, in place.

        Raises:
            RuntimeError: nothing taken, or the module's persistent buffers changed since (nothing copied then).
        """
        buffers = _HeldBuffers(module).buffers  # walked afresh: a change the kept list missed is refused here
        if not self.taken or not _same_layout(self._copies, buffers):
            raise RuntimeError("no copy of this module's current buffers to restore")
        if buffers:
            with torch.no_grad():
                torch._foreach_copy_(buffers, self._copies)


class _Registrations:
    """Tells every live :class:`_HeldBuffers` of a buffer or submodule registered into one of its modules: torch's
    global registration hooks, installed while at least one :class:`BufferCopy` watches. A module made elsewhere
    (a ``Sequential`` sliced in a forward) is no change."""

    _watchers = 0
    _handles: list[Any] = []
    _held: weakref.WeakSet[_HeldBuffers] = weakref.WeakSet()

    @classmethod
    def watch(cls) -> None:
        if cls._watchers == 0:
            cls._handles = [
                nn.modules.module.register_module_buffer_registration_hook(cls._registered),
                nn.modules.module.register_module_module_registration_hook(cls._registered),
            ]
        cls._watchers += 1

    @classmethod
    def unwatch(cls) -> None:
        cls._watchers = max(cls._watchers - 1, 0)
        if cls._watchers == 0:
            for handle in cls._handles:
                handle.remove()
            cls._handles = []

    @classmethod
    def _registered(cls, parent: nn.Module, *_: Any) -> None:
        for held in cls._held:
            if id(parent) in held.modules:
                held.changed = True


class _HeldBuffers:
    """A module's persistent buffers (those in its ``state_dict``) as one walk found them, each once (a shared
    module's are not repeated), a lazy module's not yet materialized left out; and what says they still are."""

    def __init__(self, module: nn.Module) -> None:
        self.module = weakref.ref(module)
        self.changed = False  # a buffer or submodule registered into one of its modules since
        found: dict[int, tuple[nn.Module, str, Tensor]] = {}
        self.modules: set[int] = set()
        self.lazy: list[Tensor] = []
        for m in module.modules():
            self.modules.add(id(m))
            for name, b in m._buffers.items():
                if b is None or name in m._non_persistent_buffers_set:
                    continue
                if isinstance(b, nn.parameter.UninitializedBuffer):
                    self.lazy.append(b)  # its first forward gives it a shape, in place: walked again then
                else:
                    found.setdefault(id(b), (m, name, b))
        self.entries = list(found.values())
        self.buffers = [b for _, _, b in self.entries]
        _Registrations._held.add(self)

    def holds(self, module: nn.Module) -> bool:
        """Whether these are still ``module``'s buffers: the same module, nothing registered into it since, each
        buffer still its owner's, every lazy one still unmaterialized."""
        return (
            self.module() is module
            and not self.changed
            and all(owner._buffers.get(name) is b for owner, name, b in self.entries)
            and all(isinstance(b, nn.parameter.UninitializedBuffer) for b in self.lazy)
        )


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
