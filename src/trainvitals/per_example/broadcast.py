"""A table looked up with ids shared by the batch (a position table: ``wpe(arange(T))``, HF's ``(1, T)``
position ids) and added to the examples' tensors: its per-example gradient, caught where the broadcast sums it.

With h_{i,t} = tok_{i,t} + pos_t, example i's gradient of the table is Σ_t e_{id_t} ⊗ ∂ℓ_i/∂h_{i,t}: the rule of
the lookup applied to the ids expanded to the batch and the gradient at the sum, ``(B, T, D)``, before autograd's
broadcast reduction (the add's backward) sums it over the examples. The add is found in the loss's graph
(:func:`broadcast_adds`: every node that reads the lookup's output, through ``unsqueeze(0)``); a prehook on it
gets that gradient (:func:`per_example_grad`). A lookup whose output anything else reads (a view, a product, a
repeat, an in-place op, a compiled region) has no exact per-example gradient here, and is reported so.
Host-side only (the graph's nodes and shapes). No Lightning import.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

#: The nodes through which a lookup's output may reach the add that broadcasts it (``wpe(pos)[None]``).
_UNSQUEEZE = "UnsqueezeBackward0"
_ADD = "AddBackward0"


@dataclass(frozen=True)
class Operand:
    """The lookup's output as an operand of an add that broadcasts it against the batch (the add's node is kept
    apart: a hook on that node holding it would keep the node alive).

    Attributes:
        alpha: its factor (``torch.add(x, pos, alpha=a)``: ``a``; else 1).
        shape: its shape (the lookup's output's, with a leading 1 per ``unsqueeze(0)``).
    """

    alpha: float
    shape: tuple[int, ...]


def consumers(root: Any, targets: Iterable[Any]) -> dict[Any, list[tuple[Any, int, int]]]:
    """For each of ``targets`` (autograd nodes) and each ``unsqueeze`` node, the nodes of ``root``'s graph that
    read one of its outputs: ``(consumer, the consumer's input index, the output's index)``. One walk of the graph
    (each node once; ~1 ms for a 12-layer GPT-2)."""
    wanted = set(targets)
    found: dict[Any, list[tuple[Any, int, int]]] = {}
    seen, stack = {root}, [root]
    while stack:
        node = stack.pop()
        for k, (child, output) in enumerate(node.next_functions):
            if child is None:
                continue
            if child in wanted or type(child).__name__ == _UNSQUEEZE:
                found.setdefault(child, []).append((node, k, output))
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return found


def broadcast_adds(
    node: Any, output: int, shape: tuple[int, ...], readers: dict[Any, list[tuple[Any, int, int]]]
) -> list[tuple[Any, Operand]] | str:
    """The adds (their autograd nodes, ``AddBackward0``) that read output ``output`` of ``node`` (a lookup's, of
    ``shape``), directly or through ``unsqueeze(0)``, from :func:`consumers`, with the lookup's output as their
    operand; or why another node reads it. None: the loss does not use it."""
    adds: list[tuple[Any, Operand]] = []
    for reader, k, nr in readers.get(node, []):
        if nr != output:
            continue
        kind = type(reader).__name__
        if kind == _UNSQUEEZE and reader._saved_dim == 0:
            found = broadcast_adds(reader, 0, (1, *shape), readers)
            if isinstance(found, str):
                return found
            adds += found
        elif kind == _ADD:
            adds.append((reader, Operand(1.0 if k == 0 else float(reader._saved_alpha), shape)))
        else:
            return (
                f"its output is read by {kind}: it is measured where it is only added to the examples' tensors "
                "(tok + wpe(pos))"
            )
    return adds


def per_example_grad(grad: Tensor, operand: Operand, batch: int) -> Tensor | str:
    """Each example's gradient of the lookup's output (``(B, *shape)``, a leading 1 of ``shape`` dropped): ``grad``,
    the gradient of the add's result, times ``operand.alpha``; or why it is not one: the output must be broadcast
    over the result's first dimension, the ``batch`` examples, and only over it."""
    shape = operand.shape
    rest = tuple(shape[1:] if len(shape) == grad.dim() and shape[0] == 1 else shape)
    if grad.shape[0] != batch or tuple(grad.shape[1:]) != rest:
        return (
            f"its output {shape} is added to a tensor {tuple(grad.shape)}: broadcast over another dimension "
            f"than the first, the batch's {batch} examples"
        )
    return grad * operand.alpha if operand.alpha != 1.0 else grad
