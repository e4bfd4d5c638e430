"""How many examples a batch holds, as Lightning counts them, without failing where Lightning cannot tell."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.data import extract_batch_size


def batch_size(batch: Any) -> int | None:
    """The first dimension of the batch's first tensor (``lightning.pytorch.utilities.data.extract_batch_size``),
    or ``None`` where Lightning cannot tell: it raises ``MisconfigurationException`` for a batch without a
    tensor it can find, ``RecursionError`` for one that contains itself."""
    try:
        return extract_batch_size(batch)
    except Exception:  # a diagnostic must not end the run over a batch it cannot size
        return None
