"""The step tracer: re-run a training step and record where a value left the graph.

:class:`GraphTracer` runs a step under a ``TorchFunctionMode``, with global module hooks and
``saved_tensors_hooks``, and records where a value left the autograd graph (``.item()``,
``.detach()``, ``torch.no_grad()``, a non-differentiable op) and which in-place operation changed a
tensor autograd had saved. :func:`describe_cut` says why a traced loss has no ``grad_fn``.
:mod:`trainvitals.integrity.diagnoses` uses both for its diagnoses; :mod:`trainvitals.integrity.graph` has the
cheap walks that run during training.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from trainvitals.integrity.graph import module_names, user_location


class Cut(enum.Enum):
    """How a value left the autograd graph, or a fact the tracer recorded."""

    ITEM = "read as a Python number"  # .item(), .tolist(), float(t)
    DETACH = "detached"  # .detach(), .data
    NO_GRAD = "computed with grad mode off"
    NON_DIFFERENTIABLE = "output of a non-differentiable op"
    FACTORY = "a new tensor built from Python values"
    GRAD_OFF = "grad mode switched off"
    INPLACE = "modified in place"


_ITEM_OPS = frozenset({"item", "tolist", "numpy", "__float__", "__int__"})
_DETACH_OPS = frozenset({"detach", "detach_", "data"})


@dataclass(frozen=True)
class TraceEvent:
    """One recorded call. ``index`` orders events and saves; ``storage`` is set for in-place events."""

    index: int
    op: str
    cut: Cut
    module: str | None
    location: str | None
    storage: int | None = None

    def where(self) -> str:
        """``"`sigmoid` in module `net.1` at model.py:12 in forward"``."""
        text = f"`{self.op}`"
        if self.module is not None:
            text += f" in module `{self.module}`" if self.module else " in the LightningModule's forward"
        return text + (f" at {self.location}" if self.location else "")


@dataclass(frozen=True)
class SavedRecord:
    """A tensor autograd saved for backward: by which op and module, and its version at that time."""

    index: int
    op: str
    module: str | None
    location: str | None
    storage: int
    version: int
    shape: tuple[int, ...]


def _op_name(func: Callable) -> str:
    name = getattr(func, "__name__", repr(func))
    if name == "__get__":  # a property such as Tensor.data
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _storage_ptr(t: Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, some subclasses)
        return None


class GraphTracer(TorchFunctionMode):
    """Records, while active, where values leave the graph and which in-place ops hit saved tensors.

    Use as ``with GraphTracer(model) as tracer: ...``. It sees every torch call made in Python (a
    ``TorchFunctionMode``), the module running at that time (global forward hooks), and every tensor
    autograd saves (``saved_tensors_hooks``). Slow (a stack walk per event): for re-running one step
    to explain an error, never for training.

    Args:
        root: the model, to name modules; ``None`` names them by type.
        skip_dirs: folders whose frames are not the culprit's location (besides torch and the stdlib).

    Attributes:
        events: cuts, grad-mode switches and in-place modifications, in call order.
        saved: the tensors autograd saved, in order.
        grad_enabled_at_start: grad mode when the tracer was entered.
    """

    def __init__(self, root: nn.Module | None = None, skip_dirs: Sequence[str] = ()) -> None:
        super().__init__()
        self.skip_dirs = tuple(skip_dirs)
        self.events: list[TraceEvent] = []
        self.saved: list[SavedRecord] = []
        self.grad_enabled_at_start = True
        self._names = module_names(root) if root is not None else {}
        self._modules: list[str] = []
        self._ops: list[str] = []
        self._counter = 0
        # Lineage: id of a value -> ids of the values it was computed from, and the event it came with.
        # The values are kept alive in _keep so that their ids stay unique while tracing.
        self._parents: dict[int, tuple[int, ...]] = {}
        self._event_of: dict[int, TraceEvent] = {}
        self._keep: list[Any] = []
        self._exits: list[Callable[[], Any]] = []

    def __enter__(self) -> GraphTracer:
        self.grad_enabled_at_start = torch.is_grad_enabled()
        pre = nn.modules.module.register_module_forward_pre_hook(self._push_module)
        post = nn.modules.module.register_module_forward_hook(self._pop_module, always_call=True)
        saving = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        saving.__enter__()
        self._exits = [pre.remove, post.remove, lambda: saving.__exit__(None, None, None)]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for undo in reversed(self._exits):
            undo()
        self._exits = []

    def _push_module(self, module: nn.Module, _args: Any) -> None:
        self._modules.append(self._names.get(id(module), f"<{type(module).__name__}>"))

    def _pop_module(self, *_: Any) -> None:
        if self._modules:
            self._modules.pop()

    def _here(self) -> tuple[str | None, str | None]:
        return (self._modules[-1] if self._modules else None), user_location(self.skip_dirs)

    def _pack(self, t: Tensor) -> Tensor:
        ptr = _storage_ptr(t)
        if ptr is not None:
            module, location = self._here()
            op = self._ops[-1] if self._ops else "?"
            self.saved.append(SavedRecord(self._counter, op, module, location, ptr, t._version, tuple(t.shape)))
        return t

    def _event(self, op: str, cut: Cut, storage: int | None = None) -> TraceEvent:
        module, location = self._here()
        event = TraceEvent(self._counter, op, cut, module, location, storage)
        self.events.append(event)
        return event

    def __torch_function__(self, func: Callable, types: Any, args: Sequence = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        op = _op_name(func)
        inputs = tree_flatten((args, kwargs))[0]
        tensors = [a for a in inputs if isinstance(a, Tensor)]
        versions = [t._version for t in tensors]
        grad_on = torch.is_grad_enabled()
        self._counter += 1
        self._ops.append(op)
        try:
            out = func(*args, **kwargs)
        finally:
            self._ops.pop()
        if op == "_set_grad_enabled" and args and not args[0]:
            self._event(op, Cut.GRAD_OFF)
        for t, v in zip(tensors, versions):
            if t._version != v:
                self._event(op, Cut.INPLACE, _storage_ptr(t))
        self._link(op, inputs, tensors, out, grad_on)
        return out

    def _link(self, op: str, inputs: list, tensors: list[Tensor], out: Any, grad_on: bool) -> None:
        needs_grad = any(t.requires_grad for t in tensors)
        flat_out = tree_flatten(out)[0]
        cut: Cut | None = None
        if needs_grad and op in _ITEM_OPS:
            cut = Cut.ITEM
            # Follow the number itself, so that torch.tensor(loss.item()) links back to the loss.
            outputs = [o for o in flat_out if isinstance(o, float)]
        else:
            outputs = [o for o in flat_out if isinstance(o, Tensor)]
            if needs_grad and op in _DETACH_OPS:
                cut = Cut.DETACH
            elif needs_grad and any(not o.requires_grad for o in outputs):
                cut = Cut.NON_DIFFERENTIABLE if grad_on else Cut.NO_GRAD
            elif not tensors and outputs:
                cut = Cut.FACTORY
        if not outputs:
            return
        event = self._event(op, cut) if cut is not None else None
        parents = tuple(id(a) for a in inputs if isinstance(a, Tensor) or id(a) in self._parents)
        self._keep.extend(inputs)
        for o in outputs:
            if id(o) not in self._parents:
                self._keep.append(o)
                self._parents[id(o)] = parents
                if event is not None:
                    self._event_of[id(o)] = event

    def cuts_behind(self, value: Any) -> list[TraceEvent]:
        """The cut events among the ancestors of ``value`` (a tensor the traced code returned), in order.

        Follows the recorded lineage back from ``value``. A number read with ``.item()`` and passed
        straight to ``torch.tensor`` is followed; arithmetic on Python numbers is not, so when the
        lineage ends in a factory call the ``.item()`` calls of the trace are the suspects.
        """
        seen, todo, found = set(), [id(value)], []
        while todo:
            key = todo.pop()
            if key in seen:
                continue
            seen.add(key)
            event = self._event_of.get(key)
            if event is not None and event.cut is not Cut.INPLACE:
                found.append(event)
            todo.extend(self._parents.get(key, ()))
        return sorted(set(found), key=lambda e: e.index)

    def grad_off_before(self, event: TraceEvent) -> TraceEvent | None:
        """The last grad-mode switch-off recorded before ``event`` (where ``torch.no_grad()`` was entered)."""
        offs = [e for e in self.events if e.cut is Cut.GRAD_OFF and e.index <= event.index]
        return offs[-1] if offs else None

    def inplace_after_save(self, shape: tuple[int, ...] | None = None) -> list[tuple[SavedRecord, TraceEvent]]:
        """Pairs (saved tensor, in-place op) where the op changed the saved tensor's storage later.

        Args:
            shape: keep only saved tensors of this shape (from the error message), when given.
        """
        pairs = []
        for event in self.events:
            if event.cut is not Cut.INPLACE:
                continue
            for rec in self.saved:
                if rec.storage == event.storage and rec.index < event.index and (shape is None or rec.shape == shape):
                    pairs.append((rec, event))
        return pairs


def describe_cut(tracer: GraphTracer, cuts: Sequence[TraceEvent]) -> tuple[tuple[str, ...], str]:
    """Why the traced loss has no ``grad_fn``, from :meth:`GraphTracer.cuts_behind`.

    Returns:
        The names (op, module, location of the culprit) and a sentence that starts with "it".
    """
    if not tracer.grad_enabled_at_start:
        return ("grad mode off",), "grad mode was off when the step started"
    real = [e for e in cuts if e.cut is not Cut.FACTORY]
    items = [e for e in tracer.events if e.cut is Cut.ITEM]
    if real:
        culprit = real[-1]  # the cut closest to the loss
    elif items and cuts:  # the lineage ends in a tensor built from numbers: suspect the last .item()
        culprit = items[-1]
    else:
        return (), "it does not depend on any tensor that requires grad (no parameter was used)"
    names = tuple(n for n in (culprit.op, culprit.module, culprit.location) if n)
    if culprit.cut is Cut.NO_GRAD:
        off = tracer.grad_off_before(culprit)
        if off is not None and off.location:
            names += (off.location,)
        entered = f" (entered at {off.location})" if off is not None and off.location else ""
        return names, f"it was computed inside `torch.no_grad()`{entered}, e.g. {culprit.where()}"
    if culprit.cut in (Cut.ITEM, Cut.DETACH):
        return names, f"it was rebuilt from `.{culprit.op}()`: {culprit.where()}"
    return names, f"it comes from a non-differentiable op: {culprit.where()}"
