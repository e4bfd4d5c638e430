"""A count of optimizer steps whose gradient held inf/NaN, for the callbacks that see it without GradNormMonitor.

GradNormMonitor owns ``grad_norm/nonfinite_steps`` (``grad_norm/amp_skipped_steps`` under a GradScaler, which
skips such steps as loss-scale calibration). Without one, the first of the callbacks that read
:data:`~trainvitals.plumbing.sharing.NONFINITE_STEPS` (GradNormEarlyStopping, BatchVarianceProbe, each holding a
:class:`NonfiniteCounter`) logs the same tags, so that a run that diverged reads as diverged in
``trainvitals report`` whichever of them watched it.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from trainvitals.plumbing.amp import grad_scaler
from trainvitals.plumbing.sharing import NONFINITE_STEPS


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
        """The counter under the monitor's tag, when ``owner`` is the callback that logs it (its hub's
        :meth:`~trainvitals.plumbing.sharing.Vitals.speaker`), else empty."""
        if owner.vitals.speaker(NONFINITE_STEPS) is not owner:
            return {}
        name = "amp_skipped_steps" if grad_scaler(trainer) is not None else "nonfinite_steps"
        return {f"grad_norm/{name}": self.count}
