"""Where a forward hook runs with respect to ``torch.utils.checkpoint``: in a segment's recomputation during
backward (reentrant or not), and which backward that is."""

from __future__ import annotations

import torch


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
