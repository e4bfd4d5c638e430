"""Whether a batch loss is a mean or a sum of the examples' own losses, or a sum divided by a constant that makes
it neither, read from its autograd graph."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

_SCALAR_OPS = frozenset(
    {
        "MulBackward0",
        "MulBackward1",
        "DivBackward0",
        "DivBackward1",
        "AddBackward0",
        "SubBackward0",
        "NegBackward0",
        "ToCopyBackward0",
        "CloneBackward0",
        "AliasBackward0",
        "ViewBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "UnsqueezeBackward0",
    }
)
_MEAN_OPS = frozenset({"MeanBackward0", "MeanBackward1"})
_SUM_OPS = frozenset({"SumBackward0", "SumBackward1"})
_REDUCTION_CODES = {1: "mean", 2: "sum"}  # at::Reduction, as saved by the loss nodes (NllLoss, MseLoss, ...)
_MAX_GRAPH_NODES = 64
# A selection of a batch tensor's elements (``logits[mask]``, ``torch.masked_select``), and the operations that
# keep its rows on the way to a loss function (``F.cross_entropy`` is ``nll_loss(log_softmax(x))``).
_SELECT_OPS = frozenset({"IndexBackward0", "MaskedSelectBackward0"})
_ROW_OPS = frozenset({"LogSoftmaxBackward0", "SoftmaxBackward0", "ToCopyBackward0", "CloneBackward0"})
_MAX_SELECTION_DEPTH = 4


@dataclass(frozen=True)
class LossReduction:
    """How a loss reduces its terms: ``kind`` ``"mean"``, ``"sum"`` or ``"scaled"`` (a sum divided by a host number
    that is neither 1 nor a multiple of the examples: ``reduction="sum"`` over a micro-batch's tokens divided by the
    effective batch's, transformers' ``num_items_in_batch``), over ``terms`` values (the examples
    of a micro-batch, times the tokens or elements of each for a per-token or per-element loss; the
    elements selected, for a loss over ``x[mask]``) where the graph says so, else ``None``. Targets an
    ``ignore_index`` leaves out (padding) are counted: read from shapes, not values, so with padding
    ``terms`` is an upper bound.

    ``count``: what the loss divides the sum of its terms by, where the graph holds it: a mean's elements
    (``nll_loss``: the total weight of the targets it kept) times the divisions on the way, a sum's divisions
    (``mask.sum()``), over its multiplications by numbers (``* accumulate_grad_batches``); a number, or a 0-d
    tensor on the loss's device, not read here so as not to sync. ``None``: a sum divided by nothing, or not
    known. A ``"scaled"`` loss's count is a number: each example's share of the gradient is that of the sum of
    its terms over ``count``.
    """

    kind: str
    terms: int | None
    count: float | Tensor | None = field(default=None, compare=False)


_NLL_OPS = frozenset({"NllLossBackward0", "NllLoss2DBackward0"})  # input (N, C, *): one term per target
# Loss functions whose reduction runs over every element of their input.
_ELEMENTWISE_LOSS_OPS = frozenset(
    {
        "MseLossBackward0",
        "SmoothL1LossBackward0",
        "HuberLossBackward0",
        "BinaryCrossEntropyBackward0",
        "BinaryCrossEntropyWithLogitsBackward0",
        "SoftMarginLossBackward0",
    }
)


def _loss_terms(node: Any) -> int | None:
    """The values a loss function's ``reduction=`` adds up or averages, for the losses where that is known."""
    shape, name = node._saved_self.shape, type(node).__name__
    if name in _NLL_OPS:
        return math.prod(shape) // shape[1] if len(shape) >= 2 else 1
    return math.prod(shape) if name in _ELEMENTWISE_LOSS_OPS else None


def _selected_from_batch(node: Any, batch_size: int) -> bool:
    """The input of reduction ``node`` is a selection (``x[mask]``) of a tensor whose leading dimension is a
    multiple of ``batch_size``, through operations that keep its rows."""
    for _ in range(_MAX_SELECTION_DEPTH):
        node = node.next_functions[0][0] if node.next_functions else None
        name = type(node).__name__
        if name in _SELECT_OPS:
            sizes = node._saved_self_sym_sizes if name == "IndexBackward0" else node._saved_self.shape
            return bool(sizes) and sizes[0] % batch_size == 0
        if name not in _ROW_OPS:
            return False
    return False


