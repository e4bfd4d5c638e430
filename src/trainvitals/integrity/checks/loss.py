"""The loss itself: it has a ``grad_fn`` and reaches a parameter, is a scalar, and is finite."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from trainvitals.integrity.checks.base import Check, Fit, register_check
from trainvitals.integrity.diagnoses import why_no_grad
from trainvitals.integrity.findings import FindingKind
from trainvitals.integrity.graph import GraphWalk

if TYPE_CHECKING:
    import lightning.pytorch as pl

LOSS_NO_GRAD = FindingKind(
    "loss_no_grad",
    critical="the loss had no grad_fn or reached no parameter on {n} step(s): it was detached (.item(), "
    ".detach(), torch.no_grad()), nothing trains",
)
LOSS_NOT_SCALAR = FindingKind("loss_not_scalar", warning="a loss that is not a scalar (left unreduced?)")
LOSS_NOT_FINITE = FindingKind(
    "loss_not_finite",
    metric="nonfinite_losses",
    label="non-finite losses",
    critical="{n} non-finite loss value(s) in one check window",
)

MAX_PENDING_LOSSES = 1024
"""Losses kept for the finiteness check before they are counted on the device."""


@register_check(order=10)
class LossCheck(Check):
    """Every step, before backward: a loss without ``grad_fn`` (and why), a non-scalar loss under
    automatic optimization; on a walk, a loss whose graph reaches none of the model's parameters.

    Non-finite losses are counted on the device (one ``loss.detach()`` kept per backward, added up every
    :data:`MAX_PENDING_LOSSES` losses, a state declared with ``dist_reduce_fx="sum"``) and summed over ranks where
    every rank calls: when a window closes, at a strict run's batch end, at the end of training. Logs
    ``graph/nonfinite_losses``.
    """

    kinds = (LOSS_NO_GRAD, LOSS_NOT_SCALAR, LOSS_NOT_FINITE)

    def __init__(self) -> None:
        self.max_pending = MAX_PENDING_LOSSES
        self._pending: list[Tensor] = []
        self._nonfinite: Tensor  # this rank's count since the last sync
        self.add_state("_nonfinite", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum", persistent=False)

    def on_before_backward(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor
    ) -> None:
        if loss.grad_fn is None:
            names, why = why_no_grad(loss, pl_module, trainer.optimizers, fit.rerun_if_possible(trainer, pl_module))
            fit.record(
                LOSS_NO_GRAD,
                names,
                f"The loss has no grad_fn, so backward cannot reach any parameter: {why}.",
            )
        # manual_backward(loss, gradient) of a non-scalar is legitimate; Lightning's own backward is not.
        elif pl_module.automatic_optimization and loss.numel() != 1:
            fit.record(
                LOSS_NOT_SCALAR,
                (),
                f"training_step returned a loss of shape {tuple(loss.shape)}, not a scalar: backward needs one "
                "number. Reduce it (`.mean()` over the batch).",
            )
        if not loss.is_floating_point():
            return
        self._pending.append(loss.detach())
        if len(self._pending) >= self.max_pending:
            self._count(fit)

    def on_walk(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor, walk: GraphWalk
    ) -> None:
        # Under manual optimization a loss may train something else than the model (a latent code fitted by
        # its own optimizer, test-time adaptation); Lightning's own backward trains the model.
        trainable = {id(p) for _, p in fit.tracked if p.requires_grad}
        if (
            pl_module.automatic_optimization
            and trainable
            and walk.leaves
            and not walk.stale
            and not walk.opaque
            and not any(id(t) in trainable for t in walk.leaves)
        ):
            fit.record(
                LOSS_NO_GRAD,
                ("loss reaches no parameter",),
                f"The loss reaches none of the model's parameters: its graph ends in {len(walk.leaves)} tensor(s) "
                "made in the step (a loss rebuilt from its value, `torch.tensor(loss.item(), requires_grad=True)`?). "
                "Return the loss tensor itself.",
            )

    def on_window_close(self, fit: Fit, trainer: "pl.Trainer", complete: bool) -> dict[str, float]:
        return self.on_sync(fit, trainer)

    def on_sync(self, fit: Fit, trainer: "pl.Trainer") -> dict[str, float]:
        """The non-finite losses since the last sync, summed over ranks: one collective and host sync."""
        self._count(fit)
        self.reduce_states(trainer)
        count = int(self._nonfinite.item())
        self._nonfinite = torch.zeros_like(self._nonfinite)
        if count:
            fit.record(
                LOSS_NOT_FINITE,
                (),
                f"{count} loss value(s) were NaN or inf (summed over ranks) before step {trainer.global_step}. "
                "Every gradient of such a step is NaN; set detect_anomaly_steps to find the op that made it.",
            )
        return {LOSS_NOT_FINITE.window_tag: float(count)}

    def _count(self, fit: Fit) -> Tensor:
        """Add the non-finite values among the losses kept so far to this rank's device count (no sync)."""
        values, self._pending = self._pending, []
        self._nonfinite = self._nonfinite.to(fit.device)
        if values:
            flat = torch.cat([v.reshape(-1).to(fit.device) for v in values])
            self._nonfinite = self._nonfinite + flat.isfinite().logical_not().sum()
        return self._nonfinite
