"""Whether a batch loss is a mean or a sum of the examples' own losses, read from its autograd graph."""

from __future__ import annotations

import math
from dataclasses import dataclass
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


@dataclass(frozen=True)
class LossReduction:
    """How a loss reduces its terms: ``kind`` ``"mean"`` or ``"sum"``, over ``terms`` values (the examples
    of a micro-batch, times the tokens or elements of each for a per-token or per-element loss) where
    the graph says so, else ``None``. Targets an ``ignore_index`` leaves out (padding) are counted: read
    from shapes, not values, so with padding ``terms`` is an upper bound."""

    kind: str
    terms: int | None


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


def detect_loss_reduction(loss: Tensor, batch_size: int, accumulation: int = 1) -> LossReduction | None:
    """Whether ``loss`` is a mean or a sum of the examples' own losses, and over how many terms.

    Walks the autograd graph down from ``loss`` through scalar operations (multiplications, divisions,
    additions, casts) to the first reductions over a tensor whose leading dimension is a multiple of
    ``batch_size``: ``mean()``, ``sum()``, and the loss functions' ``reduction=`` argument. A ``sum()``
    divided on the way by a multiple of ``batch_size`` counts as a mean (cross-entropy with probability
    targets). One division by ``accumulation`` is skipped (Lightning divides the loss by
    ``accumulate_grad_batches``); a division by a tensor counts as one by a count of elements
    (label smoothing). Reductions over parameters only (an L2 penalty) are ignored.

    The number of terms is read from a loss function's input, or from a ``sum()``/``mean()`` of a 1-D
    tensor; of a wider one (``(B, C)`` soft-target cross-entropy terms, a ``(B, T)`` token grid) it is
    not known, nor where the loss's parts reduce different numbers of terms.

    Returns:
        The reduction, or ``None`` when the graph shows neither, or both (or the batch is empty).
    """
    if batch_size < 1:
        return None
    found: set[LossReduction] = set()
    stack: list[tuple[Any, float]] = [(loss.grad_fn, 1.0)]
    skip_division = accumulation
    visited = 0
    while stack:
        node, divisor = stack.pop()
        visited += 1
        if node is None:
            continue
        if visited > _MAX_GRAPH_NODES:
            return None
        name = type(node).__name__
        if name in _MEAN_OPS or name in _SUM_OPS:
            sizes = node._saved_self_sym_sizes
            if sizes and sizes[0] % batch_size == 0:
                is_mean = (
                    name in _MEAN_OPS or math.isinf(divisor) or (divisor >= batch_size and divisor % batch_size == 0)
                )
                found.add(LossReduction("mean" if is_mean else "sum", sizes[0] if len(sizes) == 1 else None))
            continue
        code = getattr(node, "_saved_reduction", None)
        if code is not None:
            leading = node._saved_self.shape[0] if node._saved_self.dim() else 0
            if code in _REDUCTION_CODES and leading % batch_size == 0 and leading > 0:
                found.add(LossReduction(_REDUCTION_CODES[code], _loss_terms(node)))
            elif code not in _REDUCTION_CODES:
                return None
            continue
        if name not in _SCALAR_OPS:
            return None
        other = getattr(node, "_saved_other", None) if name in ("DivBackward0", "DivBackward1") else None
        if isinstance(other, Tensor) and (other.device.type != "cpu" or other.numel() != 1):
            # By a device tensor: a count of elements (F.cross_entropy's label smoothing); reading it would sync.
            divisor = math.inf
        elif other is not None:
            # By a Python number (recorded as DivBackward0 with a CPU scalar in recent torch, as
            # DivBackward1 before): reading it is no device sync.
            value = float(other)
            if skip_division and value == skip_division:
                skip_division = 0
            else:
                divisor *= value
        stack.extend((nxt, divisor) for nxt, _ in node.next_functions)
    kinds, terms = {f.kind for f in found}, {f.terms for f in found}
    return LossReduction(kinds.pop(), terms.pop() if len(terms) == 1 else None) if len(kinds) == 1 else None
