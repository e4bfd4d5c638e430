"""Examples mixed across the batch: output i depends on input j ≠ i."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_utilities.core.rank_zero import rank_zero_info, rank_zero_warn  # Lightning's, without Lightning
from torch import Tensor

from trainvitals.integrity.checks.base import Check, Fit, register_check
from trainvitals.integrity.findings import FindingKind
from trainvitals.integrity.graph import batch_mixing, batchnorm_in_eval
from trainvitals.text.prose import SHOWN, listed

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from trainvitals.integrity.callback import GraphIntegrityCallback

BATCH_MIXING = FindingKind(
    "batch_mixing", warning="examples mixed across the batch: an output depends on other examples"
)


@register_check(order=110)
class BatchMixingCheck(Check):
    """On the fit's first batch, once per run (resumes included): calls ``pl_module(x)`` on the batch's
    input and back-propagates from two output rows (catches ``view``/``permute`` bugs that mix
    examples). BatchNorm layers in training mode run in eval mode for it (it says so). Built only with
    ``check_batch_independence=True``.

    Args:
        batch_input: maps a batch to the model's input.
    """

    kinds = (BATCH_MIXING,)

    @classmethod
    def build(cls, callback: GraphIntegrityCallback) -> BatchMixingCheck | None:
        return cls(callback.batch_input) if callback.check_batch_independence else None

    def __init__(self, batch_input: Callable[[Any], Tensor | None]) -> None:
        self.batch_input = batch_input
        self.add_state("_done", False, key="done")

    def on_train_batch_start(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any
    ) -> None:
        if self._done:
            return
        self._done = True
        x = self.batch_input(batch)
        from trainvitals.plumbing.rerun import rerun_quietly  # imports Lightning: the fit has by now

        with rerun_quietly(pl_module), batchnorm_in_eval(pl_module) as switched:
            try:
                if x is None:
                    raise ValueError("the batch holds no tensor")
                mixing = batch_mixing(pl_module, x)
            except Exception as err:  # the model called on a guessed input: any failure means "cannot check"
                rank_zero_warn(fit.message(f"could not check batch independence: {type(err).__name__}: {err}"))
                return
        if switched:
            rank_zero_info(
                fit.message(
                    f"the batch-independence check ran {len(switched)} BatchNorm layer(s) in eval mode "
                    f"({listed(switched)}): in training mode BatchNorm mixes examples through the batch statistics "
                    "by design."
                )
            )
        mixed = {i: js for i, js in mixing.items() if js}
        if mixed:
            detail = "; ".join(f"output {i} depends on inputs {js[:SHOWN]}" for i, js in mixed.items())
            fit.record(
                BATCH_MIXING,
                tuple(f"output[{i}]" for i in mixed),
                f"Examples are mixed across the batch: {detail}. A `view`/`reshape` or `permute` that moves the "
                "batch dimension is the usual cause (e.g. `x.view(C, B, ...)` on a `(B, C, ...)` tensor).",
            )