def _factor(node: Any) -> Tensor | None:
    """The constant operand of a multiplication: the one of its two that autograd saved alone (it saves each
    operand for the other's gradient, so that one needs none); ``None`` for a product of two graphs."""
    operands = [t for t in (node._saved_self, node._saved_other) if t is not None]
    return operands[0] if len(operands) == 1 and not operands[0].requires_grad else None


def _times(count: float | Tensor | None, divisor: float | Tensor | None) -> float | Tensor | None:
    """A mean's count times the divisions on the path from the loss (device tensors stay on the device)."""
    if count is None or divisor is None:
        return count if divisor is None else None
    return count * divisor


def detect_loss_reduction(
    loss: Tensor, batch_size: int, accumulation: int = 1, loss_scale: float | Tensor | None = None
) -> LossReduction | None:
    """Whether ``loss`` is a mean or a sum of the examples' own losses, or a sum scaled to neither, over how many
    terms, and what it divides by.

    Walks the autograd graph down from ``loss`` through scalar operations (multiplications, divisions,
    additions, casts) to the first reductions over a tensor whose leading dimension is a multiple of
    ``batch_size``, or over a selection of such a tensor's elements (``F.cross_entropy(logits[mask],
    y[mask])``): ``mean()``, ``sum()``, and the loss functions' ``reduction=`` argument. A sum divided on the
    way by a multiple of ``batch_size`` counts as a mean (cross-entropy with probability targets), one divided
    by another number (over its multiplications) as ``"scaled"``. One division by ``accumulation`` is skipped
    (Lightning divides the loss by ``accumulate_grad_batches``), and one multiplication by ``loss_scale`` (the
    AMP scale, when a CPU scaler holds it on the host); a division by a device tensor counts as one by a count
    of elements (label smoothing), a multiplication by one (a CUDA scaler's scale) as none. Reductions over
    parameters only (an L2 penalty) are ignored.

    The number of terms is read from a loss function's input, or from a ``sum()``/``mean()`` of a 1-D
    tensor; of a wider one (``(B, C)`` soft-target cross-entropy terms, a ``(B, T)`` token grid) it is
    not known, nor where the loss's parts reduce different numbers of terms.

    The count a mean divides by is read where the graph holds it: the elements of a ``mean()``, a loss
    function's input elements (``nll_loss``: the total weight of the targets it kept, ignored ones left
    out), times the divisions on the way (a ``sum()`` divided by ``mask.sum()``: that tensor).

    Returns:
        The reduction, or ``None`` when the graph shows none, or several (or the batch is empty).
    """
    walked = _reductions(loss, batch_size, accumulation, loss_scale) if batch_size >= 1 else None
    if not walked:
        return None
    found = walked[0]
    kinds, terms = {f.kind for f in found}, {f.terms for f in found}
    if len(kinds) != 1:
        return None
    # The count of one reduction only: the parts of a loss that adds several reduce over counts of their own.
    count = found[0].count if len(found) == 1 else None
    return LossReduction(kinds.pop(), terms.pop() if len(terms) == 1 else None, count)


