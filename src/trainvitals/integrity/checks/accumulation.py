"""Under gradient accumulation: micro-batch losses averaged over counts that differ (a token mean over a
padding mask), so that the terms of the effective batch weigh unequally."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from trainvitals.integrity.checks.base import Check, Fit, register_check
from trainvitals.integrity.findings import FindingKind
from trainvitals.per_example.loss_reduction import detect_loss_reduction

if TYPE_CHECKING:
    import lightning.pytorch as pl

UNEVEN_MICRO_BATCH_MEANS = FindingKind(
    "uneven_micro_batch_means",
    warning="micro-batch losses averaged over different counts under gradient accumulation: terms weigh unequally",
)

_SHOWN = 8  # micro-batch counts quoted in the message


@register_check(order=15)
class MicroBatchMeanCheck(Check):
    r"""In the first optimizer step of each check window, under automatic optimization with
    ``accumulate_grad_batches`` = A >= 2: the graph of each micro-batch's loss says what it divides the sum
    of its terms by (:func:`~trainvitals.per_example.loss_reduction.detect_loss_reduction`: a mean's
    elements, as many as ``logits[mask]`` selects, ``nll_loss``'s kept targets, a ``mask.sum()``
    divisor). Lightning averages the A micro-batch losses, so the step minimises
    :math:`\frac{1}{A}\sum_k \frac{1}{n_k}\sum_{t \in k} \ell_t`: a term of micro-batch k weighs
    :math:`1/(A n_k)` rather than :math:`1/N`, :math:`N = \sum_k n_k` (transformers#24725). Counts per
    example that differ between the step's micro-batches are a finding when the window closes (counts held
    on the device are read there, with the window's other host syncs). Cost: one walk of at most 64 graph
    nodes per micro-batch of that step (about 10 µs), nothing at other steps.

    A mean over examples whose last micro-batch of an epoch is smaller weighs that one's examples more too:
    Lightning's own averaging, with the same count per example, so not reported. The counts are not saved:
    a fit resumed inside a window reads them at the next window. Files no finding under manual optimization.
    """

    kinds = (UNEVEN_MICRO_BATCH_MEANS,)

    def __init__(self) -> None:
        self._reading = False  # the window's first optimizer step is under way
        self._step = 0  # that step: the one the counts are from, not the one the window closes at
        # Per micro-batch: its examples and what its loss divides by; None: a loss divided by no count (a sum)
        self._counts: list[tuple[int, float | Tensor] | None] = []

    def on_window_open(self, fit: Fit, trainer: "pl.Trainer") -> None:
        self._reading = trainer.accumulate_grad_batches >= 2
        self._step, self._counts = fit.step, []

    def on_before_backward(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor
    ) -> None:
        if not self._reading or not pl_module.automatic_optimization or loss.grad_fn is None:
            return
        from trainvitals.plumbing.batch import batch_size  # imports Lightning: the fit has by now

        examples = batch_size(fit.batch) if fit.batch is not None else None
        found = detect_loss_reduction(loss, examples, trainer.accumulate_grad_batches) if examples else None
        self._counts.append((examples, found.count) if found is not None and found.count is not None else None)

    def on_before_optimizer_step(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", k: int, checked: bool
    ) -> None:
        self._reading = False  # one accumulation cycle is what the step's gradient averages

    def on_window_close(self, fit: Fit, trainer: "pl.Trainer", complete: bool) -> dict[str, float]:
        counted, self._counts, self._reading = self._counts, [], False
        if len(counted) < 2 or any(c is None for c in counted):
            return {}
        counts = _read([count for _, count in counted])
        per_example = {count / examples for (examples, _), count in zip(counted, counts)}
        if len(per_example) < 2 or min(counts) <= 0:
            return {}
        accumulation = len(counted)
        shown = ", ".join(f"{c:g}" for c in counts[:_SHOWN]) + (", ..." if len(counts) > _SHOWN else "")
        fit.record(
            UNEVEN_MICRO_BATCH_MEANS,
            (),
            f"Under gradient accumulation ({accumulation} micro-batches per optimizer step), each micro-batch's loss "
            f"is a mean over its own count of terms ({shown} in optimizer step {self._step}), and "
            f"Lightning averages the micro-batch losses: a term of the micro-batch with {min(counts):g} weighs "
            f"{max(counts) / min(counts):.3g}× one of the micro-batch with {max(counts):g} (a token mean over a "
            "padding mask, `F.cross_entropy(logits[mask], y[mask])`: short sequences count as much as long "
            "ones). Normalise by the effective batch's count: sum the terms (`reduction='sum'`) and divide by "
            "the total count across the accumulated micro-batches (then multiply by accumulate_grad_batches, "
            "which Lightning divides each micro-batch's loss by), as transformers does with "
            "`num_items_in_batch`.",
            step=self._step,
        )
        return {}


def _read(counts: list[float | Tensor]) -> list[float]:
    """The counts as numbers: those held on a device read in one transfer."""
    held = [c for c in counts if isinstance(c, Tensor)]
    device = held[0].device if held else None
    values = iter(torch.stack([c.detach().float().reshape(()).to(device) for c in held]).tolist() if held else [])
    return [next(values) if isinstance(c, Tensor) else float(c) for c in counts]
