"""One measured optimizer step of BatchVarianceProbe: its sums over the ranks, the units of its ``.grad``,
and its estimate of ‖G‖² and tr(Σ), each source's over its own parameters (McCandlish et al. 2018, Eq. A.2).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import lightning.pytorch as pl
import torch
from torch import Tensor

from trainvitals.noise.estimators import (
    per_example_estimates,
    sub_batch_estimates,
    sub_batch_mean_sq_norm,
    two_batch_size_estimates,
)
from trainvitals.noise.gsnr import ModuleCoordinates, StepCoordinates
from trainvitals.noise.outliers import Outliers, largest_examples
from trainvitals.per_example import PerExampleStep, SourcePlan
from trainvitals.plumbing.batch import loss_divisor
from trainvitals.plumbing.state import reduce_packed
from trainvitals.plumbing.writers import log_histogram, log_text

PER_EXAMPLE_NORMS, OUTLIERS = "grad_noise/per_example_grad_norm", "grad_noise/outliers"


@dataclass
class StepSums:
    """An optimizer step's sums over the examples of every rank."""

    sq_norm_sum: Tensor  # () Σ_i ‖g_i‖² of the per-example-norm layers, own-loss units
    micro_sum: Tensor  # () Σ_j ‖g_j‖² of the micro-batch gradients, as back-propagated
    examples: int
    valid: Tensor | bool  # every rank measured all its examples
    failed: set[str]  # layers to exclude from now on
    aside: Tensor | None = None  # (layers,) bool: those this step is measured without, the same on every rank


def sum_over_ranks(
    trainer: "pl.Trainer",
    result: PerExampleStep,
    micro_sum: Tensor | None,
    sizes: list[int],
    valid_here: bool,
    layers: list[str],
    failed_here: set[str],
    aside_here: set[str],
    read_failures: bool,
) -> StepSums:
    """This step's sums: this rank's on one process; under DDP every rank's, in one collective.

    ``sizes``: the examples of this rank's micro-batches; ``layers``: the per-example and torch.func
    layers, of which ``failed_here`` failed on this rank and ``aside_here`` failed at this step without a
    trace in its sums (``valid_here`` does not count them). A layer can fail on one rank only (a branch
    taken by some ranks' data): the collective also counts each layer's failures over the ranks, read
    when ``read_failures`` (a logging step, which syncs anyway); until then a failure on any rank
    invalidates the steps, except one set aside on every rank: the step is measured without that layer.
    On one process, a failure here is excluded at once. A lookup whose ids are still compared with
    ``arange(B)`` on the device (``result.undecided``, decided at a logging step) counts as failed where
    they were, without a read, and is set aside on the device unless some of its statistics were counted.
    """
    device = trainer.strategy.root_device
    zero = torch.zeros((), dtype=torch.float64, device=device)
    sq_norm_sum = (result.sq_norm_sum if result.sq_norm_sum is not None else zero).to(device, torch.float64)
    micro_sum = (micro_sum if micro_sum is not None else zero).to(device, torch.float64)
    local_examples = sum(sizes)
    undecided = {n: shared.to(device) for n, shared in result.undecided.items() if n not in failed_here}
    counted = [undecided[n] & c.to(device) for n, c in result.undecided_counted.items() if n in undecided]
    valid: Tensor | bool = valid_here
    if counted and valid_here:
        valid = ~torch.stack(counted).any()
    aside = None
    if aside_here or undecided or trainer.world_size > 1:
        aside = torch.zeros(len(layers), dtype=torch.bool, device=device)  # filled on the device: no copy
        for i, name in enumerate(layers):
            if name in aside_here:
                aside[i] = True
            elif name in undecided:
                aside[i] = undecided[name]
    if trainer.world_size == 1:
        return StepSums(sq_norm_sum, micro_sum, local_examples, valid, set(failed_here), aside)
    flags = torch.zeros(len(layers), dtype=torch.float64, device=device)
    for i, name in enumerate(layers):
        if name in failed_here:
            flags[i] = 1.0
        elif name in undecided:
            flags[i] = undecided[name].double()
    invalid_here = (
        (~valid).double()
        if isinstance(valid, Tensor)
        else torch.full((), 0.0 if valid else 1.0, dtype=torch.float64, device=device)
    )
    sq, micro, seen, invalid, counts, asides = reduce_packed(
        trainer,
        [
            sq_norm_sum,
            micro_sum,
            torch.full((), float(local_examples), dtype=torch.float64, device=device),
            invalid_here,
            flags,
            aside.double(),
        ],
    )
    examples = local_examples * trainer.world_size
    failed = set()
    if read_failures and layers:
        failed = {n for n, count in zip(layers, counts.tolist()) if count > 0}
    everywhere = asides == trainer.world_size  # set aside on some ranks only: those ranks' sums lack what others hold
    agreed = ~((asides > 0) & ~everywhere).any()
    return StepSums(sq, micro, examples, (invalid == 0) & (seen == examples) & agreed, failed, everywhere)


