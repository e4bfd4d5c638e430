"""Where a forward hook runs with respect to ``torch.utils.checkpoint``: in a segment's recomputation during
backward (reentrant or not), and which backward that is; a hook on all of a call's outputs that also fires
where one of them is the root of its backward (reentrant checkpointing back-propagates from a segment's outputs);
a hook on a layer's output that also fires where a later op changes that output in place."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor


def _recomputing() -> bool:
    """Whether a forward runs inside a backward: ``torch.utils.checkpoint`` recomputing a segment."""
    return torch._C._current_autograd_node() is not None


def _reentrant_recomputation() -> bool:
    """Whether a forward is reentrant checkpointing's recomputation, the only run of its calls with a graph
    (non-reentrant checkpointing recomputes calls whose first run had one)."""
    node = torch._C._current_autograd_node()
    return node is not None and type(node).__name__ == "CheckpointFunctionBackward"


def _recomputing_task() -> int | None:
    """The backward that recomputes this forward (checkpointing), ``None`` outside a backward."""
    return torch._C._current_graph_task_id() if _recomputing() else None


def _hook_target(t: Tensor) -> tuple[Tensor, Callable[[Tensor], Tensor] | None]:
    """Where to hook the gradient of ``t``, a layer's output, so that it arrives also where an op after the layer
    changes ``t`` in place: ``t``, or its base with the map from the base's gradient to ``t``'s.

    A tensor's hook belongs to its autograd node. An in-place op on a plain tensor keeps that node in the graph,
    whose hook gets the gradient with respect to the values before the op: the layer's own output's. An in-place op
    on a view (a Linear's output on ``(B, T, D)`` inputs, a view of its ``(B·T, D)`` result; a batch-first LSTM's, a
    transpose) re-roots the view on its base: its node leaves the graph (timm's ``LayerScale(inplace=True)``:
    ``x.mul_(gamma)`` on the attention's ``proj`` output), or stays with only the gradients of the reads before the
    op. The base keeps its node, which gets them all: a view that holds each element of a contiguous base once is
    hooked there, the gradient read through the view's strides.
    """
    base = t._base
    if (
        base is None
        or base.grad_fn is None
        or base.numel() != t.numel()
        or base.storage_offset() != t.storage_offset()
        or not base.is_contiguous()
        or not _dense(t)
    ):
        return t, None
    size, stride = t.shape, t.stride()

    def to_view(grad: Tensor) -> Tensor:
        grad = grad.contiguous()
        return grad.as_strided(size, stride, grad.storage_offset())

    return base, to_view


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill ``t.numel()`` consecutive places of its storage, each once (a permutation of a
    contiguous layout)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda p: p[1]):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def register_grad_hook(t: Tensor, fn: Callable[[Tensor], None]) -> None:
    """Call ``fn`` with the gradient of ``t``, a layer's output, in each backward, also where an op after the layer
    changes ``t`` in place (:func:`_hook_target`)."""
    target, to_view = _hook_target(t)
    if to_view is None:
        t.register_hook(fn)
        return

    def from_base(grad: Tensor) -> None:
        fn(to_view(grad))

    target.register_hook(from_base)


class AllGradsHook:
    """Calls ``fn`` with the gradients of ``tensors`` (``None`` for those the backward does not reach) once all
    those it reaches have arrived, in each backward, while the caller keeps this object: ``register_multi_grad_hook``
    (mode "all"), also where one of them is the backward's only root. The engine then starts at that tensor's own node
    and does not count it among the nodes it will execute, so torch's hook awaits one gradient fewer than arrive: where
    only the root's arrives it never fires. Reentrant checkpointing back-propagates so from a segment that returns a
    layer's output (an LSTM's, without its final states).

    The tensors' hooks hold it weakly: a hook holding the nodes it counts would be a cycle through autograd's C++
    nodes (node, its hook, the node), which Python's gc cannot see and never frees — the graph's nodes and whatever
    ``fn`` holds (a call's inputs), every step. Dropped, it fires no more, and the graph holds nothing of it."""

    def __init__(self, tensors: Sequence[Tensor], fn: Callable[[list[Tensor | None]], None]) -> None:
        targets = [_hook_target(t) for t in tensors]  # a view changed in place: its base's gradient
        if len({id(target) for target, _ in targets}) < len(targets):  # two on one base: each its own gradient
            targets = [(t, None) for t in tensors]
        self._nodes = [
            t.grad_fn if t.grad_fn is not None else t.view_as(t).grad_fn.next_functions[0][0] for t, _ in targets
        ]
        self._maps = [to_view for _, to_view in targets]
        self._fn = fn
        self._pending: dict[int, list[Any]] = {}  # per backward: the gradients still awaited, those that arrived
        self._lock = threading.Lock()  # hooks of a backward over several devices run on the devices' threads
        me = weakref.ref(self)
        for index, (t, _) in enumerate(targets):
            t.register_hook(functools.partial(_arrived, me, index))

    def _arrived(self, index: int, grad: Tensor | None) -> None:
        task = torch._C._current_graph_task_id()
        with self._lock:
            if task not in self._pending:  # the first node of ours the backward runs: the root, if one of ours is
                running = torch._C._current_autograd_node()
                awaited = sum(node is running or torch._C._will_engine_execute_node(node) for node in self._nodes)
                self._pending[task] = [awaited, [None] * len(self._nodes)]
            entry = self._pending[task]
            entry[0] -= 1
            to_view = self._maps[index]
            entry[1][index] = grad if to_view is None or grad is None else to_view(grad)
            done = entry[0] == 0
            if done:
                del self._pending[task]
        if done:
            self._fn(entry[1])


def _arrived(hook: weakref.ref[AllGradsHook], index: int, grad: Tensor | None) -> None:
    """A tensor's hook: its gradient to ``hook``, if it is still kept."""
    target = hook()
    if target is not None:
        target._arrived(index, grad)
