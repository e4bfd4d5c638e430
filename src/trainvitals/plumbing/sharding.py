"""Gradient norms of the whole model when each rank holds only a shard of it as plain tensors (FSDP).

FSDP2 and tensor parallelism hand out DTensor gradients, which
:func:`~trainvitals.fused_norms.per_tensor_norms` reduces itself. ``FSDPStrategy`` (FSDP1) hands out
plain tensors: a rank's slice of each parameter, or ``None`` where the parameter lies wholly in other
ranks' shards. DeepSpeed's partitioned gradients are not handled.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
from lightning.pytorch.strategies import FSDPStrategy
from torch import Tensor


def holds_shards(trainer: "pl.Trainer") -> bool:
    """Whether this rank's plain-tensor gradients are shards (FSDP1 with a sharding strategy that shards).

    Then every rank must measure at every step, even one whose shard holds no gradient at all: the
    norms are all-reduced.
    """
    strategy = trainer.strategy
    return isinstance(strategy, FSDPStrategy) and getattr(strategy.sharding_strategy, "name", "") != "NO_SHARD"


def reduce_shard_norms(trainer: "pl.Trainer", norms: Tensor, norm_type: float = 2.0) -> Tensor:
    """Norms of whole gradients from this rank's norms of its shards (any shape, the same on every rank).

    The shards' p-th powers are summed over all ranks (their maximum for p = ∞). Under hybrid
    sharding each shard exists once per node, so the sum is divided by the number of nodes.
    """
    if not holds_shards(trainer):
        return norms
    if math.isinf(norm_type):
        return trainer.strategy.reduce(norms, reduce_op="max")
    return reduce_shard_sums(trainer, norms.pow(norm_type)).pow(1.0 / norm_type)


def reduce_shard_sums(trainer: "pl.Trainer", sums: Tensor) -> Tensor:
    """Sums over whole tensors (Σ of squares, dot products) from this rank's sums over its shards: added
    over all ranks, divided by the number of nodes under hybrid sharding (each shard exists once per
    node); ``sums`` itself when the gradients are not shards."""
    if not holds_shards(trainer):
        return sums
    total = trainer.strategy.reduce(sums, reduce_op="sum")
    if "HYBRID" in trainer.strategy.sharding_strategy.name:  # type: ignore[attr-defined]
        total = total / trainer.num_nodes
    return total
