"""A tensor shared by the batch's examples and broadcast over them: its per-example gradient, caught where the
broadcast sums it. Two kinds: a table looked up with ids shared by the batch (a position table: ``wpe(arange(T))``,
HF's ``(1, T)`` position ids) and added to the examples' tensors, and a module's own bare parameter (a ViT's
``pos_embed`` and ``cls_token``, a ConvNeXt block's layer-scale ``gamma``) added to, multiplied with or expanded over
them.

With h_{i,t} = tok_{i,t} + pos_t, example i's gradient of the table is Σ_t e_{id_t} ⊗ ∂ℓ_i/∂h_{i,t}: the rule of
the lookup applied to the ids expanded to the batch and the gradient at the sum, ``(B, T, D)``, before autograd's
broadcast reduction (the add's backward) sums it over the examples. The add is found in the loss's graph
(:func:`broadcast_adds`: every node that reads the lookup's output, through ``unsqueeze(0)``); a prehook on it
gets that gradient (:func:`per_example_grad`). A lookup whose output anything else reads (a view, a product, a
repeat, an in-place op, a compiled region) has no exact per-example gradient here, and is reported so.

A bare parameter p of shape S meets the batch at a node that broadcasts it over the examples: an add or a
subtraction (``x + p``: example i's gradient is the result's gradient at i, summed over the dimensions p is
broadcast over), a product (``x * p``: the same of the gradient times x) or an expansion (``p.expand(B, ...)``:
the gradient at i). Between its ``AccumulateGrad`` and that node it may pass through views, slices and
arithmetic free of the batch (:class:`Step`), back through which the gradient goes. A product in place on a plain
tensor (``x.mul_(p)``) is read as one out of place, its node saving ``x`` as it was; on a view, autograd hides it in
a ``CopySlices`` node, and the parameter is named. :class:`BroadcastParameters`
is the rule of such a module's parameters; the hooks catch the gradients at those nodes
(:func:`parameter_readers`, :func:`parameter_grad`).

Host-side only (the graph's nodes and shapes; a batch-free product's small operand). No Lightning import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from trainvitals.per_example.registry import PerExampleRule, Use
from trainvitals.per_example.tensor_ops import _accumulation_dtype

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


def consumers(root: Any) -> dict[Any, list[tuple[Any, int, int]]]:
    """For each node of ``root``'s graph, the nodes that read one of its outputs: ``(consumer, the consumer's input
    index, the output's index)``. One walk of the graph (each node once; ~1 ms for a 12-layer GPT-2)."""
    found: dict[Any, list[tuple[Any, int, int]]] = {}
    seen, stack = {root}, [root]
    while stack:
        node = stack.pop()
        for k, (child, output) in enumerate(node.next_functions):
            if child is None:
                continue
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


#: Nodes that give a bare parameter a new shape on its way to the batch: their gradient goes back by a reshape
#: (``p[None]``, ``p.view(1, -1, 1, 1)``), a slice's scatter (``p[:, 1:]``) or a sum over what was expanded.
_RESHAPES = ("AliasBackward0", "UnsqueezeBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0")
#: Arithmetic with a number: the gradient times a factor (``alpha * p``, ``p / 2``, ``-p``).
_SCALED = {
    "MulBackward1": lambda node, k: float(node._saved_other),
    "DivBackward1": lambda node, k: 1.0 / float(node._saved_other),
    "NegBackward0": lambda node, k: -1.0,
    "AddBackward1": lambda node, k: 1.0,
    "SubBackward1": lambda node, k: 1.0,
    "RsubBackward1": lambda node, k: -float(node._saved_alpha),
}
#: Arithmetic with another tensor: the gradient times a factor, for a product times the other operand (its saved
#: attribute); where the other operand holds the batch, this is the node that broadcasts the parameter over it.
_TENSOR_OPS = {
    "AddBackward0": lambda node, k: (1.0 if k == 0 else float(node._saved_alpha), None),
    "SubBackward0": lambda node, k: (1.0 if k == 0 else -float(node._saved_alpha), None),
    "MulBackward0": lambda node, k: (1.0, "_saved_other" if k == 0 else "_saved_self"),
    "ExpandBackward0": lambda node, k: (1.0, None),
}
#: An in-place op on a view: autograd wraps the op's node, and its saved operands, in this one.
_IN_PLACE_ON_VIEW = "CopySlices"
CHECKPOINTED = "CheckpointFunctionBackward"  # reentrant checkpointing: what it computes is not in the graph


@dataclass(frozen=True)
class Step:
    """One node between a bare parameter and the node that broadcasts it over the batch, as the per-example
    gradient goes back through it: from the node's result, of ``shape``, to its operand, of ``of``. A slice of
    dimension ``dim`` (``start:end:step``, ``step`` > 0) scatters it into zeros; else it is multiplied by
    ``factor`` and by ``other`` (a product's other operand, free of the batch too) and summed or reshaped to ``of``."""

    shape: tuple[int, ...]
    of: tuple[int, ...]
    factor: float = 1.0
    other: Tensor | None = None
    dim: int = 0
    start: int = 0
    end: int = 0
    step: int = 0

    def undo(self, per: Tensor) -> Tensor:
        """Per-example gradients ``(B, *shape)`` as those of the operand, ``(B, *of)``."""
        b = per.shape[0]
        if self.step:
            dim = self.dim if self.dim >= 0 else self.dim + len(self.of)
            return per.new_zeros(b, *self.of).slice_scatter(per, dim + 1, self.start, self.end, self.step)
        if self.other is not None:
            per = per * self.other
        if self.factor != 1.0:
            per = per * self.factor
        if math.prod(self.shape) == math.prod(self.of):
            return per.reshape(b, *self.of)
        padded = (1,) * (len(self.shape) - len(self.of)) + self.of
        return per.sum_to_size((b, *padded)).reshape(b, *self.of)


