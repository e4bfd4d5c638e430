"""How many examples a batch holds, as Lightning counts them, without failing where Lightning cannot tell;
and what Lightning divides a micro-batch's loss by."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.data import extract_batch_size


def batch_size(batch: Any) -> int | None:
    """The first dimension of the batch's first tensor (``lightning.pytorch.utilities.data.extract_batch_size``),
    or ``None`` where Lightning cannot tell: it raises ``MisconfigurationException`` for a batch without a
    tensor it can find, ``RecursionError`` for one that contains itself."""
    try:
        return extract_batch_size(batch)
    except Exception:  # a diagnostic must not end the run over a batch it cannot size
        return None


def loss_divisor(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> int:
    """What Lightning divides each micro-batch's loss by before backward: ``accumulate_grad_batches``
    under automatic optimization; 1 under manual optimization (``manual_backward`` divides by nothing)."""
    return trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