@dataclass
class MicroBatches:
    """The micro-batches of the optimizer step being measured, on this rank."""

    sizes: list[int] = field(default_factory=list)  # the examples of each that ran backward
    unsized: bool = False  # one of them Lightning cannot size
    rows: list[Tensor | None] = field(default_factory=list)  # their dataset rows, on the steps that keep norms

    @property
    def size(self) -> int:
        """The first one's examples; 1 for an empty one, in a step left out anyway."""
        return self.sizes[0] or 1

    def grad_units(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", reduction: str) -> float:
        """The step's ``.grad`` over the mean of its per-example gradients: the accumulated, rank-averaged,
        unscaled ``.grad`` of n micro-batches of b is (n/A)·ḡ for a mean loss and (n·b/A)·ḡ for a sum."""
        per_loss = 1 if reduction == "mean" else self.size
        return len(self.sizes) * per_loss / loss_divisor(trainer, pl_module)

    def whole_window(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> bool:
        """Whether ``.grad`` is the mean of these micro-batches alone: all of an accumulation window, sized and
        equal, on one device (the ``.grad`` of several is averaged over ranks), under automatic optimization."""
        return (
            trainer.world_size == 1
            and not self.unsized
            and len(set(self.sizes)) == 1
            and 0 not in self.sizes
            and len(self.sizes) == trainer.accumulate_grad_batches
            and pl_module.automatic_optimization
        )


def step_estimates(
    plan: SourcePlan,
    batch_sq: dict[str, Tensor],
    result: PerExampleStep,
    sums: StepSums,
    groups: int,
    group_size: int,
    unit: Tensor | float,
    aside: set[str],
) -> tuple[Tensor, Tensor, Tensor | bool, Tensor, Tensor]:
    """``(‖G‖², tr(Σ), valid, ‖ḡ‖² measured, ‖ḡ‖² all)`` of the step in per-example units.

    Each source's estimate over its own parameters, added up, since tr(Σ) and ‖G‖² are sums over
    parameters. ``batch_sq``: ‖ḡ‖² in per-example units over each source's parameters and the others'
    (:meth:`ProbeSources.batch_sq_norms`, with the layers set aside among the others); ``groups``
    micro-batches of ``group_size`` examples over all ranks, whose back-propagated gradients are ``unit`` ×
    the mean of their examples' own-loss gradients; ``aside``: the layers this step is measured without (a
    torch.func source with all of them aside has no sub-batch, and nothing to measure).
    """
    estimates, valid = [], sums.valid
    if plan.per_example:
        estimates.append(per_example_estimates(sums.sq_norm_sum, batch_sq["per_example"], sums.examples))
    if plan.micro_batch and groups < 2:  # an epoch's last accumulation window can hold one micro-batch
        valid = False
    elif plan.micro_batch:
        group_mean = sums.micro_sum * (unit / group_size) ** 2 / groups
        estimates.append(two_batch_size_estimates(group_mean, batch_sq["micro_batch"], groups, group_size))
    vmap = set(plan.vmap) - aside
    if vmap and result.num_sub < 2:
        valid = False
    elif vmap:
        sub_mean_sq = sub_batch_mean_sq_norm(list(result.sub_grad_sum.values()), result.num_sub)
        estimates.append(
            sub_batch_estimates(
                result.sub_sq_norm_sum.double(),
                sub_mean_sq,  # type: ignore[union-attr]
                result.num_sub,
                batch_sq["vmap"],
                sums.examples,
            )
        )
    covered = batch_sq["per_example"] + batch_sq["micro_batch"] + batch_sq["vmap"]
    total = covered + batch_sq["other"]
    if not estimates:
        zero = torch.zeros((), dtype=torch.float64, device=sums.sq_norm_sum.device)
        return zero, zero, valid, covered, total
    grad_sq_norm, trace_cov = (functools.reduce(torch.add, parts) for parts in zip(*estimates))
    return grad_sq_norm, trace_cov, valid, covered, total


def coordinate_stats(
    trainer: "pl.Trainer",
    coordinates: ModuleCoordinates,
    selection: dict[str, slice],
    result: PerExampleStep,
    examples: int,
    left_out: set[str],
) -> tuple[dict[str, Tensor], StepCoordinates]:
    """Σ_d GSNR_d per module over this step's ``selection`` of coordinates, :data:`~trainvitals.noise.gsnr.EB_CRITERION` when they are
    all the measured ones (:meth:`ModuleCoordinates.snr_sums`), over every rank's examples; without the
    parameters ``left_out`` (of layers failed on some rank, the same on every rank), which have no sums."""
    # Zeros where this rank has no sums (a layer failed here only): the ranks' collectives must match; the
    # step is invalid.
    selection = {q: rows for q, rows in selection.items() if q not in left_out}
    selection = selection if result.sum_sq or trainer.world_size > 1 else {}
    reduce = (lambda flat: trainer.strategy.reduce(flat, reduce_op="sum")) if trainer.world_size > 1 else None
    grad_sums, sum_sqs = coordinates.selected_sums(selection, result.grad_sum, result.sum_sq, reduce)
    return coordinates.snr_sums(
        selection, grad_sums, sum_sqs, examples, result.sub_grad_sum, result.sub_sum_sq, result.num_sub
    )


def log_per_example_norms(
    trainer: "pl.Trainer", sq_norms: list[Tensor], rows: list[Tensor | None], top_k: int, coverage: str, step: int
) -> Outliers | None:
    """The histogram :data:`PER_EXAMPLE_NORMS` of a step's ‖g_i‖ (each micro-batch's ``(b,)`` ‖g_i‖² in
    ``sq_norms``, over the parameters ``coverage`` says) and, with ``top_k`` ≥ 1, the panel :data:`OUTLIERS` of
    the largest, by ``rows`` where known; returns those."""
    norms = torch.cat(sq_norms).clamp_min(0.0).sqrt()
    log_histogram(trainer, PER_EXAMPLE_NORMS, norms, step, f"Each example's gradient norm ‖g_i‖, {coverage}.")
    if top_k == 0:
        return None
    outliers = largest_examples(norms, rows, top_k, coverage)
    log_text(trainer, OUTLIERS, outliers.markdown(step), step)
    return outliers