def _int64(saved: Any, default: int) -> int:
    """A slice's saved bound as a signed int (autograd shows a negative one as its unsigned 64-bit value)."""
    if saved is None:
        return default
    value = int(saved)
    return value - 2**64 if value >= 2**63 else value


@dataclass(frozen=True)
class Reader:
    """How a node that broadcasts a bare parameter over the batch gives its per-example gradient: the gradient of
    the node's result times ``factor`` (an add's ``alpha``; −alpha for the subtracted operand), for a product times
    its other operand, the node's saved attribute ``other``, summed to the operand's shape; then back through
    ``steps`` (the nodes between the parameter and this one, in the forward's order)."""

    factor: float
    other: str | None = None
    steps: tuple[Step, ...] = ()


def parameter_readers(
    node: Any,
    readers: dict[Any, list[tuple[Any, int, int]]],
    shape: tuple[int, ...],
    batch: int,
    steps: tuple[Step, ...] = (),
) -> list[tuple[Any, Reader]] | str:
    """The nodes that broadcast a bare parameter of ``shape`` over the ``batch`` examples (``node``: its
    ``AccumulateGrad``), from :func:`consumers`, each with how it gives the per-example gradient; or why one gives
    none. The nodes between them — views, slices, expansions and arithmetic free of the batch (``cls_token +
    pos_embed[:, :1]``, ``alpha * pos``) — are followed: a node broadcasts the parameter where its result's first
    dimension holds the batch and the parameter's operand, aligned to it, has 1 there."""
    found: list[tuple[Any, Reader]] = []
    operand = steps[-1].shape if steps else tuple(shape)
    for reader, k, _ in readers.get(node, []):
        kind = type(reader).__name__
        out = tuple(reader._input_metadata[0].shape)
        padded = (1,) * (len(out) - len(operand)) + operand
        broadcast = len(out) == len(padded) and bool(out) and out[0] == batch and padded[0] == 1
        if kind in _TENSOR_OPS and broadcast:
            found.append((reader, Reader(*_TENSOR_OPS[kind](reader, k), steps)))
            continue
        if kind in _TENSOR_OPS:
            factor, other = _TENSOR_OPS[kind](reader, k)
            step = Step(out, operand, factor, getattr(reader, other) if other else None)
        elif kind == "DivBackward0" and k == 0:  # p / t, t free of the batch
            step = Step(out, operand, other=1.0 / reader._saved_other)
        elif kind in _SCALED:
            step = Step(out, operand, _SCALED[kind](reader, k))
        elif kind in _RESHAPES:
            step = Step(out, operand)
        elif kind == "SliceBackward0":
            bounds = _int64(reader._saved_start, 0), _int64(reader._saved_end, 2**62)
            step = Step(
                out, operand, dim=int(reader._saved_dim), start=bounds[0], end=bounds[1], step=int(reader._saved_step)
            )
        elif kind == _IN_PLACE_ON_VIEW:
            return (
                "is applied in place to a view (CopySlices: `x.mul_(p)` on a Linear's (B, T, D) output, a view of "
                "its (B·T, D) result), whose node autograd hides; out of place (`x * p`) it is measured"
            )
        else:
            return (
                f"is read by {kind}: a module's own parameter is measured where it is added to, multiplied with or "
                "expanded over the examples (x + p, x * p, p.expand(B, ...)), through views, slices and arithmetic "
                "free of the batch"
            )
        further = parameter_readers(reader, readers, shape, batch, (*steps, step))
        if isinstance(further, str):
            return further
        found += further
    return found


def parameter_grad(
    grad: Tensor, shape: tuple[int, ...], batch: int, reader: Reader, other: Tensor | None
) -> Tensor | str:
    """Each example's gradient ``(batch, *shape)`` of a parameter of ``shape`` read by a node whose result has the
    gradient ``grad`` (times ``other``, the product's other operand): summed over the dimensions the parameter's
    operand is broadcast over, but the first, which must hold the ``batch`` examples, and put back through the
    reader's steps; or why it is not one."""
    grad = grad.to(_accumulation_dtype(grad))
    if other is not None:
        grad = grad * other
    operand = reader.steps[-1].shape if reader.steps else tuple(shape)
    padded = (1,) * (grad.dim() - len(operand)) + operand
    if len(padded) != grad.dim() or grad.shape[0] != batch or padded[0] != 1:
        return (
            f"is broadcast to {tuple(grad.shape)} from {operand}: not over the first dimension alone of the "
            f"batch's {batch} examples"
        )
    per = grad.sum_to_size((batch, *padded[1:])).reshape(batch, *operand)
    if reader.factor != 1.0:
        per = per * reader.factor
    for step in reversed(reader.steps):
        per = step.undo(per)
    return per


class BroadcastParameters(PerExampleRule):
    """The rule of a module's own parameters that its forward broadcasts over the batch (a ViT's ``pos_embed`` and
    ``cls_token``): each use's :attr:`~.registry.Use.grad_output` is the tuple of their per-example gradients
    ``(B, *shape)``, in :meth:`parameters`' order, which the hooks catch in the loss's graph."""

    def grads(self, module: nn.Module, uses: Sequence[Use]) -> dict[str, Tensor]:
        total: dict[str, Tensor] = {}
        for use in uses:
            for name, g in zip(self.parameters(module), use.grad_output):
                total[name] = g if name not in total else total[name] + g
        return total


BROADCAST_PARAMETERS = BroadcastParameters()
