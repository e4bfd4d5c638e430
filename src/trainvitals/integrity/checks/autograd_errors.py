"""Autograd's three classic errors, explained: the tensor, module and operation behind them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_utilities.core.rank_zero import rank_zero_warn  # Lightning's own, without importing Lightning

from trainvitals.integrity.checks.base import Check, Fit, register_check
from trainvitals.integrity.checks.loss import LOSS_NO_GRAD
from trainvitals.integrity.diagnoses import diagnose_inplace, diagnose_no_grad, diagnose_second_backward
from trainvitals.integrity.findings import FindingKind, GraphIntegrityError
from trainvitals.integrity.graph import AutogradError, classify_autograd_error

if TYPE_CHECKING:
    import lightning.pytorch as pl

_AUTOGRAD_ERROR = (
    "the run failed in backward with one of autograd's classic errors ({n}); the integrity panel has the diagnosis"
)
NO_GRAD_ERROR = FindingKind("no_grad_error", critical=_AUTOGRAD_ERROR)
SECOND_BACKWARD = FindingKind("second_backward", critical=_AUTOGRAD_ERROR)
INPLACE_MODIFIED = FindingKind("inplace_modified", critical=_AUTOGRAD_ERROR)

_ERROR_KIND = {
    AutogradError.NO_GRAD: NO_GRAD_ERROR,
    AutogradError.SECOND_BACKWARD: SECOND_BACKWARD,
    AutogradError.INPLACE: INPLACE_MODIFIED,
}


@register_check(order=100)
class AutogradErrorCheck(Check):
    """On an exception: an autograd error ("does not require grad", "backward through the graph a second
    time", "modified by an inplace operation") gets a diagnosis from what the batch recorded (its losses,
    the optimizers that stepped, a re-run of the step where that is safe), added to the exception as a
    note; the original exception propagates unchanged (the callback's own :class:`GraphIntegrityError` gets
    none).
    """

    kinds = tuple(_ERROR_KIND.values())

    def on_exception(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException
    ) -> None:
        kind = None if isinstance(exception, GraphIntegrityError) else classify_autograd_error(exception)
        if kind is None:
            return
        try:
            names, message = self._diagnose(kind, fit, trainer, pl_module, exception)
        except Exception as err:  # a diagnosis must never replace the user's error
            names, message = (), f"the diagnosis itself failed ({type(err).__name__}: {err})"
        finding = fit.record(_ERROR_KIND[kind], names, message, warn=False)
        note = fit.message(finding.message, finding.kind.value)
        if hasattr(exception, "add_note"):
            exception.add_note(note)
        else:  # Python < 3.11
            rank_zero_warn(note)

    @staticmethod
    def _diagnose(
        kind: AutogradError, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException
    ) -> tuple[tuple[str, ...], str]:
        """Names and message for autograd's error ``kind``, from what this batch recorded."""
        loss, rerun = fit.last_loss, fit.rerun_if_possible(trainer, pl_module)
        if kind is AutogradError.NO_GRAD:
            found = next((f for f in reversed(fit.findings) if f.kind is LOSS_NO_GRAD), None)
            if found is not None:  # already explained before backward
                return found.names, found.message
            return diagnose_no_grad(loss, pl_module, trainer.optimizers, rerun)
        if kind is AutogradError.SECOND_BACKWARD:
            return diagnose_second_backward(loss, fit.losses[:-1], pl_module, fit.names, fit.mark)
        stepped = [
            (p, fit.optimizer(trainer, k))
            for _, p in fit.tracked
            if (k := fit.opt_of.get(id(p))) is not None and k in fit.stepped
        ]
        return diagnose_inplace(exception, loss, pl_module, fit.names, fit.mark, stepped, rerun)
