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

A bare parameter p of shape S reaches the loss through the nodes that read its ``AccumulateGrad``: an add or a
subtraction (``x + p``: example i's gradient is the result's gradient at i, summed over the dimensions p is
broadcast over), a product (``x * p``: the same of the gradient times x) or an expansion (``p.expand(B, ...)``:
the gradient at i). :class:`BroadcastParameters` is the rule of such a module's parameters; the hooks catch the
gradients at those nodes (:func:`parameter_reader`, :func:`parameter_grad`).

Host-side only (the graph's nodes and shapes). No Lightning import.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from trainvitals.per_example.registry import PerExampleRule, Use
from trainvitals.per_example.tensor_ops import _accumulation_dtype

#: The nodes through which a lookup's output may reach the add that broadcasts it (``wpe(pos)[None]``).
_UNSQUEEZE = "UnsqueezeBackward0"
_ADD = "AddBackward0"
#: The views a bare parameter may pass through before the node that broadcasts it (``p[:, 1:]``, ``p[None]``).
_SLICE, _ALIAS = "SliceBackward0", "AliasBackward0"
_FOLLOWED = (_UNSQUEEZE, _SLICE, _ALIAS)


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
    """For each of ``targets`` (autograd nodes) and each view node (``unsqueeze``, a slice), the nodes of ``root``'s graph that
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
            if child in wanted or type(child).__name__ in _FOLLOWED:
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


@dataclass(frozen=True)
class View:
    """A view between a bare parameter and the node that broadcasts it: a slice of dimension ``dim``
    (``start:end:step``) or an ``unsqueeze(dim)`` (``step`` 0)."""

    dim: int
    start: int = 0
    end: int = 0
    step: int = 0

    def shape(self, of: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the view of a tensor of shape ``of``."""
        dim = self.dim if self.dim >= 0 else self.dim + len(of) + (0 if self.step else 1)
        if not self.step:
            return (*of[:dim], 1, *of[dim:])
        return (*of[:dim], len(range(*slice(self.start, self.end, self.step).indices(of[dim]))), *of[dim + 1 :])

    def undo(self, per: Tensor, of: tuple[int, ...]) -> Tensor:
        """Per-example gradients ``(B, *view's shape)`` as those of the viewed tensor, ``(B, *of)``."""
        if not self.step:
            return per.reshape(per.shape[0], *of)
        dim = self.dim if self.dim >= 0 else self.dim + len(of)
        return per.new_zeros(per.shape[0], *of).slice_scatter(per, dim + 1, self.start, self.end, self.step)


def _view(node: Any) -> View | None:
    """The view ``node`` (a slice, an alias or an unsqueeze) takes; ``None`` for an alias (the tensor itself)."""
    kind = type(node).__name__
    if kind == _ALIAS:
        return None
    if kind == _UNSQUEEZE:
        return View(int(node._saved_dim))
    start, end = (_int64(node._saved_start, 0), _int64(node._saved_end, 2**62))
    return View(int(node._saved_dim), start, end, int(node._saved_step))


def _int64(saved: Any, default: int) -> int:
    """A slice's saved bound as a signed int (autograd shows a negative one as its unsigned 64-bit value)."""
    if saved is None:
        return default
    value = int(saved)
    return value - 2**64 if value >= 2**63 else value


@dataclass(frozen=True)
class Reader:
    """How a node that reads a bare parameter gives its per-example gradient: the gradient of the node's result
    times ``factor`` (an add's ``alpha``; −alpha for the subtracted operand), for a product times its other
    operand, the node's saved attribute ``other``; the parameter reaching it through ``views``, in order."""

    factor: float
    other: str | None = None
    views: tuple[View, ...] = ()


def parameter_readers(
    node: Any, readers: dict[Any, list[tuple[Any, int, int]]], views: tuple[View, ...] = ()
) -> list[tuple[Any, Reader]] | str:
    """The nodes that broadcast a bare parameter over the batch (``node``: its ``AccumulateGrad``, or a view of it),
    from :func:`consumers`, each with how it gives the per-example gradient; or why one gives none."""
    found: list[tuple[Any, Reader]] = []
    for reader, k, _ in readers.get(node, []):
        kind = type(reader).__name__
        if kind in _FOLLOWED:
            view = _view(reader)
            further = parameter_readers(reader, readers, views if view is None else (*views, view))
            if isinstance(further, str):
                return further
            found += further
        elif kind == "AddBackward0":
            found.append((reader, Reader(1.0 if k == 0 else float(reader._saved_alpha), views=views)))
        elif kind == "SubBackward0":
            found.append((reader, Reader(1.0 if k == 0 else -float(reader._saved_alpha), views=views)))
        elif kind == "MulBackward0":
            found.append((reader, Reader(1.0, "_saved_other" if k == 0 else "_saved_self", views)))
        elif kind == "ExpandBackward0":
            found.append((reader, Reader(1.0, views=views)))
        else:
            return (
                f"is read by {kind}: a module's own parameter is measured where it is added to, multiplied with or "
                "expanded over the examples (x + p, x * p, p.expand(B, ...)), through slices"
            )
    return found


def parameter_grad(
    grad: Tensor, shape: tuple[int, ...], batch: int, reader: Reader, other: Tensor | None
) -> Tensor | str:
    """Each example's gradient ``(batch, *shape)`` of a parameter of ``shape`` read by a node whose result has the
    gradient ``grad`` (times ``other``, the product's other operand): summed over the dimensions the parameter's
    view is broadcast over, but the first, which must hold the ``batch`` examples, and put back through the views;
    or why it is not one."""
    grad = grad.to(_accumulation_dtype(grad))
    if other is not None:
        grad = grad * other
    shapes = [tuple(shape)]  # the parameter's, then each view's
    for view in reader.views:
        shapes.append(view.shape(shapes[-1]))
    operand = shapes[-1]
    padded = (1,) * (grad.dim() - len(operand)) + operand
    if len(padded) != grad.dim() or grad.shape[0] != batch or padded[0] != 1:
        return (
            f"is broadcast to {tuple(grad.shape)} from {operand}: not over the first dimension alone of the "
            f"batch's {batch} examples"
        )
    per = grad.sum_to_size((batch, *padded[1:])).reshape(batch, *operand)
    for view, of in zip(reversed(reader.views), reversed(shapes[:-1])):
        per = view.undo(per, of)
    return per * reader.factor if reader.factor != 1.0 else per


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
