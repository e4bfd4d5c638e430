"""Autograd's three classic errors, explained: the tensor, module and operation behind them."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from trainvitals.integrity.checks.base import Check, Fit
from trainvitals.integrity.diagnoses import diagnose_inplace, diagnose_no_grad, diagnose_second_backward
from trainvitals.integrity.findings import FindingKind
from trainvitals.integrity.graph import AutogradError, classify_autograd_error

_ERROR_KIND = {
    AutogradError.NO_GRAD: FindingKind.NO_GRAD_ERROR,
    AutogradError.SECOND_BACKWARD: FindingKind.SECOND_BACKWARD,
    AutogradError.INPLACE: FindingKind.INPLACE_MODIFIED,
}


class AutogradErrorCheck(Check):
    """On an exception: an autograd error ("does not require grad", "backward through the graph a second
    time", "modified by an inplace operation") gets a diagnosis from what the batch recorded (its losses,
    the optimizers that stepped, a re-run of the step where that is safe), added to the exception as a
    note; the original exception propagates unchanged.

    Args:
        ignore: an exception type not to diagnose (the callback's own strict error).
    """

    kinds = tuple(_ERROR_KIND.values())

    def __init__(self, ignore: type[BaseException]) -> None:
        self.ignore = ignore

    def on_exception(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException
    ) -> None:
        kind = None if isinstance(exception, self.ignore) else classify_autograd_error(exception)
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
            found = next((f for f in reversed(fit.findings) if f.kind is FindingKind.LOSS_NO_GRAD), None)
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
