"""Gradient norms of the whole model when each rank holds only a shard of it (FSDP)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import Tensor

import lightning.pytorch as pl
from lightning.pytorch.strategies import FSDPStrategy

from trainvitals.core.norms import per_tensor_norms


def gradient_norms(trainer: "pl.Trainer", grads: Sequence[Tensor], norm_type: float = 2.0) -> Tensor:
    """Per-tensor p-norms ``(P,)`` of the full gradients, whatever the strategy holds on this rank.

    DDP: every rank holds the whole all-reduced gradient, nothing to combine. FSDP2 and tensor
    parallelism (``ModelParallelStrategy``): the gradients are ``DTensor``s, which
    :func:`~trainvitals.core.norms.per_tensor_norms` reduces itself. FSDP (``FSDPStrategy``): each rank
    holds a plain-tensor shard of every (flat) parameter, so the shards' p-th powers are summed across
    ranks (their maximum for p = ∞). Every rank must call this at the same step: it may all-reduce.
    """
    norms = per_tensor_norms(grads, norm_type)
    if not isinstance(trainer.strategy, FSDPStrategy):
        return norms
    if math.isinf(norm_type):
        return trainer.strategy.reduce(norms, reduce_op="max")
    return trainer.strategy.reduce(norms.pow(norm_type), reduce_op="sum").pow(1.0 / norm_type)
