"""Where a forward hook runs with respect to ``torch.utils.checkpoint``: in a segment's recomputation during
backward (reentrant or not), and which backward that is; a hook on all of a call's outputs that also fires
where one of them is the root of its backward (reentrant checkpointing back-propagates from a segment's outputs)."""

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
        self._nodes = [
            t.grad_fn if t.grad_fn is not None else t.view_as(t).grad_fn.next_functions[0][0] for t in tensors
        ]
        self._fn = fn
        self._pending: dict[int, list[Any]] = {}  # per backward: the gradients still awaited, those that arrived
        self._lock = threading.Lock()  # hooks of a backward over several devices run on the devices' threads
        me = weakref.ref(self)
        for index, t in enumerate(tensors):
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
            entry[1][index] = grad
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