def _reductions(
    loss: Tensor, batch_size: int, accumulation: int = 1, loss_scale: float | Tensor | None = None
) -> tuple[list[LossReduction], set[int]] | None:
    """The walk :func:`detect_loss_reduction` describes: the reductions found over the batch's rows, and the leading
    sizes of those over other rows (parameters' L2 penalties, a graph batch's graphs); ``None`` where the graph holds
    anything but scalar operations above its reductions, or is too large to walk."""

    def sum_kind(divisor: float) -> str:
        if math.isinf(divisor) or (divisor >= batch_size and divisor % batch_size == 0):
            return "mean"
        return "sum" if divisor == 1 else "scaled"

    found: list[LossReduction] = []
    others: set[int] = set()
    # (node, the product of the divisions above it: inf once one is by a device tensor, and that product with
    # the device tensors kept as such, None when none)
    stack: list[tuple[Any, float, float | Tensor | None]] = [(loss.grad_fn, 1.0, None)]
    skip_division = accumulation
    # A CPU scaler's scale is a number to skip; a CUDA one's is a device tensor, passed over as any such factor.
    on_host = loss_scale is not None and not (isinstance(loss_scale, Tensor) and loss_scale.device.type != "cpu")
    skip_scale = float(loss_scale) if on_host else None
    visited = 0
    while stack:
        node, divisor, by = stack.pop()
        visited += 1
        if node is None:
            continue
        if visited > _MAX_GRAPH_NODES:
            return None
        name = type(node).__name__
        if name in _MEAN_OPS or name in _SUM_OPS:
            sizes = node._saved_self_sym_sizes
            if sizes and (sizes[0] % batch_size == 0 or _selected_from_batch(node, batch_size)):
                kind = "mean" if name in _MEAN_OPS else sum_kind(divisor)
                count = _times(float(math.prod(sizes)), by) if name in _MEAN_OPS else by
                terms = sizes[0] if len(sizes) == 1 else None
                found.append(LossReduction(kind, terms, count))
            elif sizes:
                others.add(int(sizes[0]))
            continue
        code = getattr(node, "_saved_reduction", None)
        if code is not None:
            leading = node._saved_self.shape[0] if node._saved_self.dim() else 0
            from_batch = leading > 0 and (leading % batch_size == 0 or _selected_from_batch(node, batch_size))
            if code in _REDUCTION_CODES and from_batch:
                kind = _REDUCTION_CODES[code]
                counted = getattr(node, "_saved_total_weight", None) if type(node).__name__ in _NLL_OPS else None
                if counted is None and kind == "mean":
                    counted = float(node._saved_self.numel())
                count = _times(counted, by) if kind == "mean" else by
                found.append(LossReduction(kind if kind == "mean" else sum_kind(divisor), _loss_terms(node), count))
            elif code not in _REDUCTION_CODES:
                return None
            elif leading:
                others.add(int(leading))
            continue
        if name not in _SCALAR_OPS:
            return None
        # A multiplication by a Python number (a CPU scalar in MulBackward0, a number in MulBackward1 before):
        # its inverse is a division; reading it is no device sync.
        factor = _factor(node) if name == "MulBackward0" else getattr(node, "_saved_other", None)
        if (
            name.startswith("Mul")
            and factor is not None
            and not (isinstance(factor, Tensor) and (factor.device.type != "cpu" or factor.numel() != 1))
        ):
            value = float(factor)
            if value == 0.0:
                return None  # a loss times 0 reduces nothing
            if skip_scale is not None and value == skip_scale:
                skip_scale = None
            else:
                divisor, by = divisor / value, 1.0 / value if by is None else by / value
        other = getattr(node, "_saved_other", None) if name in ("DivBackward0", "DivBackward1") else None
        if isinstance(other, Tensor) and (other.device.type != "cpu" or other.numel() != 1):
            # By a device tensor: a count of elements (F.cross_entropy's label smoothing); reading it would sync.
            divisor, by = math.inf, _times(other.detach(), by) if by is not None else other.detach()
        elif other is not None:
            # By a Python number (recorded as DivBackward0 with a CPU scalar in recent torch, as
            # DivBackward1 before): reading it is no device sync.
            value = float(other)
            if skip_division and value == skip_division:
                skip_division = 0
            else:
                divisor, by = divisor * value, value if by is None else by * value
        stack.extend((nxt, divisor, by) for nxt, _ in node.next_functions)
    return found, others


def reduced_rows(loss: Tensor, batch_size: int) -> int | None:
    """The one number of rows ``loss``'s reductions are over where none is over the batch's ``batch_size`` rows (or a
    selection of them), in :func:`detect_loss_reduction`'s walk; ``None`` otherwise. A batch whose examples are not
    its first tensor's rows (a graph batch led by its nodes) shows here as rows that are not a multiple of the batch
    Lightning counts."""
    walked = _reductions(loss, batch_size) if batch_size >= 1 else None
    if not walked or walked[0] or len(walked[1]) != 1:
        return None
    return next(iter(walked[1]))
