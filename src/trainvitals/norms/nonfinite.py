"""A count of optimizer steps whose gradient held inf/NaN, for the callbacks that see it without GradNormMonitor.

GradNormMonitor owns ``grad_norm/nonfinite_steps`` (``grad_norm/amp_skipped_steps`` under a GradScaler, which
skips such steps as loss-scale calibration). Without one, the first of the callbacks in the list holding a
:class:`NonfiniteCounter` (GradNormEarlyStopping, BatchVarianceProbe) logs the same tags, so that a run
that diverged reads as diverged in ``trainvitals report`` whichever of them watched it.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from trainvitals.plumbing.amp import grad_scaler


class NonfiniteCounter:
    """Steps seen with a non-finite gradient norm, counted on the device (no host sync)."""

    def __init__(self) -> None:
        self.count = torch.zeros((), dtype=torch.long)

    def add(self, finite: Tensor) -> None:
        """One step seen; ``finite`` (``()`` bool) whether its gradient norm was finite."""
        self.count = self.count.to(finite.device) + (~finite).long()

    def state_dict(self) -> dict[str, Any]:
        return {"count": int(self.count)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = torch.tensor(int(state["count"]))

    def metrics(self, trainer: "pl.Trainer", owner: Any) -> dict[str, Tensor]:
        """The counter under the monitor's tag, when ``owner`` is the callback that logs it (else empty)."""
        from trainvitals.norms.monitor import GradNormMonitor

        first = next(
            (
                cb
                for cb in trainer.callbacks
                if isinstance(cb, GradNormMonitor) or isinstance(getattr(cb, "nonfinite", None), NonfiniteCounter)
            ),
            None,
        )
        if first is not owner or any(isinstance(cb, GradNormMonitor) for cb in trainer.callbacks):
            return {}
        name = "amp_skipped_steps" if grad_scaler(trainer) is not None else "nonfinite_steps"
        return {f"grad_norm/{name}": self.count}
