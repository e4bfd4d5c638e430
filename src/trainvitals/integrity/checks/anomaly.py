"""Anomaly detection for the first optimizer steps: the one-batch self-test before a long run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from trainvitals.integrity.checks.base import Check, Fit, register_check

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from trainvitals.integrity.callback import GraphIntegrityCallback


@register_check(order=120)  # after AutogradErrorCheck: its diagnoses quote what anomaly mode recorded
class AnomalyModeCheck(Check):
    """Runs the batches that start before optimizer step ``steps`` under ``torch.autograd`` anomaly
    detection (NaN checks on), restoring the previous mode at the batch's end (or when the fit fails,
    after the diagnoses, which quote the forward tracebacks anomaly mode records). Files no finding:
    autograd raises, and :class:`~trainvitals.integrity.checks.autograd_errors.AutogradErrorCheck`
    explains. Built only with ``detect_anomaly_steps`` > 0.

    Args:
        steps: optimizer steps whose batches run under anomaly mode.
    """

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self._previous: tuple[bool, bool] | None = None

    @classmethod
    def build(cls, callback: GraphIntegrityCallback) -> AnomalyModeCheck | None:
        return cls(callback.detect_anomaly_steps) if callback.detect_anomaly_steps else None

    def on_train_batch_start(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any
    ) -> None:
        if fit.step < self.steps and self._previous is None:
            self._previous = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
            torch.set_anomaly_enabled(True, True)

    def on_train_batch_end(self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.teardown()

    def teardown(self) -> None:
        if self._previous is not None:
            torch.set_anomaly_enabled(*self._previous)
            self._previous = None
