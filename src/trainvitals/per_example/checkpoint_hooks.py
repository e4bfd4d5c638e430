"""Where a forward hook runs with respect to ``torch.utils.checkpoint``: in a segment's recomputation during
backward (reentrant or not), and which backward that is; a hook on all of a call's outputs that also fires
where one of them is the root of its backward (reentrant checkpointing back-propagates from a segment's outputs)."""

from __future__ import annotations

import functools
import threading
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


def register_all_grads_hook(tensors: Sequence[Tensor], fn: Callable[[list[Tensor | None]], None]) -> None:
    """Call ``fn`` with the gradients of ``tensors`` (``None`` for those the backward does not reach) once all
    those it reaches have arrived, in each backward: ``register_multi_grad_hook(tensors, fn)`` (mode "all"), also
    where one of them is the backward's only root. The engine then starts at that tensor's own node and does not
    count it among the nodes it will execute, so torch's hook awaits one gradient fewer than arrive: where only the
    root's arrives it never fires. Reentrant checkpointing back-propagates so from a segment that returns a layer's
    output (an LSTM's, without its final states)."""
    nodes = [t.grad_fn if t.grad_fn is not None else t.view_as(t).grad_fn.next_functions[0][0] for t in tensors]
    pending: dict[int, list[Any]] = {}  # per backward: the gradients still awaited, those that arrived
    lock = threading.Lock()  # hooks of a backward over several devices run on the devices' threads

    def hook(index: int, grad: Tensor | None) -> None:
        task = torch._C._current_graph_task_id()
        with lock:
            if task not in pending:  # the first node of ours the backward runs: the root, if one of ours is
                running = torch._C._current_autograd_node()
                awaited = sum(node is running or torch._C._will_engine_execute_node(node) for node in nodes)
                pending[task] = [awaited, [None] * len(tensors)]
            entry = pending[task]
            entry[0] -= 1
            entry[1][index] = grad
            done = entry[0] == 0
            if done:
                del pending[task]
        if done:
            fn(entry[1])

    for index, t in enumerate(tensors):
        t.register_hook(functools.partial(hook, index))
